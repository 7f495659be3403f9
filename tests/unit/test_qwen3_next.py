"""Qwen3-Next (decoder_block=qwen3_next): what the HF goldens cannot show. Packed documents are computed as
if alone (the Gated DeltaNet's state and conv restart at a segment boundary); a decoding state carried over
equals the whole run, padding leaving it alone; the combinations nnxtron does not run are refused by name. HF parity: tests/parity/test_hf_golden.py (qwen3_next), tests/unit/test_hf_roundtrip.py."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from nnxtron.errors import ConfigError
from nnxtron.infer.cache import attach_caches
from nnxtron.infer.decode import unrolled
from nnxtron.infer.paging import Paging
from nnxtron.layers.gated_deltanet import causal_conv, gated_delta_rule
from nnxtron.models.build import build_model
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
        (dict(ici_pipeline_parallelism=2), "pipeline parallelism"),
        (dict(ici_context_parallelism=2), "ici_context_parallelism=1"),
        (dict(use_qwix_quantization=True, quantization="int8"), "use_qwix_quantization=false"),
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
    from nnxtron.models.build import abstract_model
    from nnxtron.params import flatten

    cfg = tiny_config(MODEL, scan_layers=False)
    params = flatten(nnx.state(abstract_model(cfg), nnx.Param))

    def kernels(layer: str) -> int:
        return sum(v.size for k, v in params.items() if k.startswith(f"{layer}/attention/") and k.endswith("/kernel"))

    assert kernels("layers/layers/0/cycle/1") == flops._attention_params(cfg)[0]  # full (gated) attention
    assert kernels("layers/layers/0/cycle/0") == flops._linear_attention(cfg)[0]  # Gated DeltaNet
