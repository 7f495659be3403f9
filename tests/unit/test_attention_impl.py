"""attention= (docs/attention.md): the xla einsum path and jax.nn.dot_product_attention compute
the same attention, forward and backward, for every mask nnxtron builds; whole models train
the same with either; auto resolves per backend; cudnn is refused where it cannot run.

Tolerances are measured on this CPU (jax 0.10.2). float32: the paths differ by <= 4.8e-7 on
outputs and q/k/v gradients of magnitude 1-6 (0 with as many kv heads as query heads); bound
2e-6. bfloat16: by one bf16 ulp (<= 1.6e-2; xla rounds the logits to bfloat16, dot_product
keeps them in float32), at most 0.55 of the bound 2e-2 + 2e-2 |ref|. Whole models in float32:
loss within 9e-8 relative, gradients within 3.2e-7 (aggregate) and 1e-7 of the per-leaf bound;
bounds as tests/parity/test_strategies.py (>= 10x headroom).
Mutations in the dot_product path turn these red: a dropped segment mask changes outputs by
2-3 and the llama3.1-tiny loss by 5e-2 relative; a dropped window the mistral-tiny loss by 3e-4.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from nnxtron.config import load_config
from nnxtron.errors import ConfigError
from nnxtron.layers import attention
from nnxtron.layers.attention import attend, resolve_attention
from nnxtron.models.build import abstract_model, build_model
from nnxtron.tools.parity import assert_grad_parity, loss_and_grads
from tests.conftest import random_batch, tiny_config

# row 0: three documents then padding (segment 0); row 1: one document (plain causal)
SEGMENTS = np.array([[1] * 5 + [2] * 6 + [3] * 3 + [0] * 2, [1] * 16], np.int32)
CASES = {  # name: (query heads, kv heads, sliding_window, chunk_size)
    "causal_packed": (4, 4, 0, 0),
    "gqa": (4, 2, 0, 0),
    "mqa_sliding": (4, 1, 5, 0),
    "gqa_chunked": (4, 2, 0, 4),
}
TOLERANCE = {"float32": dict(rtol=0, atol=2e-6), "bfloat16": dict(rtol=2e-2, atol=2e-2)}
MODEL_BOUNDS = dict(loss_rtol=1e-6, rel=1e-5, abs_frac=1e-6, aggregate_rel=5e-6)


def _inputs(heads: int, kv_heads: int, dtype: str, dim: int = 8):
    keys = jax.random.split(jax.random.key(0), 4)
    batch, seq = SEGMENTS.shape
    q = jax.random.normal(keys[0], (batch, seq, heads, dim), dtype)
    k = jax.random.normal(keys[1], (batch, seq, kv_heads, dim), dtype)
    v = jax.random.normal(keys[2], (batch, seq, kv_heads, dim), dtype)
    cotangent = jax.random.normal(keys[3], (batch, seq, heads, dim), dtype)
    return q, k, v, cotangent


def _forward_backward(q, k, v, cotangent, case: str, implementation: str):
    _, _, window, chunk = CASES[case]

    def f(q, k, v):
        return attend(
            q, k, v, SEGMENTS, scale=0.3, sliding_window=window, chunk_size=chunk, dtype=q.dtype,
            implementation=implementation,
        )  # fmt: skip

    out, vjp = jax.vjp(f, q, k, v)
    return out, *vjp(cotangent)


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def computed(request):
    """Output and q/k/v gradients of every case with both implementations (one compile per dtype)."""
    inputs = {case: _inputs(heads, kv_heads, request.param) for case, (heads, kv_heads, *_) in CASES.items()}

    @jax.jit
    def run(inputs):
        return {(case, impl): _forward_backward(*inputs[case], case, impl) for case in CASES for impl in ("xla", "dot_product")}

    return request.param, run(inputs)


@pytest.mark.parametrize("case", list(CASES))
def test_dot_product_equals_xla_forward_and_backward(computed, case):
    dtype, results = computed
    for name, got, ref in zip(("output", "d/dq", "d/dk", "d/dv"), results[case, "dot_product"], results[case, "xla"]):
        assert got.dtype == ref.dtype == jnp.dtype(dtype), name
        np.testing.assert_allclose(
            np.asarray(got, np.float32), np.asarray(ref, np.float32), err_msg=f"{case} {dtype} {name}", **TOLERANCE[dtype]
        )


@pytest.mark.parametrize("model", ["llama3.1-tiny", "mistral-tiny"])  # both GQA; mistral-tiny: a window of 8
def test_models_train_the_same_with_dot_product(model):
    """Loss, input cotangent and every parameter gradient (two scanned layers, two packed documents)."""
    batch = random_batch(tiny_config(model), batch=2, seq=16, packed=True)
    results = {}
    for impl in ("xla", "dot_product"):
        net = build_model(tiny_config(model, attention=impl, base_num_decoder_layers=2))
        assert _implementations(net) == {impl}  # the key is read
        results[impl] = loss_and_grads(net, batch)
    assert_grad_parity(results["dot_product"], results["xla"], **MODEL_BOUNDS)


def _implementations(model: nnx.Module) -> set[str]:
    return {m.implementation for _, m in nnx.iter_graph(model) if isinstance(m, nnx.Module) and hasattr(m, "implementation")}


@pytest.mark.parametrize("model", ["gpt3-52k", "gemma3-tiny", "llama4-tiny", "qwen3-tiny"])
def test_every_family_reads_attention(model):
    """Every GQA family threads the key to its attention modules (llama4: chunked layers too);
    auto is xla on this CPU."""
    assert _implementations(abstract_model(tiny_config(model))) == {"xla"}
    assert _implementations(abstract_model(tiny_config(model, attention="dot_product"))) == {"dot_product"}


def test_auto_on_a_cuda_gpu_resolves_per_layer(monkeypatch):
    """Built as on a CUDA GPU (construction only, nothing runs): Llama 4's chunked layers stay
    xla, its NoPE (global) layers get cudnn."""
    monkeypatch.setattr(attention, "attention_backend", lambda: "gpu")
    model = abstract_model(tiny_config("llama4-tiny", dtype="bfloat16", weight_dtype="bfloat16"))
    chosen = {(m.chunk_size > 0, m.implementation) for _, m in nnx.iter_graph(model) if isinstance(m, attention.Attention)}
    assert chosen == {(True, "xla"), (False, "cudnn")}


GPU_BF16 = ("gpu", "bfloat16", 64)


@pytest.mark.parametrize(
    "value, backend, dtype, head_dim, flags, expected",
    [
        ("auto", "cpu", "bfloat16", 64, {}, "xla"),
        ("auto", "tpu", "bfloat16", 64, {}, "splash"),
        ("auto", "rocm", "bfloat16", 64, {}, "xla"),
        ("auto", *GPU_BF16, {}, "cudnn"),
        ("auto", "gpu", "float16", 128, {}, "cudnn"),
        ("auto", "gpu", "float32", 64, {}, "xla"),  # cuDNN flash has no float32 kernel
        ("auto", "gpu", "bfloat16", 256, {}, "xla"),  # head_dim > 128 needs Hopper: auto stays safe
        ("auto", "gpu", "bfloat16", 20, {}, "xla"),  # not a multiple of 8
        ("auto", *GPU_BF16, {"chunked": True}, "xla"),
        ("auto", *GPU_BF16, {"sequence_sharded": True}, "xla"),
        ("xla", *GPU_BF16, {}, "xla"),
        ("dot_product", "cpu", "float32", 64, {}, "dot_product"),
        ("dot_product", "tpu", "bfloat16", 64, {}, "dot_product"),
        ("dot_product", "gpu", "float32", 64, {"chunked": True}, "dot_product"),
        ("cudnn", *GPU_BF16, {}, "cudnn"),
        ("cudnn", "gpu", "bfloat16", 256, {}, "cudnn"),  # explicit: the user vouches for a Hopper GPU
    ],
)
def test_resolve_attention(value, backend, dtype, head_dim, flags, expected):
    assert resolve_attention(value, backend, dtype, head_dim, **flags) == expected


@pytest.mark.parametrize(
    "backend, dtype, head_dim, flags, message",
    [
        ("cpu", "bfloat16", 64, {}, "attention=cudnn needs a CUDA GPU; this backend is cpu"),
        ("tpu", "bfloat16", 64, {}, "this backend is tpu"),
        ("rocm", "bfloat16", 64, {}, "this backend is rocm"),
        ("gpu", "float32", 64, {}, "attention=cudnn needs dtype=bfloat16"),
        ("gpu", "bfloat16", 264, {}, "attention=cudnn needs head_dim a multiple of 8 and at most 256"),
        ("gpu", "bfloat16", 60, {}, "multiple of 8"),
        ("gpu", "bfloat16", 64, {"chunked": True}, "attention=cudnn cannot express chunked attention"),
        ("gpu", "bfloat16", 64, {"sequence_sharded": True}, "attention=cudnn cannot shard queries over the sequence"),
    ],
)
def test_explicit_cudnn_that_cannot_run_raises(backend, dtype, head_dim, flags, message):
    with pytest.raises(ConfigError, match=message):
        resolve_attention("cudnn", backend, dtype, head_dim, **flags)


def test_cudnn_on_this_cpu_fails_at_model_build_naming_the_key():
    cfg = tiny_config(attention="cudnn", dtype="bfloat16", weight_dtype="bfloat16")  # loads: valid on a GPU
    with pytest.raises(ConfigError, match="^attention=cudnn needs a CUDA GPU; this backend is cpu; use attention=auto"):
        build_model(cfg)


@pytest.mark.parametrize(
    "model, overrides, message",
    [
        ("deepseek3-tiny", {"attention": "dot_product"}, "attention=dot_product supports attention_type=global only"),
        ("deepseek3-tiny", {"attention": "cudnn", "dtype": "bfloat16"}, "attention_type=global only"),
        ("deepseek4-tiny", {"attention": "dot_product"}, "attention_type=global only"),
        ("llama3.1-tiny", {"attention": "cudnn"}, "attention=cudnn needs dtype=bfloat16"),
        ("llama4-tiny", {"attention": "cudnn", "dtype": "bfloat16"}, "attention=cudnn cannot express chunked"),
        ("llama3.1-tiny", {"attention": "cudnn", "dtype": "bfloat16", "ici_context_parallelism": 2}, "cannot shard"),
        ("llama3.1-tiny", {"attention": "flash"}, "config key 'attention'"),
    ],
)
def test_config_rejects_what_no_backend_can_run(model, overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(values={"model_name": model, **overrides})


@pytest.mark.parametrize("model", ["deepseek3-tiny", "llama4-tiny", "gpt3-52k"])
def test_auto_and_xla_load_for_every_attention_type(model):
    assert load_config(values={"model_name": model}).attention == "auto"
    load_config(values={"model_name": model, "attention": "xla"})


def test_attention_sinks_run_on_the_einsum_path_only():
    """GPT-OSS's sinks (attention_sink) exist on the xla einsum path (and the KV cache's): auto is xla on every
    backend; an explicit kernel, ring attention or a direct call with sinks is refused naming the key."""
    for backend in ("cpu", "tpu", "gpu"):
        assert resolve_attention("auto", backend, "bfloat16", 64, sinks=True) == "xla"
    for value in ("dot_product", "cudnn", "splash"):
        with pytest.raises(ConfigError, match=f"attention={value} cannot apply attention sinks"):
            resolve_attention(value, "tpu", "bfloat16", 64, sinks=True)
        with pytest.raises(ConfigError, match=f"attention={value} cannot apply attention sinks"):
            load_config(overrides=["model_name=gpt-oss-tiny", f"attention={value}"])
    with pytest.raises(ConfigError, match="ring attention .* cannot apply attention sinks"):
        load_config(overrides=["model_name=gpt-oss-tiny", "ici_context_parallelism=2", "context_parallel_strategy=ring"])
    q = jnp.ones((1, 4, 2, 8))
    with pytest.raises(ConfigError, match="attention=dot_product cannot apply attention sinks"):
        attend(q, q, q, jnp.ones((1, 4), jnp.int32), scale=1.0, sliding_window=0, dtype=jnp.float32,
               implementation="dot_product", sinks=jnp.zeros((2,)))  # fmt: skip
