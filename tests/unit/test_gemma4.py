"""Gemma 4's text decoder (decoder_block=gemma4): what the HF golden cannot show. Its proportional RoPE is HF's
frequencies; a global layer without value weights computes the layer whose values are its keys' projection; its FLOP
count is its parameters'; its HF config maps (the hub's form and transformers' ``per_layer_config``); the
combinations nnxtron does not run are refused by name. HF parity: tests/parity/test_hf_golden.py (gemma4),
tests/unit/test_hf_roundtrip.py, tests/parity/test_kv_cache.py; MaxText: tests/unit/test_maxtext_checkpoint.py."""

from __future__ import annotations

import json
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from nnxtron.config.flops import _attention_params, _ffn_params
from nnxtron.config.layout import layer_kinds
from nnxtron.convert.hf import hf_config_to_nnxtron
from nnxtron.errors import ConfigError
from nnxtron.layers.attention import Attention
from nnxtron.layers.rope import RopeSpec, inverse_frequencies
from nnxtron.models import gemma4_hf
from nnxtron.models.build import abstract_model
from nnxtron.params import flatten
from tests.helpers import tiny_config

MODEL = "gemma4-tiny"
GOLDEN = Path(__file__).resolve().parents[1] / "assets" / "golden" / "gemma4"


def test_proportional_rope_frequencies_are_hfs():
    """HF's proportional RoPE (transformers 5.25, the golden's global layer: head_dim 16, 0.25, theta 1e6) keeps
    ``int(0.25 * 16 // 2)`` = 2 frequencies over the whole width's exponents, the rest 0; Gemma 4 26B's global layers
    (512 wide) rotate 64 of 256 pairs."""
    hf = np.array([1.0, 0.17782793939113617, 0, 0, 0, 0, 0, 0], np.float32)  # rotary_emb.full_attention_inv_freq
    np.testing.assert_array_equal(inverse_frequencies(RopeSpec(head_dim=16, theta=1e6, proportion=0.25)), hf)
    wide = inverse_frequencies(RopeSpec(head_dim=512, theta=1e6, proportion=0.25))
    plain = inverse_frequencies(RopeSpec(head_dim=512, theta=1e6))
    assert np.array_equal(wide[:64], plain[:64]) and not wide[64:].any()


def test_values_of_the_key_projection_are_attention_with_a_value_kernel_equal_to_the_key():
    """``share_kv_projections`` (HF ``attention_k_eq_v``): no value weights, the values are the key projection (before
    the key norm and RoPE), normed without a weight; the same as attention whose value kernel is the key kernel."""
    kw = dict(qk_norm="rms", scale=1.0, value_norm=True, dtype=jnp.float32, weight_dtype=jnp.float32)
    rope = RopeSpec(head_dim=16, theta=1e6, proportion=0.25)
    with nnx.use_eager_sharding(False):
        shared = Attention(32, 4, 1, 16, rope, shared_kv=True, rngs=nnx.Rngs(0), **kw)
        separate = Attention(32, 4, 1, 16, rope, rngs=nnx.Rngs(0), **kw)
    assert not hasattr(shared, "value")
    rng = np.random.default_rng(0)
    for name in ("query", "key", "out"):
        getattr(separate, name).kernel[...] = getattr(shared, name).kernel[...]
    shared.key_norm.scale[...] = jnp.asarray(1 + 0.3 * rng.standard_normal(16), jnp.float32)  # the key norm: keys only
    separate.key_norm.scale[...] = shared.key_norm.scale[...]
    separate.value.kernel[...] = shared.key.kernel[...]
    x = jnp.asarray(rng.standard_normal((2, 12, 32)), jnp.float32)
    positions, segments = jnp.broadcast_to(jnp.arange(12), (2, 12)), jnp.ones((2, 12), jnp.int32)
    want = separate(x, positions, segments)
    np.testing.assert_allclose(shared(x, positions, segments), want, atol=1e-6, rtol=0)
    separate.value_norm = False  # the value norm is read: without it another function
    assert float(jnp.abs(separate(x, positions, segments) - want).max()) > 1e-3


@pytest.mark.parametrize("experts", [1, 4])
def test_flops_count_the_models_matmul_weights(experts):
    """config/flops.py's matmul parameters of every layer (global layers of their own shape, no value kernel there;
    the MLP beside all experts, as with num_experts_per_tok = num_experts) are the model's matmul weights."""
    moe = dict(num_experts_per_tok=experts) if experts > 1 else dict(num_experts=1, shared_experts=0, num_experts_per_tok=1)
    cfg = tiny_config(MODEL, base_num_decoder_layers=4, **moe)
    weights = flatten(nnx.to_pure_dict(nnx.state(abstract_model(cfg), nnx.Param)))
    layers = [k for k in weights if k.startswith("layers/") and (k.endswith("kernel") or k.endswith(("wi_0", "wi_1", "wo")))]
    counted = sum(_attention_params(cfg, kind)[0] + _ffn_params(cfg, kind.moe) for kind in layer_kinds(cfg))
    assert counted == sum(int(np.prod(weights[k].shape)) for k in layers)


def test_hub_config_and_transformers_per_layer_config_import_alike(tmp_path):
    """Hub configs name global_head_dim / num_global_key_value_heads; transformers 5.25 writes per_layer_config (the
    golden's); both are the same model, and the export writes the hub's form."""
    golden = json.loads((GOLDEN / "config.json").read_text())
    assert "per_layer_config" in golden and "global_head_dim" not in golden
    hub = {k: v for k, v in golden.items() if k != "per_layer_config"}
    hub.update(global_head_dim=16, num_global_key_value_heads=1)
    (tmp_path / "config.json").write_text(json.dumps(hub))
    values = hf_config_to_nnxtron(tmp_path)
    assert values == hf_config_to_nnxtron(GOLDEN)
    assert (values["global_head_dim"], values["global_num_kv_heads"], values["share_kv_projections"]) == (16, 1, True)
    exported = gemma4_hf.config_to_hf(tiny_config(MODEL, base_num_decoder_layers=4))
    assert (exported["global_head_dim"], exported["num_global_key_value_heads"], exported["attention_k_eq_v"]) == (16, 1, True)
    assert exported["layer_types"] == ["sliding_attention", "full_attention"] * 2


@pytest.mark.parametrize(
    "change, fragment",
    [
        ({"hidden_size_per_layer_input": 256}, "Gemma 4 small"),
        ({"num_kv_shared_layers": 2}, "Gemma 4 small"),
        ({"use_bidirectional_attention": "all"}, "use_bidirectional_attention"),
        ({"layer_types": ["sliding_attention", "full_attention", "sliding_attention", "sliding_attention"]}, "layer_types"),
    ],
)
def test_hf_configs_nnxtron_does_not_build_are_refused(tmp_path, change, fragment):
    (tmp_path / "config.json").write_text(json.dumps({**json.loads((GOLDEN / "config.json").read_text()), **change}))
    with pytest.raises(ConfigError, match=fragment):
        hf_config_to_nnxtron(tmp_path)


@pytest.mark.parametrize(
    "overrides, fragment",
    [
        (dict(sliding_window_pattern=0), "sliding_window_pattern > 0"),
        (dict(query_pre_attn_scalar=8.0), "query_pre_attn_scalar=1"),
        (dict(shared_experts=2), "shared_experts=1"),
        (dict(rope_type="linear"), "rope_type=default"),
        (dict(ici_pipeline_parallelism=2, per_device_batch_size=2), "global_head_dim"),  # 1 cycle, 2 stages
    ],
)
def test_what_gemma4_does_not_run_is_refused_by_name(overrides, fragment):
    with pytest.raises(ConfigError, match=fragment):
        tiny_config(MODEL, **overrides)


def test_gemma4_keys_are_refused_elsewhere_and_the_export_refuses_what_hf_cannot_hold():
    with pytest.raises(ConfigError, match="global_head_dim is read by decoder_block=gemma4 only"):
        tiny_config("gemma3-tiny", global_head_dim=32)
    with pytest.raises(ConfigError, match="makes its last layer global"):
        gemma4_hf.config_to_hf(tiny_config(MODEL, base_num_decoder_layers=3))
    with pytest.raises(ConfigError, match="num_global_key_value_heads only with attention_k_eq_v"):
        gemma4_hf.config_to_hf(tiny_config(MODEL, share_kv_projections=False))
