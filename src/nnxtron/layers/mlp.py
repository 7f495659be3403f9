"""Feed-forward blocks: gated (SwiGLU, GeGLU) and plain with biases (GPT-3)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from nnxtron.layers.linear import Linear
from nnxtron.parallel.sharding import constrain

ACTIVATIONS = {
    "silu": jax.nn.silu,
    "gelu": lambda x: jax.nn.gelu(x, approximate=True),  # tanh form = HF gelu_pytorch_tanh / gelu_new (MaxText "gelu")
    "linear": lambda x: x,
}


class GatedMLP(nnx.Module):
    """``wo(act(wi_0 x) * wi_1 x)`` — HF gate_proj, up_proj, down_proj."""

    def __init__(self, emb_dim: int, mlp_dim: int, activation: str, *, dtype: jnp.dtype, weight_dtype: jnp.dtype, rngs: nnx.Rngs):
        kw = dict(dtype=dtype, weight_dtype=weight_dtype, rngs=rngs)
        self.wi_0 = Linear([emb_dim], [mlp_dim], ("embed", "mlp"), **kw)
        self.wi_1 = Linear([emb_dim], [mlp_dim], ("embed", "mlp"), **kw)
        self.wo = Linear([mlp_dim], [emb_dim], ("mlp", "embed"), **kw)
        self.activation = activation

    def __call__(self, x: jax.Array) -> jax.Array:
        gate = checkpoint_name(self.wi_0(x), "mlpwi_0")
        up = checkpoint_name(self.wi_1(x), "mlpwi_1")
        hidden = constrain(ACTIVATIONS[self.activation](gate) * up, ("activation_batch", "activation_length", "activation_mlp"))
        return checkpoint_name(self.wo(hidden), "mlpwo")


class MLP(nnx.Module):
    """``wo(act(wi x + b_i)) + b_o`` — the plain two-layer feed-forward with biases (GPT-3)."""

    def __init__(self, emb_dim: int, mlp_dim: int, activation: str, *, dtype: jnp.dtype, weight_dtype: jnp.dtype, rngs: nnx.Rngs):
        kw = dict(dtype=dtype, weight_dtype=weight_dtype, rngs=rngs, use_bias=True)
        self.wi = Linear([emb_dim], [mlp_dim], ("embed", "mlp"), **kw)
        self.wo = Linear([mlp_dim], [emb_dim], ("mlp", "embed"), **kw)
        self.activation = activation

    def __call__(self, x: jax.Array) -> jax.Array:
        hidden = checkpoint_name(self.wi(x), "mlpwi")
        hidden = constrain(ACTIVATIONS[self.activation](hidden), ("activation_batch", "activation_length", "activation_mlp"))
        return checkpoint_name(self.wo(hidden), "mlpwo")
