"""Routed-expert dispatch: group assignments by expert, three grouped matmuls, combine.

``expert_ffn`` runs on one device's tokens for the experts it holds: it groups the (token,
slot) assignments by expert (``parallel/grouped_matmul.group_rows``), gathers their tokens
into that layout, runs the three expert matmuls as grouped matmuls and gathers the outputs
back (both gathers have gather gradients: ``gather_slots``, ``permute_rows``). ``method`` (``grouped_matmul``,
resolved by ``resolve_grouped_matmul``) picks the grouped matmul: ``ragged_dot``
(``jax.lax.ragged_dot``; XLA's grouped kernel on TPU, a dense product over every expert on
CPU and GPU) or ``blocked`` (each expert's rows padded to whole blocks, one expert per block:
the routed FLOPs + at most 25 % padding, on every backend). ``dispatch`` is the
entry point used by ``MoE``. With ``compute="dense"`` (``moe_compute=dense``, MaxText's
``sparse_matmul=false``) it calls ``dense_ffn`` instead: every expert on every token with
two einsums (the gate and up projections in one) and the routing weights scattered to
``[B, S, E]`` (zero for unselected or dropped assignments) — the same function, ``E / k``
times the FLOPs, in plain matmuls. The dense path never enters
``shard_map``: under a mesh XLA partitions its einsums (expert weights sharded on
``exp``) like any other matmul. Otherwise, without an active mesh ``dispatch`` calls
``expert_ffn`` directly; with one it runs ``expert_ffn`` under ``jax.shard_map`` (manual
over every mesh axis):

* tokens stay on their batch/sequence shards; expert weights are split over the mesh
  axes that the logical name ``exp`` maps to (the ``expert`` axis) and, on the hidden
  dimension, over the axes of ``mlp`` (tensor parallelism; partial sums are ``psum``-ed);
  the ``embed`` dimension is gathered on entry (as FSDP does for any weight);
* expert parallelism (``exp`` maps to axes of size > 1): each shard all-gathers the
  tokens and their routing over the expert axes, computes its local experts'
  contributions with the same grouped matmul (assignments to other experts are in no
  group and contribute zero), and ``psum_scatter``s the float32 partial outputs back to the token
  shards. The result equals the unsharded layer (values and gradients).

Routing (top-k, capacity) is decided before the dispatch, on the global token set, so
capacity mode means the same thing with and without a mesh.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec as P

from nnxtron.config.options import MOE_COMPUTES
from nnxtron.errors import ConfigError
from nnxtron.parallel.grouped_matmul import gather_slots, group_rows, permute_rows, take_rows
from nnxtron.parallel.sharding import active_mesh, logical_to_spec, spec_axes

TOKEN_NAMES = ("activation_batch", "activation_length")


def capacity_keep(indices: jax.Array, num_experts: int, capacity: int) -> jax.Array:
    """Bool ``[T, k]``: an assignment is kept iff fewer than ``capacity`` earlier assignments
    (in (token, slot) order) went to the same expert."""
    flat = indices.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    counts = jnp.zeros((num_experts,), jnp.int32).at[flat].add(1)
    start = jnp.cumsum(counts) - counts
    rank_sorted = jnp.arange(flat.size, dtype=jnp.int32) - start[flat[order]]
    rank = jnp.zeros_like(flat).at[order].set(rank_sorted)
    return (rank < capacity).reshape(indices.shape)


def expert_ffn(
    x: jax.Array,
    indices: jax.Array,
    combine: jax.Array,
    keep: jax.Array,
    in_scale: jax.Array | None,
    wi_0: jax.Array,
    wi_1: jax.Array,
    wo: jax.Array,
    *,
    glu: Callable[[jax.Array, jax.Array], jax.Array],
    method: str,
    expert_offset: jax.Array | int = 0,
    chunks: int = 1,
    biases: tuple[jax.Array, jax.Array] | None = None,
) -> jax.Array:
    """``sum_j combine[t, j] * FFN_{indices[t, j]}(x[t] * in_scale[t, j])`` in float32.

    ``x [T, D]`` (compute dtype), ``indices/combine/keep/in_scale [T, k]``; the weights
    ``[E_local, ...]`` hold experts ``expert_offset .. expert_offset + E_local - 1``.
    Assignments to other experts, or with ``keep`` false, contribute zero. ``method``: the
    grouped matmul, ``ragged_dot`` or ``blocked`` (``parallel/grouped_matmul.py``).
    ``biases`` (GPT-OSS ``mlp_bias``): the gate and up projections' biases ``[E_local, H]``,
    gathered by each grouped row's expert and added after the matmuls: the kernels stay the
    parameters themselves, which qwix finds as weights to quantize, and the biases are not
    quantized.

    ``chunks > 1`` (``moe_token_chunks``) runs it over that many equal pieces of the ``T``
    tokens, one after another, each recomputed in the backward pass: the same values, with
    one piece's grouped rows (``T k / chunks``, padded) alive instead of all ``T k``.
    """
    if chunks > 1:
        tokens = x.shape[0]
        if tokens % chunks:
            raise ConfigError(f"moe_token_chunks={chunks} does not divide the {tokens} tokens a device routes; use a divisor")
        split = lambda a: None if a is None else a.reshape(chunks, tokens // chunks, *a.shape[1:])  # noqa: E731

        def one(args):
            return expert_ffn(*args, wi_0, wi_1, wo, glu=glu, method=method, expert_offset=expert_offset, biases=biases)

        out = jax.lax.map(jax.checkpoint(one), tuple(map(split, (x, indices, combine, keep, in_scale))))
        return out.reshape(tokens, -1)
    tokens, k = indices.shape
    local_experts = wi_0.shape[0]
    local = indices - expert_offset
    valid = keep & (local >= 0) & (local < local_experts)
    # assignments slot-major (j * T + t): the outputs come back as [k, T, D] by a reshape of whole
    # rows, where [T, k, D] would re-tile k as a second-minor dimension (a copy on a TPU)
    key = jnp.where(valid, local, local_experts).T.reshape(-1)  # invalid -> in no group (zero output)
    grouped = group_rows(key, local_experts, method)
    xs = gather_slots(x, grouped.rows, grouped.restore, k, grouped.in_bounds)  # padding rows are zero rows
    if in_scale is not None:
        xs = xs * permute_rows(in_scale.T.reshape(-1), grouped.rows, grouped.restore, grouped.in_bounds)[:, None].astype(xs.dtype)
    dtype = x.dtype
    gate, up = grouped.matmul(xs, wi_0.astype(dtype)), grouped.matmul(xs, wi_1.astype(dtype))
    if biases is not None:  # each row's expert bias (zero on padding rows and rows in no group)
        row_expert = jnp.take(key, grouped.rows, mode="fill", fill_value=local_experts)
        gate = gate + take_rows(biases[0].astype(dtype), row_expert)
        up = up + take_rows(biases[1].astype(dtype), row_expert)
    gate, up = checkpoint_name(gate, "mlpwi_0"), checkpoint_name(up, "mlpwi_1")
    out = checkpoint_name(grouped.matmul(glu(gate, up), wo.astype(dtype)), "mlpwo")
    out = permute_rows(out, grouped.restore, grouped.rows, grouped.in_bounds).reshape(k, tokens, -1).astype(jnp.float32)
    weights = jnp.where(valid, combine.astype(jnp.float32), 0.0)
    return jnp.einsum("ktd,tk->td", out, weights)


def dense_ffn(
    x: jax.Array,
    indices: jax.Array,
    combine: jax.Array,
    keep: jax.Array,
    in_scale: jax.Array | None,
    wi_0: jax.Array,
    wi_1: jax.Array,
    wo: jax.Array,
    *,
    glu: Callable[[jax.Array, jax.Array], jax.Array],
    quantized: bool = False,
    biases: tuple[jax.Array, jax.Array] | None = None,
) -> jax.Array:
    """``expert_ffn``'s function on ``x [B, S, D]`` and routing ``[B, S, k]`` -> ``[B, S, D]``
    float32, computing every expert ``[E, ...]`` on every token. ``in_scale`` (Llama 4) needs
    ``k == 1``: the token's one scale multiplies its input to every expert.

    Unquantized, two matmuls a layer: the gate and up projections are one einsum over the
    weights stacked on a new axis (``[E, D, 2, H]``; stacking keeps each weight's sharding),
    and the routing weight multiplies each expert's activation before ``wo``, so the output
    projection contracts experts and hidden units at once (``[T, E H] x [E H, D]``). On
    XLA:CPU that takes ~40 % less time than MaxText's form (``[B, S, E, D]`` expert outputs,
    then their weighted sum), which transposes ``[T, E, H]`` to ``[E, T, H]`` around a batched
    matmul per projection. ``quantized`` (qwix) keeps MaxText's form: qwix finds a weight by
    identity (a stacked weight would go unquantized) and scales ``wo`` per expert only where
    the expert axis is a batch axis, not a contracted one."""
    experts, dtype = wi_0.shape[0], x.dtype
    if in_scale is not None:
        if in_scale.shape[-1] != 1:
            raise ValueError("moe_compute=dense scales the expert input (router_scales_expert_input) only with k=1")
        x = x * in_scale.astype(dtype)
    weights = jnp.where(keep, combine.astype(jnp.float32), 0.0)  # [B, S, k]
    chosen = indices[..., None] == jnp.arange(experts, dtype=indices.dtype)  # [B, S, k, E]
    weights = jnp.sum(jnp.where(chosen, weights[..., None], 0.0), axis=-2)  # [B, S, E]: exact, no matmul rounding
    # the weights enter the einsums uncast (the activations take the weight dtype; results are cast
    # to the compute dtype): qwix's einsum rule finds a weight by identity, and its fallback, matching
    # by shape, cannot tell wi_0 from wi_1 (nor from wo when the widths are equal) — a cast weight
    # would stay unquantized or fail under the gradient trace
    xw = x.astype(wi_0.dtype)
    bias_0, bias_1 = (0.0, 0.0) if biases is None else (b.astype(wi_0.dtype) for b in biases)  # [E, H] per expert
    if quantized:  # MaxText's form: per-expert outputs [B, S, E, D], then the weighted sum
        gate = checkpoint_name((jnp.einsum("bsd,edh->bseh", xw, wi_0) + bias_0).astype(dtype), "mlpwi_0")
        up = checkpoint_name((jnp.einsum("bsd,edh->bseh", xw, wi_1) + bias_1).astype(dtype), "mlpwi_1")
        hidden = glu(gate, up).astype(wo.dtype)
        out = checkpoint_name(jnp.einsum("bseh,ehd->bsed", hidden, wo).astype(dtype), "mlpwo")
        return jnp.einsum("bsed,bse->bsd", out.astype(jnp.float32), weights)
    both = jnp.einsum("bsd,edgh->bsegh", xw, jnp.stack([wi_0, wi_1], axis=-2))
    if biases is not None:
        both = both + jnp.stack([bias_0, bias_1], axis=-2)  # [E, 2, H]
    gate = checkpoint_name(both[..., 0, :].astype(dtype), "mlpwi_0")
    up = checkpoint_name(both[..., 1, :].astype(dtype), "mlpwi_1")
    weighted = glu(gate, up).astype(jnp.float32) * weights[..., None]  # [B, S, E, H]; unselected experts: 0
    return checkpoint_name(jnp.einsum("bseh,ehd->bsd", weighted, wo), "mlpwo")  # float32, as the weighted activations


def dispatch(
    x: jax.Array,
    indices: jax.Array,
    combine: jax.Array,
    keep: jax.Array,
    in_scale: jax.Array | None,
    wi_0: jax.Array,
    wi_1: jax.Array,
    wo: jax.Array,
    *,
    glu: Callable[[jax.Array, jax.Array], jax.Array],
    compute: str,
    method: str,
    token_chunks: int = 1,
    quantized: bool = False,
    biases: tuple[jax.Array, jax.Array] | None = None,
) -> jax.Array:
    """Routed output ``[B, S, D]`` float32 for ``x [B, S, D]`` and routing ``[B, S, k]``;
    ``glu(gate, up)`` is the gated activation (``nnxtron.layers.mlp.glu``); ``compute`` is
    ``moe_compute`` (``grouped``: ``expert_ffn``, sharded by hand; ``dense``: ``dense_ffn``);
    ``method`` the grouped matmul of ``expert_ffn`` (``ragged_dot`` or ``blocked``);
    ``token_chunks`` runs it over that many pieces of each device's tokens
    (``expert_ffn``'s ``chunks``); ``quantized`` is ``dense_ffn``'s; ``biases`` the gate and up
    projections' ``[E, H]`` (``expert_ffn``)."""
    if compute == "dense":
        return dense_ffn(x, indices, combine, keep, in_scale, wi_0, wi_1, wo, glu=glu, quantized=quantized, biases=biases)
    if compute != "grouped":
        raise ValueError(f"moe_compute={compute!r}; choose one of {MOE_COMPUTES}")
    kw = dict(glu=glu, method=method)
    active = active_mesh()
    if active is None:
        batch, seq, dim = x.shape
        flat = lambda a: None if a is None else a.reshape(batch * seq, -1)  # noqa: E731
        y = expert_ffn(
            x.reshape(batch * seq, dim), *map(flat, (indices, combine, keep, in_scale)), wi_0, wi_1, wo,
            chunks=token_chunks, biases=biases, **kw,
        )  # fmt: skip
        return y.reshape(batch, seq, -1)
    mesh, rules = active
    token_spec = logical_to_spec((*TOKEN_NAMES, None), rules, mesh)
    token_axes = {a for entry in token_spec for a in spec_axes(entry)}
    ep_axes = spec_axes(logical_to_spec(("exp",), rules, mesh)[0])
    mlp_axes = tuple(a for a in spec_axes(logical_to_spec(("mlp",), rules, mesh)[0]) if a not in token_axes and a not in ep_axes)
    num_experts = wi_0.shape[0]
    ep = math.prod(mesh.shape[a] for a in ep_axes)
    if num_experts % ep:
        raise ValueError(f"num_experts={num_experts} does not divide over the expert mesh axes {ep_axes} ({ep} ways)")
    gather_dims = [d for d, entry in enumerate(token_spec[:2]) if set(spec_axes(entry)) & set(ep_axes)]
    if gather_dims and (len(gather_dims) > 1 or not set(ep_axes) <= set(spec_axes(token_spec[gather_dims[0]]))):
        raise ValueError(f"expert axes {ep_axes} must all shard one token dimension (got token spec {token_spec})")
    gather = gather_dims[0] if gather_dims else None
    ep_name = ep_axes if len(ep_axes) > 1 else (ep_axes[0] if ep_axes else None)
    mlp_name = mlp_axes if len(mlp_axes) > 1 else (mlp_axes[0] if mlp_axes else None)

    has_scale = in_scale is not None
    extras = ((in_scale,) if has_scale else ()) + (biases or ())

    def body(x, indices, combine, keep, wi_0, wi_1, wo, *rest):
        scale, local_biases = rest[: int(has_scale)], (tuple(rest[int(has_scale) :]) or None)
        routing = (indices, combine, keep, *scale)
        if gather is not None:
            x, *routing = (jax.lax.all_gather(a, ep_name, axis=gather, tiled=True) for a in (x, *routing))
        offset = jax.lax.axis_index(ep_name) * wi_0.shape[0] if ep_name is not None else 0
        batch, seq, dim = x.shape
        indices, combine, keep, *scale = (a.reshape(batch * seq, -1) for a in routing)
        local_scale = scale[0] if scale else None
        y = expert_ffn(
            x.reshape(batch * seq, dim), indices, combine, keep, local_scale, wi_0, wi_1, wo,
            expert_offset=offset, chunks=token_chunks, biases=local_biases, **kw,
        )  # fmt: skip
        y = y.reshape(batch, seq, -1)
        if mlp_name is not None:
            y = jax.lax.psum(y, mlp_name)
        if gather is not None:
            return jax.lax.psum_scatter(y, ep_name, scatter_dimension=gather, tiled=True)
        return jax.lax.psum(y, ep_name) if ep_name is not None else y

    wi_spec, wo_spec = P(ep_name, None, mlp_name), P(ep_name, mlp_name, None)
    route_spec = P(*token_spec[:2], None)
    bias_spec = P(ep_name, mlp_name)
    in_specs = (token_spec, route_spec, route_spec, route_spec, wi_spec, wi_spec, wo_spec)
    in_specs += ((route_spec,) if has_scale else ()) + ((bias_spec, bias_spec) if biases else ())
    fn = jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=token_spec, axis_names=set(mesh.axis_names), check_vma=False)
    return fn(x, indices, combine, keep, wi_0, wi_1, wo, *extras)
