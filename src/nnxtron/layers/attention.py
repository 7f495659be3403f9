"""Grouped-query attention: causal, sliding-window, chunked and packed-segment masks; qk-norms;
projection biases (``attention_bias``); the attention logit soft cap (``attn_logits_soft_cap``, Gemma 2);
attention sinks (``attention_sink``, GPT-OSS: one learned logit per head in the softmax denominator);
NoPE layers with temperature tuning (Llama 4); the selectable implementation (``attention=``,
docs/attention.md); context parallelism (``attend_sharded``: ring attention or gathered keys and
values); ``gqa_attention`` builds the attention of a layer of a given kind from the config."""

from __future__ import annotations

from typing import TYPE_CHECKING

import jax
import jax.extend
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from nnxtron.config.checks import (
    CUDNN_AUTO_MAX_HEAD_DIM,
    SINKS_UNSUPPORTED,
    SOFT_CAP_UNSUPPORTED,
    cudnn_unsupported,
    sinks_refusal,
    soft_cap_refusal,
)
from nnxtron.config.families import rules_for
from nnxtron.config.layout import LayerKind, attention_shape
from nnxtron.config.options import ATTENTION_IMPLEMENTATIONS
from nnxtron.errors import ConfigError
from nnxtron.layers import matmul
from nnxtron.layers.kv_cache import CacheSpec, TokenCache, cache_mask, cache_size
from nnxtron.layers.linear import Linear
from nnxtron.layers.norms import RMSNorm, l2_norm
from nnxtron.layers.rope import RopeSpec, apply_rope, apply_selected_rope
from nnxtron.layers.splash import splash_attention
from nnxtron.parallel.layer_kind import current_is_global
from nnxtron.parallel.ring_attention import ContextParallel, ring_attention, sequence_axes, visible
from nnxtron.parallel.sharding import constrain

if TYPE_CHECKING:
    from nnxtron.config.schema import Config

QK_NORMS = ("none", "rms", "rms_zero_centered", "rms_projection", "l2")
QUERY = ("activation_batch", "activation_length", "activation_heads", None)
KEY_VALUE = ("activation_batch", "activation_kv_length", "activation_kv_heads", None)  # gathered over the context axis
# what a layer whose kind is data (``selected``) can run: a boolean mask built from a traced window
SELECTED_IMPLEMENTATIONS = ("xla", "dot_product")
RING_KEY_VALUE = ("activation_batch", "activation_length", "activation_kv_heads", None)  # sharded like the queries


def soft_capped(scores: jax.Array, cap: float) -> jax.Array:
    """``cap * tanh(scores / cap)`` (HF's and MaxText's attention soft cap) in the scores' dtype; 0 = off."""
    if not cap:
        return scores
    cap_ = jnp.asarray(cap, scores.dtype)
    return jnp.tanh(scores / cap_) * cap_


def resolve_attention(
    value: str,
    backend: str,
    dtype: str | jnp.dtype,
    head_dim: int,
    *,
    chunked: bool = False,
    sequence_sharded: bool = False,
    soft_capped: bool = False,
    sinks: bool = False,
) -> str:
    """The implementation ``attention=value`` runs as: ``xla``, ``dot_product``, ``cudnn`` or ``splash``.

    ``backend`` is ``cpu``, ``tpu``, ``gpu`` (a CUDA GPU) or ``rocm``. ``auto`` is ``splash``
    on a TPU (sequence not sharded), ``cudnn`` on a CUDA GPU where cuDNN flash runs on every
    GPU generation (bfloat16/float16, head_dim <= 128 and a multiple of 8, not chunked,
    sequence not sharded), else ``xla``. An explicit ``cudnn`` or ``splash`` that cannot run
    raises a ConfigError naming the key; ``splash`` off a TPU runs in Pallas interpret mode
    on a CPU (for tests; slow) and is refused on a GPU. ``soft_capped`` (``attn_logits_soft_cap > 0``):
    ``dot_product`` and ``cudnn`` cannot cap the logits (refused), ``auto`` is never ``cudnn``.
    ``sinks`` (``attention_sink``): only ``xla`` has them (``auto`` is ``xla``, the others refused).
    """
    dtype = jnp.dtype(dtype).name
    if sinks:
        if value not in ("auto", "xla"):
            raise ConfigError(sinks_refusal(value))
        return "xla"
    if value == "auto":
        if backend == "tpu":
            return "xla" if sequence_sharded else "splash"
        fits = cudnn_unsupported(
            dtype, head_dim, chunked=chunked, sequence_sharded=sequence_sharded, max_head_dim=CUDNN_AUTO_MAX_HEAD_DIM
        )
        return "cudnn" if backend == "gpu" and fits is None and not soft_capped else "xla"
    if value not in ATTENTION_IMPLEMENTATIONS:
        raise ConfigError(f"attention={value!r} is not one of {['auto', *ATTENTION_IMPLEMENTATIONS]}")
    if soft_capped and value in SOFT_CAP_UNSUPPORTED:
        raise ConfigError(soft_cap_refusal(value))
    if value == "cudnn":
        if backend != "gpu":
            raise ConfigError(f"attention=cudnn needs a CUDA GPU; this backend is {backend}; use attention=auto or xla")
        reason = cudnn_unsupported(dtype, head_dim, chunked=chunked, sequence_sharded=sequence_sharded)
        if reason is not None:
            raise ConfigError(f"attention=cudnn {reason}; use attention=auto, dot_product or xla")
    if value == "splash" and backend not in ("tpu", "cpu"):
        raise ConfigError(
            f"attention=splash is a TPU kernel (Pallas interpret mode on a CPU); this backend is {backend}; "
            "use attention=auto, cudnn or xla"
        )
    return value


def attention_backend() -> str:
    """This process's backend as ``resolve_attention`` names it (``gpu`` only for CUDA)."""
    backend = jax.default_backend()
    if backend == "gpu" and "cuda" not in jax.extend.backend.get_backend().platform_version.lower():
        return "rocm"
    return backend


def configured_attention(cfg: Config, *, chunked: bool = False, head_dim: int = 0) -> str:
    """``resolve_attention`` of ``cfg.attention`` for a layer built on this process's backend (``head_dim``:
    the layer's, where it differs from ``cfg.resolved_head_dim``: Gemma 4's global layers)."""
    return resolve_attention(
        cfg.attention,
        attention_backend(),
        cfg.dtype,
        head_dim or cfg.resolved_head_dim,
        chunked=chunked,
        sequence_sharded=cfg.ici_context_parallelism != 1,
        soft_capped=cfg.attn_logits_soft_cap > 0,
        sinks=cfg.attention_sink,
    )


def attention_in_use(cfg: Config) -> str:
    """What ``cfg.attention`` runs as on this backend, for logs and benchmark records:
    ``splash``, ``xla``...; Llama 4 names both of its kinds where they differ, and
    DeepSeek-V4's compressed attention says it has no kernel."""
    if cfg.attention_type == "compressed":
        return "xla (attention_type=compressed has its own einsum attention, no kernel)"
    chosen = {configured_attention(cfg, chunked=False)}
    if cfg.chunk_attn_window_size:
        chosen.add(configured_attention(cfg, chunked=True))
    return " + ".join(sorted(chosen))


def attention_mask(segment_ids: jax.Array, sliding_window: int = 0, chunk_size: int = 0) -> jax.Array:
    """Boolean [B, S, S] mask: causal, same packed segment, optional sliding window or chunks.

    Key ``t`` is visible to query ``s`` iff ``t <= s``, both lie in the same segment and,
    with a window W > 0, ``s - t < W`` (the current token plus W - 1 previous ones); with
    chunks of C > 0 (Llama 4), ``s // C == t // C`` (aligned chunks of the sequence index).
    """
    index = jnp.arange(segment_ids.shape[-1])
    same_segment = segment_ids[:, :, None] == segment_ids[:, None, :]
    return visible(index, index, sliding_window, chunk_size)[None] & same_segment


def attend(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    segment_ids: jax.Array,
    *,
    scale: float,
    sliding_window: int,
    dtype: jnp.dtype,
    chunk_size: int = 0,
    implementation: str = "xla",
    query_block: int = 0,
    soft_cap: float = 0.0,
    sinks: jax.Array | None = None,
) -> jax.Array:
    """Masked softmax attention; queries share key/value heads in groups.

    ``q`` [B, S, N, dk], ``k`` [B, S, K, dk], ``v`` [B, S, K, dv] with N a multiple of K
    (``dot_product`` and ``cudnn`` need dk == dv). Returns [B, S, N, dv]. ``implementation``:

    * ``xla``: ``masked_attention`` (HF eager numerics: logits ``(q.k) * scale`` in the
      activation dtype, softmax in float32);
    * ``dot_product``: ``jax.nn.dot_product_attention`` (XLA) with the same boolean mask;
      logits in float32 (same result in float32, rounding differences in bfloat16);
    * ``cudnn``: cuDNN flash attention: causal and sliding window as kernel masks, the
      packed segments as a [B, 1, S, S] mask (no chunks);
    * ``splash``: Pallas splash attention (``layers.splash``): every mask as kernel masks
      and segment ids, float32 logits; dk may differ from dv.

    ``query_block > 0`` (``xla`` and ``dot_product``) computes the queries in blocks of
    that many (``query_blocks``): the same values, with one block's scores alive at a time.
    ``soft_cap > 0``: the scaled logits become ``soft_cap * tanh(logits / soft_cap)`` before the
    mask (``xla`` and ``splash``; ``dot_product`` and ``cudnn`` cannot: refused). ``sinks [N]`` (float32,
    GPT-OSS): one extra logit per query head joins each row's softmax (``xla`` only; the others refused).
    """
    if soft_cap and implementation in SOFT_CAP_UNSUPPORTED:
        raise ConfigError(soft_cap_refusal(implementation))
    if sinks is not None and implementation in SINKS_UNSUPPORTED:
        raise ConfigError(sinks_refusal(implementation))
    if query_block and implementation in ("cudnn", "splash"):
        raise ConfigError(
            f"attention_query_block applies to attention=xla or dot_product; attention={implementation} is already blockwise"
        )
    if implementation == "xla":
        rows = lambda q, mask: masked_attention(q, k, v, mask, scale=scale, dtype=dtype, soft_cap=soft_cap, sinks=sinks)  # noqa: E731
        return query_blocks(rows, q, attention_mask(segment_ids, sliding_window, chunk_size), query_block)
    if implementation == "dot_product":
        mask = attention_mask(segment_ids, sliding_window, chunk_size)  # each block's [B, b, S] -> [B, 1, b, S]
        rows = lambda q, mask: jax.nn.dot_product_attention(q, k, v, mask=mask[:, None], scale=scale, implementation="xla")  # noqa: E731
        return query_blocks(rows, q, mask, query_block)
    if implementation == "cudnn":
        if chunk_size:
            raise ConfigError("attention=cudnn cannot express chunked attention; use attention=auto, dot_product or xla")
        same_segment = (segment_ids[:, :, None] == segment_ids[:, None, :])[:, None]
        window = (sliding_window - 1, 0) if sliding_window > 0 else None  # s - t <= W - 1
        return jax.nn.dot_product_attention(
            q, k, v, mask=same_segment, scale=scale, is_causal=True, local_window_size=window, implementation="cudnn"
        )
    if implementation == "splash":
        return splash_attention(
            q, k, v, segment_ids, scale=scale, sliding_window=sliding_window, chunk_size=chunk_size, soft_cap=soft_cap
        )
    raise ConfigError(f"attention implementation {implementation!r} is not one of {list(ATTENTION_IMPLEMENTATIONS)}")


def query_blocks(rows, q: jax.Array, mask: jax.Array, block: int) -> jax.Array:
    """``rows(q, mask)`` (attention of queries ``q [B, S, N, d]`` under ``mask [B, S, T]``)
    over blocks of ``block`` queries, one after another, each recomputed in the backward
    pass: one block's ``[.., block, T]`` scores alive instead of ``[.., S, T]``.

    Block ``i`` holds the strided positions ``i, i + S/block, ...``, so a sequence sharded
    in contiguous pieces over the context axis stays sharded inside each block. Every query
    row is computed by the same operations as without blocks. ``block`` 0, or at least
    ``S``, is one block (``rows`` runs once on everything)."""
    batch, seq = q.shape[:2]
    if not block or block >= seq:
        return rows(q, mask)
    if seq % block:
        raise ConfigError(f"attention_query_block={block} does not divide the sequence length {seq}; use a divisor of it")
    blocks = seq // block

    def split(a: jax.Array) -> jax.Array:  # [B, S, ...] -> [blocks, B, block, ...]
        return jnp.moveaxis(a.reshape(batch, block, blocks, *a.shape[2:]), 2, 0)

    out = jax.lax.map(jax.checkpoint(lambda args: rows(*args)), (split(q), split(mask)))  # [blocks, B, block, N, dv]
    return jnp.moveaxis(out, 0, 2).reshape(batch, seq, *out.shape[3:])


def attend_sharded(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    segment_ids: jax.Array,
    *,
    context: ContextParallel,
    scale: float,
    sliding_window: int,
    dtype: jnp.dtype,
    chunk_size: int = 0,
    implementation: str = "xla",
    soft_cap: float = 0.0,
    sinks: jax.Array | None = None,
) -> jax.Array:
    """``attend`` (training and evaluation) with the activations constrained to the active
    mesh. Queries and the output stay sharded over the sequence (context parallelism). With
    ``context.strategy == "ring"`` and the sequence sharded (``sequence_axes``), keys and
    values stay sharded too and ``ring_attention`` passes them around the context axis
    (numerics of ``xla``); otherwise they are gathered over the sequence and ``attend`` runs."""
    q = constrain(q, QUERY)
    window = dict(sliding_window=sliding_window, chunk_size=chunk_size)
    if context.strategy == "ring" and sequence_axes():
        if implementation != "xla":
            raise ConfigError(
                f"attention={implementation} cannot run as ring attention (context_parallel_strategy=ring); "
                "use attention=xla or auto, or context_parallel_strategy=all_gather"
            )
        if soft_cap:
            raise ConfigError(
                "ring attention (context_parallel_strategy=ring) cannot apply attn_logits_soft_cap (its backward pass "
                "is written by hand without the cap); use context_parallel_strategy=all_gather or attn_logits_soft_cap=0"
            )
        if sinks is not None:
            raise ConfigError(
                "ring attention (context_parallel_strategy=ring) cannot apply attention sinks (attention_sink=true); "
                "use context_parallel_strategy=all_gather"
            )
        k, v = constrain(k, RING_KEY_VALUE), constrain(v, RING_KEY_VALUE)
        out = ring_attention(q, k, v, segment_ids, scale=scale, dtype=dtype, load_balance=context.load_balance, **window)
    else:
        k, v = constrain(k, KEY_VALUE), constrain(v, KEY_VALUE)
        out = attend(
            q,
            k,
            v,
            segment_ids,
            scale=scale,
            dtype=dtype,
            implementation=implementation,
            query_block=context.query_block,
            soft_cap=soft_cap,
            sinks=sinks,
            **window,
        )
    return constrain(out, QUERY)


def masked_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    mask: jax.Array,
    *,
    scale: float,
    dtype: jnp.dtype,
    head_major: bool = False,
    soft_cap: float = 0.0,
    sinks: jax.Array | None = None,
) -> jax.Array:
    """``attend`` with an explicit boolean mask ``[B, S, T]`` (``k``/``v`` hold T tokens,
    ``[B, T, K, D]``, or ``[B, K, T, D]`` with ``head_major``: a decoding cache's layout);
    ``soft_cap > 0`` caps the scaled logits (``soft_capped``) before the mask, as HF and MaxText.
    ``sinks [N]``: each head's sink logit is one more column of the (float32) softmax, then dropped
    (HF GPT-OSS's ``eager_attention_forward``, MaxText's ``attention_sink``): it takes a share of the
    probability and contributes no value."""
    batch, seq, heads, dk = q.shape
    kv_heads = k.shape[1 if head_major else 2]
    keys = "bktd" if head_major else "btkd"
    q = q.reshape(batch, seq, kv_heads, heads // kv_heads, dk)
    scores = soft_capped(matmul.einsum(f"bskgd,{keys}->bkgst", q, k) * jnp.asarray(scale, q.dtype), soft_cap)
    scores = jnp.where(mask[:, None, None], scores.astype(jnp.float32), jnp.finfo(jnp.float32).min)
    if sinks is None:
        probs = jax.nn.softmax(scores, axis=-1).astype(dtype)
    else:
        sink = sinks.astype(jnp.float32).reshape(kv_heads, -1)[None, :, :, None, None]
        sink = jnp.broadcast_to(sink, (*scores.shape[:-1], 1))
        probs = jax.nn.softmax(jnp.concatenate([scores, sink], axis=-1), axis=-1)[..., :-1].astype(dtype)
    return matmul.einsum(f"bkgst,{keys}->bskgd", probs, v).reshape(batch, seq, heads, v.shape[-1])


def attend_with_cache(
    cache: TokenCache,
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    positions: jax.Array,
    segment_ids: jax.Array,
    *,
    scale: float,
    dtype: jnp.dtype,
    sliding_window: int = 0,
    chunk_size: int = 0,
    soft_cap: float = 0.0,
    sinks: jax.Array | None = None,
) -> jax.Array:
    """Decoding: attend over the cached tokens and the new ones (then cache the new ones).
    ``segment_ids`` 0 marks padding (never cached, never attended to)."""
    kv, key_positions = cache.attended({"key": k, "value": v}, positions, segment_ids != 0)
    mask = cache_mask(positions, key_positions, sliding_window, chunk_size)
    head_major = q.shape[1] == 1  # a decode step reads the cache in its (head-major) storage layout
    return masked_attention(
        q, kv["key"], kv["value"], mask, scale=scale, dtype=dtype, head_major=head_major, soft_cap=soft_cap, sinks=sinks
    )


def key_value_cache(
    max_length: int, kv_heads: int, head_dim: int, dtype: jnp.dtype, sliding_window: int = 0, chunk_size: int = 0
) -> CacheSpec:
    """The cache of grouped-query attention: keys and values per token, stored head-major
    (``[B, kv_heads, slots, head_dim]``) so that a decode step's attention reads them in place."""
    entry = ((kv_heads, head_dim), ("kv_heads", "head_dim"))
    return CacheSpec(cache_size(max_length, sliding_window, chunk_size), {"key": entry, "value": entry}, dtype, slot_dim=1)


class Attention(nnx.Module):
    """Multi-head attention with ``num_kv_heads`` shared key/value heads (GQA).

    Weights keep HF semantics: the query is not pre-scaled; logits are multiplied by
    ``scale`` (default ``head_dim ** -0.5``) after the q.k product and the softmax runs in
    float32. ``rope=None`` is a NoPE layer. ``qk_norm`` normalises every query and key
    head over ``head_dim``:

    * ``"rms"`` (Qwen3): RMSNorm with one weight per projection (``query_norm``/``key_norm``), before RoPE;
    * ``"rms_zero_centered"`` (Gemma 3): the same with zero-centred ``(1 + w)`` weights, before RoPE;
    * ``"rms_projection"`` (OLMo 3): RMSNorm over the whole projection (all heads, ``heads * head_dim``
      weights), before RoPE;
    * ``"l2"`` (Llama 4): weightless, after RoPE, only on RoPE layers.

    ``qkv_bias`` / ``out_bias``: the query, key and value projections / the output projection
    add a bias (``attention_bias``; HF ``q_proj.bias`` ..., laid out ``[heads, head_dim]``).

    ``soft_cap > 0`` (Gemma 2's ``attn_logits_soft_cap``): the scaled logits become
    ``soft_cap * tanh(logits / soft_cap)`` before the mask, in training and with a KV cache.

    ``sinks`` (GPT-OSS's ``attention_sink``): a learned logit per query head, ``sinks [N]`` (float32, zero
    at init as MaxText's), joins the softmax denominator (``masked_attention``), in training and with a KV cache.

    ``temperature_tuning=(floor_scale, scale)`` (Llama 4 NoPE layers) multiplies q by
    ``log1p(floor((position + 1) / floor_scale)) * scale + 1`` (computed in float32).

    ``shared_kv`` (Gemma 4's global layers, ``share_kv_projections``; HF ``attention_k_eq_v``): no value
    projection, the values are the key projection's output (before the key norm and RoPE). ``value_norm``
    (Gemma 4): the values are RMS-normalised over ``head_dim`` without a weight (HF ``v_norm``).

    ``implementation`` (``xla``, ``dot_product``, ``cudnn``; see ``attend``) runs training
    and evaluation; with a KV cache (prefill and decode) attention always runs the einsum
    path (``masked_attention``). ``context`` says how it runs with the sequence sharded
    (``attend_sharded``: ring attention or gathered keys and values).
    """

    def __init__(
        self,
        emb_dim: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        rope: RopeSpec | None,
        *,
        sliding_window: int = 0,
        chunk_size: int = 0,
        qk_norm: str = "none",
        norm_eps: float = 1e-6,
        scale: float | None = None,
        soft_cap: float = 0.0,
        temperature_tuning: tuple[float, float] | None = None,
        qkv_bias: bool = False,
        out_bias: bool = False,
        sinks: bool = False,
        shared_kv: bool = False,
        value_norm: bool = False,
        implementation: str = "xla",
        context: ContextParallel | None = None,
        selected: bool = False,
        sliding_rope: RopeSpec | None = None,
        dtype: jnp.dtype,
        weight_dtype: jnp.dtype,
        rngs: nnx.Rngs,
    ):
        if qk_norm not in QK_NORMS:
            raise ValueError(f"qk_norm={qk_norm!r} is not one of {QK_NORMS}")
        if selected and (
            implementation not in SELECTED_IMPLEMENTATIONS or chunk_size or (rope is None) != (sliding_rope is None)
        ):
            raise ValueError(
                f"a selected layer needs a traced-mask implementation {SELECTED_IMPLEMENTATIONS} (got {implementation!r}), "
                "no chunks, and a sliding RoPE exactly when it has a global one"
            )
        if implementation not in ATTENTION_IMPLEMENTATIONS:
            raise ValueError(
                f"implementation={implementation!r} is not one of {ATTENTION_IMPLEMENTATIONS} (resolve attention=auto first)"
            )
        kw = dict(dtype=dtype, weight_dtype=weight_dtype, rngs=rngs)
        # unscaled logits without a qk-norm (MaxText's llama2 / mistral / mixtral, query_pre_attn_scalar=1):
        # the query kernel starts / sqrt(head_dim), MaxText's initialiser (its logits at init: unit scale)
        fold = head_dim**-0.5 if scale == 1.0 and qk_norm == "none" else 1.0
        q_axes, kv_axes = ("embed", "q_heads", "head_dim"), ("embed", "kv_heads", "head_dim")
        self.query = Linear([emb_dim], [num_heads, head_dim], q_axes, init_scale=fold, use_bias=qkv_bias, **kw)
        self.key = Linear([emb_dim], [num_kv_heads, head_dim], kv_axes, use_bias=qkv_bias, **kw)
        if not shared_kv:
            self.value = Linear([emb_dim], [num_kv_heads, head_dim], kv_axes, use_bias=qkv_bias, **kw)
        self.out = Linear([num_heads, head_dim], [emb_dim], ("q_heads", "head_dim", "embed"), use_bias=out_bias, **kw)
        if qk_norm in ("rms", "rms_zero_centered"):
            norm = dict(eps=norm_eps, dtype=dtype, weight_dtype=weight_dtype, zero_centered=qk_norm == "rms_zero_centered")
            self.query_norm = RMSNorm(head_dim, **norm)
            self.key_norm = RMSNorm(head_dim, **norm)
        elif qk_norm == "rms_projection":
            norm = dict(eps=norm_eps, dtype=dtype, weight_dtype=weight_dtype)
            self.query_norm = RMSNorm(num_heads * head_dim, **norm)
            self.key_norm = RMSNorm(num_kv_heads * head_dim, **norm)
        if sinks:
            self.sinks = nnx.Param(jnp.zeros((num_heads,), jnp.float32), out_sharding=(None,))
        self.qk_norm = qk_norm
        self.shared_kv, self.value_norm = shared_kv, value_norm
        self.norm_eps = norm_eps
        self.scale = head_dim**-0.5 if scale is None else scale
        self.soft_cap = soft_cap
        self.rope = rope
        self.sliding_window = sliding_window
        self.chunk_size = chunk_size
        self.temperature_tuning = temperature_tuning
        self.selected = selected
        self.sliding_rope = sliding_rope
        self.implementation = implementation
        self.context = context or ContextParallel()
        self.dtype = dtype

    def cache_spec(self, max_length: int) -> CacheSpec:
        heads, head_dim = self.key.out_shape
        return key_value_cache(max_length, heads, head_dim, self.dtype, self.sliding_window, self.chunk_size)

    def __call__(self, x: jax.Array, positions: jax.Array, segment_ids: jax.Array) -> jax.Array:
        q = checkpoint_name(self.query(x), "query_proj")
        k = checkpoint_name(self.key(x), "key_proj")
        v = k if self.shared_kv else checkpoint_name(self.value(x), "value_proj")
        if self.value_norm:
            v = l2_norm(v, self.norm_eps)
        if self.qk_norm in ("rms", "rms_zero_centered"):
            q, k = self.query_norm(q), self.key_norm(k)
        elif self.qk_norm == "rms_projection":  # one statistic over all heads: [B, S, N * hd]
            q = self.query_norm(q.reshape(*q.shape[:-2], -1)).reshape(q.shape)
            k = self.key_norm(k.reshape(*k.shape[:-2], -1)).reshape(k.shape)
        sliding_window = self.sliding_window
        if self.selected:  # the kind is data: global (no window, self.rope) or sliding (the window, sliding_rope)
            is_global = current_is_global()
            sliding_window = jnp.where(is_global, 0, self.sliding_window)
            if self.rope is not None:
                q = apply_selected_rope(q, positions, self.rope, self.sliding_rope, is_global)
                k = apply_selected_rope(k, positions, self.rope, self.sliding_rope, is_global)
        elif self.rope is not None:
            q, k = apply_rope(q, positions, self.rope), apply_rope(k, positions, self.rope)
        if self.qk_norm == "l2":
            q, k = l2_norm(q, self.norm_eps), l2_norm(k, self.norm_eps)
        if self.temperature_tuning is not None:
            floor_scale, scale = self.temperature_tuning
            factor = jnp.log1p(jnp.floor((positions.astype(jnp.float32) + 1.0) / floor_scale)) * scale + 1.0
            q = (q * factor[:, :, None, None]).astype(q.dtype)
        window = dict(sliding_window=sliding_window, chunk_size=self.chunk_size, soft_cap=self.soft_cap)
        window["sinks"] = self.sinks[...] if hasattr(self, "sinks") else None
        if hasattr(self, "cache"):
            if self.selected:
                raise ConfigError(
                    "a layer whose attention kind is data (a pipeline of one-layer sliding/global blocks) has no KV cache; "
                    "decode with infer.decode.unrolled(model), which rebuilds the model's layers by kind"
                )
            q, k, v = constrain(q, QUERY), constrain(k, KEY_VALUE), constrain(v, KEY_VALUE)
            out = attend_with_cache(self.cache, q, k, v, positions, segment_ids, scale=self.scale, dtype=self.dtype, **window)
            out = constrain(out, QUERY)
        else:
            kw = dict(scale=self.scale, dtype=self.dtype, implementation=self.implementation, context=self.context)
            out = attend_sharded(q, k, v, segment_ids, **kw, **window)
        return checkpoint_name(self.out(checkpoint_name(out, "context")), "out_proj")


def gqa_attention(
    cfg: Config,
    rngs: nnx.Rngs,
    kind: LayerKind,
    qk_norm: str = "rms",
    cls: type[Attention] = Attention,
    value_norm: bool = False,
) -> Attention:
    """The GQA attention of a layer of ``kind``.

    ``qk_norm`` is what ``use_qk_norm`` means for the family (``rms``, ``gemma`` or
    ``l2``; ``l2`` applies on RoPE layers only, as in Llama 4). Sliding layers of a
    ``sliding_window_pattern`` use ``local_rope_max_timescale`` (unscaled) when set;
    NoPE layers take ``temperature_tuning``; every layer caps its logits at ``attn_logits_soft_cap``.
    ``attention_bias`` biases the query, key and value projections, and the output one where the
    family's rules say so (``config/families.py``: ``attention_out_bias``). ``cfg.attention`` is
    resolved per layer for this backend (``auto`` is never ``cudnn`` on a chunked layer, nor on a
    soft-capped one). ``cls``: an ``Attention`` subclass to build (Qwen3-Next's gated attention).
    ``kind.attention == "selected"`` (a one-layer block whose kind is data, ``config/layout.selected_stacks``):
    the layer holds both kinds' window and RoPE and reads its kind per call (``parallel/layer_kind.py``);
    it runs ``xla`` or ``dot_product`` (``auto`` is ``xla``; ``config/pipeline.py`` refuses the kernels by name).
    Gemma 4: a global layer has its own shape (``config/layout.attention_shape``: ``global_head_dim``,
    ``global_num_kv_heads``, ``share_kv_projections``), global and sliding layers rotate their own share of
    the RoPE frequencies (``global_rope_proportion`` / ``local_rope_proportion``), and ``value_norm`` (the
    family's) normalises the values.
    """
    kv_heads, head_dim, shared_kv = attention_shape(cfg, kind)
    sliding_head_dim = cfg.resolved_head_dim  # a sliding (or selected) layer's: the base shape
    rope = RopeSpec.from_config(cfg, head_dim) if kind.rope else None
    sliding_rope = RopeSpec.from_config(cfg, sliding_head_dim, sliding=True) if kind.rope else None
    if rope is not None and cfg.sliding_window_pattern and cfg.local_rope_max_timescale:
        sliding_rope = RopeSpec(
            head_dim=sliding_head_dim,
            theta=cfg.local_rope_max_timescale,
            interleave=cfg.rope_interleave,
            proportion=cfg.local_rope_proportion,
        )
    if kind.attention == "sliding":
        rope = sliding_rope
    selected = kind.attention == "selected"
    implementation = configured_attention(cfg, chunked=kind.attention == "chunked", head_dim=head_dim)
    if selected and implementation not in SELECTED_IMPLEMENTATIONS:  # an explicit kernel is refused by the config
        implementation = "xla"  # attention=auto: the best that runs a traced window
    norm = qk_norm if cfg.use_qk_norm and (kind.rope or qk_norm != "l2") else "none"
    tuning = (
        (cfg.temperature_tuning_floor_scale, cfg.temperature_tuning_scale) if cfg.temperature_tuning and not kind.rope else None
    )
    return cls(
        cfg.base_emb_dim,
        cfg.base_num_query_heads,
        kv_heads,
        head_dim,
        rope,
        sliding_window=cfg.sliding_window_size if kind.attention in ("sliding", "selected") else 0,
        chunk_size=cfg.chunk_attn_window_size if kind.attention == "chunked" else 0,
        qk_norm=norm,
        norm_eps=cfg.normalization_layer_epsilon,
        scale=cfg.query_pre_attn_scalar**-0.5 if cfg.query_pre_attn_scalar else None,
        soft_cap=cfg.attn_logits_soft_cap,
        temperature_tuning=tuning,
        qkv_bias=cfg.attention_bias,
        out_bias=cfg.attention_bias and rules_for(cfg.decoder_block).attention_out_bias,
        sinks=cfg.attention_sink,
        shared_kv=shared_kv,
        value_norm=value_norm,
        implementation=implementation,
        context=ContextParallel.from_config(cfg),
        selected=selected,
        sliding_rope=sliding_rope if selected else None,
        dtype=jnp.dtype(cfg.dtype),
        weight_dtype=jnp.dtype(cfg.weight_dtype),
        rngs=rngs,
    )
