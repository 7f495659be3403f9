"""MaxText's toy blocks (``decoder_block=simple`` and ``simple_mlp``): one or two matmuls a layer.

MaxText 0.2.5 ``models/simple_layer.py`` (``SimpleDecoderLayer``, ``SimpleMlpDecoderLayer``), used by
its pipeline tests. Per layer, no norm, no attention, no activation and no residual::

    simple:      y = x @ W                    # W [emb_dim, emb_dim], MaxText's `weights`
    simple_mlp:  y = (x @ ff_1) @ ff_2        # ff_1 [emb_dim, mlp_dim], ff_2 [mlp_dim, emb_dim]

The decoder around them is the common one (MaxText's ``nnx_decoders.py`` wires them so): token
embeddings (no scale), the layers, the final RMSNorm (``decoder_norm``) and the head
(``logits_dense``, or the tied table with ``logits_via_embedding``). Each position is computed on
its own (no attention): a model of per-token maps, for testing strategies, not a language model.

There is no HuggingFace counterpart: HF import and export (``convert/hf.py``, ``nnxtron convert
from-hf`` / ``to-hf``) are refused with an error naming ``decoder_block``; no HF golden exists, so
MaxText's own logits (``tests/assets/maxtext/checkpoints/simple*``) are the reference. MaxText
names a layer's kernels ``weights`` / ``ff_1``, ``ff_2`` directly under ``decoder/layers_{i}``.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from nnxtron.config.layout import PLAIN, LayerKind
from nnxtron.config.schema import Config
from nnxtron.errors import ConfigError
from nnxtron.layers import dropout
from nnxtron.layers.linear import Linear
from nnxtron.models.family import Family, StrategyRow, WeightMap
from nnxtron.models.maxtext_map import MaxTextMap, Rule
from nnxtron.parallel.sharding import RESIDUAL, constrain


def _linear(cfg: Config, rngs: nnx.Rngs, d_in: int, d_out: int, axes: tuple[str, str]) -> Linear:
    return Linear([d_in], [d_out], axes, dtype=jnp.dtype(cfg.dtype), weight_dtype=jnp.dtype(cfg.weight_dtype), rngs=rngs)


class SimpleBlock(nnx.Module):
    """MaxText's ``SimpleDecoderLayer`` (``y = x @ weights``, ``[emb_dim, emb_dim]``, axes embed x mlp) or,
    with ``mlp``, its ``SimpleMlpDecoderLayer`` (``y = (x @ ff_1) @ ff_2``): no activation, no residual."""

    def __init__(self, cfg: Config, rngs: nnx.Rngs, kind: LayerKind = PLAIN, mlp: bool = False):
        """``kind`` is always dense (``config/simple.py`` refuses num_experts > 1)."""
        dim = cfg.base_emb_dim
        if mlp:
            self.ff_1 = _linear(cfg, rngs, dim, cfg.base_mlp_dim, ("embed", "mlp"))
            self.ff_2 = _linear(cfg, rngs, cfg.base_mlp_dim, dim, ("mlp", "embed"))
        else:
            self.weights = _linear(cfg, rngs, dim, dim, ("embed", "mlp"))
        self.mlp = mlp

    def __call__(
        self, x: jax.Array, positions: jax.Array, segment_ids: jax.Array, dropout_keys: dropout.Keys | None = None
    ) -> jax.Array:
        """MaxText's layers drop nothing: ``dropout_keys`` is accepted (the stacks pass it) and unused."""
        x = checkpoint_name(constrain(x, RESIDUAL), "decoder_layer_input")
        if not self.mlp:
            return self.weights(x)
        hidden = checkpoint_name(self.ff_1(x), "mlpwi")
        return checkpoint_name(self.ff_2(hidden), "mlpwo")


def simple_block(cfg: Config, rngs: nnx.Rngs, kind: LayerKind = PLAIN) -> SimpleBlock:
    return SimpleBlock(cfg, rngs, kind)


def simple_mlp_block(cfg: Config, rngs: nnx.Rngs, kind: LayerKind = PLAIN) -> SimpleBlock:
    return SimpleBlock(cfg, rngs, kind, mlp=True)


def _no_hf(cfg: Config) -> ConfigError:
    return ConfigError(
        f"decoder_block={cfg.decoder_block} is MaxText's toy block and has no HuggingFace architecture: "
        "HF import and export are not supported for it; convert MaxText checkpoints (convert from-maxtext / to-maxtext) instead"
    )


def _hf_weights(cfg: Config, *_: Any) -> tuple[WeightMap, ...]:
    """HF names: none (``convert/hf.py`` asks for them first, so HF import and export stop here)."""
    raise _no_hf(cfg)


def _hf_config_from(hf: dict[str, Any]) -> dict[str, Any]:
    raise ConfigError("decoder_block simple / simple_mlp have no HuggingFace architecture; no HF config maps to them")


def _hf_config_to(cfg: Config) -> dict[str, Any]:
    raise _no_hf(cfg)


def _simple_rules(cfg: Config, kind: LayerKind) -> tuple[Rule, ...]:
    return (Rule("weights", "weights/kernel"),)


def _simple_mlp_rules(cfg: Config, kind: LayerKind) -> tuple[Rule, ...]:
    return (Rule("ff_1", "ff_1/kernel"), Rule("ff_2", "ff_2/kernel"))


# no HF counterpart (Family's docstring): no golden; MaxText's logits on its checkpoints are the reference
_NO_HF = dict(
    hf_model_type="",
    hf_architecture="",
    layer_weights=_hf_weights,
    top_weights=_hf_weights,
    config_from_hf=_hf_config_from,
    config_to_hf=_hf_config_to,
)

FAMILIES = (
    Family(
        name="simple",
        make_block=simple_block,
        maxtext=MaxTextMap(_simple_rules),
        # scanned, remat full, fsdp4 x tensor2 (the kernel's mlp axis over tensor), 2 microbatches
        strategy_rows=(StrategyRow("simple-tiny", True, "full", "fsdp4_tensor2", 2),),
        **_NO_HF,
    ),
    Family(
        name="simple_mlp",
        make_block=simple_mlp_block,
        maxtext=MaxTextMap(_simple_mlp_rules),
        # scanned, saving the matmuls except the MLP's (save_dot_except_mlp), data2 x fsdp4, 2 microbatches
        strategy_rows=(StrategyRow("simple_mlp-tiny", True, "save_dot_except_mlp", "data2_fsdp4", 2),),
        **_NO_HF,
    ),
)
