"""The one registry of decoder families: ``decoder_block`` name -> ``Family``.

The names are ``config.options.DECODER_BLOCKS`` (what the config accepts); every family
module lists its ``Family`` records in ``FAMILIES``, and this module checks at import
that the two agree, so a family cannot be accepted by the config and missing here.
"""

from __future__ import annotations

from nnxtron.config.options import DECODER_BLOCKS
from nnxtron.errors import ConfigError
from nnxtron.models import (
    deepseek,
    deepseek4,
    gemma,
    gemma2,
    gemma3,
    gemma4,
    gpt3,
    gpt_oss,
    llama,
    llama4,
    mixtral,
    olmo3,
    qwen2,
    qwen3,
    qwen3_5,
    qwen3_next,
    simple,
)
from nnxtron.models.family import Family

_MODULES = (
    llama,
    mixtral,
    qwen2,
    qwen3,
    deepseek,
    gemma,
    gemma2,
    gemma3,
    gemma4,
    llama4,
    gpt3,
    deepseek4,
    olmo3,
    gpt_oss,
    qwen3_next,
    qwen3_5,
    simple,
)
FAMILIES: dict[str, Family] = {family.name: family for module in _MODULES for family in module.FAMILIES}
if sorted(FAMILIES) != sorted(DECODER_BLOCKS) or len(FAMILIES) != sum(len(m.FAMILIES) for m in _MODULES):
    raise ImportError(f"the family modules define {sorted(FAMILIES)}, the config accepts decoder_block {sorted(DECODER_BLOCKS)}")


def family_for(decoder_block: str) -> Family:
    if decoder_block not in FAMILIES:
        raise ConfigError(f"decoder_block '{decoder_block}' is not registered; choose one of {sorted(FAMILIES)}")
    return FAMILIES[decoder_block]


def family_for_hf(model_type: str) -> tuple[str, Family]:
    """The decoder_block name and family for an HF ``model_type``."""
    for name, family in FAMILIES.items():
        if family.hf_model_type and family.hf_model_type == model_type:  # "": no HF counterpart
            return name, family
    supported = sorted({f.hf_model_type for f in FAMILIES.values() if f.hf_model_type})
    raise ConfigError(f"HF model_type '{model_type}' is not supported; supported: {', '.join(supported)}")
