"""``attention_bias`` (MaxText's key): biased query/key/value projections, and the output one except for
Qwen2; refused where attention has no such projections; its HF and MaxText names."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from nnxtron.convert.maxtext import from_maxtext, to_maxtext
from nnxtron.errors import ConfigError
from nnxtron.layers.lora import merge_adapters
from nnxtron.models.build import abstract_model, build_model
from nnxtron.models.hf_common import common_config_from_hf
from nnxtron.models.registry import family_for
from nnxtron.params import flatten
from tests.conftest import tiny_config

HF_LLAMA = dict(
    model_type="llama",
    hidden_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=96,
    num_hidden_layers=2,
    vocab_size=256,
)


def _biases(cfg) -> set[str]:
    params = flatten(nnx.to_pure_dict(nnx.state(abstract_model(cfg), nnx.Param)))
    return {k.split("/attention/")[1] for k in params if k.endswith("/bias") and "/attention/" in k}


def test_qwen2_biases_query_key_value_only():
    assert _biases(tiny_config("qwen2-tiny")) == {"query/bias", "key/bias", "value/bias"}
    assert _biases(tiny_config("qwen2-tiny", attention_bias=False)) == set()


@pytest.mark.parametrize("model", ["llama3.1-tiny", "gemma3-tiny", "llama4-tiny", "mixtral-tiny"])
def test_other_gqa_families_bias_the_output_too(model):
    """MaxText's rule: attention_bias biases q, k, v and out (decoder_block qwen2 excepted)."""
    assert _biases(tiny_config(model)) == set()
    assert _biases(tiny_config(model, attention_bias=True)) == {"query/bias", "key/bias", "value/bias", "out/bias"}


@pytest.mark.parametrize("model", ["deepseek3-test", "gpt3-52k", "deepseek4-test"])
def test_attention_without_those_projections_refuses_it(model):
    with pytest.raises(ConfigError, match="attention_bias"):
        tiny_config(model, attention_bias=True)


def test_the_bias_is_added():
    """The same weights with non-zero q/k/v biases compute other logits; zeroed, the same as unbiased."""
    cfg = tiny_config("qwen2-tiny")
    model = build_model(cfg)
    tokens = jnp.asarray(np.arange(24, dtype=np.int32).reshape(2, 12) % cfg.vocab_size)
    before = np.asarray(model(tokens).logits)
    plain = build_model(tiny_config("qwen2-tiny", attention_bias=False))
    np.testing.assert_array_equal(np.asarray(plain(tokens).logits), before)  # biases start at zero
    for name in ("query", "key", "value"):
        linear = getattr(model.layers.layers.attention, name)
        linear.bias[...] = jax.random.normal(jax.random.key(1), linear.bias[...].shape) * 0.5
    assert np.abs(np.asarray(model(tokens).logits) - before).max() > 1e-3


def test_hf_attention_bias_is_read_for_qwen2_only():
    with pytest.raises(ConfigError, match="attention_bias=true is not supported by decoder_block llama2"):
        common_config_from_hf({**HF_LLAMA, "attention_bias": True}, "llama2")
    values = family_for("qwen2").config_from_hf({**HF_LLAMA, "model_type": "qwen2", "sliding_window": 4096})
    assert values["attention_bias"] is True and values["sliding_window_size"] == 0
    with pytest.raises(ConfigError, match="use_sliding_window"):
        family_for("qwen2").config_from_hf({**HF_LLAMA, "model_type": "qwen2", "use_sliding_window": True})


def test_hf_export_needs_the_hf_classes_biases():
    with pytest.raises(ConfigError, match="export needs attention_bias=false"):
        family_for("llama2").config_to_hf(tiny_config("llama3.1-tiny", attention_bias=True))
    with pytest.raises(ConfigError, match="export needs attention_bias=true"):
        family_for("qwen2").config_to_hf(tiny_config("qwen2-tiny", attention_bias=False))
    hf = family_for("qwen2").config_to_hf(tiny_config("qwen2-tiny"))
    assert hf["architectures"] == ["Qwen2ForCausalLM"] and "attention_bias" not in hf


@pytest.mark.parametrize("scanned", [True, False])
def test_maxtext_names_and_round_trip(scanned):
    """MaxText's Qwen2 layer holds self_attention/{query,key,value}/bias, no out/bias; the tree
    converts back to the same parameters."""
    cfg = tiny_config("qwen2-tiny")
    params = nnx.to_pure_dict(nnx.state(build_model(cfg), nnx.Param))
    flat = to_maxtext(params, cfg, scanned=scanned)
    biases = sorted(k.rsplit("/", 2)[-2] for k in flat if k.endswith("/bias") and "/layers" in k)
    assert set(biases) == {"query", "key", "value"}
    back, _ = from_maxtext(flat, cfg)
    assert {k: np.asarray(v).tobytes() for k, v in flatten(back).items()} == {
        k: np.asarray(v).tobytes() for k, v in flatten(params).items()
    }


def test_lora_adapts_a_biased_projection():
    """A LoRA adapter beside a biased Linear: the bias stays (frozen, not merged), the adapter starts at
    zero (the same logits as without it) and then adds x @ A @ B on top of kernel and bias; merging the
    adapters into the kernels keeps that function."""
    plain = build_model(tiny_config("qwen2-tiny"))
    model = build_model(tiny_config("qwen2-tiny", lora_rank=4))
    query = model.layers.layers.attention.query
    assert query.use_bias and query.lora_scale
    tokens = jnp.asarray(np.arange(24, dtype=np.int32).reshape(2, 12) % 256)
    for name in ("query", "key", "value"):
        for m in (plain, model):
            linear = getattr(m.layers.layers.attention, name)
            linear.bias[...] = jax.random.normal(jax.random.key(3), linear.bias[...].shape)
    np.testing.assert_array_equal(np.asarray(model(tokens).logits), np.asarray(plain(tokens).logits))
    query.lora_b[...] = jax.random.normal(jax.random.key(4), query.lora_b[...].shape) * 0.1
    adapted = np.asarray(model(tokens).logits)
    assert np.abs(adapted - np.asarray(plain(tokens).logits)).max() > 1e-4
    merged = merge_adapters(nnx.to_pure_dict(nnx.state(model)), query.lora_scale)
    assert "bias" in merged["layers"]["layers"]["attention"]["query"]
    nnx.update(plain, merged)
    np.testing.assert_allclose(np.asarray(plain(tokens).logits), adapted, atol=1e-5)
