"""DeepSeek-V4 compressed attention: shared-KV MQA over sliding-window keys plus compressed entries.

Follows HF ``DeepseekV4Attention`` (transformers 5.24; full-sequence path)::

    q_res = q_norm(x @ wq_a);  q = rms(q_res @ wq_b -> [H, hd]);  q = rope_tail(q)
    kv = rope_tail(kv_norm(x @ wkv))                        # one head; keys = values
    C, visible = compressor(x, q_res)                       # CSA / HCA layers only
    logits = [q.kv (sliding window W) | q.C (visible)] * hd^-0.5, plus one sink logit per head
    o = softmax(logits)[without the sink] @ [kv | C];  o = rope_tail(o, -angle)
    out = wo_b(concat_g(o_g @ wo_a[g]))                     # grouped low-rank output

``rope_tail`` rotates the last ``qk_rope_head_dim`` dims in interleaved pairs (float32).
Sliding layers use ``rope_max_timescale``; CSA/HCA layers, their compressors and the
indexer use ``compressed_rope_max_timescale`` (with the config's YaRN, if any, at
attention factor 1, as HF).

Compressors pool windows of ``m`` tokens with a softmax gate (float32) over
``gate + position_bias``, then ``kv_norm`` and RoPE at the window's start position:

* HCA (``hca_compress_ratio``): entry ``w`` pools tokens ``[w m, (w+1) m)``;
* CSA (``csa_compress_ratio``): entry ``w`` pools ``2m`` slots — the first ``hd`` dims of
  window ``w-1`` and the last ``hd`` dims of window ``w`` (projections are ``2 hd`` wide);
  a lightning indexer scores the entries per query (``sum_h relu(q^I_h . K^I_w) c^-0.5 *
  (x W)_h nI^-0.5``) and each query sees its ``indexer_topk`` best.

Entry ``w`` is visible to query ``t`` only once complete (``(w+1) m <= t+1``). Packed
sequences: windows stay aligned to the row; a slot whose token belongs to another
document than the window's last token is dropped from the pooling, and queries see only
entries whose last token is in their own document (no leakage across documents; a
document not starting at a multiple of ``m`` has a partial first window).

Decoding (``infer.cache``): the sliding keys are a ring buffer of the window; each
compressor buffers the last ``m`` (CSA: ``2m``) tokens' projections and gates, pools the
windows completed by the new tokens with the training ``_pool`` and stores the entries by
window index; the indexer scores its own stored entries the same way.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from nnxtron.config.schema import Config
from nnxtron.layers.kv_cache import CacheSpec, TokenCache, cache_mask, cache_size
from nnxtron.layers.linear import Linear, fan_in_init
from nnxtron.layers.norms import RMSNorm, l2_norm
from nnxtron.layers.rope import RopeSpec, apply_rope
from nnxtron.layers.router import top_k
from nnxtron.parallel.sharding import constrain

NEG_INF = -jnp.inf


def rope_tail(x: jax.Array, positions: jax.Array, spec: RopeSpec, inverse: bool = False) -> jax.Array:
    """Rotate the last ``spec.head_dim`` dims of ``x [B, S, N, d]`` (interleaved pairs) in float32."""
    rope_dim = spec.head_dim
    head, tail = x[..., :-rope_dim], x[..., -rope_dim:]
    angles = -positions if inverse else positions
    rotated = apply_rope(tail.astype(jnp.float32), angles, spec).astype(x.dtype)
    return jnp.concatenate([head, rotated], axis=-1)


def rope_specs(cfg: Config) -> tuple[RopeSpec, RopeSpec]:
    """(sliding-layer spec, compressed-layer spec) over the ``qk_rope_head_dim`` rotated dims."""
    main = RopeSpec(head_dim=cfg.qk_rope_head_dim, theta=cfg.rope_max_timescale, interleave=True)
    compress = RopeSpec.from_config(cfg, cfg.qk_rope_head_dim)
    compress = RopeSpec(
        **{**compress.__dict__, "theta": cfg.compressed_rope_max_timescale, "interleave": True, "unit_attention_factor": True}
    )
    return main, compress


def _norm(dim: int, cfg: Config, dtype: jnp.dtype) -> RMSNorm:
    return RMSNorm(dim, eps=cfg.normalization_layer_epsilon, dtype=dtype, weight_dtype=jnp.dtype(cfg.weight_dtype))


class Compressor(nnx.Module):
    """Gated pooling of ``ratio``-token windows into entries of ``dim`` (``overlap``: CSA's 2m slots)."""

    def __init__(self, cfg: Config, dim: int, ratio: int, overlap: bool, rope: RopeSpec, dtype: jnp.dtype, rngs: nnx.Rngs):
        width = 2 * dim if overlap else dim
        kw = dict(dtype=dtype, weight_dtype=jnp.dtype(cfg.weight_dtype), rngs=rngs)
        self.wkv = Linear([cfg.base_emb_dim], [width], ("embed", None), **kw)
        self.wgate = Linear([cfg.base_emb_dim], [width], ("embed", None), **kw)
        self.position_bias = nnx.Param(jnp.zeros((ratio, width), jnp.float32), out_sharding=(None, None))
        self.norm = _norm(dim, cfg, dtype)
        self.dim, self.ratio, self.overlap, self.rope = dim, ratio, overlap, rope

    def __call__(self, x: jax.Array, positions: jax.Array, segment_ids: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """``x [B, S, D]`` -> entries ``[B, N, dim]`` (N = S // ratio), each entry's last token
        index ``[N]`` and its document ``[B, N]``."""
        batch, seq, _ = x.shape
        m, n = self.ratio, seq // self.ratio
        usable = n * m
        kv = self.wkv(x[:, :usable]).reshape(batch, n, m, -1)
        gate = self.wgate(x[:, :usable]).reshape(batch, n, m, -1).astype(jnp.float32) + self.position_bias[...]
        seg = segment_ids[:, :usable].reshape(batch, n, m)
        owner = seg[:, :, -1]  # the document of each window's last token
        keep = seg == owner[:, :, None]
        prev = None
        if self.overlap:  # window w-1 of each window w (none before the first)
            shift = lambda a, fill: jnp.pad(a[:, :-1], ((0, 0), (1, 0)) + ((0, 0),) * (a.ndim - 2), constant_values=fill)  # noqa: E731
            prev = (shift(kv, 0), shift(gate, NEG_INF), shift(seg, -1) == owner[:, :, None])
        start = positions[:, :usable].reshape(batch, n, m)[:, :, 0]  # the window's first token's position
        entries = self._pool((kv, gate, keep), prev, start)
        last = jnp.arange(n) * m + (m - 1)
        return entries, last, owner

    def _pool(self, window: tuple, prev: tuple | None, start: jax.Array) -> jax.Array:
        """Entries ``[B, N, dim]`` from windows ``(kv, gate, keep)`` ``[B, N, m, ...]`` (CSA: and
        the previous windows ``prev``): slots are the window's tokens, or for CSA the first
        ``dim`` dims of window w-1 then the last ``dim`` dims of window w; a softmax over the
        kept slots of ``gate`` weighs ``kv``; then ``norm`` and RoPE at ``start``."""
        kv, gate, keep = window
        if self.overlap:
            d = self.dim
            kv = jnp.concatenate([prev[0][..., :d], kv[..., d:]], axis=2)
            gate = jnp.concatenate([prev[1][..., :d], gate[..., d:]], axis=2)
            keep = jnp.concatenate([prev[2], keep], axis=2)
        gate = jnp.where(keep[..., None], gate, NEG_INF)
        weights = jax.nn.softmax(gate, axis=2).astype(kv.dtype)
        pooled = self.norm(jnp.sum(kv * weights, axis=2))
        return rope_tail(pooled[:, :, None, :], start, self.rope)[:, :, 0, :]

    def cache_specs(self, max_length: int, prefix: str) -> dict[str, CacheSpec]:
        """Decoding: the projections of the last ``m`` (CSA: ``2m``) tokens — windows not yet
        complete, and CSA's previous window — and every complete window's entry."""
        width = self.wkv.out_shape[0]
        buffer = {"kv": ((width,), (None,)), "gate": ((width,), (None,))}
        slots = (2 if self.overlap else 1) * self.ratio
        return {
            f"{prefix}_buffer": CacheSpec(slots, buffer, jnp.float32),
            f"{prefix}_entries": CacheSpec(max_length // self.ratio + 1, {"entry": ((self.dim,), (None,))}, self.norm.dtype),
        }

    def decode(self, buffer: TokenCache, stored: TokenCache, x: jax.Array, positions: jax.Array, valid: jax.Array):
        """Decoding: buffer the new tokens' projections, pool the windows they complete, store
        those entries. Returns every stored entry then the new ones ``[B, T, dim]`` and which
        of them each query at ``positions`` sees ``[B, S, T]``: entry ``w`` once its last
        token ``(w+1) m - 1`` is at or before the query."""
        batch, seq, _ = x.shape
        m = self.ratio
        kv = self.wkv(x)
        gate = self.wgate(x).astype(jnp.float32) + self.position_bias[...][positions % m]
        tokens, token_positions = buffer.extend({"kv": kv.astype(jnp.float32), "gate": gate}, positions, valid)
        # the buffered and new tokens laid out by position: slot r holds position base + r
        span = token_positions.shape[1]
        last = jnp.max(jnp.where(valid, positions, -1), axis=1)
        first = jnp.min(jnp.where(valid, positions, jnp.iinfo(jnp.int32).max), axis=1)
        base = last - span + 1
        rows = jnp.arange(batch)[:, None]
        offset = token_positions - base[:, None]
        offset = jnp.where((token_positions >= 0) & (offset >= 0), offset, span)  # out of the span: dropped
        dense_kv = jnp.zeros((batch, span, kv.shape[-1]), jnp.float32).at[rows, offset].set(tokens["kv"], mode="drop")
        dense_gate = jnp.full((batch, span, gate.shape[-1]), NEG_INF).at[rows, offset].set(tokens["gate"], mode="drop")
        present = jnp.zeros((batch, span), bool).at[rows, offset].set(True, mode="drop")
        # the windows whose last token is new: at most seq // m + 1 of them, in increasing order
        # (with the stored entries before them, the indexer's top-k breaks ties as in training)
        count = seq // m + 1
        window = ((last + 1) // m - count)[:, None] + jnp.arange(count)[None, :]  # [B, K]
        window_end = (window + 1) * m - 1
        complete = (window >= 0) & (window_end >= first[:, None]) & (window_end <= last[:, None])

        def gather(w: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
            index = w[:, :, None] * m + jnp.arange(m) - base[:, None, None]  # [B, K, m]
            inside = (index >= 0) & (index < span)
            index = jnp.clip(index, 0, span - 1).reshape(batch, -1)
            pick = lambda a: jnp.take_along_axis(a, index[..., None] if a.ndim == 3 else index, axis=1)  # noqa: E731
            shape = (batch, count, m)
            kv_w = pick(dense_kv).reshape(*shape, -1).astype(kv.dtype)
            return kv_w, pick(dense_gate).reshape(*shape, -1), pick(present).reshape(shape) & inside

        prev = gather(window - 1) if self.overlap else None
        entries = self._pool(gather(window), prev, window * m)
        entries = jnp.where(complete[..., None], entries, 0)  # a window with no token pools to NaN
        cached, windows = stored.extend({"entry": entries}, window, complete)  # window index -1: empty slot
        visible = (windows[:, None, :] >= 0) & ((windows[:, None, :] + 1) * m - 1 <= positions[:, :, None])
        return cached["entry"], visible


def _entry_visible(last: jax.Array, owner: jax.Array, segment_ids: jax.Array) -> jax.Array:
    """``[B, S, N]``: entry complete before the query and in the query's document."""
    seq = segment_ids.shape[1]
    complete = last[None, :] <= jnp.arange(seq)[:, None]  # [S, N]
    return complete[None] & (owner[:, None, :] == segment_ids[:, :, None])


class Indexer(nnx.Module):
    """Lightning indexer of a CSA layer: which compressed entries each query attends to."""

    def __init__(self, cfg: Config, rope: RopeSpec, dtype: jnp.dtype, rngs: nnx.Rngs):
        kw = dict(dtype=dtype, weight_dtype=jnp.dtype(cfg.weight_dtype), rngs=rngs)
        heads, dim = cfg.indexer_n_heads, cfg.indexer_head_dim
        self.compressor = Compressor(cfg, dim, cfg.csa_compress_ratio, True, rope, dtype, rngs)
        self.wq_b = Linear([cfg.q_lora_rank], [heads, dim], ("q_lora", "q_heads", None), **kw)
        self.weights_proj = Linear([cfg.base_emb_dim], [heads], ("embed", None), **kw)
        self.heads, self.dim, self.topk, self.rope = heads, dim, cfg.indexer_topk, rope

    def __call__(self, x: jax.Array, q_res: jax.Array, positions: jax.Array, segment_ids: jax.Array) -> jax.Array:
        """Boolean ``[B, S, N]``: the entries each query selects."""
        keys, last, owner = self.compressor(x, positions, segment_ids)  # [B, N, c]
        scores = self._scores(x, q_res, positions, keys)
        visible = _entry_visible(last, owner, segment_ids)
        return self._select(scores, visible)

    def _select(self, scores: jax.Array, visible: jax.Array) -> jax.Array:
        """The ``topk`` best visible entries of each query, boolean ``[B, S, N]``."""
        n = scores.shape[-1]
        scores = jnp.where(visible, scores, NEG_INF)
        _, picked = top_k(scores, min(self.topk, n))  # [B, S, k]; ties in window order (layers/router.py)
        chosen = jnp.any(picked[..., None] == jnp.arange(n), axis=-2)  # [B, S, N]
        return chosen & visible

    def _scores(self, x: jax.Array, q_res: jax.Array, positions: jax.Array, keys: jax.Array) -> jax.Array:
        q = rope_tail(self.wq_b(q_res), positions, self.rope)  # [B, S, nI, c]
        scores = jnp.einsum("bshc,bnc->bshn", q.astype(jnp.float32), keys.astype(jnp.float32))
        scores = jax.nn.relu(scores) * self.dim**-0.5
        weights = self.weights_proj(x).astype(jnp.float32) * self.heads**-0.5  # [B, S, nI]
        return jnp.einsum("bshn,bsh->bsn", scores, weights)


class CompressedAttention(nnx.Module):
    """One DeepSeek-V4 attention layer of kind ``sliding``, ``csa`` or ``hca``."""

    def __init__(self, cfg: Config, kind: str, rngs: nnx.Rngs):
        dtype, weight_dtype = jnp.dtype(cfg.dtype), jnp.dtype(cfg.weight_dtype)
        kw = dict(dtype=dtype, weight_dtype=weight_dtype, rngs=rngs)
        heads, hd, groups = cfg.base_num_query_heads, cfg.resolved_head_dim, cfg.o_groups
        main, compress = rope_specs(cfg)
        self.rope = main if kind == "sliding" else compress
        self.wq_a = Linear([cfg.base_emb_dim], [cfg.q_lora_rank], ("embed", "q_lora"), **kw)
        self.q_norm = _norm(cfg.q_lora_rank, cfg, dtype)
        self.wq_b = Linear([cfg.q_lora_rank], [heads, hd], ("q_lora", "q_heads", "head_dim"), **kw)
        self.wkv = Linear([cfg.base_emb_dim], [hd], ("embed", "head_dim"), **kw)
        self.kv_norm = _norm(hd, cfg, dtype)
        per_group = heads * hd // groups
        init = fan_in_init(groups * per_group)  # MaxText 0.2.5's o_a_proj: the group axis counts into the fan-in
        shape = (groups, cfg.o_lora_rank, per_group)  # HF o_a_proj rows, group-major; contracted per group
        self.wo_a = nnx.Param(init(rngs.params(), shape, jnp.float32).astype(weight_dtype), out_sharding=(None, None, "embed"))
        self.wo_b = Linear([groups * cfg.o_lora_rank], [cfg.base_emb_dim], (None, "embed"), **kw)
        self.sinks = nnx.Param(jnp.zeros((heads,), jnp.float32), out_sharding=(None,))
        if kind == "csa":
            self.compressor = Compressor(cfg, hd, cfg.csa_compress_ratio, True, compress, dtype, rngs)
            self.indexer = Indexer(cfg, compress, dtype, rngs)
        elif kind == "hca":
            self.compressor = Compressor(cfg, hd, cfg.hca_compress_ratio, False, compress, dtype, rngs)
        self.kind, self.heads, self.hd, self.groups = kind, heads, hd, groups
        self.window, self.eps, self.dtype = cfg.sliding_window_size, cfg.normalization_layer_epsilon, dtype

    def cache_spec(self, max_length: int) -> dict[str, CacheSpec]:
        """Decoding caches: the sliding keys (a ring of the window) and, for CSA/HCA, the
        compressor's buffer and entries (CSA: the indexer's too)."""
        specs = {"sliding": CacheSpec(cache_size(max_length, self.window), {"kv": ((self.hd,), ("head_dim",))}, self.dtype)}
        if self.kind != "sliding":
            specs.update(self.compressor.cache_specs(max_length, "compressor"))
        if self.kind == "csa":
            specs.update(self.indexer.compressor.cache_specs(max_length, "indexer"))
        return specs

    def __call__(self, x: jax.Array, positions: jax.Array, segment_ids: jax.Array) -> jax.Array:
        batch, seq, _ = x.shape
        q_res = self.q_norm(self.wq_a(x))
        q = rope_tail(l2_norm(self.wq_b(q_res), self.eps), positions, self.rope)  # [B, S, H, hd]
        kv = rope_tail(self.kv_norm(self.wkv(x))[:, :, None, :], positions, self.rope)[:, :, 0]  # [B, S, hd]
        q = constrain(q, ("activation_batch", "activation_length", "activation_heads", None))
        if hasattr(self, "cache"):
            keys, mask = self._cached_keys(x, q_res, kv, positions, segment_ids != 0)
        else:
            idx = jnp.arange(seq)
            near = (idx[None, :] <= idx[:, None]) & (idx[:, None] - idx[None, :] < self.window)
            mask = near[None] & (segment_ids[:, :, None] == segment_ids[:, None, :])  # [B, S, S]
            keys = kv
            if self.kind != "sliding" and seq >= self.compressor.ratio:  # shorter sequences have no complete window
                entries, last, owner = self.compressor(x, positions, segment_ids)
                if self.kind == "csa":  # the indexer's picks (complete, same-document entries only)
                    visible = self.indexer(x, q_res, positions, segment_ids)
                else:
                    visible = _entry_visible(last, owner, segment_ids)
                keys = jnp.concatenate([kv, entries], axis=1)
                mask = jnp.concatenate([mask, visible], axis=-1)
        logits = jnp.einsum("bshd,btd->bhst", q, keys) * jnp.asarray(self.hd**-0.5, q.dtype)
        logits = jnp.where(mask[:, None], logits.astype(jnp.float32), NEG_INF)
        sinks = jnp.broadcast_to(self.sinks[...].astype(jnp.float32)[None, :, None, None], (batch, self.heads, seq, 1))
        probs = jax.nn.softmax(jnp.concatenate([logits, sinks], axis=-1), axis=-1)[..., :-1].astype(keys.dtype)
        out = jnp.einsum("bhst,btd->bshd", probs, keys)
        out = rope_tail(out, positions, self.rope, inverse=True)
        grouped = out.reshape(batch, seq, self.groups, -1)
        low = jnp.einsum("bsgi,goi->bsgo", grouped, self.wo_a[...].astype(self.dtype))
        return self.wo_b(low.reshape(batch, seq, -1))

    def _cached_keys(self, x, q_res, kv, positions, valid) -> tuple[jax.Array, jax.Array]:
        """Decoding: keys ``[B, T, hd]`` (cached and new sliding keys, then compressed entries)
        and their mask ``[B, S, T]`` — the training mask on one document per row."""
        cache = self.cache
        cached, key_positions = cache["sliding"].extend({"kv": kv}, positions, valid)
        keys, mask = cached["kv"], cache_mask(positions, key_positions, self.window)
        if self.kind == "sliding":
            return keys, mask
        entries, visible = self.compressor.decode(cache["compressor_buffer"], cache["compressor_entries"], x, positions, valid)
        if self.kind == "csa":
            indexer = self.indexer
            keys_i, visible_i = indexer.compressor.decode(cache["indexer_buffer"], cache["indexer_entries"], x, positions, valid)
            visible = visible & indexer._select(indexer._scores(x, q_res, positions, keys_i), visible_i)
        return jnp.concatenate([keys, entries], axis=1), jnp.concatenate([mask, visible], axis=-1)
