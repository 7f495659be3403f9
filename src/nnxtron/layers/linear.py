"""A dense layer over several input and output axes (kernel ``[*in, *out]``)."""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from nnxtron.layers.lora import adapter_input, adapters_for, lora_delta
from nnxtron.layers.matmul import contract_last

# the standard deviation of a standard normal truncated to [-2, 2]: jax's truncated_normal(stddev=s)
# draws std 0.88 s; dividing by it gives std s, as MaxText's variance_scaling(1, fan_in, truncated_normal)
TRUNCATED_STD = 0.87962566103423978


def fan_in_init(fan_in: int, scale: float = 1.0) -> jax.nn.initializers.Initializer:
    """MaxText's kernel initialiser (``nd_dense_init(1.0, "fan_in", "truncated_normal")``): a normal
    truncated at two standard deviations with std ``scale / sqrt(fan_in)``."""
    return jax.nn.initializers.truncated_normal(stddev=scale / math.sqrt(fan_in) / TRUNCATED_STD)


class Linear(nnx.Module):
    """``y = x @ kernel (+ bias)`` contracting the last ``len(in_shape)`` axes of ``x``.

    ``axes`` are the logical sharding names of the kernel (one per kernel dimension).
    Weights are stored in ``weight_dtype``; the matmul runs in ``dtype``. Built inside
    ``layers.lora.building`` it also holds LoRA adapters ``lora_a`` / ``lora_b`` and adds
    ``lora_scale * x @ A @ B`` (``layers/lora.py``).
    """

    def __init__(
        self,
        in_shape: Sequence[int],
        out_shape: Sequence[int],
        axes: Sequence[str],
        *,
        dtype: jnp.dtype,
        weight_dtype: jnp.dtype,
        rngs: nnx.Rngs,
        use_bias: bool = False,
        init_scale: float = 1.0,
    ):
        self.in_shape = tuple(in_shape)
        self.out_shape = tuple(out_shape)
        shape = self.in_shape + self.out_shape
        if len(axes) != len(shape):
            raise ValueError(f"Linear: {len(axes)} axis names for a kernel of rank {len(shape)}")
        fan_in = math.prod(self.in_shape)
        init = fan_in_init(fan_in, init_scale)  # init_scale: MaxText's query kernel folds 1/sqrt(head_dim)
        # drawn in float32 then cast: the same seed gives the same model for any weight_dtype
        key = rngs.params()
        self.kernel = nnx.Param(init(key, shape, jnp.float32).astype(weight_dtype), out_sharding=tuple(axes))
        adapters = adapters_for(key, self.in_shape, self.out_shape, axes, weight_dtype)
        self.lora_scale = 0.0  # 0: no adapters (none built, or removed by layers.lora.select_targets)
        if adapters is not None:
            self.lora_a, self.lora_b, self.lora_scale, self.lora_dropout = adapters
            self.lora_site = 0  # the adapters' dropout site, set by layers.lora.select_targets
        if use_bias:  # zeros, sharded like the output dims
            self.bias = nnx.Param(jnp.zeros(self.out_shape, weight_dtype), out_sharding=tuple(axes[len(self.in_shape) :]))
        self.use_bias = use_bias
        self.dtype = dtype

    def __call__(self, x: jax.Array) -> jax.Array:
        x = x.astype(self.dtype)
        y = contract_last(x, self.kernel[...].astype(self.dtype), len(self.in_shape))
        if self.lora_scale:
            x_in = adapter_input(x, self.lora_dropout, self.lora_site)
            y = y + lora_delta(x_in, self.lora_a[...], self.lora_b[...], self.lora_scale, len(self.in_shape), contract_last)
        return y + self.bias[...].astype(self.dtype) if self.use_bias else y
