"""Cached decoding equals the full forward pass, position by position (float32).

For each family: the logits of a prompt prefilled into the cache and then of every
following token decoded one at a time (and, separately, of the rest fed as a second
chunk longer than the window) must equal the logits of one full forward pass over the
whole sequence. Sequences of 40 tokens are longer than the tiny presets' sliding
windows and attention chunks (8), so ring buffers wrap several times; batches mix
prompt lengths (right padding).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file

from nnxtron.convert.hf import from_hf
from nnxtron.infer.decode import CachedModel, DegenerateLogits, decode, prompt_batch, sampler, unrolled, with_caches
from nnxtron.infer.generate import generate
from nnxtron.infer.sample import generate_tokens
from nnxtron.models.build import build_model
from nnxtron.params import flatten
from tests.conftest import tiny_config
from tests.helpers import forward_logits
from tests.parity.test_hf_golden import CASES, GOLDEN

FAMILIES = {
    "llama3.1-tiny": {},
    "mistral-tiny": {},  # sliding window
    "qwen2-tiny": {},  # query/key/value biases
    "gemma-tiny": {},  # multi-query (1 key/value head), scaled embeddings
    "qwen3-tiny": {},  # qk-norm
    "gemma3-tiny": {},  # 5 sliding : 1 global, remainder block
    # one (sliding, global) cycle, the global layer's cache holding its own head width and values = keys' projection;
    # dense (its MoE decodes as the other MoE families': greedy generation = HF's checks the MoE golden)
    "gemma4-tiny": dict(num_experts=1, num_experts_per_tok=1, shared_experts=0),
    "llama4-tiny": {},  # chunked attention, NoPE layers, MoE
    "gpt3-52k": dict(base_num_decoder_layers=2),  # fused QKV, learned positions
    "deepseek3-test": {},  # MLA latent cache, dense + MoE stacks
    "mixtral-tiny": dict(scan_layers=False),  # unrolled stack
    # sliding / CSA (+ indexer) / HCA layers, hash-routed prefix, mHC: compressor buffers and entries
    "deepseek4-test": {},
    # Gated DeltaNet + gated attention: conv inputs and the recurrent state in the cache. Two layers: at four, this
    # random init is ill-conditioned at a few positions (a 3e-7 relative nudge of the embeddings moves their
    # full-forward logits by 2.9e-5, the cached ones differ by up to 4.4e-5 there); at two 8.1e-6
    "qwen3-next-tiny": dict(base_num_decoder_layers=2),
}
SEQ = 40
# |logit difference| <= TOLERANCE + RELATIVE * |logit| (float32, the same function in another op order):
# measured below 3e-6 alone; in a full CI run 2.3e-5 on a logit of 65 (3 ulps, 3.5e-7 relative).
# A real bug (a wrong position, a stale or missing cache entry) moves logits by O(1).
TOLERANCE = 2e-5
RELATIVE = 2e-6


def _tokens(cfg, rows: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(3, cfg.vocab_size, size=(rows, SEQ)).astype(np.int32)


def _step(cached, caches, tokens, positions, segments):
    return cached.step(caches, jnp.asarray(tokens), jnp.asarray(positions), jnp.asarray(segments))


@pytest.mark.parametrize("model_name", sorted(FAMILIES))
def test_cached_logits_equal_the_full_forward(model_name):
    cfg = tiny_config(model_name, **FAMILIES[model_name])
    model = build_model(cfg)
    tokens = _tokens(cfg, 2)
    full = np.asarray(forward_logits(model, jnp.asarray(tokens)))
    prompt_lengths = (11, 6)  # row 1 is right-padded in the prefill

    # prefill then one token at a time
    cached = with_caches(model, 2, SEQ)
    batch = prompt_batch([tokens[r, :n] for r, n in enumerate(prompt_lengths)], 16)
    logits, caches = _step(cached, cached.caches, batch["tokens"], batch["positions"], batch["segment_ids"])
    logits = np.asarray(logits)
    for row, n in enumerate(prompt_lengths):
        np.testing.assert_allclose(logits[row, :n], full[row, :n], atol=TOLERANCE, rtol=RELATIVE, err_msg=f"prefill row {row}")
    position = np.array(prompt_lengths)
    while position.min() < SEQ:
        live = position < SEQ
        index = np.minimum(position, SEQ - 1)
        step_tokens = tokens[np.arange(2), index][:, None]
        logits, caches = _step(cached, caches, step_tokens, index[:, None], live.astype(np.int32)[:, None])
        for row in np.flatnonzero(live):
            np.testing.assert_allclose(
                np.asarray(logits)[row, 0],
                full[row, index[row]],
                atol=TOLERANCE,
                rtol=RELATIVE,
                err_msg=f"row {row} pos {index[row]}",
            )
        position = position + 1

    # a second chunk longer than any window: the ring buffer takes only its last slots
    cached = with_caches(model, 2, SEQ)
    first, second = prompt_batch(tokens[:, :13], 13), tokens[:, 13:]
    _, caches = _step(cached, cached.caches, first["tokens"], first["positions"], first["segment_ids"])
    positions = np.broadcast_to(np.arange(13, SEQ, dtype=np.int32), second.shape)
    logits, _ = _step(cached, caches, second, positions, np.ones_like(second))
    np.testing.assert_allclose(np.asarray(logits), full[:, 13:], atol=TOLERANCE, rtol=RELATIVE, err_msg="second chunk")


@pytest.mark.parametrize("model_name", ["mistral-tiny", "llama4-tiny"])
def test_decoding_loop_logits_equal_the_full_forward(model_name):
    """The generation loop itself (prefill of right-padded prompts, then each row at its own
    position) fed the true continuation: every step's logits equal the full forward's."""
    cfg = tiny_config(model_name)
    model = build_model(cfg)
    tokens = _tokens(cfg, 2, seed=5)
    full = np.asarray(forward_logits(model, jnp.asarray(tokens)))
    lengths = np.array([14, 5])
    seen = []

    def teacher(logits):  # record the logits, answer with the true next tokens
        step = len(seen)
        seen.append(logits)
        return tokens[np.arange(2), lengths + step]

    list(decode(model, [tokens[r, :n] for r, n in enumerate(lengths)], SEQ - 14, teacher))
    for step, logits in enumerate(seen):
        np.testing.assert_allclose(
            logits, full[np.arange(2), lengths - 1 + step], atol=TOLERANCE, rtol=RELATIVE, err_msg=f"step {step}"
        )


@pytest.mark.parametrize("strategy", ["greedy", "weighted", "topk", "nucleus"])
def test_cached_sampling_equals_uncached_sampling(strategy):
    """Same seed, same strategy: KV-cached decoding of a batch with different prompt lengths
    draws exactly the tokens that rerunning the full forward per token draws, row by row
    (so sampling is reproducible and the cache changes nothing)."""
    cfg = tiny_config("llama3.1-tiny", decode_sampling_strategy=strategy, decode_sampling_temperature=0.7)
    model = build_model(cfg)
    prompts = [list(_tokens(cfg, 1, seed=1)[0, :9]), list(_tokens(cfg, 1, seed=2)[0, :4])]
    batched = np.array(list(generate(model, prompts, cfg, max_new_tokens=10)))
    for row, prompt in enumerate(prompts):
        alone = np.array([step[0] for step in generate(model, [prompt], cfg, max_new_tokens=10)])
        uncached = list(generate_tokens(model, prompt, cfg, 10))
        np.testing.assert_array_equal(alone, uncached, err_msg=f"row {row}")
        if strategy == "greedy":  # sampling keys are shared by the rows of a batch; argmax is not
            np.testing.assert_array_equal(batched[:, row], uncached, err_msg=f"batched row {row}")


def test_stop_tokens_end_each_row_separately():
    cfg = tiny_config("llama3.1-tiny", decode_sampling_strategy="greedy")
    model = build_model(cfg)
    prompts = [list(_tokens(cfg, 1, seed=3)[0, :5]), list(_tokens(cfg, 1, seed=4)[0, :7])]
    free = np.array(list(generate(model, prompts, cfg, max_new_tokens=10)))
    stop = int(free[2, 0])  # row 0's third token
    steps = list(generate(model, prompts, cfg, max_new_tokens=10, stop_ids=(stop,)))
    first_stop = {
        row: next(i for i, t in enumerate(free[:, row]) if t == stop) if stop in free[:, row] else None for row in (0, 1)
    }
    assert [s[0] for s in steps][: first_stop[0] + 1] == list(free[: first_stop[0] + 1, 0])
    assert all(s[0] is None for s in steps[first_stop[0] + 1 :])
    if first_stop[1] is None:
        assert [s[1] for s in steps] == list(free[: len(steps), 1])


@pytest.mark.parametrize("strategy, per_call, unroll", [("greedy", 3, 2), ("nucleus", 3, 2), ("weighted", 1, 1)])
def test_generate_on_the_device_draws_the_host_loops_tokens(strategy, per_call, unroll):
    """``generate`` samples on the device, ``per_call`` tokens per call and ``unroll`` per
    iteration of its loop: the same tokens, the same stops, as the host loop (``decode``
    with the config's ``sampler``), across call boundaries (11 tokens = 3 + 3 + 3 + 2: with
    2 a call, an iteration's second token not wanted), with a stop token that ends one row early."""
    cfg = tiny_config("llama3.1-tiny", decode_sampling_strategy=strategy, decode_sampling_temperature=0.7)
    model = build_model(cfg)
    prompts = [list(_tokens(cfg, 1, seed=6)[0, :9]), list(_tokens(cfg, 1, seed=7)[0, :4])]
    free = [tokens for tokens, _ in decode(model, prompts, 11, sampler(cfg))]
    stop = int(free[4][1])  # row 1's fifth token
    on_host = [
        [None if d else int(t) for t, d in zip(tokens, done)]
        for tokens, done in decode(model, prompts, 11, sampler(cfg), (stop,))
    ]
    on_device = list(generate(model, prompts, cfg, 11, (stop,), tokens_per_call=per_call, tokens_per_iteration=unroll))
    assert on_device == on_host and on_device[5][1] is None


def test_generate_takes_the_backends_tokens_per_iteration(monkeypatch):
    """Named by no caller, the device loop's tokens per iteration are the backend's (two on a
    TPU, one elsewhere: made two here on the CPU; the tests above show the tokens the same)."""
    import nnxtron.infer.generate as module

    assert [module.default_tokens_per_iteration(b) for b in ("tpu", "gpu", "cpu")] == [2, 1, 1]
    cfg = tiny_config("llama3.1-tiny", decode_sampling_strategy="greedy")
    model = build_model(cfg)
    prompt = [list(_tokens(cfg, 1, seed=11)[0, :6])]
    unrolls, real = [], module.jitted_chunk
    monkeypatch.setattr(module, "jitted_chunk", lambda *args: unrolls.append(args[-1]) or real(*args))
    monkeypatch.setitem(module.TOKENS_PER_ITERATION, "cpu", 2)
    assert len(list(generate(model, prompt, cfg, 6))) == 6 and unrolls == [2]


@pytest.mark.parametrize("faulty", [1, 2])
def test_a_fault_stops_an_unrolled_loop_at_its_token(monkeypatch, faulty):
    """Two tokens per iteration of the device loop: logits that cannot be sampled before new
    token ``faulty + 1`` (here: the logits whose argmax is the free run's token ``faulty``,
    flagged by a stand-in check) stop ``generate`` there — the second token of an iteration
    (1) or the first (2) — after exactly the tokens before it."""
    import nnxtron.infer.generate as module

    cfg = tiny_config("llama3.1-tiny", decode_sampling_strategy="greedy")
    model = build_model(cfg)
    prompt = [list(_tokens(cfg, 1, seed=11)[0, :6])]  # free run: 6 different tokens
    free = [step[0] for step in generate(model, prompt, cfg, 6, tokens_per_iteration=2)]
    poison = free[faulty]
    assert poison not in free[:faulty], "the stand-in fault must first fire at the chosen token"
    real = module.logit_faults

    def flagged(logits, live):
        nonfinite, flat, value = real(logits, live)
        return nonfinite | jnp.any((jnp.argmax(logits, -1) == poison) & live), flat, value

    monkeypatch.setattr(module, "logit_faults", flagged)
    module.jitted_chunk.cache_clear()
    got = []
    with pytest.raises(DegenerateLogits, match=f"new token {faulty + 1} are not finite"):
        for step in generate(model, prompt, cfg, 6, tokens_per_call=4, tokens_per_iteration=2):
            got.append(step[0])
    module.jitted_chunk.cache_clear()
    assert got == free[:faulty]


def test_generate_calls_the_device_once_per_chunk(monkeypatch):
    """One prefill, then one call per ``tokens_per_call`` tokens (10 = 4 + 4 + 2): the
    per-token step never goes through the host."""
    import nnxtron.infer.generate as module

    calls = {"step": 0, "chunk": 0}
    real_step, real_chunk = CachedModel.step, module.jitted_chunk

    def step(self, *args):
        calls["step"] += 1
        return real_step(self, *args)

    def chunk(*key):
        run = real_chunk(*key)

        def counted(*args):
            calls["chunk"] += 1
            return run(*args)

        return counted

    monkeypatch.setattr(CachedModel, "step", step)
    monkeypatch.setattr(module, "jitted_chunk", chunk)
    cfg = tiny_config("llama3.1-tiny", decode_sampling_strategy="greedy")
    steps = list(generate(build_model(cfg), [[5, 6, 7]], cfg, 10, tokens_per_call=4))
    assert len(steps) == 10 and calls == {"step": 1, "chunk": 3}


@pytest.mark.parametrize("case", CASES)
def test_greedy_generation_equals_hf_generate(case):
    """Greedy cached decoding of the stored tiny HF models equals transformers' own cached
    greedy ``generate`` (scripts/make_generate_goldens.py): 24 new tokens after 12, past the
    sliding windows and chunks of 8."""
    golden = load_file(str(GOLDEN / case / "generate.safetensors"))
    model = from_hf(GOLDEN / case)
    cfg = model.config.model_copy(update={"decode_sampling_strategy": "greedy"})
    steps = list(generate(model, [list(row) for row in golden["prompt_ids"]], cfg, max_new_tokens=golden["generated"].shape[1]))
    np.testing.assert_array_equal(np.array(steps).T, golden["generated"])


def test_decoding_runs_an_unrolled_copy_with_the_same_weights():
    """with_caches decodes an unrolled copy (one cache per layer, updated in place): for a
    partially pipelined model (2 of 4 layers pipelined, the rest in ``unpipelined_layers``)
    the copy has one 4-layer list whose layers are the stacked weights, in layer order, and the
    cached prefill equals the full forward."""
    cfg = tiny_config(base_num_decoder_layers=4, ici_pipeline_parallelism=2, pipeline_parallel_layers=2)
    model = build_model(cfg)
    copy = unrolled(model)
    assert model.stack_names == ("layers", "unpipelined_layers") and copy.stack_names == ("layers",)
    stacked, listed = flatten(nnx.state(model, nnx.Param)), flatten(nnx.state(copy, nnx.Param))
    kernel = "attention/query/kernel"
    for layer in range(4):
        source = (
            stacked[f"layers/layers/{kernel}"][layer] if layer < 2 else stacked[f"unpipelined_layers/layers/{kernel}"][layer - 2]
        )
        np.testing.assert_array_equal(listed[f"layers/layers/{layer}/{kernel}"], source)
    tokens = _tokens(cfg, 2)[:, :16]
    cached = with_caches(model, 2, 16)
    batch = prompt_batch(list(tokens), 16)
    logits, _ = _step(cached, cached.caches, batch["tokens"], batch["positions"], batch["segment_ids"])
    np.testing.assert_allclose(
        np.asarray(logits), np.asarray(forward_logits(model, jnp.asarray(tokens))), atol=TOLERANCE, rtol=RELATIVE
    )
