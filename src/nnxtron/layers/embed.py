"""Embedding tables (tokens, also usable as a tied output head; learned positions)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx


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

    def attend(self, x: jax.Array) -> jax.Array:
        """Logits against the table (tied head): ``x @ E^T``."""
        return jnp.einsum("bsd,vd->bsv", x.astype(self.dtype), self.embedding[...].astype(self.dtype))
