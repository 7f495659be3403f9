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
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from nnxtron.config.schema import Config
from nnxtron.layers.linear import Linear
from nnxtron.layers.norms import RMSNorm, l2_norm
from nnxtron.layers.rope import RopeSpec, apply_rope
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
        if self.overlap:  # slots: first `dim` dims of window w-1, then last `dim` dims of window w
            d = self.dim
            prev_kv = jnp.pad(kv[:, :-1, :, :d], ((0, 0), (1, 0), (0, 0), (0, 0)))
            prev_gate = jnp.pad(gate[:, :-1, :, :d], ((0, 0), (1, 0), (0, 0), (0, 0)), constant_values=NEG_INF)
            prev_seg = jnp.pad(seg[:, :-1], ((0, 0), (1, 0), (0, 0)), constant_values=-1)
            kv = jnp.concatenate([prev_kv, kv[..., d:]], axis=2)
            gate = jnp.concatenate([prev_gate, gate[..., d:]], axis=2)
            seg = jnp.concatenate([prev_seg, seg], axis=2)
        gate = jnp.where((seg == owner[:, :, None])[..., None], gate, NEG_INF)
        weights = jax.nn.softmax(gate, axis=2).astype(kv.dtype)
        pooled = self.norm(jnp.sum(kv * weights, axis=2))
        start = positions[:, :usable].reshape(batch, n, m)[:, :, 0]  # the window's first token's position
        entries = rope_tail(pooled[:, :, None, :], start, self.rope)[:, :, 0, :]
        last = jnp.arange(n) * m + (m - 1)
        return entries, last, owner


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
        n = keys.shape[1]
        q = rope_tail(self.wq_b(q_res), positions, self.rope)  # [B, S, nI, c]
        scores = jnp.einsum("bshc,bnc->bshn", q.astype(jnp.float32), keys.astype(jnp.float32))
        scores = jax.nn.relu(scores) * self.dim**-0.5
        weights = self.weights_proj(x).astype(jnp.float32) * self.heads**-0.5  # [B, S, nI]
        scores = jnp.einsum("bshn,bsh->bsn", scores, weights)
        visible = _entry_visible(last, owner, segment_ids)
        scores = jnp.where(visible, scores, NEG_INF)
        _, picked = jax.lax.top_k(scores, min(self.topk, n))  # [B, S, k]
        chosen = jnp.any(picked[..., None] == jnp.arange(n), axis=-2)  # [B, S, N]
        return chosen & visible


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
        init = jax.nn.initializers.truncated_normal(stddev=per_group**-0.5)
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

    def __call__(self, x: jax.Array, positions: jax.Array, segment_ids: jax.Array) -> jax.Array:
        batch, seq, _ = x.shape
        q_res = self.q_norm(self.wq_a(x))
        q = rope_tail(l2_norm(self.wq_b(q_res), self.eps), positions, self.rope)  # [B, S, H, hd]
        kv = rope_tail(self.kv_norm(self.wkv(x))[:, :, None, :], positions, self.rope)[:, :, 0]  # [B, S, hd]
        q = constrain(q, ("activation_batch", "activation_length", "activation_heads", None))
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
