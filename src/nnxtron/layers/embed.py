"""Embedding tables (tokens, also usable as a tied output head; learned positions).

The tied head is MaxText's (``layers/embeddings.py: attend_on_embedding`` and the decoder's
``normalize_embedding_logits``): ``(x @ T^T) / sqrt(emb_dim)`` with ``normalize_embedding_logits``,
``x @ T^T`` without, where MaxText's table ``T`` is nnxtron's times the family's input scale
(Gemma's ``sqrt(emb_dim)``, folded into MaxText's table; 1 elsewhere). ``tied_logit_scale`` gives
that as nnxtron's ``(scale, divisor)``: the logits are ``x @ (E * scale)^T / divisor``. HF's tied
head is ``x @ E^T``: ``scale == divisor`` (Gemma with normalize, every other family without).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from nnxtron.layers.matmul import contract_last


def tied_logit_scale(emb_dim: int, input_scale: float, normalize: bool) -> tuple[float, float]:
    """``(scale, divisor)`` of the tied head ``x @ (E * scale)^T / divisor`` (see the module):
    ``scale`` the family's input scale (0: none, 1), ``divisor`` ``sqrt(emb_dim)`` with
    ``normalize_embedding_logits`` (MaxText divides by ``sqrt`` of the hidden size), else 1."""
    return (input_scale or 1.0), (emb_dim**0.5 if normalize else 1.0)


def table_stddev(emb_dim: int, input_scale: float, tied: bool, normalize: bool) -> float:
    """The token table's initial standard deviation (nnxtron's table; MaxText's is it times the
    input scale): MaxText's standard normal table, except a tied head without MaxText's division
    (``normalize_embedding_logits=false``, HF's head), whose table starts at ``1 / sqrt(emb_dim)``
    (HF's small-std table, scaled so the logits start at unit scale whatever ``emb_dim``) — with
    the division, MaxText's std 1 does that."""
    maxtext_std = emb_dim**-0.5 if tied and not normalize else 1.0
    return maxtext_std / (input_scale or 1.0)


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
        stddev: float = 1.0,
    ):
        """``stddev``: the table's normal initialiser (``table_stddev`` for tokens; MaxText's
        ``nn.initializers.normal(1.0)`` by default)."""
        init = jax.nn.initializers.normal(stddev=stddev)
        table = init(rngs.params(), (vocab_size, emb_dim), jnp.float32).astype(weight_dtype)  # same draw for any dtype
        self.embedding = nnx.Param(table, out_sharding=axes)
        self.dtype = dtype

    def __call__(self, tokens: jax.Array) -> jax.Array:
        return jnp.take(self.embedding[...], tokens, axis=0).astype(self.dtype)

    def attend(self, x: jax.Array, scale: float = 1.0, divisor: float = 1.0, bf16: bool = False) -> jax.Array:
        """Logits against the table (tied head): ``x @ (E * scale)^T / divisor`` (``tied_logit_scale``),
        in ``dtype``; the division in ``dtype`` after the product, as MaxText's. ``bf16``: MaxText's
        head (``attend_on_embedding``) exactly: its table ``E * scale`` rounded to bfloat16 whatever
        ``dtype`` is (``tied_head_bf16``). Without it, HF's head (``scale == divisor``) is the plain
        ``x @ E^T``."""
        table = self.embedding[...]
        if not bf16:
            logits = contract_last(x.astype(self.dtype), table.astype(self.dtype).T, 1)
            return logits if scale == divisor else logits * scale / divisor
        rounded = (table.astype(jnp.float32) * scale).astype(jnp.bfloat16)
        return contract_last(x.astype(self.dtype), rounded.astype(self.dtype).T, 1) / divisor
