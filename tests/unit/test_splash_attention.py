"""attention=splash (docs/attention.md, src/nnxtron/layers/splash.py): Pallas splash attention
computes what the xla path computes, here in Pallas interpret mode on the CPU — the same
kernel code, masks, padding and shard_map the TPU runs (its bfloat16 bounds on the chip are
in benchmarks/results/tpu_attention-v5e.json, run by benchmarks/tpu_attention.py).

Tolerances measured on this CPU (jax 0.10.2), float32: outputs differ from xla by <= 1e-6 and
q/k/v gradients (magnitude 1-10) by <= 1.4e-5 (online softmax, another summation order); bound
1e-4. Whole tiny models: as tests/unit/test_attention_impl.py's dot_product bounds.
Broken on purpose: a window of W instead of W - 1 in the LocalMask, segment ids not passed to the
kernel, or the scale not applied to the query each turn the kernel test red (the window: the
sliding case). The padded tail lies after every real token, so causality alone hides it.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from nnxtron.config import load_config
from nnxtron.errors import ConfigError
from nnxtron.layers import attention, splash
from nnxtron.layers.attention import attend, resolve_attention
from nnxtron.layers.splash import block_size, padded_length, splash_attention
from nnxtron.models.build import abstract_model, build_model
from nnxtron.parallel.mesh import make_mesh
from nnxtron.tools.parity import assert_grad_parity, loss_and_grads
from tests.conftest import random_batch, tiny_config

# row 0: three documents then padding (segment 0); row 1: one document (plain causal); 20 tokens: padded to 128
SEGMENTS = np.array([[1] * 6 + [2] * 7 + [3] * 4 + [0] * 3, [1] * 20], np.int32)
CASES = {  # name: (query heads, kv heads, sliding_window, chunk_size, key dim, value dim)
    "causal_packed": (4, 4, 0, 0, 8, 8),
    "gqa": (4, 2, 0, 0, 8, 8),
    "mqa_sliding": (4, 1, 5, 0, 8, 8),
    "gqa_chunked": (4, 2, 0, 4, 8, 8),
    "mla_dims": (2, 2, 0, 0, 12, 8),  # DeepSeek-V3: key dim (nope + rope) != value dim
    "gqa_soft_capped": (4, 2, 0, 0, 8, 8),  # "gqa"'s inputs, logits (std ~0.85) capped at 1 (Gemma 2's attn_logits_soft_cap)
}
SOFT_CAPS = {"gqa_soft_capped": 1.0}
BOUND = dict(rtol=0, atol=1e-4)
MODEL_BOUNDS = dict(loss_rtol=1e-6, rel=1e-5, abs_frac=1e-6, aggregate_rel=5e-6)


def _inputs(heads, kv_heads, dk, dv):
    keys = jax.random.split(jax.random.key(1), 4)
    batch, seq = SEGMENTS.shape
    q = jax.random.normal(keys[0], (batch, seq, heads, dk))
    k = jax.random.normal(keys[1], (batch, seq, kv_heads, dk))
    v = jax.random.normal(keys[2], (batch, seq, kv_heads, dv))
    return q, k, v, jax.random.normal(keys[3], (batch, seq, heads, dv))


@pytest.fixture(scope="module")
def computed():
    """Output and q/k/v gradients of every case under both implementations (one compile)."""

    def forward_backward(case, implementation, q, k, v, cotangent):
        _, _, window, chunk, *_ = CASES[case]
        f = lambda q, k, v: attend(  # noqa: E731
            q,
            k,
            v,
            SEGMENTS,
            scale=0.3,
            sliding_window=window,
            chunk_size=chunk,
            dtype=q.dtype,
            implementation=implementation,
            soft_cap=SOFT_CAPS.get(case, 0.0),
        )
        out, vjp = jax.vjp(f, q, k, v)
        return out, *vjp(cotangent)

    inputs = {case: _inputs(h, kv, dk, dv) for case, (h, kv, _, _, dk, dv) in CASES.items()}
    run = jax.jit(lambda inputs: {(c, i): forward_backward(c, i, *inputs[c]) for c in CASES for i in ("xla", "splash")})
    return run(inputs)


@pytest.mark.parametrize("case", list(CASES))
def test_splash_equals_xla_forward_and_backward(computed, case):
    for name, got, ref in zip(("output", "d/dq", "d/dk", "d/dv"), computed[case, "splash"], computed[case, "xla"]):
        assert got.shape == ref.shape and got.dtype == ref.dtype, name
        np.testing.assert_allclose(np.asarray(got), np.asarray(ref), err_msg=f"{case} {name}", **BOUND)


def test_the_soft_cap_bends_the_attention(computed):
    """The capped case has "gqa"'s inputs: the cap moves xla's output and gradients (so the splash =
    xla check above covers the kernel's own soft cap, not two uncapped paths)."""
    for got, ref in zip(computed["gqa_soft_capped", "xla"], computed["gqa", "xla"]):
        assert np.abs(np.asarray(got) - np.asarray(ref)).max() > 1e-2


def test_the_fused_backward_kernel_equals_the_two_kernel_backward():
    """``fused_backward=True`` (the default, ``FUSED_BACKWARD``: dq accumulated inside the dk/dv
    kernel, one backward kernel instead of two; benchmarks/tpu_attention.py's sweep) computes the
    output and gradients of the two-kernel backward, on packed GQA and sliding-window MQA."""
    for case in ("gqa", "mqa_sliding"):
        _, _, window, chunk, *_ = CASES[case]
        q, k, v, cotangent = _inputs(*CASES[case][:2], *CASES[case][4:])
        results = {}
        for fused in (True, False):

            def f(q, k, v, fused=fused, window=window, chunk=chunk):
                return splash_attention(
                    q, k, v, SEGMENTS, scale=0.3, sliding_window=window, chunk_size=chunk, fused_backward=fused
                )

            out, vjp = jax.vjp(f, q, k, v)
            kernels = str(jax.make_jaxpr(vjp)(cotangent)).count("pallas_call")
            assert kernels == (1 if fused else 2), f"{case}: {kernels} backward kernels with fused_backward={fused}"
            results[fused] = (out, *vjp(cotangent))
        for name, got, ref in zip(("output", "d/dq", "d/dk", "d/dv"), results[True], results[False]):
            np.testing.assert_allclose(np.asarray(got), np.asarray(ref), err_msg=f"{case} {name}", **BOUND)
    assert splash.FUSED_BACKWARD  # what attention=splash runs


def test_blocks_and_padding_follow_the_shape():
    assert [padded_length(n) for n in (1, 128, 129, 2048)] == [128, 128, 256, 2048]
    assert [block_size(n) for n in (128, 256, 384, 1024, 2048)] == [128, 256, 128, 1024, 1024]


@pytest.mark.parametrize("model", ["llama3.1-tiny", "deepseek3-test"])  # GQA; MLA (key dim != value dim)
def test_models_train_the_same_with_splash_on_a_mesh(model):
    """Loss, input cotangent and every parameter gradient, splash vs xla, both sharded over
    batch (data x fsdp) and heads (tensor): the kernel runs inside its shard_map."""
    mesh_keys = dict(ici_data_parallelism=2, ici_fsdp_parallelism=2, ici_tensor_parallelism=2, base_num_decoder_layers=2)
    batch = random_batch(tiny_config(model), batch=4, seq=16, packed=True)
    results = {}
    for impl in ("xla", "splash"):
        cfg = tiny_config(model, attention=impl, **mesh_keys)
        net = build_model(cfg)
        assert _implementations(net) == {impl}  # the key is read (MLA included)
        results[impl] = loss_and_grads(net, batch, mesh=make_mesh(cfg))
    assert_grad_parity(results["splash"], results["xla"], **MODEL_BOUNDS)


def _implementations(model: nnx.Module) -> set[str]:
    return {m.implementation for _, m in nnx.iter_graph(model) if isinstance(m, nnx.Module) and hasattr(m, "implementation")}


@pytest.mark.parametrize(
    "model, expected",
    [("llama4-tiny", {"splash"}), ("deepseek3-tiny", {"splash"}), ("gemma3-tiny", {"splash"}), ("gpt3-52k", {"splash"})],
)
def test_auto_on_a_tpu_is_splash(monkeypatch, model, expected):
    """Built as on a TPU (construction only): every global, sliding, chunked and MLA layer."""
    monkeypatch.setattr(attention, "attention_backend", lambda: "tpu")
    assert _implementations(abstract_model(tiny_config(model))) == expected


@pytest.mark.parametrize(
    "value, backend, flags, expected",
    [
        ("auto", "tpu", {}, "splash"),
        ("auto", "tpu", {"chunked": True}, "splash"),
        ("auto", "tpu", {"sequence_sharded": True}, "xla"),
        ("splash", "tpu", {}, "splash"),
        ("splash", "cpu", {}, "splash"),  # Pallas interpret mode
    ],
)
def test_resolve_splash(value, backend, flags, expected):
    assert resolve_attention(value, backend, "bfloat16", 64, **flags) == expected


@pytest.mark.parametrize("backend", ["gpu", "rocm"])
def test_splash_on_a_gpu_is_refused(backend):
    with pytest.raises(ConfigError, match=f"attention=splash is a TPU kernel .*this backend is {backend}"):
        resolve_attention("splash", backend, "bfloat16", 64)


@pytest.mark.parametrize(
    "model, overrides, message",
    [
        ("deepseek4-tiny", {}, "attention=splash supports attention_type=global and mla"),
        ("llama3.1-tiny", {"ici_context_parallelism": 2}, "attention=splash cannot shard queries over the sequence"),
        (
            "llama3.1-tiny",
            {"attention_query_block": 8},
            r"attention_query_block applies to attention=xla or dot_product \(attention=splash",
        ),
    ],
)
def test_config_refuses_splash_where_it_cannot_run(model, overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(values={"model_name": model, "attention": "splash", **overrides})


@pytest.mark.parametrize(
    "model, overrides, message",
    [
        ("gemma2-tiny", {"attention": "dot_product"}, "attention=dot_product cannot apply attn_logits_soft_cap"),
        ("gemma2-tiny", {"attention": "cudnn"}, "attention=cudnn cannot apply attn_logits_soft_cap"),
        ("gemma2-tiny", {"ici_context_parallelism": 2}, r"ring attention .* cannot apply attn_logits_soft_cap"),
        ("deepseek3-test", {"attn_logits_soft_cap": 50.0}, "attn_logits_soft_cap applies to attention_type=global"),
        ("gpt3-52k", {"attn_logits_soft_cap": 50.0}, "gpt3's attention has no logit soft cap"),
    ],
)
def test_attention_that_cannot_soft_cap_is_refused(model, overrides, message):
    """attn_logits_soft_cap runs on xla and splash (and the KV cache's einsum); elsewhere: one error naming it."""
    with pytest.raises(ConfigError, match=message):
        load_config(values={"model_name": model, **overrides})
    assert resolve_attention("auto", "gpu", "bfloat16", 64, soft_capped=True) == "xla"  # never cudnn
    with pytest.raises(ConfigError, match="attention=dot_product cannot apply attn_logits_soft_cap"):
        resolve_attention("dot_product", "cpu", "float32", 64, soft_capped=True)


def test_the_kernel_is_a_pallas_call():
    """The splash path lowers to a Pallas kernel (not a silent fallback to the einsum path)."""
    q = jnp.zeros((1, 8, 2, 8))
    jaxpr = jax.make_jaxpr(
        lambda q: attend(q, q, q, np.ones((1, 8), np.int32), scale=1.0, sliding_window=0, dtype=q.dtype, implementation="splash")
    )(q)
    assert "pallas_call" in str(jaxpr)
