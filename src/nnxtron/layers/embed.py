"""Embedding tables (tokens, also usable as a tied output head; learned positions)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from nnxtron.layers.matmul import contract_last


class Embed(nnx.Module):
    def __init__(
        self,
        vocab_size: int,
        emb_dim: int,
        *,
        dtype: jnp.dtype,
        weight_dtype: jnp.dtype,
        rngs: nnx.Rngs,
        axes: tuple[str | None, str] = ("vocab", "embed"),
    ):
        init = jax.nn.initializers.normal(stddev=1.0)
        table = init(rngs.params(), (vocab_size, emb_dim), jnp.float32).astype(weight_dtype)  # same draw for any dtype
        self.embedding = nnx.Param(table, out_sharding=axes)
        self.dtype = dtype

    def __call__(self, tokens: jax.Array) -> jax.Array:
        return jnp.take(self.embedding[...], tokens, axis=0).astype(self.dtype)

    def attend(self, x: jax.Array, bf16_scale: float = 0.0) -> jax.Array:
        """Logits against the table (tied head): ``x @ E^T``. ``bf16_scale`` > 0: MaxText's tied head
        (``attend_on_embedding``), ``(x @ bf16(E * bf16_scale)^T) / bf16_scale``: its table, which
        holds Gemma's ``sqrt(emb_dim)`` folded in (``bf16_scale`` then; else 1), rounded to bfloat16
        whatever ``dtype`` is, the logits divided by that scale (``normalize_embedding_logits``)."""
        table = self.embedding[...]
        if not bf16_scale:
            return contract_last(x.astype(self.dtype), table.astype(self.dtype).T, 1)
        rounded = (table.astype(jnp.float32) * bf16_scale).astype(jnp.bfloat16)
        return contract_last(x.astype(self.dtype), rounded.astype(self.dtype).T, 1) / bf16_scale
