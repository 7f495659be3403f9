"""The pipeline layout chosen for patterned models (config/pipeline_layout.py).

With the layout keys at their defaults, a main stack of cycle blocks (Gemma 3, Llama 4,
DeepSeek-V4) is pipelined one whole cycle per stage, the largest multiple of the stage
count of its blocks pipelined and the rest in ``unpipelined_layers``; too few cycles is
one clear error; explicit layout keys stay authoritative. Pure config arithmetic.
"""

from __future__ import annotations

import re

import pytest

from nnxtron.config import load_config
from nnxtron.config.layout import layer_kinds, pattern_stacks
from nnxtron.config.pipeline import pipeline_spec
from nnxtron.config.stacks import layer_stacks, pipeline_summary
from nnxtron.errors import ConfigError


def _cfg(model: str, stages: int, **values):
    return load_config(values={"model_name": model, "ici_pipeline_parallelism": stages, **values})


# model, extra values, stages -> (pipelined blocks, repeats, blocks in unpipelined_layers, layers per block)
RELEASES = [
    ("gemma3-4b", {}, 2, (4, 2, 1, 6)),  # 34 layers = 5 cycles + 4-layer remainder
    ("gemma3-4b", {}, 4, (4, 1, 1, 6)),
    ("gemma3-12b", {}, 2, (8, 4, 0, 6)),  # 48 layers = 8 cycles
    ("gemma3-12b", {}, 4, (8, 2, 0, 6)),
    ("gemma3-12b", {}, 8, (8, 1, 0, 6)),
    ("gemma3-27b", {}, 2, (10, 5, 0, 6)),  # 62 layers = 10 cycles + 2-layer remainder
    ("gemma3-27b", {}, 4, (8, 2, 2, 6)),
    ("gemma3-27b", {}, 8, (8, 1, 2, 6)),
    ("gemma3-tiny", {"base_num_decoder_layers": 20}, 2, (2, 1, 1, 6)),  # 3 cycles + 2-layer remainder
    ("llama4-17b-16e", {}, 2, (12, 6, 0, 4)),  # 48 layers = 12 cycles of 4
    ("llama4-17b-16e", {}, 4, (12, 3, 0, 4)),
    ("llama4-17b-16e", {}, 8, (8, 1, 4, 4)),
    ("llama4-17b-128e", {}, 2, (12, 6, 0, 4)),
    ("llama4-17b-128e", {}, 4, (12, 3, 0, 4)),
    ("llama4-17b-128e", {}, 8, (8, 1, 4, 4)),
    ("llama4-tiny", {}, 2, (2, 1, 0, 4)),  # 8 layers = 2 cycles
    ("llama4-tiny", {"base_num_decoder_layers": 12}, 2, (2, 1, 1, 4)),
    ("deepseek4-284b", {}, 2, (20, 10, 0, 2)),  # 3 hash layers, then 20 blocks of (HCA, CSA)
    ("deepseek4-284b", {}, 4, (20, 5, 0, 2)),
    ("deepseek4-284b", {}, 8, (16, 2, 4, 2)),
    ("deepseek4-tiny", {}, 2, (20, 10, 0, 2)),
    ("deepseek4-tiny", {}, 4, (20, 5, 0, 2)),
    ("deepseek4-tiny", {}, 8, (16, 2, 4, 2)),
]


@pytest.mark.parametrize(
    "model,values,stages,expected", RELEASES, ids=[f"{m}-{v.get('base_num_decoder_layers', '')}-{s}" for m, v, s, _ in RELEASES]
)
def test_default_layout_of_patterned_models(model, values, stages, expected):
    cfg = _cfg(model, stages, **values)
    spec = pipeline_spec(cfg)
    blocks, repeats, unpipelined, per_block = expected
    assert (spec.blocks, spec.repeats, spec.layers_per_stage, spec.layers_per_block) == (blocks, repeats, 1, per_block)
    assert spec.stages == stages and spec.microbatches == stages
    stacks = layer_stacks(cfg)
    counts = {stack.name: stack.num_layers for stack in stacks}
    assert counts[spec.stack] == blocks and counts.get("unpipelined_layers", 0) == unpipelined
    # every layer is in exactly one stack, in order: nothing dropped by the split
    layers = [stack.hf_layer(b, j) for stack in stacks for b in range(stack.num_layers) for j in range(stack.layers_per_block)]
    assert layers == list(range(cfg.base_num_decoder_layers))
    assert [s.name for s in pattern_stacks(cfg)][0] in ("layers", "hash_layers")  # DeepSeek-V4's prefix stays outside
    assert spec.auto_note.startswith("pipeline layout chosen automatically") and f"{blocks} " in spec.auto_note
    assert pipeline_summary(cfg)[1] == spec.auto_note


def test_summary_line_names_the_pipelined_and_outside_layers():
    line = pipeline_summary(_cfg("gemma3-4b", 2))[0]
    assert line.startswith("pipeline: layers (layers 0-23) on 2 stages x 2 repeats (circular), 6 layers per stage")
    assert line.endswith("unpipelined_layers (layers 24-29), remainder_layers (layers 30-33)")
    assert pipeline_summary(_cfg("gemma3-4b", 1)) == []


@pytest.mark.parametrize(
    "model,values,stages,message",
    [
        (
            "llama4-tiny",
            {},
            4,
            re.escape(
                "llama4 with 8 layers has 2 whole 4-layer cycles to pipeline but 4 stages need one each; a cycle cannot be "
                "split across stages: every stage runs one program under vmap, and the layers of a cycle differ (chunked, "
                "chunked+moe, global+nope+moe); nor can they run as one-layer blocks whose attention kind is data (as the "
                "sliding/global patterns of Gemma 2/3, OLMo 3 and GPT-OSS do): its layers' parameters or code differ (MoE "
                "and dense feed-forward layers; chunked attention with weights or code of its own; RoPE and NoPE layers: "
                "chunked, chunked+moe, global+nope+moe); use base_num_decoder_layers >= 16 or at most 2 pipeline stages"
            ),
        ),
        (  # 2 hash layers + 2 x 2
            "deepseek4-test",
            {},
            2,
            r"parameters or code differ \(hash-routed and learned-router MoE layers; csa/hca attention with weights or code "
            r"of its own: .*\); use base_num_decoder_layers >= 6 \(and compress_ratios to match\) or no pipeline",
        ),
    ],
)
def test_fewer_cycles_than_stages_is_one_clear_error(model, values, stages, message):
    with pytest.raises(ConfigError, match=message) as err:
        _cfg(model, stages, **values)  # at load: check_pipeline_options resolves the schedule
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(
    "values,message",
    [
        ({"num_layers_per_pipeline_stage": 2}, "num_layers_per_pipeline_stage=2 is not a whole number of the 4-layer blocks"),
        ({"pipeline_parallel_layers": 4}, "num_layers_per_pipeline_stage=1 is not a whole number of the 4-layer blocks"),
        ({"num_layers_per_pipeline_stage": 4, "base_num_decoder_layers": 12}, "12 pipelined layers do not divide into 2"),
        ({"num_pipeline_repeats": 2}, r"num_pipeline_repeats=2 but 8 pipelined layers / \(2 stages x 4 layers per stage\) = 1"),
    ],
)
def test_explicit_layout_keys_stay_authoritative(values, message):
    """Any layout key set (to a value other than its default) means no automatic choice:
    today's errors, not a silent fix. ``num_pipeline_repeats`` is a check of the layout,
    chosen or not: a wrong value is refused with the layout's own numbers."""
    with pytest.raises(ConfigError, match=message):
        _cfg("llama4-tiny", 2, **values)


def test_num_pipeline_repeats_equal_to_the_chosen_repeats_keeps_the_automatic_layout():
    """Setting ``num_pipeline_repeats`` to the repeats the automatic layout derives (a check)
    keeps that layout; it used to switch the choice off and refuse the config over
    ``num_layers_per_pipeline_stage=1``, a key the user never set."""
    auto = pipeline_spec(_cfg("gemma3-tiny", 2, base_num_decoder_layers=24))
    spec = pipeline_spec(_cfg("gemma3-tiny", 2, base_num_decoder_layers=24, num_pipeline_repeats=auto.repeats))
    assert auto.repeats == 2 and (spec.repeats, spec.layers_per_stage, spec.blocks) == (2, auto.layers_per_stage, auto.blocks)


def test_explicit_valid_layout_is_used_as_given():
    spec = pipeline_spec(_cfg("llama4-tiny", 2, base_num_decoder_layers=16, num_layers_per_pipeline_stage=8))
    assert (spec.blocks, spec.layers_per_stage, spec.repeats, spec.auto_note) == (4, 2, 1, "")
    spec = pipeline_spec(
        _cfg("llama4-tiny", 2, base_num_decoder_layers=12, pipeline_parallel_layers=8, num_layers_per_pipeline_stage=4)
    )
    assert (spec.blocks, spec.layers_per_stage, spec.repeats, spec.auto_note) == (2, 1, 1, "")


def test_one_layer_blocks_keep_the_defaults_meaning():
    """Dense models: one layer per stage, every layer pipelined (an indivisible count is an error)."""
    spec = pipeline_spec(_cfg("llama3.1-tiny", 2, base_num_decoder_layers=4))
    assert (spec.blocks, spec.repeats, spec.auto_note) == (4, 2, "")
    with pytest.raises(ConfigError, match="3 pipelined layers do not divide into 2 stages"):
        _cfg("llama3.1-tiny", 2, base_num_decoder_layers=3)


# model, values, stages -> (pipelined layers, repeats, layers in unpipelined_layers)
SELECTED = [
    ("gemma3-tiny", {}, 2, (8, 4, 0)),  # 1 whole 6-layer cycle for 2 stages
    ("gemma3-tiny", {"base_num_decoder_layers": 4}, 2, (4, 2, 0)),  # no whole cycle at all
    ("gemma3-4b", {}, 8, (32, 4, 2)),  # 5 cycles for 8 stages: 32 of 34 layers pipelined
    ("gemma2-tiny", {}, 4, (4, 1, 0)),  # (sliding, global) pairs: 2 for 4 stages
    ("olmo3-tiny", {}, 4, (4, 1, 0)),
    ("gpt-oss-tiny", {}, 2, (2, 1, 0)),
]


@pytest.mark.parametrize("model,values,stages,expected", SELECTED, ids=[f"{m}-{s}" for m, v, s, _ in SELECTED])
def test_sliding_global_patterns_split_across_stages_as_one_layer_blocks(model, values, stages, expected):
    """Too few whole cycles for the stages, and layers of one structure: one-layer blocks of kind
    ``selected`` whose kinds (``global_layers``) are the pattern's, by layer."""
    cfg = _cfg(model, stages, **values)
    spec = pipeline_spec(cfg)
    layers, repeats, unpipelined = expected
    assert (spec.blocks, spec.repeats, spec.layers_per_stage, spec.layers_per_block) == (layers, repeats, 1, 1)
    stacks = layer_stacks(cfg)
    assert all(stack.kinds[0].attention == "selected" for stack in stacks)
    assert {s.name: s.num_layers for s in stacks}.get("unpipelined_layers", 0) == unpipelined
    expected_kinds = tuple(kind.attention == "global" for kind in layer_kinds(cfg))
    assert all(stack.global_layers == expected_kinds for stack in stacks)
    assert "attention kind" in spec.auto_note and "is data" in spec.auto_note


def test_whole_cycles_keep_the_cycle_layout_and_set_keys_decide():
    """Where whole cycles fill the stages the cycle blocks stay; set keys that are not whole
    cycles take one-layer blocks (which the one-layer rules then check)."""
    assert pipeline_spec(_cfg("gemma3-tiny", 2, base_num_decoder_layers=12)).layers_per_block == 6
    spec = pipeline_spec(_cfg("gemma3-tiny", 2, num_layers_per_pipeline_stage=3, pipeline_parallel_layers=6))
    assert (spec.blocks, spec.layers_per_stage, spec.repeats, spec.layers_per_block) == (6, 3, 1, 1)
    with pytest.raises(ConfigError, match="8 pipelined layers do not divide into 2 stages x num_layers_per_pipeline_stage=3"):
        _cfg("gemma3-tiny", 2, num_layers_per_pipeline_stage=3)


@pytest.mark.parametrize(
    "values,message",
    [
        ({"attention": "splash"}, "attention=splash takes a static mask"),
        ({"attention": "cudnn", "dtype": "bfloat16"}, "attention=cudnn takes a static mask"),
        ({"ici_context_parallelism": 2}, "context_parallel_strategy=ring takes a static window"),
    ],
)
def test_static_mask_attention_is_refused_by_name_for_kinds_as_data(values, message):
    with pytest.raises(ConfigError, match=message):
        _cfg("gemma3-tiny", 2, **values)
