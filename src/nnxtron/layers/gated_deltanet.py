"""Gated DeltaNet linear attention (Qwen3-Next's and Qwen3.5's ``linear_attention`` layers; HF ``Qwen3NextGatedDeltaNet``).

Per token ``t`` and value head ``h`` (its query/key head ``h // (Hv / Hk)``)::

    q, k, v, z = split(in_proj_qkvz(x)); b, a = split(in_proj_ba(x))      # HF's per-key-head grouping
    q, k, v = silu(causal_depthwise_conv([q, k, v]))                      # kernel gdn_conv_kernel_dim
    beta = sigmoid(b);  g = -exp(A_log) * softplus(a + dt_bias)           # float32
    q, k = l2norm(q), l2norm(k);  q = q / sqrt(dk)
    S = S * exp(g_t);  S = S + k_t (beta_t (v_t - S^T k_t))^T;  o_t = S^T q_t   # S [dk, dv], float32
    y = out_proj(rms_norm(o) * w * silu(z))                               # the gated norm, w starts at 1

``gated_delta_rule`` is the recurrence token by token (HF's ``torch_recurrent_gated_delta_rule``), the
definition; the layer runs ``chunked_gated_delta_rule``, the same function ``gdn_chunk_size`` tokens at a time
(HF's ``torch_chunk_gated_delta_rule``), whose backward keeps one state per chunk. Packed sequences:
the state restarts and the convolution sees no token of another segment where ``segment_ids`` change
(HF has no packing here; a single segment is HF's computation exactly). Decoding caches the last ``K - 1``
conv inputs (by position) and the recurrent state (``cache_spec``); padding tokens leave both alone.

Weights keep HF's layout: ``in_proj_qkvz`` ``[D, Hk, 2 dk + 2 (Hv/Hk) dv]`` and ``in_proj_ba``
``[D, Hk, 2 Hv/Hk]`` (HF's ``view`` per key head); with ``fused_projections=False`` (HF ``Qwen3_5GatedDeltaNet``,
the same function) ``in_proj_qkv [D, C]`` (all q heads, all k, all v), ``in_proj_z [D, Hv, dv]``, ``in_proj_b``
and ``in_proj_a [D, Hv]`` instead; ``conv [C, 1, K]`` (HF ``conv1d.weight``, C = 2 Hk dk + Hv dv),
``dt_bias [Hv]``, ``A_log [Hv]``, ``norm/scale [dv]``, ``out [Hv, dv, D]``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from nnxtron.config.schema import Config
from nnxtron.layers.kv_cache import CacheSpec
from nnxtron.layers.linear import Linear
from nnxtron.layers.norms import RMSNorm

L2_EPS = 1e-6  # HF l2norm's eps (FLA's)


def l2_normalise(x: jax.Array, eps: float = L2_EPS) -> jax.Array:
    """``x * rsqrt(sum(x^2) + eps)`` over the last axis (HF ``l2norm``)."""
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)


def causal_conv(x: jax.Array, kernel: jax.Array, segment_ids: jax.Array) -> jax.Array:
    """Depthwise causal convolution of ``x [B, S, C]`` with ``kernel [C, K]`` (HF conv1d, padding K - 1, the
    first S outputs): ``out[t] = sum_j kernel[:, j] * x[t - (K - 1) + j]``, terms of another segment left out."""
    size = kernel.shape[-1]
    out = jnp.zeros(x.shape, jnp.float32)
    for j in range(size):
        shift = size - 1 - j
        past = jnp.pad(x, ((0, 0), (shift, 0), (0, 0)))[:, : x.shape[1]]
        same = jnp.pad(segment_ids, ((0, 0), (shift, 0)), constant_values=-1)[:, : x.shape[1]] == segment_ids
        out = out + jnp.where(same[..., None], past, 0).astype(jnp.float32) * kernel[:, j].astype(jnp.float32)
    return out


def _normalised(q: jax.Array, k: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The delta rule's queries and keys: L2-normalised in float32, the queries scaled by ``1 / sqrt(dk)``."""
    return l2_normalise(q.astype(jnp.float32)) * (q.shape[-1] ** -0.5), l2_normalise(k.astype(jnp.float32))


def gated_delta_rule(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    g: jax.Array,
    beta: jax.Array,
    restart: jax.Array,
    initial: jax.Array | None = None,
    keep: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """The delta-rule recurrence over time, in float32: ``q, k [B, S, H, dk]``, ``v [B, S, H, dv]``, ``g, beta
    [B, S, H]``, ``restart [B, S]`` (the state is zeroed before token t where true) -> ``(o [B, S, H, dv],
    final state [B, H, dk, dv])``. ``initial``: the state before the first token (decoding; zeros if None);
    ``keep [B, S]``: where false the token leaves the state unchanged (padding while decoding)."""
    q, k = _normalised(q, k)
    batch, _, heads, dk = k.shape
    state = jnp.zeros((batch, heads, dk, v.shape[-1]), jnp.float32) if initial is None else initial.astype(jnp.float32)
    keep = jnp.ones(restart.shape, bool) if keep is None else keep

    def step(state: jax.Array, inputs: tuple[jax.Array, ...]) -> tuple[jax.Array, jax.Array]:
        q_t, k_t, v_t, g_t, beta_t, restart_t, keep_t = inputs
        new = jnp.where(restart_t[:, None, None, None], 0.0, state) * jnp.exp(g_t)[..., None, None]
        memory = jnp.einsum("bhkv,bhk->bhv", new, k_t)
        delta = (v_t - memory) * beta_t[..., None]
        new = new + k_t[..., :, None] * delta[..., None, :]
        return jnp.where(keep_t[:, None, None, None], new, state), jnp.einsum("bhkv,bhk->bhv", new, q_t)

    inputs = (q, k, v.astype(jnp.float32), g, beta.astype(jnp.float32), restart, keep)
    state, out = jax.lax.scan(step, state, tuple(jnp.moveaxis(a, 1, 0) for a in inputs))
    return jnp.moveaxis(out, 0, 1), state


def chunked_gated_delta_rule(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    g: jax.Array,
    beta: jax.Array,
    restart: jax.Array,
    initial: jax.Array | None = None,
    keep: jax.Array | None = None,
    chunk_size: int = 64,
) -> tuple[jax.Array, jax.Array]:
    """``gated_delta_rule``'s function computed a chunk of tokens at a time (HF ``torch_chunk_gated_delta_rule``,
    MaxText's ``gdn_chunk_size``): the same arguments and results, float32.

    Inside a chunk of ``C`` tokens with cumulative log decay ``G`` the delta rule's updates are one triangular
    solve, ``T = (I + tril(diag(beta) K K^T * exp(G_i - G_j), -1))^-1``, and the chunk's outputs two products
    with the state it starts from; only that state is carried from chunk to chunk (``lax.scan``), so the
    backward pass keeps one ``[B, H, dk, dv]`` state per chunk, not per token. A restart inside a chunk splits
    it: token pairs of different pieces do not interact and only the piece before the first restart sees the
    incoming state. ``keep`` false makes a token's decay 1 and its ``beta`` 0 (the state passes it unchanged,
    as in the recurrence); the sequence is padded to whole chunks the same way.

    Its products run at ``highest`` matmul precision: at a TPU's default (bfloat16 passes) the chunk's
    solve and products lose 5e-3 of the output where this is within 2.2e-6 of the token-by-token rule,
    for 1.26x the time (``benchmarks/delta_rule.py``; ``benchmarks/results/delta_rule-TPU_v5_lite.json``)."""
    with jax.default_matmul_precision("highest"):
        q, k = _normalised(q, k)
        v, g, beta = v.astype(jnp.float32), g.astype(jnp.float32), beta.astype(jnp.float32)
        batch, seq, heads, dk = k.shape
        dv = v.shape[-1]
        if keep is not None:
            g, beta, restart = jnp.where(keep[..., None], g, 0.0), jnp.where(keep[..., None], beta, 0.0), restart & keep
        size = min(chunk_size, seq)
        chunks = -(-seq // size)
        pad = chunks * size - seq

        def chunked(x: jax.Array) -> jax.Array:  # [B, S, ...] -> [n, B, H, C, ...] (restart: [n, B, 1, C])
            x = jnp.pad(x, ((0, 0), (0, pad)) + ((0, 0),) * (x.ndim - 2))
            x = x.reshape(batch, chunks, size, *x.shape[2:])
            x = x[:, :, :, None] if x.ndim == 3 else x  # restart: a head axis of 1
            return jnp.moveaxis(jnp.moveaxis(x, 3, 2), 1, 0)

        q, k, v, beta = (chunked(x) for x in (q, k, v, beta))
        piece = jnp.cumsum(chunked(restart).astype(jnp.int32), axis=-1)  # [n, B, 1, C]: restarts so far inside the chunk
        gcum = jnp.cumsum(chunked(g), axis=-1)  # [n, B, H, C]
        causal = jnp.tril(jnp.ones((size, size), bool))
        together = causal & (piece[..., :, None] == piece[..., None, :])  # i >= j, no restart in (j, i]
        decay = jnp.where(together, jnp.exp(jnp.where(together, gcum[..., :, None] - gcum[..., None, :], 0.0)), 0.0)
        k_beta = k * beta[..., None]
        strict = jnp.einsum("nbhid,nbhjd->nbhij", k_beta, k) * decay * (1.0 - jnp.eye(size))
        solve = jax.scipy.linalg.solve_triangular(
            jnp.eye(size) + strict, jnp.broadcast_to(jnp.eye(size), strict.shape), lower=True, unit_diagonal=True
        )
        values = solve @ (v * beta[..., None])  # the chunk's updates before the incoming state's part
        first_piece = (piece == 0).astype(jnp.float32)  # tokens that see the incoming state
        k_decayed = (solve @ (k_beta * jnp.exp(gcum)[..., None])) * first_piece[..., None]
        q_decayed = q * (jnp.exp(gcum) * first_piece)[..., None]
        scores = jnp.einsum("nbhid,nbhjd->nbhij", q, k) * decay
        last = piece[..., -1:]  # the piece the chunk ends in
        to_end = jnp.where(piece == last, jnp.exp(gcum[..., -1:] - gcum), 0.0)  # [n, B, H, C]
        carry_over = jnp.where(last[..., 0] == 0, jnp.exp(gcum[..., -1]), 0.0)  # [n, B, H]

        def step(state: jax.Array, xs: tuple[jax.Array, ...]) -> tuple[jax.Array, jax.Array]:
            values_c, k_decayed_c, q_decayed_c, scores_c, k_c, to_end_c, carry_c = xs
            new_values = values_c - k_decayed_c @ state
            out = q_decayed_c @ state + scores_c @ new_values
            state = state * carry_c[..., None, None] + jnp.einsum("bhc,bhck,bhcv->bhkv", to_end_c, k_c, new_values)
            return state, out

        state = jnp.zeros((batch, heads, dk, dv), jnp.float32) if initial is None else initial.astype(jnp.float32)
        state, out = jax.lax.scan(step, state, (values, k_decayed, q_decayed, scores, k, to_end, carry_over))
        out = jnp.moveaxis(out, 0, 1).swapaxes(2, 3).reshape(batch, chunks * size, heads, dv)  # [B, n C, H, dv]
        return out[:, :seq], state


def cached_causal_conv(x: jax.Array, kernel: jax.Array, q_positions: jax.Array, k_positions: jax.Array) -> jax.Array:
    """``causal_conv`` while decoding: ``x [B, T, C]`` the cached then the new tokens' inputs at ``k_positions
    [B, T]`` (-1: empty), outputs for the new tokens at ``q_positions [B, S]``: term ``j`` takes the input at
    position ``p - (K - 1) + j`` where the cache or the step holds it."""
    size = kernel.shape[-1]
    out = jnp.zeros((*q_positions.shape, x.shape[-1]), jnp.float32)
    for j in range(size):
        wanted = q_positions[:, :, None] - (size - 1 - j)
        match = (k_positions[:, None, :] == wanted) & (k_positions[:, None, :] >= 0)
        out = out + jnp.einsum("bst,btc->bsc", match.astype(jnp.float32), x.astype(jnp.float32)) * kernel[:, j].astype(
            jnp.float32
        )
    return out


class GatedRMSNorm(nnx.Module):
    """HF ``Qwen3NextRMSNormGated``: ``(w * rms_norm(x)) * silu(z)`` (w starts at 1, not zero-centred)."""

    def __init__(self, dim: int, *, eps: float, dtype: jnp.dtype, weight_dtype: jnp.dtype):
        self.norm = RMSNorm(dim, eps=eps, dtype=dtype, weight_dtype=weight_dtype)
        self.dtype = dtype

    def __call__(self, x: jax.Array, z: jax.Array) -> jax.Array:
        return (self.norm(x).astype(jnp.float32) * jax.nn.silu(z.astype(jnp.float32))).astype(self.dtype)


class GatedDeltaNet(nnx.Module):
    """One Gated DeltaNet token mixer: ``x [B, S, D]`` -> ``[B, S, D]`` (see the module docstring)."""

    def __init__(self, cfg: Config, rngs: nnx.Rngs, fused_projections: bool = True):
        dtype, weight_dtype = jnp.dtype(cfg.dtype), jnp.dtype(cfg.weight_dtype)
        self.key_heads, self.value_heads = cfg.gdn_num_key_heads, cfg.gdn_num_value_heads
        self.key_dim, self.value_dim = cfg.gdn_key_head_dim, cfg.gdn_value_head_dim
        group = self.value_heads // self.key_heads
        kw = dict(dtype=dtype, weight_dtype=weight_dtype, rngs=rngs)
        channels = 2 * self.key_heads * self.key_dim + self.value_heads * self.value_dim
        self.fused = fused_projections
        if fused_projections:  # Qwen3-Next: per key head, [q, k, v..., z...] and [b..., a...]
            width = 2 * self.key_dim + 2 * group * self.value_dim
            self.in_proj_qkvz = Linear([cfg.base_emb_dim], [self.key_heads, width], ("embed", "kv_heads", None), **kw)
            self.in_proj_ba = Linear([cfg.base_emb_dim], [self.key_heads, 2 * group], ("embed", "kv_heads", None), **kw)
        else:  # Qwen3.5: HF's separate projections; qkv is the conv's channel order (all q, all k, all v)
            self.in_proj_qkv = Linear([cfg.base_emb_dim], [channels], ("embed", None), **kw)
            self.in_proj_z = Linear(
                [cfg.base_emb_dim], [self.value_heads, self.value_dim], ("embed", "q_heads", "head_dim"), **kw
            )
            self.in_proj_b = Linear([cfg.base_emb_dim], [self.value_heads], ("embed", None), **kw)
            self.in_proj_a = Linear([cfg.base_emb_dim], [self.value_heads], ("embed", None), **kw)
        size = self.conv_size = cfg.gdn_conv_kernel_dim
        self.chunk_size = cfg.gdn_chunk_size
        conv = jax.random.uniform(rngs.params(), (channels, 1, size), jnp.float32, -(size**-0.5), size**-0.5)
        self.conv = nnx.Param(conv.astype(weight_dtype), out_sharding=(None, None, None))
        self.dt_bias = nnx.Param(jnp.ones((self.value_heads,), jnp.float32), out_sharding=(None,))
        a = jax.random.uniform(rngs.params(), (self.value_heads,), jnp.float32, 0.01, 16.0)  # HF's init
        self.A_log = nnx.Param(jnp.log(a), out_sharding=(None,))
        self.norm = GatedRMSNorm(self.value_dim, eps=cfg.normalization_layer_epsilon, dtype=dtype, weight_dtype=weight_dtype)
        self.out = Linear([self.value_heads, self.value_dim], [cfg.base_emb_dim], ("q_heads", "head_dim", "embed"), **kw)
        self.dtype = dtype

    def project(self, x: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
        """``x [B, S, D]`` -> the conv's input ``[B, S, C]`` (all q, all k, all v), ``z [B, S, Hv, dv]`` and ``b, a
        [B, S, Hv]``: from Qwen3-Next's fused per-key-head projections, or Qwen3.5's separate ones."""
        batch, seq, _ = x.shape
        if not self.fused:
            return self.in_proj_qkv(x), self.in_proj_z(x), self.in_proj_b(x), self.in_proj_a(x)
        dk, dv, group = self.key_dim, self.value_dim, self.value_heads // self.key_heads
        qkvz = self.in_proj_qkvz(x)  # [B, S, Hk, 2 dk + 2 group dv]
        q, k = qkvz[..., :dk], qkvz[..., dk : 2 * dk]
        v = qkvz[..., 2 * dk : 2 * dk + group * dv].reshape(batch, seq, self.value_heads, dv)
        z = qkvz[..., 2 * dk + group * dv :].reshape(batch, seq, self.value_heads, dv)
        ba = self.in_proj_ba(x)
        b = ba[..., :group].reshape(batch, seq, self.value_heads)
        a = ba[..., group:].reshape(batch, seq, self.value_heads)
        mixed = jnp.concatenate([q.reshape(batch, seq, -1), k.reshape(batch, seq, -1), v.reshape(batch, seq, -1)], -1)
        return mixed, z, b, a

    def __call__(self, x: jax.Array, positions: jax.Array, segment_ids: jax.Array) -> jax.Array:
        batch, seq, _ = x.shape
        dk, dv, group = self.key_dim, self.value_dim, self.value_heads // self.key_heads
        mixed, z, b, a = self.project(x)
        kernel = self.conv[...][:, 0, :]
        if hasattr(self, "cache"):  # decoding: the last K - 1 inputs come from the cache
            past, k_positions = self.cache["conv"].extend({"x": mixed}, positions, segment_ids != 0)
            mixed = jax.nn.silu(cached_causal_conv(past["x"], kernel, positions, k_positions)).astype(self.dtype)
        else:
            mixed = jax.nn.silu(causal_conv(mixed, kernel, segment_ids)).astype(self.dtype)
        keys = self.key_heads * dk
        q = mixed[..., :keys].reshape(batch, seq, self.key_heads, dk)
        k = mixed[..., keys : 2 * keys].reshape(batch, seq, self.key_heads, dk)
        v = mixed[..., 2 * keys :].reshape(batch, seq, self.value_heads, dv)
        beta = jax.nn.sigmoid(b.astype(jnp.float32))
        g = -jnp.exp(self.A_log[...].astype(jnp.float32)) * jax.nn.softplus(
            a.astype(jnp.float32) + self.dt_bias[...].astype(jnp.float32)
        )
        q, k = jnp.repeat(q, group, axis=2), jnp.repeat(k, group, axis=2)  # HF's repeat_interleave
        if hasattr(self, "cache"):  # decoding: one document per row, padding (segment 0) leaves the state alone
            valid = segment_ids != 0
            state = self.cache["state"]
            out, final = chunked_gated_delta_rule(
                q, k, v, g, beta, jnp.zeros(valid.shape, bool),
                initial=state.entries["s"][...][:, 0], keep=valid, chunk_size=self.chunk_size,
            )  # fmt: skip
            last = jnp.max(jnp.where(valid, positions, -1), axis=1, keepdims=True)
            state.store({"s": final[:, None]}, last, last >= 0)
        else:
            restart = jnp.pad(segment_ids[:, 1:] != segment_ids[:, :-1], ((0, 0), (1, 0)))
            out, _ = chunked_gated_delta_rule(q, k, v, g, beta, restart, chunk_size=self.chunk_size)
        return self.out(self.norm(out.astype(self.dtype), z))

    def cache_spec(self, max_length: int) -> dict[str, CacheSpec]:
        """Decoding state: the last ``K - 1`` conv inputs (a ring buffer by position) and the recurrent state
        (one slot, float32), neither of them paged."""
        channels = 2 * self.key_heads * self.key_dim + self.value_heads * self.value_dim
        conv = CacheSpec(max(self.conv_size - 1, 1), {"x": ((channels,), (None,))}, self.dtype, pageable=False)
        dims = (self.value_heads, self.key_dim, self.value_dim)
        state = CacheSpec(1, {"s": (dims, ("kv_heads", None, None))}, jnp.float32, pageable=False)
        return {"conv": conv, "state": state}
