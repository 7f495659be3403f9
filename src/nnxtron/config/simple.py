"""The config rules of MaxText's toy blocks ``simple`` / ``simple_mlp`` (``models/simple.py`` holds the
blocks): their layers are one or two matmuls, so a config asking for routed experts or another
attention kind asks for something they do not have. (Like MaxText, they leave the other attention
keys — heads, RoPE, windows — unread: there is no attention to configure.)"""

from __future__ import annotations

from typing import TYPE_CHECKING

from nnxtron.errors import ConfigError

if TYPE_CHECKING:
    from nnxtron.config.schema import Config


def check(cfg: Config) -> None:
    """The rules of ``decoder_block=simple`` and ``simple_mlp`` (``config/families.py`` runs them for them only)."""
    if cfg.num_experts > 1:
        raise ConfigError(
            f"decoder_block {cfg.decoder_block} (MaxText's toy block) has no MoE layers, so num_experts={cfg.num_experts} "
            "cannot apply; set num_experts=1"
        )
    if cfg.attention_type != "global":
        raise ConfigError(
            f"decoder_block {cfg.decoder_block} (MaxText's toy block) has no attention, so attention_type="
            f"{cfg.attention_type} cannot apply; leave attention_type=global"
        )
