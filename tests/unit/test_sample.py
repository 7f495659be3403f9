"""Sampling: greedy equals the full forward's argmax; strategies restrict as documented."""

import jax
import jax.numpy as jnp
import numpy as np

from nnxtron.infer.sample import generate_tokens, sample_logits
from nnxtron.models.build import build_model
from tests.conftest import tiny_config


def test_greedy_generation_matches_step_by_step_argmax():
    cfg = tiny_config("llama2-tiny", decode_sampling_strategy="greedy")
    model = build_model(cfg)
    prompt = [5, 17, 42]
    out = list(generate_tokens(model, prompt, cfg, max_new_tokens=6))
    seq = list(prompt)
    for _ in range(6):
        seq.append(int(jnp.argmax(model(jnp.asarray([seq])).logits[0, -1])))
    assert out == seq[len(prompt) :]


def test_stop_token_ends_generation():
    cfg = tiny_config("llama2-tiny")
    model = build_model(cfg)
    first = next(iter(generate_tokens(model, [5, 6], cfg, max_new_tokens=5)))
    assert list(generate_tokens(model, [5, 6], cfg, max_new_tokens=5, stop_ids=(first,))) == [first]


def test_seeded_sampling_is_reproducible_and_seed_dependent():
    cfg = tiny_config("llama2-tiny", decode_sampling_strategy="weighted", decode_sampling_temperature=2.0)
    model = build_model(cfg)
    a = list(generate_tokens(model, [5, 6], cfg, 12))
    assert a == list(generate_tokens(model, [5, 6], cfg, 12))
    other = tiny_config(
        "llama2-tiny", decode_sampling_strategy="weighted", decode_sampling_temperature=2.0, decode_sampling_seed=1
    )
    assert a != list(generate_tokens(model, [5, 6], other, 12))


def test_top_k_and_nucleus_restrict_the_support():
    logits = jnp.log(jnp.asarray([[0.5, 0.3, 0.15, 0.05]]))
    keys = jax.random.split(jax.random.key(0), 400)
    topk = {int(sample_logits(logits, k, "topk", 1.0, 2, 1.0)[0]) for k in keys}
    assert topk == {0, 1}
    nucleus = {int(sample_logits(logits, k, "nucleus", 1.0, 4, 0.7)[0]) for k in keys}
    assert nucleus == {0, 1}  # 0.5 < 0.7 <= 0.8
    weighted = {int(sample_logits(logits, k, "weighted", 1.0, 4, 1.0)[0]) for k in keys}
    assert weighted == {0, 1, 2, 3}
    np.testing.assert_array_equal(sample_logits(logits, keys[0], "greedy", 1.0, 1, 1.0), [0])
