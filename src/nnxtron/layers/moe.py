"""Mixture-of-experts feed-forward layer (Mixtral, Qwen3-MoE, Llama 4, DeepSeek-V3/V4).

``MoE(cfg, rngs)(x [B, S, D]) -> (y [B, S, D], aux)``. Routing runs in float32 (see
``nnxtron.layers.router``); each routed expert is the SwiGLU
``wo[e](act(x @ wi_0[e]) * (x @ wi_1[e]))`` (HF gate_proj / up_proj / down_proj) and the
routed sum accumulates in float32 before the cast to ``cfg.dtype``. An optional shared
expert (``shared_experts * base_moe_mlp_dim`` wide) sees every token. GPT-OSS: the router's logits
have a trained bias (``routed_bias`` with ``trained_router_bias``, the family's block says), the experts have biases
(``mlp_bias``: ``wi_0_bias``, ``wi_1_bias`` ``[E, H]`` and ``wo_bias`` ``[E, D]``, as MaxText names them)
and their activation is the clamped ``glu("sigmoid", limit)``.

Dispatch (``nnxtron.parallel.expert``; ``moe_compute=grouped`` groups the assignments by
expert for a grouped matmul — ``grouped_matmul``: ``ragged_dot`` on TPU and under
quantization, ``blocked`` (padded row blocks, ``parallel/grouped_matmul.py``) on CPU and GPU,
where ``ragged_dot`` has no grouped kernel — ``dense`` computes every expert on every token
with einsums and weights the unselected / dropped ones by zero — the same function either way):

* dropless (``capacity_factor == -1``): every assignment is computed, grouped by expert;
* capacity (``capacity_factor > 0``, ``expert_capacity``): expert ``e`` takes at most ``C``
  assignments, admitted in (token index, slot) order; the overflow contributes zero — the
  kept weights are not renormalised. ``capacity_scope=call``: ``C = ceil(factor * T * k / E)``
  over all ``T = B * S`` tokens of the call; ``capacity_scope=sequence`` (MaxText's dense
  path, ``generate_masks``): per sequence, ``C = int(max(ceil(S * k / E) * factor, factor))``
  (0 drops every assignment);
* with an active mesh the experts are split over the ``expert`` axis (logical ``exp``)
  and dispatched under ``jax.shard_map`` (grouped) or partitioned by XLA (dense); results
  equal the unsharded layer.

Non-trainable state: ``router_bias`` (``RouterBias``, selection-only bias, when
``routed_bias``), ``tid2eid`` (``HashTable``, hash-routed layers) and ``expert_load`` (``ExpertLoad``, assignments per expert summed over
forward calls, when ``routed_bias_update_rate > 0``). ``update_router_bias`` applies
DeepSeek's loss-free balancing to a pure-dict tree of such state and resets the load.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from nnxtron.config.options import CAPACITY_SCOPES
from nnxtron.config.schema import Config
from nnxtron.layers.linear import Linear, fan_in_init
from nnxtron.layers.mlp import ACTIVATIONS, GatedMLP, Intermediate, glu
from nnxtron.layers.router import RouterSpec, expert_counts, load_balance_loss, load_balance_weight, route
from nnxtron.parallel.expert import capacity_keep, dispatch
from nnxtron.parallel.grouped_matmul import resolve_grouped_matmul
from nnxtron.parallel.sharding import constrain

TOKENS = ("activation_batch", "activation_length", "activation_embed")


class RouterBias(nnx.Variable):
    """Selection-only expert bias (DeepSeek ``e_score_correction_bias``); not trained by the optimizer."""


class ExpertLoad(nnx.Variable):
    """(token, slot) assignments per expert, summed over forward calls until ``update_router_bias``."""


class HashTable(nnx.Variable):
    """DeepSeek-V4 ``tid2eid``: the experts of each token id ``[vocab, k]`` (int32) on hash-routed
    layers. Not a parameter: never updated by the optimizer; saved in checkpoints, carried by scan."""


def random_hash_table(key: jax.Array, vocab: int, experts: int, k: int) -> jax.Array:
    """``k`` distinct random experts per token id (a fresh model's table; checkpoints bring their own)."""
    return jnp.argsort(jax.random.uniform(key, (vocab, experts)), axis=-1)[:, :k].astype(jnp.int32)


def expert_capacity(scope: str, factor: float, batch: int, seq: int, k: int, experts: int) -> int:
    """Assignments each expert admits per call (``scope=call``) or per sequence (``sequence``)."""
    if scope == "call":
        return math.ceil(factor * batch * seq * k / experts)
    if scope == "sequence":  # MaxText 0.2.5 RoutedMoE.generate_masks, rounding included
        return int(max(math.ceil(seq * k / experts) * factor, factor))
    raise ValueError(f"capacity_scope={scope!r}; choose one of {CAPACITY_SCOPES}")


def keep_mask(indices: jax.Array, num_experts: int, factor: float, scope: str) -> jax.Array:
    """Bool ``[B, S, k]``: the assignments of ``indices [B, S, k]`` within capacity (all when
    ``factor <= 0``); admitted in (position, slot) order over the call or within each row."""
    batch, seq, k = indices.shape
    if factor <= 0:
        return jnp.ones(indices.shape, bool)
    capacity = expert_capacity(scope, factor, batch, seq, k, num_experts)
    if scope == "sequence":
        return jax.vmap(lambda row: capacity_keep(row, num_experts, capacity))(indices)
    return capacity_keep(indices.reshape(batch * seq, k), num_experts, capacity).reshape(indices.shape)


def _expert_weight(
    rngs: nnx.Rngs, shape: tuple[int, ...], fan_in: int, weight_dtype: jnp.dtype, axes: tuple[str, ...]
) -> nnx.Param:
    init = fan_in_init(fan_in)
    return nnx.Param(init(rngs.params(), shape, jnp.float32).astype(weight_dtype), out_sharding=axes)


class MoE(nnx.Module):
    """Routed experts (+ optional shared expert); returns ``(y, aux)``. ``trained_router_bias`` (GPT-OSS):
    ``routed_bias`` is a trained bias of the router's logits (selection and weights alike: MaxText's
    ``GateLogit`` bias outside DeepSeek, HF's ``router.bias``), not DeepSeek's selection-only ``RouterBias``.
    ``gated_shared_expert`` (Qwen3-Next): the shared expert's output is scaled by ``sigmoid(x @ shared_gate)``.
    ``per_expert_scale`` (Gemma 4): a learned ``[E]`` vector (ones at init, MaxText's ``per_expert_scale``, HF's
    ``router.per_expert_scale``) multiplies each chosen expert's combine weight after the renormalisation.
    ``shared_expert=False``: the family builds the ``shared_experts`` itself (Gemma 4: the layer's own MLP)."""

    def __init__(
        self,
        cfg: Config,
        rngs: nnx.Rngs,
        hash_routed: bool = False,
        trained_router_bias: bool = False,
        gated_shared_expert: bool = False,
        per_expert_scale: bool = False,
        shared_expert: bool = True,
    ):
        dim, hidden, experts = cfg.base_emb_dim, cfg.base_moe_mlp_dim, cfg.num_experts
        self.dtype, weight_dtype = jnp.dtype(cfg.dtype), jnp.dtype(cfg.weight_dtype)
        self.spec = RouterSpec.from_config(cfg)
        if cfg.mlp_activations[0] not in ACTIVATIONS:
            raise ValueError(f"mlp_activations[0]={cfg.mlp_activations[0]!r} is not one of {sorted(ACTIVATIONS)}")
        self.activation = cfg.mlp_activations[0]
        self.limit = cfg.mlp_activations_limit
        self.capacity_factor, self.capacity_scope = cfg.capacity_factor, cfg.capacity_scope
        self.compute = cfg.moe_compute
        self.token_chunks = cfg.moe_token_chunks
        self.quantized = cfg.use_qwix_quantization  # qwix needs each expert weight as its own einsum operand
        self.grouped_matmul = resolve_grouped_matmul(cfg.grouped_matmul, jax.default_backend(), self.quantized)
        self.lb_weight = load_balance_weight(cfg, hash_routed)  # / the MoE layers under load_balance_convention=maxtext
        trained_bias = cfg.routed_bias and trained_router_bias  # GPT-OSS: a Param
        self.router = Linear(
            [dim], [experts], ("embed", None), dtype=jnp.float32, weight_dtype=weight_dtype, rngs=rngs, use_bias=trained_bias
        )
        if hash_routed:  # the table replaces the selection; no correction bias (as HF)
            table = random_hash_table(rngs.params(), cfg.vocab_size, experts, cfg.num_experts_per_tok)
            self.tid2eid = HashTable(table, out_sharding=(None, None))
        elif cfg.routed_bias and not trained_bias:
            self.router_bias = RouterBias(jnp.zeros((experts,), jnp.float32), out_sharding=(None,))
        if per_expert_scale:
            self.per_expert_scale = nnx.Param(jnp.ones((experts,), weight_dtype), out_sharding=(None,))
        if cfg.routed_bias_update_rate > 0 and not hash_routed:
            self.expert_load = ExpertLoad(jnp.zeros((experts,), jnp.float32), out_sharding=(None,))
        # MaxText's initialiser counts the expert axis into the fan-in (variance_scaling over [E, in, out])
        self.wi_0 = _expert_weight(rngs, (experts, dim, hidden), experts * dim, weight_dtype, ("exp", "embed", "mlp"))
        self.wi_1 = _expert_weight(rngs, (experts, dim, hidden), experts * dim, weight_dtype, ("exp", "embed", "mlp"))
        self.wo = _expert_weight(rngs, (experts, hidden, dim), experts * hidden, weight_dtype, ("exp", "mlp", "embed"))
        if cfg.mlp_bias:  # zeros, as MaxText's default_bias_init
            self.wi_0_bias = nnx.Param(jnp.zeros((experts, hidden), weight_dtype), out_sharding=("exp", "mlp"))
            self.wi_1_bias = nnx.Param(jnp.zeros((experts, hidden), weight_dtype), out_sharding=("exp", "mlp"))
            self.wo_bias = nnx.Param(jnp.zeros((experts, dim), weight_dtype), out_sharding=("exp", "embed"))
        if cfg.shared_experts > 0 and shared_expert:
            self.shared = GatedMLP(
                dim,
                cfg.shared_experts * hidden,
                self.activation,
                dtype=self.dtype,
                weight_dtype=weight_dtype,
                rngs=rngs,
                limit=self.limit,
            )
            if gated_shared_expert:  # Qwen3-Next: sigmoid(x @ w) scales the shared expert (HF shared_expert_gate)
                self.shared_gate = Linear([dim], [1], ("embed", None), dtype=self.dtype, weight_dtype=weight_dtype, rngs=rngs)

    def route(self, x: jax.Array, tokens: jax.Array | None = None) -> tuple[jax.Array, jax.Array, jax.Array]:
        """Routing of ``x [B, S, D]`` (the router's input): weights ``[B, S, k]``, indices ``[B, S, k]``, probs
        ``[B, S, E]``. Hash-routed layers need the token ids ``tokens [B, S]``."""
        batch, seq, dim = x.shape
        logits = self.router(x)  # a float32 Linear: its own module, so quantization rules can name (and skip) it
        bias = self.router_bias[...] if hasattr(self, "router_bias") else None
        forced = None
        if hasattr(self, "tid2eid"):
            if tokens is None:
                raise ValueError("a hash-routed MoE layer needs the token ids (tokens=...)")
            forced = jnp.take(self.tid2eid[...], tokens.reshape(-1), axis=0)
        weights, indices, probs = route(logits.reshape(batch * seq, -1), bias, self.spec, forced)
        if hasattr(self, "per_expert_scale"):
            weights = weights * jnp.take(self.per_expert_scale[...].astype(jnp.float32), indices)
        return weights.reshape(batch, seq, -1), indices.reshape(batch, seq, -1), probs.reshape(batch, seq, -1)

    def __call__(
        self,
        x: jax.Array,
        tokens: jax.Array | None = None,
        intermediate: Intermediate = None,
        router_input: jax.Array | None = None,
    ) -> tuple[jax.Array, dict[str, jax.Array]]:
        """``x [B, S, D]`` -> ``(y [B, S, D] in cfg.dtype, aux)``; aux holds ``moe_lb_loss``
        (already multiplied by ``load_balance_loss_weight``, ``router.load_balance_weight``) when that weight is > 0.
        ``intermediate`` (dropout) acts on the shared expert's intermediate activations only;
        routed experts are not dropped (MaxText). ``router_input`` (Gemma 4): what the router sees, where it
        is not the experts' input ``x``."""
        experts = self.spec.num_experts
        x = constrain(x.astype(self.dtype), TOKENS)
        routed_from = x if router_input is None else constrain(router_input.astype(self.dtype), TOKENS)
        weights, indices, probs = self.route(routed_from, tokens)
        if hasattr(self, "expert_load"):
            self.expert_load[...] = self.expert_load[...] + expert_counts(indices, experts)
        keep = keep_mask(indices, experts, self.capacity_factor, self.capacity_scope)
        if self.spec.scales_input:  # Llama 4: the router weight scales the expert input
            combine, in_scale = jnp.ones_like(weights), weights
        else:
            combine, in_scale = weights, None
        biases = (self.wi_0_bias[...], self.wi_1_bias[...]) if hasattr(self, "wi_0_bias") else None
        routed = dispatch(
            x, indices, combine, keep, in_scale, self.wi_0[...], self.wi_1[...], self.wo[...],
            glu=glu(self.activation, self.limit), compute=self.compute, method=self.grouped_matmul,
            token_chunks=self.token_chunks, quantized=self.quantized, biases=biases,
        )  # fmt: skip
        if hasattr(self, "wo_bias"):  # each kept assignment adds its weight x its expert's output bias
            kept = jnp.where(keep, combine.astype(jnp.float32), 0.0)
            routed = routed + jnp.einsum("bsk,bskd->bsd", kept, jnp.take(self.wo_bias[...].astype(jnp.float32), indices, axis=0))
        y = constrain(routed.astype(self.dtype), TOKENS)
        if hasattr(self, "shared"):
            shared = self.shared(x, intermediate)
            if hasattr(self, "shared_gate"):
                shared = jax.nn.sigmoid(self.shared_gate(x).astype(jnp.float32)).astype(self.dtype) * shared
            y = y + shared
        aux = {}
        if self.lb_weight > 0:
            lb_loss = load_balance_loss(indices, probs, self.spec.balance, self.dtype)
            aux["moe_lb_loss"] = jnp.float32(self.lb_weight) * lb_loss
        return y, aux


def update_router_bias(rest: Mapping[str, Any], rate: float) -> dict[str, Any]:
    """Loss-free balancing on a pure-dict state tree: wherever a dict holds both
    ``router_bias`` and ``expert_load``, ``bias += rate * sign(mean(load) - load)`` (mean
    over the last, expert axis, so stacked ``[L, E]`` layers update per layer) and the load
    is reset to zero. Returns a new tree; jit-able."""

    def walk(node: Any) -> Any:
        if not isinstance(node, Mapping):
            return node
        new = {key: walk(value) for key, value in node.items()}
        if "router_bias" in node and "expert_load" in node:
            bias, load = jnp.asarray(node["router_bias"]), jnp.asarray(node["expert_load"])
            step = jnp.sign(jnp.mean(load, axis=-1, keepdims=True) - load)
            new["router_bias"] = (bias + rate * step).astype(bias.dtype)
            new["expert_load"] = jnp.zeros_like(load)
        return new

    return walk(rest)
