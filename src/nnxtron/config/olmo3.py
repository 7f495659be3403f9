"""OLMo 3's config rule (``models/olmo3.py`` holds its block and maps): its layers are 3 sliding-window
to 1 global, the pattern MaxText's ``decoder_block=olmo3`` fixes (``OLMO3_ATTENTION_PATTERN``) and HF's
default ``layer_types``; a config without it (a MaxText config naming the block but no ``model_name``)
is refused rather than run with every layer global. Its projections have no biases."""

from __future__ import annotations

from typing import TYPE_CHECKING

from nnxtron.errors import ConfigError

if TYPE_CHECKING:
    from nnxtron.config.schema import Config

PATTERN = 4  # layer i is global iff (i + 1) % 4 == 0


def check(cfg: Config) -> None:
    """The rule of ``decoder_block=olmo3`` (``config/families.py`` runs it for it only)."""
    if cfg.sliding_window_pattern != PATTERN:
        raise ConfigError(
            f"decoder_block olmo3 has 3 sliding-window layers to 1 global (MaxText's OLMO3_ATTENTION_PATTERN), so "
            f"sliding_window_pattern={cfg.sliding_window_pattern} cannot apply; set sliding_window_pattern={PATTERN} "
            "(and sliding_window_size > 0), as the olmo3-* presets do"
        )
    if cfg.attention_bias:
        raise ConfigError(
            "decoder_block olmo3's projections have no biases (HF Olmo3's attention_bias is false in every release); "
            "set attention_bias=false"
        )
