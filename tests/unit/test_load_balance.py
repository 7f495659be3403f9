"""``load_balance_convention``: nnxtron's Switch loss over a call, summed over layers, and
MaxText 0.2.5's per-sequence loss averaged over the MoE layers (``layers/router.py``).

The MaxText value is checked against a NumPy transcription of ``RoutedMoE.load_balance_loss``
and of ``train.py``'s mean over layers; the model-level tests show the properties the
convention promises: per-row (a batch's loss is the mean of its rows'), a mean over layers
(with one row and a softmax router, where both conventions have the same per-layer value, it is
nnxtron's sum / L),
whatever the stacking, and gradient accumulation changes nothing. The step-for-step check
against MaxText's own run is tests/parity/test_maxtext_reproduction.py (mixtral family)."""

from __future__ import annotations

import functools
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from nnxtron.config import load_config
from nnxtron.layers.router import RouterSpec, load_balance_layers, load_balance_loss, route
from nnxtron.models.build import build_model
from nnxtron.train.step import compute_gradients
from tests.conftest import random_batch, tiny_config

MAXTEXT_BASE_YML = "tests/assets/maxtext/base.yml"


def maxtext_numpy(indices: np.ndarray, probs: np.ndarray) -> float:
    """MaxText 0.2.5 ``RoutedMoE.load_balance_loss`` (weight 1), transcribed: indices [B, S, k], probs [B, S, E]."""
    batch, seq, k = indices.shape
    experts = probs.shape[-1]
    mask = np.zeros((batch, seq, experts))
    for b in range(batch):
        for s in range(seq):
            for j in range(k):
                mask[b, s, indices[b, s, j]] += 1  # one_hot(top_k_indices).sum(axis=2)
    density = mask.mean(axis=1) / k  # per-sequence token density, sums to 1 over experts
    density_prob = probs.astype(np.float64).mean(axis=1)
    return float(np.mean(density * density_prob) * experts**2)


def random_routing(seed: int, batch: int, seq: int, experts: int, k: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    probs = rng.dirichlet(np.full(experts, 0.3), size=(batch, seq)).astype(np.float32)
    indices = np.argsort(-probs, axis=-1)[..., :k].astype(np.int32)
    return indices, probs


@pytest.mark.parametrize("batch,seq,experts,k", [(1, 16, 4, 2), (3, 12, 8, 2), (2, 9, 6, 1), (4, 5, 16, 4)])
def test_the_maxtext_loss_is_maxtexts_formula(batch, seq, experts, k):
    indices, probs = random_routing(batch * 100 + seq, batch, seq, experts, k)
    got = float(load_balance_loss(jnp.asarray(indices), jnp.asarray(probs), "maxtext"))
    np.testing.assert_allclose(got, maxtext_numpy(indices, probs), rtol=1e-6)
    nnxtron = float(load_balance_loss(jnp.asarray(indices), jnp.asarray(probs), "nnxtron"))
    if batch == 1:  # one sequence: the same Switch loss (density / k is the assignment share)
        np.testing.assert_allclose(got, nnxtron, rtol=1e-6)
    else:  # per sequence vs pooled over the call: rows routed differently give different values
        assert abs(got - nnxtron) > 1e-4 * nnxtron, (got, nnxtron)


def test_the_maxtext_loss_rounds_the_probabilities_to_the_dtype():
    """MaxText casts the softmax to its dtype before the per-sequence mean (bfloat16 runs)."""
    indices, probs = random_routing(3, 2, 8, 4, 2)
    rounded = np.asarray(jnp.asarray(probs).astype(jnp.bfloat16).astype(jnp.float32))
    got = float(load_balance_loss(jnp.asarray(indices), jnp.asarray(probs), "maxtext", jnp.bfloat16))
    assert got != float(load_balance_loss(jnp.asarray(indices), jnp.asarray(probs), "maxtext"))
    density = jnp.mean(jax.nn.one_hot(indices, 4).sum(2), axis=1) / 2
    mean = jnp.mean(jnp.asarray(rounded, jnp.bfloat16), axis=1)  # jnp's bfloat16 mean, as MaxText's
    assert got == float(jnp.mean(density * mean) * 16)


@pytest.mark.parametrize(
    "options,probs_of",
    [
        (dict(score_func="softmax", norm_topk_prob=True), lambda x: jax.nn.softmax(x)),
        (dict(score_func="sigmoid", n_groups=2, topk_groups=1), lambda x: jax.nn.softmax(jax.nn.sigmoid(x))),
        (dict(score_func="sqrtsoftplus"), lambda x: jax.nn.softmax(jnp.sqrt(jax.nn.softplus(x)))),
        (dict(score_func="sigmoid", k=1, scales_input=True), lambda x: jax.nn.softmax(x)),  # Llama 4: raw logits
    ],
    ids=["softmax", "sigmoid", "sqrtsoftplus", "llama4"],
)
def test_maxtext_probabilities_are_the_softmax_of_the_gate_output_before_the_bias(options, probs_of):
    spec = RouterSpec(**{"num_experts": 8, "k": 2, **options, "balance": "maxtext"})
    logits = jax.random.normal(jax.random.key(0), (10, 8))
    bias = 0.3 * jax.random.normal(jax.random.key(1), (8,))  # changes the selection only
    _, indices, probs = route(logits, bias, spec)
    np.testing.assert_allclose(np.asarray(probs), np.asarray(probs_of(logits)), rtol=1e-6, atol=1e-7)
    nnxtron_spec = RouterSpec(**{"num_experts": 8, "k": 2, **options})
    _, same_indices, _ = route(logits, bias, nnxtron_spec)
    np.testing.assert_array_equal(np.asarray(indices), np.asarray(same_indices))  # the convention never moves tokens


@pytest.mark.parametrize(
    "model,overrides,layers",
    [
        ("mixtral-tiny", {}, 2),
        ("llama4-tiny", {}, 4),  # every 2nd of 8 layers is MoE
        ("deepseek3-tiny", {"mtp_num_layers": 1}, 61 - 3 + 1),  # dense prefix excluded, MTP depth counted
        ("deepseek4-tiny", {}, 43 - 3),  # hash-routed layers have no loss
    ],
)
def test_the_layer_count_is_static(model, overrides, layers):
    cfg = tiny_config(model, load_balance_convention="maxtext", load_balance_loss_weight=0.5, **overrides)
    assert load_balance_layers(cfg) == layers


def test_a_maxtext_config_selects_maxtexts_convention():
    cfg = load_config(MAXTEXT_BASE_YML, ["decoder_block=mixtral", "num_experts=4", "num_experts_per_tok=2"])
    assert cfg.load_balance_convention == "maxtext"
    assert tiny_config("mixtral-tiny").load_balance_convention == "nnxtron"
    with pytest.raises(Exception, match="load_balance_convention"):
        tiny_config("mixtral-tiny", load_balance_convention="hf")


@partial(jax.jit, static_argnums=0)
def _aux(graphdef, state, tokens):
    return nnx.merge(graphdef, state)(tokens).aux["losses"]["moe_lb_loss"]


@functools.cache
def split_model(cfg) -> tuple:
    return nnx.split(build_model(cfg, seed=0))


def lb_loss(cfg, tokens: np.ndarray) -> float:
    return float(_aux(*split_model(cfg), jnp.asarray(tokens)))


MODELS = {  # tiny MoE decoders: plain; a pattern cycle of dense / MoE and NoPE layers (CycleBlock)
    "mixtral": ("mixtral-tiny", {}),
    "llama4": ("llama4-tiny", {"base_num_decoder_layers": 4, "inhomogeneous_layer_cycle_interval": 4}),
}


@pytest.mark.parametrize("name", sorted(MODELS))
def test_the_maxtext_loss_is_per_row_and_a_mean_over_layers(name):
    model, overrides = MODELS[name]
    common = dict(load_balance_loss_weight=0.1, max_target_length=16, **overrides)
    maxtext = tiny_config(model, load_balance_convention="maxtext", **common)
    tokens = random_batch(maxtext, batch=2, seq=16)["inputs"]
    rows = [lb_loss(maxtext, tokens[i : i + 1]) for i in range(2)]
    np.testing.assert_allclose(lb_loss(maxtext, tokens), np.mean(rows), rtol=1e-6)  # per sequence, mean over rows
    layers = load_balance_layers(maxtext)
    assert layers >= 2
    if maxtext.routed_score_func == "softmax":  # both conventions then have one row's per-layer value: sum / L
        np.testing.assert_allclose(rows[0] * layers, lb_loss(tiny_config(model, **common), tokens[:1]), rtol=1e-5)
    unrolled = tiny_config(model, load_balance_convention="maxtext", scan_layers=False, **common)
    np.testing.assert_allclose(lb_loss(unrolled, tokens), lb_loss(maxtext, tokens), rtol=1e-6)


def test_gradient_accumulation_does_not_change_the_maxtext_loss():
    """Per-row losses split exactly over microbatches (equal token counts): k = 1 and k = 2 agree,
    which nnxtron's pooled loss does not promise."""
    cfg = tiny_config("mixtral-tiny", load_balance_convention="maxtext", load_balance_loss_weight=0.1, max_target_length=16)
    batch = {k: jnp.asarray(v) for k, v in random_batch(cfg, batch=4, seq=16).items()}
    graphdef, params, rest = nnx.split(build_model(cfg, seed=0), nnx.Param, ...)
    params, rest = nnx.to_pure_dict(params), nnx.to_pure_dict(rest)
    run = jax.jit(partial(compute_gradients, graphdef), static_argnums=3)
    whole, split = run(params, rest, batch, 1), run(params, rest, batch, 2)
    np.testing.assert_allclose(float(split.aux["moe_lb_loss"]), float(whole.aux["moe_lb_loss"]), rtol=1e-6)
    for a, b in zip(jax.tree.leaves(split.grads), jax.tree.leaves(whole.grads), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-7)
