"""Building a model from a config: the ``Decoder``, quantized when the config asks for it."""

from __future__ import annotations

import functools

from flax import nnx

from nnxtron.config.schema import Config
from nnxtron.models.decoder import Decoder
from nnxtron.models.quant import quantize


def _quantized(model: Decoder) -> Decoder:
    """The model with qwix-quantized matmuls when its config asks for it (``models.quant``)."""
    if not model.config.use_qwix_quantization:
        return model
    return quantize(model)


def build_model(cfg: Config, seed: int | None = None) -> Decoder:
    """Construct a Decoder eagerly (unsharded); see train.state for sharded creation."""
    with nnx.use_eager_sharding(False):
        return _quantized(Decoder(cfg, nnx.Rngs(cfg.init_weights_seed if seed is None else seed)))


def abstract_model(cfg: Config) -> Decoder:
    """The Decoder with ShapeDtypeStruct leaves: shapes, dtypes and metadata, no arrays (a new
    module on each call, merged from the parts traced once per config)."""
    return nnx.merge(*_abstract_parts(cfg))


@functools.lru_cache(maxsize=8)
def _abstract_parts(cfg: Config) -> tuple[nnx.GraphDef, nnx.State]:
    """``abstract_model``'s graph and state: tracing the construction of a large model takes
    seconds, and a run asks for its abstract model several times (shardings, the optimizer's
    masks, the weights' restore ...)."""
    with nnx.use_eager_sharding(False):
        return nnx.split(_quantized(nnx.eval_shape(lambda: Decoder(cfg, nnx.Rngs(cfg.init_weights_seed)))))
