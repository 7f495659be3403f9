"""Qwen3-Next (decoder_block=qwen3_next): what the HF goldens cannot show. Packed documents are computed as
if alone (the Gated DeltaNet's state and conv restart at a segment boundary); a decoding state carried over
equals the whole run, padding leaving it alone; the combinations nnxtron does not run are refused by name. HF parity: tests/parity/test_hf_golden.py (qwen3_next), tests/unit/test_hf_roundtrip.py."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from nnxtron.errors import ConfigError
from nnxtron.infer.cache import attach_caches
from nnxtron.infer.decode import unrolled
from nnxtron.infer.paging import Paging
from nnxtron.layers.gated_deltanet import causal_conv, chunked_gated_delta_rule, gated_delta_rule
from nnxtron.models.build import build_model
from tests.conftest import sub_jaxprs
from tests.helpers import tiny_config

MODEL = "qwen3-next-tiny"


def test_packed_documents_equal_each_document_alone():
    """Two documents in one row (segments 1, 2; positions restart) give each one's logits run alone: the recurrence
    and the causal conv do not carry across the boundary (HF has no packing; per document it is HF's function)."""
    model = build_model(tiny_config(MODEL, base_num_decoder_layers=2), seed=0)  # one DeltaNet layer, one full
    rng = np.random.default_rng(0)
    first, second = rng.integers(3, 256, size=12), rng.integers(3, 256, size=12)  # one length: one compile
    packed = model(
        jnp.asarray(np.concatenate([first, second])[None]),
        jnp.asarray(np.concatenate([np.arange(12), np.arange(12)])[None]),
        jnp.asarray(np.array([1] * 12 + [2] * 12)[None]),
    ).logits[0]
    alone = model(jnp.asarray(np.stack([first, second]))).logits
    np.testing.assert_allclose(packed, jnp.concatenate(list(alone)), atol=2e-6, rtol=0)  # measured 0.0


def test_the_recurrence_restarts_and_the_conv_stops_at_a_segment_boundary():
    """At the layer level: after a boundary the outputs equal those of a fresh sequence (and differ without it)."""
    rng = np.random.default_rng(1)
    q, k = (jnp.asarray(rng.normal(size=(1, 9, 2, 4)), jnp.float32) for _ in range(2))
    v = jnp.asarray(rng.normal(size=(1, 9, 2, 3)), jnp.float32)
    g, beta = jnp.asarray(-rng.uniform(0.01, 0.3, size=(1, 9, 2)), jnp.float32), jnp.full((1, 9, 2), 0.7)
    restart = jnp.zeros((1, 9), bool).at[0, 5].set(True)
    out, _ = gated_delta_rule(q, k, v, g, beta, restart)
    fresh, _ = gated_delta_rule(q[:, 5:], k[:, 5:], v[:, 5:], g[:, 5:], beta[:, 5:], jnp.zeros((1, 4), bool))
    np.testing.assert_allclose(out[:, 5:], fresh, atol=1e-6)
    carried, _ = gated_delta_rule(q, k, v, g, beta, jnp.zeros((1, 9), bool))
    assert float(jnp.abs(carried[:, 5:] - fresh).max()) > 1e-2
    # decoding: the state after the first 5 tokens, then the rest from it = the whole run; padding changes nothing
    head, state = gated_delta_rule(q[:, :5], k[:, :5], v[:, :5], g[:, :5], beta[:, :5], jnp.zeros((1, 5), bool))
    keep = jnp.ones((1, 4), bool).at[0, 1].set(False)
    rest, _ = gated_delta_rule(q[:, 5:], k[:, 5:], v[:, 5:], g[:, 5:], beta[:, 5:], jnp.zeros((1, 4), bool), state, keep)
    kept = np.array([5, 7, 8])  # token 6 is padding
    unpadded, _ = gated_delta_rule(q[:, kept], k[:, kept], v[:, kept], g[:, kept], beta[:, kept], jnp.zeros((1, 3), bool), state)
    np.testing.assert_allclose(rest[:, 2:], unpadded[:, 1:], atol=1e-6)
    np.testing.assert_allclose(jnp.concatenate([head, rest[:, :1]], 1), carried[:, :6], atol=1e-6)  # no padding yet
    x, kernel = jnp.asarray(rng.normal(size=(1, 9, 5)), jnp.float32), jnp.asarray(rng.normal(size=(5, 4)), jnp.float32)
    segments = jnp.asarray([[1] * 5 + [2] * 4])
    np.testing.assert_allclose(causal_conv(x, kernel, segments)[:, 5:], causal_conv(x[:, 5:], kernel, segments[:, 5:]), atol=1e-6)


@pytest.mark.parametrize(
    "overrides, match",
    [
        (dict(ici_context_parallelism=2), "ici_context_parallelism=1"),
        (dict(mtp_num_layers=1), "mtp_num_layers"),
        (dict(inhomogeneous_layer_cycle_interval=0), "inhomogeneous_layer_cycle_interval"),
        (dict(shared_experts=0), "shared_experts >= 1"),
        (dict(use_qk_norm=False), "use_qk_norm=true"),
        (dict(gdn_num_value_heads=3), "multiple of gdn_num_key_heads"),
        (dict(partial_rotary_factor=0.375), "must be even"),
        (dict(sliding_window_size=8), "sliding_window_size=0"),
    ],
)
def test_unsupported_combinations_are_refused_by_name(overrides, match):
    with pytest.raises(ConfigError, match=match):
        tiny_config(MODEL, **overrides)


def test_its_keys_are_refused_on_other_families():
    with pytest.raises(ConfigError, match="gdn_conv_kernel_dim is read by decoder_block=qwen3_next/qwen3_5 only"):
        tiny_config("qwen3-tiny", gdn_conv_kernel_dim=2)
    with pytest.raises(ConfigError, match="partial_rotary_factor is read by decoder_block=qwen3_next/qwen3_5 only"):
        tiny_config("qwen3-tiny", partial_rotary_factor=0.5)


def test_paged_decoding_caches_are_refused():
    """The DeltaNet's recurrent state is not per-token entries: paged caches (serve's engine) refuse it by name."""
    model = unrolled(build_model(tiny_config(MODEL, base_num_decoder_layers=2), seed=0))
    with pytest.raises(ConfigError, match="decoder_block=qwen3_next: its recurrent decoding state cannot live in paged"):
        attach_caches(model, 2, 32, Paging())


def test_the_flop_count_counts_each_mixer_s_weights():
    """config/flops.py's matmul weights per layer are the model's: the gated attention's query kernel holds the
    output gate's half too (``FamilyRules.query_gate``), the DeltaNet its qkvz / ba projections and out."""
    from flax import nnx

    from nnxtron.config import flops
    from nnxtron.config.layout import LayerKind
    from nnxtron.models.build import abstract_model
    from nnxtron.params import flatten

    cfg = tiny_config(MODEL, scan_layers=False)
    params = flatten(nnx.state(abstract_model(cfg), nnx.Param))

    def kernels(layer: str) -> int:
        return sum(v.size for k, v in params.items() if k.startswith(f"{layer}/attention/") and k.endswith("/kernel"))

    assert kernels("layers/layers/0/cycle/1") == flops._attention_params(cfg, LayerKind(moe=True))[0]  # full (gated) attention
    assert kernels("layers/layers/0/cycle/0") == flops._linear_attention(cfg)[0]  # Gated DeltaNet


def _delta_rule_inputs(seq: int, seed: int = 2) -> tuple:
    rng = np.random.default_rng(seed)
    q, k = (jnp.asarray(rng.normal(size=(2, seq, 3, 5)), jnp.float32) for _ in range(2))
    v = jnp.asarray(rng.normal(size=(2, seq, 3, 4)), jnp.float32)
    g = jnp.asarray(-rng.uniform(0.01, 2.0, size=(2, seq, 3)), jnp.float32)
    beta = jnp.asarray(rng.uniform(0.0, 1.0, size=(2, seq, 3)), jnp.float32)
    restart = jnp.asarray(rng.uniform(size=(2, seq)) < 0.1).at[:, 9].set(True)  # one inside the first chunk of 8
    keep = jnp.asarray(rng.uniform(size=(2, seq)) < 0.8)
    state = jnp.asarray(rng.normal(size=(2, 3, 5, 4)), jnp.float32)
    return q, k, v, g, beta, restart, keep, state


@pytest.mark.parametrize("chunk_size", [8, 64])  # chunks that do not divide 37 (a restart inside the first), one chunk
def test_the_chunked_delta_rule_is_the_recurrence(chunk_size):
    """chunked_gated_delta_rule (what the layer runs) = gated_delta_rule (token by token, the definition): outputs,
    final state and the gradients of every input, with restarts inside chunks, and with a carried state and padding
    (``keep``: the outputs of kept tokens; a padding token's output is never read)."""
    q, k, v, g, beta, restart, keep, state = _delta_rule_inputs(37)
    chunked_rule = functools.partial(chunked_gated_delta_rule, chunk_size=chunk_size)

    @jax.jit
    def both(q, k, v, g, beta, restart, state, keep):
        def loss(rule, *args):
            return jnp.sum(rule(*args, restart)[0] ** 2)

        plain = (rule(q, k, v, g, beta, restart) for rule in (gated_delta_rule, chunked_rule))
        carried = (rule(q, k, v, g, beta, restart, state, keep) for rule in (gated_delta_rule, chunked_rule))
        grads = (
            jax.grad(functools.partial(loss, rule), argnums=range(5))(q, k, v, g, beta)
            for rule in (gated_delta_rule, chunked_rule)
        )
        return tuple(plain), tuple(carried), tuple(grads)

    ((out, final), (chunked, chunked_final)), ((c_out, c_final), (c_chunked, c_chunked_final)), grads = both(
        q, k, v, g, beta, restart, state, keep
    )
    np.testing.assert_allclose(chunked, out, atol=2e-6)  # measured 6e-7 at 64
    np.testing.assert_allclose(chunked_final, final, atol=5e-6)
    np.testing.assert_allclose(jnp.where(keep[..., None, None], c_chunked - c_out, 0.0), 0.0, atol=2e-6)
    np.testing.assert_allclose(c_chunked_final, c_final, atol=5e-6)
    for name, want, got in zip("q k v g beta".split(), *grads):
        np.testing.assert_allclose(got, want, atol=2e-5, rtol=1e-5, err_msg=name)  # measured 6e-7


def test_the_chunked_backward_keeps_a_state_per_chunk_not_per_token():
    """The memory the chunked form exists for: the compiled gradient of 512 tokens keeps far less than the
    token-by-token scan, which saves one [B, H, dk, dv] float32 state per token (here 512 x 16 KiB = 8 MiB)."""
    rng = np.random.default_rng(3)
    q, k, v = (jnp.asarray(rng.normal(size=(1, 512, 4, 32)), jnp.float32) for _ in range(3))
    g, beta = jnp.full((1, 512, 4), -0.1), jnp.full((1, 512, 4), 0.5)
    restart = jnp.zeros((1, 512), bool)

    def temporaries(rule) -> int:
        grad = jax.jit(jax.grad(lambda q: jnp.sum(rule(q, k, v, g, beta, restart)[0])))
        return grad.lower(q).compile().memory_analysis().temp_size_in_bytes

    per_token, per_chunk = temporaries(gated_delta_rule), temporaries(chunked_gated_delta_rule)
    assert per_token > 512 * 4 * 32 * 32 * 4 and per_chunk < per_token / 3, (per_token, per_chunk)


def test_the_chunked_delta_rule_multiplies_at_highest_precision():
    """Every product of the chunked rule, forward and backward, asks for ``Precision.HIGHEST``: at a TPU's default
    (bfloat16 passes) its output was 5e-3 off the token-by-token rule, at highest 2.2e-6
    (benchmarks/results/delta_rule-TPU_v5_lite.json). On CPU both are exact float32, so only the program shows it."""
    x, g, beta = jnp.ones((1, 16, 2, 4)), jnp.full((1, 16, 2), -0.1), jnp.full((1, 16, 2), 0.5)
    restart = jnp.zeros((1, 16), bool)
    grad = jax.grad(lambda q: jnp.sum(chunked_gated_delta_rule(q, x, x, g, beta, restart, chunk_size=8)[0]))
    precisions = []

    def walk(jaxpr) -> None:
        for eqn in getattr(jaxpr, "jaxpr", jaxpr).eqns:
            if eqn.primitive.name == "dot_general":
                precisions.append(eqn.params["precision"])
            for sub in sub_jaxprs(eqn):
                walk(sub)

    walk(jax.make_jaxpr(grad)(x))
    highest = (jax.lax.Precision.HIGHEST, jax.lax.Precision.HIGHEST)
    assert len(precisions) >= 8 and all(p == highest for p in precisions), precisions
