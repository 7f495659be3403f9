"""Feed-forward blocks: gated (SwiGLU, GeGLU) and plain with biases (GPT-3).

Both take an optional ``intermediate`` function applied to the activations before the
output projection: MaxText's intermediate dropout (``layers.dropout.site_dropout``)."""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from nnxtron.layers.linear import Linear
from nnxtron.parallel.sharding import constrain

Intermediate = Callable[[jax.Array], jax.Array] | None

ACTIVATIONS = {
    "silu": jax.nn.silu,
    "gelu": lambda x: jax.nn.gelu(x, approximate=True),  # tanh form = HF gelu_pytorch_tanh / gelu_new (MaxText "gelu")
    "linear": lambda x: x,
    "sigmoid": jax.nn.sigmoid,  # gpt_oss only: its clamped SwiGLU (``glu``)
}
GPT_OSS_ALPHA = 1.702  # HF swiglu_alpha; MaxText's gpt_oss activation hard-codes it


def glu(activation: str, limit: float = 0.0) -> Callable[[jax.Array, jax.Array], jax.Array]:
    """The gated activation ``act(gate) * up``; with ``limit`` > 0 (DeepSeek-V4
    ``swiglu_limit``) ``gate`` is clamped above at ``limit`` and ``up`` to ``[-limit, limit]`` first.

    ``sigmoid`` (GPT-OSS, MaxText's ``mlp_activations=[sigmoid, linear]`` of ``decoder_block=gpt_oss``):
    ``g * sigmoid(1.702 g) * (u + 1)`` of the clamped ``g``, ``u`` (HF ``GptOssExperts._apply_gate``)."""
    act = ACTIVATIONS[activation]
    if activation == "sigmoid":

        def gpt_oss(gate: jax.Array, up: jax.Array) -> jax.Array:
            if limit > 0:
                gate, up = jnp.minimum(gate, limit), jnp.clip(up, -limit, limit)
            return gate * act(gate * GPT_OSS_ALPHA) * (up + 1)

        return gpt_oss
    if limit <= 0:
        return lambda gate, up: act(gate) * up
    return lambda gate, up: act(jnp.minimum(gate, limit)) * jnp.clip(up, -limit, limit)


class GatedMLP(nnx.Module):
    """``wo(act(wi_0 x) * wi_1 x)`` — HF gate_proj, up_proj, down_proj (``limit``: see ``glu``)."""

    def __init__(
        self,
        emb_dim: int,
        mlp_dim: int,
        activation: str,
        *,
        dtype: jnp.dtype,
        weight_dtype: jnp.dtype,
        rngs: nnx.Rngs,
        limit: float = 0.0,
    ):
        kw = dict(dtype=dtype, weight_dtype=weight_dtype, rngs=rngs)
        self.wi_0 = Linear([emb_dim], [mlp_dim], ("embed", "mlp"), **kw)
        self.wi_1 = Linear([emb_dim], [mlp_dim], ("embed", "mlp"), **kw)
        self.wo = Linear([mlp_dim], [emb_dim], ("mlp", "embed"), **kw)
        self.activation = activation
        self.limit = limit

    def __call__(self, x: jax.Array, intermediate: Intermediate = None) -> jax.Array:
        gate = checkpoint_name(self.wi_0(x), "mlpwi_0")
        up = checkpoint_name(self.wi_1(x), "mlpwi_1")
        hidden = constrain(
            glu(self.activation, self.limit)(gate, up), ("activation_batch", "activation_length", "activation_mlp")
        )
        if intermediate is not None:
            hidden = intermediate(hidden)
        return checkpoint_name(self.wo(hidden), "mlpwo")


class MLP(nnx.Module):
    """``wo(act(wi x + b_i)) + b_o`` — the plain two-layer feed-forward with biases (GPT-3)."""

    def __init__(self, emb_dim: int, mlp_dim: int, activation: str, *, dtype: jnp.dtype, weight_dtype: jnp.dtype, rngs: nnx.Rngs):
        kw = dict(dtype=dtype, weight_dtype=weight_dtype, rngs=rngs, use_bias=True)
        self.wi = Linear([emb_dim], [mlp_dim], ("embed", "mlp"), **kw)
        self.wo = Linear([mlp_dim], [emb_dim], ("mlp", "embed"), **kw)
        self.activation = activation

    def __call__(self, x: jax.Array, intermediate: Intermediate = None) -> jax.Array:
        hidden = checkpoint_name(self.wi(x), "mlpwi")
        hidden = constrain(ACTIVATIONS[self.activation](hidden), ("activation_batch", "activation_length", "activation_mlp"))
        if intermediate is not None:
            hidden = intermediate(hidden)
        return checkpoint_name(self.wo(hidden), "mlpwo")
