"""Layer patterns: every layer's kind, the grouping into scanned cycle blocks + remainder,
and the model's parameter layout. Numerical parity lives in tests/parity (goldens,
scan vs unrolled)."""

from __future__ import annotations

import pytest
from flax import nnx

from nnxtron.config.layout import LayerKind, layer_kind
from nnxtron.config.stacks import layer_stacks
from nnxtron.errors import ConfigError
from nnxtron.models.build import abstract_model
from nnxtron.params import flatten
from tests.conftest import tiny_config

SLIDING, GLOBAL = LayerKind(attention="sliding"), LayerKind(attention="global")


def _layers_in_order(cfg) -> list[tuple[int, LayerKind]]:
    """(model layer, kind) of every layer the stacks hold, in application order."""
    out = []
    for stack in layer_stacks(cfg):
        for block in range(stack.num_layers):
            out += [(stack.hf_layer(block, j), kind) for j, kind in enumerate(stack.kinds)]
    return out


@pytest.mark.parametrize(
    "model, stacks",
    [
        ("gemma3-4b", [("layers", 5, 6), ("remainder_layers", 1, 4)]),  # 34 = 5 x 6 + 4
        ("gemma3-12b", [("layers", 8, 6)]),
        ("gemma3-27b", [("layers", 10, 6), ("remainder_layers", 1, 2)]),
        ("gemma3-tiny", [("layers", 1, 6), ("remainder_layers", 1, 2)]),
        ("llama4-17b-16e", [("layers", 12, 4)]),
        ("llama4-17b-128e", [("layers", 12, 4)]),
        ("llama4-tiny", [("layers", 2, 4)]),
        ("deepseek3-671b", [("dense_layers", 3, 1), ("moe_layers", 58, 1)]),
        ("gpt3-175b", [("layers", 96, 1)]),
        ("llama3.1-8b", [("layers", 32, 1)]),
        ("deepseek4-284b", [("hash_layers", 1, 3), ("layers", 20, 2)]),  # 3 hash layers, 20 x (HCA, CSA)
        ("deepseek4-test", [("hash_layers", 1, 2), ("layers", 1, 2), ("remainder_layers", 1, 1)]),
    ],
)
def test_stacks_hold_every_layer_once_in_order(model, stacks):
    cfg = tiny_config(model)
    assert [(s.name, s.num_layers, s.layers_per_block) for s in layer_stacks(cfg)] == stacks
    layers = _layers_in_order(cfg)
    assert [i for i, _ in layers] == list(range(cfg.base_num_decoder_layers))
    assert all(kind == layer_kind(cfg, i) for i, kind in layers)


def test_gemma3_pattern_is_five_sliding_then_global():
    cfg = tiny_config("gemma3-27b")
    kinds = [layer_kind(cfg, i) for i in range(cfg.base_num_decoder_layers)]
    assert kinds[:12] == [SLIDING] * 5 + [GLOBAL] + [SLIDING] * 5 + [GLOBAL]
    assert kinds[60:] == [SLIDING, SLIDING]  # the remainder (layers 60, 61) is sliding


def test_llama4_kinds():
    scout, maverick = tiny_config("llama4-17b-16e"), tiny_config("llama4-17b-128e")
    chunked_moe = LayerKind(moe=True, attention="chunked")
    nope_moe = LayerKind(moe=True, attention="global", rope=False)
    assert [layer_kind(scout, i) for i in range(4)] == [chunked_moe] * 3 + [nope_moe]
    assert [layer_kind(maverick, i) for i in range(4)] == [
        LayerKind(attention="chunked"),
        chunked_moe,
        LayerKind(attention="chunked"),
        nope_moe,
    ]


def test_remainder_and_longer_cycles():
    six = tiny_config("llama4-tiny", base_num_decoder_layers=6)
    assert [(s.name, s.num_layers, s.layers_per_block) for s in layer_stacks(six)] == [
        ("layers", 1, 4),
        ("remainder_layers", 1, 2),
    ]
    eight = tiny_config("llama4-tiny", inhomogeneous_layer_cycle_interval=8)
    assert [(s.name, s.num_layers, s.layers_per_block) for s in layer_stacks(eight)] == [("layers", 1, 8)]
    assert [i for i, _ in _layers_in_order(eight)] == list(range(8))


def test_parameter_paths_name_stack_block_and_position():
    keys = flatten(nnx.state(abstract_model(tiny_config("gemma3-tiny")), nnx.Param))
    assert "layers/layers/cycle/5/attention/query_norm/scale" in keys  # the global layer of the pattern block
    assert "remainder_layers/layers/cycle/1/post_ffw_norm/scale" in keys
    assert keys["layers/layers/cycle/0/attention/query/kernel"].shape == (1, 64, 4, 16)  # one pattern block
    unrolled = flatten(nnx.state(abstract_model(tiny_config("gemma3-tiny", scan_layers=False)), nnx.Param))
    assert "remainder_layers/layers/0/cycle/1/mlp/wo/kernel" in unrolled


def test_llama4_blocks_differ_by_kind():
    keys = flatten(nnx.state(abstract_model(tiny_config("llama4-tiny")), nnx.Param))
    assert "layers/layers/cycle/0/mlp/wi_0/kernel" in keys  # dense
    assert keys["layers/layers/cycle/1/mlp/wi_0"].shape == (2, 4, 64, 48)  # MoE: [blocks, E, D, F]
    assert "layers/layers/cycle/3/mlp/shared/wo/kernel" in keys


@pytest.mark.parametrize(
    "overrides, fragment",
    [
        (dict(model_name="llama4-tiny", inhomogeneous_layer_cycle_interval=6), "does not fit the layer pattern"),
        (dict(model_name="gemma3-tiny", sliding_window_size=0), "set sliding_window_size > 0"),
        (dict(model_name="gemma3-tiny", sliding_window_size=100_000), "larger than max_position_embeddings"),
        (dict(model_name="llama4-tiny", chunk_attn_window_size=100_000), "larger than max_position_embeddings"),
        (dict(model_name="llama4-tiny", nope_layer_interval=0), "temperature_tuning"),
        (dict(model_name="gpt3-52k", max_target_length=4096), "trainable_position_size=2048 is smaller"),
        (dict(model_name="llama3.1-tiny", interleave_moe_layer_step=2), "needs num_experts > 1"),
        (dict(model_name="gemma3-tiny", chunk_attn_window_size=4), "cannot be combined"),
        (dict(model_name="deepseek4-test", compress_ratios=(0, 4, 8)), "compress_ratios has 3 entries"),
        (dict(model_name="deepseek4-test", compress_ratios=(0, 4, 8, 4, 16)), "entries [16] are not supported"),
        (dict(model_name="deepseek4-test", first_num_hash_layers=9), "exceeds base_num_decoder_layers"),
        (dict(model_name="deepseek4-test", mtp_num_layers=1), "HF drops its MTP layer"),
        (dict(model_name="llama3.1-tiny", mhc_expansion_rate=4), "read by decoder_block=deepseek4 only"),
        (dict(model_name="deepseek4-test", inhomogeneous_layer_cycle_interval=3), "does not fit the layer pattern"),
    ],
)
def test_bad_pattern_configs_name_the_key(overrides, fragment):
    with pytest.raises(ConfigError) as err:
        tiny_config(**overrides)
    assert fragment in str(err.value)


def test_deepseek4_kinds_follow_compress_ratios():
    cfg = tiny_config("deepseek4-284b")
    kinds = [layer_kind(cfg, i) for i in range(cfg.base_num_decoder_layers)]
    assert [k.attention for k in kinds[:6]] == ["sliding", "sliding", "csa", "hca", "csa", "hca"]
    assert [k.hash for k in kinds[:4]] == [True, True, True, False] and all(k.moe for k in kinds)
    assert kinds[-1].attention == "csa"
