"""Mixture-of-experts routing math (pure functions, float32), matching HF transformers.

``route(logits, bias, spec)`` turns router logits ``[T, E]`` into combine weights
``[T, k]``, expert indices ``[T, k]`` and per-token probabilities ``[T, E]`` for the
load-balance loss:

* ``softmax`` (Mixtral, Qwen3-MoE): ``p = softmax(logits)``; top-k of ``p`` (+ bias);
  ``w = p[idx]``, renormalised ``w / sum(w)`` when ``norm_topk_prob``.
* ``sigmoid`` (DeepSeek-V3) / ``sqrtsoftplus`` (DeepSeek-V4): ``s = score(logits)``;
  selection on ``s + bias``, optionally group-limited (sum of the top-2 biased scores of
  each group of ``E/G`` consecutive experts; experts outside the kept groups get -inf);
  ``w = s[idx]`` (pre-bias), renormalised ``w / (sum(w) + 1e-20)`` when ``norm_topk_prob``.
* hash routing (DeepSeek-V4 ``first_num_hash_layers``): the experts come from a fixed
  token -> expert table instead of the top-k; the weights as above.
* every score function then multiplies ``w`` by ``routed_scaling_factor``.
* ``scales_input`` (Llama 4): top-1 of the raw logits (+ bias); ``w = sigmoid(logit)``
  scales the expert *input*; neither renormalisation nor ``routed_scaling_factor`` apply.

Tie rule of every top-k in the models (``top_k``: the router's experts, the group limit's groups,
the DeepSeek-V4 indexer's entries): the larger value first; equal values in increasing index order,
with -0.0 counted equal to +0.0 (normalised before the choice, so a ReLU score times a negative
weight, -0.0, ties with +0.0); -inf entries (masked groups, invisible entries) come after every
finite value, in index order; NaN comes last. ``torch.topk`` (HF) leaves the order of ties
unspecified, so the HF goldens refuse near-ties instead of relying on it.

The load-balance loss (``load_balance_loss``) follows ``load_balance_convention``:

* ``nnxtron``: Switch style over all ``T`` tokens of the call, ``E * sum_e f_e P_e`` with
  ``f_e`` the share of the ``T k`` assignments routed to e and ``P_e`` the mean of ``probs``
  (softmax, or the scores normalised per token); the layers' losses add up.
* ``maxtext`` (MaxText 0.2.5 ``RoutedMoE.load_balance_loss``): per sequence b,
  ``density[b, e]`` = mean over positions of the one-hot assignments / k and
  ``prob[b, e]`` = mean over positions of ``softmax(router output before the bias)`` (the raw
  logits for softmax and Llama 4 routers, the sigmoid / sqrt-softplus scores for DeepSeek's),
  rounded to ``cfg.dtype``; loss = ``E^2 * mean_{b, e}(density * prob)``. Every position counts
  (padding and packed segments as well, as in MaxText). MaxText averages the MoE layers' losses
  (decoder and MTP; hash-routed layers have none): ``load_balance_weight`` divides each layer's
  weight by that static number, so the sum over the layers is the mean whatever the stacking.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp

from nnxtron.config.layout import layer_kinds
from nnxtron.config.options import LOAD_BALANCE_CONVENTIONS, ROUTER_SCORE_FUNCS


@dataclass(frozen=True)
class RouterSpec:
    """Static routing options (read from the config by ``from_config``)."""

    num_experts: int
    k: int
    score_func: str = "softmax"
    norm_topk_prob: bool = False
    scaling_factor: float = 1.0
    n_groups: int = -1  # -1 = no group-limited routing
    topk_groups: int = -1
    scales_input: bool = False
    balance: str = "nnxtron"  # load_balance_convention: which probs route() returns

    def __post_init__(self):
        if self.balance not in LOAD_BALANCE_CONVENTIONS:
            raise ValueError(f"load_balance_convention={self.balance!r}; choose one of {LOAD_BALANCE_CONVENTIONS}")
        if self.score_func not in ROUTER_SCORE_FUNCS:
            raise ValueError(f"routed_score_func={self.score_func!r}; choose one of {ROUTER_SCORE_FUNCS}")
        if not 1 <= self.k <= self.num_experts:
            raise ValueError(f"num_experts_per_tok={self.k} must be between 1 and num_experts={self.num_experts}")
        if self.n_groups > 0 and self.num_experts % self.n_groups:
            raise ValueError(f"n_routing_groups={self.n_groups} does not divide num_experts={self.num_experts}")
        if self.scales_input and self.k != 1:
            raise ValueError("router_scales_expert_input=true needs num_experts_per_tok=1")

    @classmethod
    def from_config(cls, cfg: Any) -> RouterSpec:
        return cls(
            num_experts=cfg.num_experts,
            k=cfg.num_experts_per_tok,
            score_func=cfg.routed_score_func,
            norm_topk_prob=cfg.norm_topk_prob,
            scaling_factor=cfg.routed_scaling_factor,
            n_groups=cfg.n_routing_groups,
            topk_groups=cfg.topk_routing_group,
            scales_input=cfg.router_scales_expert_input,
            balance=cfg.load_balance_convention,
        )


def top_k(x: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """The ``k`` largest values over the last axis and their indices, by the tie rule above.

    A stable sort, not ``jax.lax.top_k``: the sharding partitioner keeps a sort sharded along
    the token axis but replicates ``chlo.top_k`` (every device would route every token of the
    global batch), and ``lax.top_k`` ranks +0.0 above -0.0 (XLA's total order).
    """
    x = jnp.where(x == 0, jnp.zeros_like(x), x)  # -0.0 -> +0.0
    idx = jnp.argsort(-x, axis=-1, stable=True)[..., :k]
    return jnp.take_along_axis(x, idx, axis=-1), idx


def scores(logits: jax.Array, score_func: str) -> jax.Array:
    """Per-expert scores in float32: softmax, sigmoid or sqrt(softplus)."""
    logits = logits.astype(jnp.float32)
    if score_func == "softmax":
        return jax.nn.softmax(logits, axis=-1)
    if score_func == "sigmoid":
        return jax.nn.sigmoid(logits)
    if score_func == "sqrtsoftplus":
        return jnp.sqrt(jax.nn.softplus(logits))
    raise ValueError(f"unknown routed_score_func {score_func!r}; choose one of {ROUTER_SCORE_FUNCS}")


def group_limit(choice: jax.Array, n_groups: int, topk_groups: int) -> jax.Array:
    """Set to -inf the experts outside each token's ``topk_groups`` best groups.

    A group's score is the sum of its top-2 ``choice`` values (top-1 for groups of one).
    """
    tokens, experts = choice.shape
    grouped = choice.reshape(tokens, n_groups, experts // n_groups)
    group_score = top_k(grouped, min(2, experts // n_groups))[0].sum(-1)  # [T, G]
    _, keep = top_k(group_score, topk_groups)  # [T, g]
    kept = jnp.any(keep[:, :, None] == jnp.arange(n_groups)[None, None, :], axis=1)  # [T, G]; no scatter (shards by token)
    return jnp.where(kept[:, :, None], grouped, -jnp.inf).reshape(tokens, experts)


def route(
    logits: jax.Array, bias: jax.Array | None, spec: RouterSpec, indices: jax.Array | None = None
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``logits [T, E]`` -> ``(weights [T, k] f32, indices [T, k] int32, probs [T, E] f32)``.

    ``bias`` ([E] or None) shifts the selection only, never the weights. ``probs`` are
    the per-token routing probabilities used by the load-balance loss (``nnxtron``: softmax, or
    the scores normalised to sum to one; ``maxtext``: see the module docstring). ``indices``
    ([T, k], DeepSeek-V4 hash routing) replaces the selection: the weights are then those
    experts' scores, normalised and scaled as usual.
    """
    logits = logits.astype(jnp.float32)
    if spec.scales_input:
        s = jax.nn.sigmoid(logits)
        choice = logits if bias is None else logits + bias.astype(jnp.float32)
        _, idx = top_k(choice, spec.k)
        weights = jax.nn.sigmoid(jnp.take_along_axis(logits, idx, axis=-1))
        probs = jax.nn.softmax(logits, axis=-1) if spec.balance == "maxtext" else s / jnp.sum(s, axis=-1, keepdims=True)
        return weights, idx.astype(jnp.int32), probs
    s = scores(logits, spec.score_func)
    if indices is not None:
        idx = indices.astype(jnp.int32)
    else:
        choice = s if bias is None else s + bias.astype(jnp.float32)
        if spec.n_groups > 0:
            choice = group_limit(choice, spec.n_groups, spec.topk_groups)
        _, idx = top_k(choice, spec.k)
    weights = jnp.take_along_axis(s, idx, axis=-1)
    if spec.norm_topk_prob:
        eps = 0.0 if spec.score_func == "softmax" else 1e-20
        weights = weights / (jnp.sum(weights, axis=-1, keepdims=True) + eps)
    weights = weights * jnp.float32(spec.scaling_factor)
    if spec.balance == "maxtext":  # softmax of MaxText's gate output before the bias (its score function applied)
        probs = jax.nn.softmax(logits if spec.score_func == "softmax" else s, axis=-1)
    else:
        probs = s if spec.score_func == "softmax" else s / jnp.sum(s, axis=-1, keepdims=True)
    return weights, idx.astype(jnp.int32), probs


def expert_counts(indices: jax.Array, num_experts: int) -> jax.Array:
    """Number of (token, slot) assignments per expert, float32 [E]."""
    return jnp.zeros((num_experts,), jnp.float32).at[indices.reshape(-1)].add(1.0)


def load_balance_layers(cfg: Any) -> int:
    """MoE layers with a load-balance loss under ``load_balance_convention=maxtext``: the decoder's
    MoE layers that are not hash-routed, plus the MTP depths when their block (the last layer's
    kind) is one. Static: the mean over layers is a sum of per-layer losses scaled by 1 / this."""
    kinds = layer_kinds(cfg)
    routed = sum(kind.moe and not kind.hash for kind in kinds)
    last = kinds[-1] if kinds else None
    return routed + (cfg.mtp_num_layers if last is not None and last.moe and not last.hash else 0)


def load_balance_weight(cfg: Any, hash_routed: bool = False) -> float:
    """The factor on one MoE layer's ``load_balance_loss`` (0 = none): ``load_balance_loss_weight``;
    under ``maxtext`` divided by ``load_balance_layers`` and 0 on hash-routed layers (as MaxText)."""
    weight = cfg.load_balance_loss_weight
    if cfg.load_balance_convention == "nnxtron" or weight == 0:
        return weight
    return 0.0 if hash_routed else weight / load_balance_layers(cfg)


def load_balance_loss(
    indices: jax.Array, probs: jax.Array, convention: str = "nnxtron", dtype: jnp.dtype = jnp.float32
) -> jax.Array:
    """The unweighted load-balance loss of one MoE call: ``indices [B, S, k]``, ``probs [B, S, E]``
    from ``route``; ``dtype`` (``maxtext``) is the one MaxText rounds the probabilities to."""
    if convention == "maxtext":
        return sequence_load_balance_loss(indices, probs, dtype)
    if convention != "nnxtron":
        raise ValueError(f"load_balance_convention={convention!r}; choose one of {LOAD_BALANCE_CONVENTIONS}")
    return call_load_balance_loss(indices, probs)


def call_load_balance_loss(indices: jax.Array, probs: jax.Array) -> jax.Array:
    """Switch-style ``E * sum_e f_e * P_e``: f_e the fraction of assignments to expert e,
    P_e the mean routing probability of expert e over tokens."""
    num_experts = probs.shape[-1]
    fraction = expert_counts(indices, num_experts) / indices.size
    mean_prob = jnp.mean(probs.reshape(-1, num_experts).astype(jnp.float32), axis=0)
    return num_experts * jnp.sum(fraction * mean_prob)


def sequence_load_balance_loss(indices: jax.Array, probs: jax.Array, dtype: jnp.dtype = jnp.float32) -> jax.Array:
    """MaxText 0.2.5's per-sequence loss, operation for operation: ``indices [B, S, k]``,
    ``probs [B, S, E]`` -> ``E^2 * mean_{b, e}(density * prob)`` (float32 scalar)."""
    num_experts, k = probs.shape[-1], indices.shape[-1]
    assigned = jnp.sum(jax.nn.one_hot(indices, num_experts, dtype=jnp.int32), axis=2)  # [B, S, E]
    density = jnp.mean(assigned, axis=1) / k  # [B, E] float32
    density_prob = jnp.mean(probs.astype(dtype), axis=1)  # [B, E] in dtype, as MaxText's
    return (jnp.mean(density * density_prob) * num_experts**2).astype(jnp.float32)
