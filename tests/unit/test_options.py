"""Every closed list of option values has one definition (``config/options.py``): the schema
accepts exactly those values, the module that acts on an option handles every one of them,
and ``base.yml`` holds each "not used" value the checks compare against."""

from __future__ import annotations

import re
import typing

import jax
import jax.numpy as jnp
import pytest
import yaml
from flax import nnx

from nnxtron.config import deepseek4, derive, load_config, options
from nnxtron.config.loader import PRESET_DIR
from nnxtron.config.schema import Config
from nnxtron.data.tokenizer import TOKENIZERS
from nnxtron.errors import ConfigError
from nnxtron.infer.sample import sample_logits
from nnxtron.models.build import abstract_model
from nnxtron.models.quant import MODES
from nnxtron.models.registry import FAMILIES
from nnxtron.parallel.remat import RematSpec, jax_policy
from nnxtron.train.optimizer import base_optimizer
from nnxtron.train.schedules import learning_rate_schedule

BASE = yaml.safe_load((PRESET_DIR / "base.yml").read_text())

SCHEMA_LISTS = {  # config key -> the option list its Literal is built from
    "decoder_block": options.DECODER_BLOCKS,
    "dtype": options.DTYPES,
    "weight_dtype": options.DTYPES,
    "rope_type": options.ROPE_TYPES,
    "attention_type": options.ATTENTION_TYPES,
    "attention": options.ATTENTION_CHOICES,
    "routed_score_func": options.ROUTER_SCORE_FUNCS,
    "capacity_scope": options.CAPACITY_SCOPES,  # each has a rule: tests/unit/test_moe_capacity.py
    "moe_compute": options.MOE_COMPUTES,  # each computes the experts: tests/unit/test_moe_dense.py
    "grouped_matmul": options.GROUPED_MATMULS,  # each resolves and runs: tests/unit/test_grouped_matmul.py
    "load_balance_convention": options.LOAD_BALANCE_CONVENTIONS,  # each has a rule: tests/unit/test_load_balance.py
    "matmul_precision": options.MATMUL_PRECISIONS,  # each reaches the matmuls: tests/unit/test_matmul_precision.py
    "remat_policy": options.REMAT_POLICIES,
    "query_proj": options.REMAT_CHOICES,
    "quantization": ("", *options.QUANTIZATION_MODES),
    "dataset_type": options.DATASET_TYPES,
    "tokenizer_type": options.TOKENIZER_TYPES,
    "packing": options.PACKING_MODES,
    "non_finite_policy": options.NON_FINITE_POLICIES,
    "decode_sampling_strategy": options.SAMPLING_STRATEGIES,
    "lr_schedule_type": options.LR_SCHEDULES,  # each has a schedule: test_every_schedule_and_wsd_style_has_a_schedule
    "wsd_decay_style": options.WSD_DECAY_STYLES,
    "opt_type": options.OPTIMIZERS,  # each builds: test_every_optimizer_builds_and_updates
    "wandb_mode": options.WANDB_MODES,  # each reaches wandb.init: tests/integration/test_wandb.py
}


@pytest.mark.parametrize("key", sorted(SCHEMA_LISTS))
def test_schema_accepts_exactly_the_option_list(key):
    assert typing.get_args(Config.model_fields[key].annotation) == tuple(SCHEMA_LISTS[key])
    assert BASE[key] in SCHEMA_LISTS[key]


def test_every_decoder_block_has_one_family():
    assert sorted(FAMILIES) == sorted(options.DECODER_BLOCKS)
    assert all(family.name == name for name, family in FAMILIES.items())


def test_every_remat_policy_has_a_jax_policy():
    for name in options.REMAT_POLICIES:
        policy = jax_policy(RematSpec(name))
        assert (policy is None) == (name == "none"), name


def test_every_quantization_mode_has_its_element_types():
    assert list(MODES) == list(options.QUANTIZATION_MODES)
    for mode, (forward, backward) in options.QUANTIZATION_MODES.items():
        assert (jnp.dtype(MODES[mode][0]).name, jnp.dtype(MODES[mode][1]).name) == (forward, backward)


def test_every_tokenizer_type_has_a_tokenizer():
    assert sorted(TOKENIZERS) == sorted(options.TOKENIZER_TYPES)


@pytest.mark.parametrize("strategy", options.SAMPLING_STRATEGIES)
def test_every_sampling_strategy_samples(strategy):
    logits = jnp.array([[0.0, 5.0, 1.0, -2.0]])
    token = sample_logits(logits, jax.random.key(0), strategy, temperature=1.0, top_k=1, top_p=0.1)
    assert int(token[0]) == 1  # top-1, nucleus 0.1 and greedy keep only the best; weighted: 97% likely, seed fixed


@pytest.mark.parametrize(
    "table",
    [
        options.PIPELINE_OPTIONS_OFF,
        options.QUANTIZATION_OPTIONS_OFF,
        deepseek4.OPTIONS_OFF,
        options.WANDB_OPTIONS_OFF,
        options.MOE_OPTIONS_OFF,
    ],
    ids=["pipeline", "quantization", "deepseek4", "wandb", "moe"],
)
def test_base_yml_holds_the_off_values(table):
    values = {key: tuple(BASE[key]) if isinstance(BASE[key], list) else BASE[key] for key in table}
    assert values == table


@pytest.mark.parametrize("opt", options.OPTIMIZERS)
def test_every_optimizer_builds_and_updates(opt):
    cfg = load_config(values={"model_name": "llama2-tiny", "base_num_decoder_layers": 1, "vocab_size": 64, "opt_type": opt})
    params = jax.tree.map(jnp.ones_like, nnx.to_pure_dict(nnx.state(abstract_model(cfg), nnx.Param)))
    tx = base_optimizer(cfg, lambda step: 0.1)
    updates, _ = jax.jit(lambda p: tx.update(p, tx.init(p), p))(params)
    assert jax.tree.structure(updates) == jax.tree.structure(params)


@pytest.mark.parametrize("kind, style", [(k, s) for k in options.LR_SCHEDULES for s in options.WSD_DECAY_STYLES])
def test_every_schedule_and_wsd_style_has_a_schedule(kind, style):
    values = {"lr_schedule_type": kind} | ({"wsd_decay_style": style} if kind == "wsd" else {})
    cfg = load_config(values={"model_name": "llama2-tiny", **values})
    assert float(learning_rate_schedule(cfg, derive(cfg, 1))(cfg.steps // 2)) > 0


def test_base_yml_holds_the_optimization_defaults():
    """The keys a schedule or optimizer reads are checked against these values when another
    one is chosen (config/checks.py: check_optimization): base.yml's, and every such key."""
    read = {k for table in (options.SCHEDULE_KEYS, options.OPTIMIZER_KEYS) for keys in table.values() for k in keys}
    assert read == set(options.OPTIMIZATION_DEFAULTS)
    assert {key: BASE[key] for key in options.OPTIMIZATION_DEFAULTS} == options.OPTIMIZATION_DEFAULTS


@pytest.mark.parametrize(
    "model, overrides, fragment",
    [
        ("llama3.1-tiny", dict(shared_experts=2), "shared_experts=2 is read only by MoE layers"),
        ("llama3.1-tiny", dict(load_balance_loss_weight=0.01), "load_balance_loss_weight=0.01 is read only by MoE layers"),
        ("qwen3-tiny", dict(first_num_dense_layers=1), "first_num_dense_layers=1 is read only by MoE layers"),
        ("gpt3-52k", dict(mlp_activations=["gelu", "linear"]), "decoder_block gpt3 has a plain (ungated) MLP"),
        ("gpt3-52k", dict(base_num_kv_heads=1), "so base_num_kv_heads=1 cannot apply; set it to base_num_query_heads (2)"),
        *(  # one activation names a plain MLP: the gated families built a gated one from its first entry
            (model, dict(mlp_activations=["gelu"]), "mlp_activations=['gelu'] is taken by decoder_block=gpt3 only")
            for model in ("llama3.1-tiny", "gemma3-tiny", "mixtral-tiny", "deepseek3-test")
        ),
        ("llama4-tiny", dict(sliding_window_size=8), "sliding_window_size=8 is not read when chunk_attn_window_size"),
    ],
)
def test_keys_a_model_would_not_read_are_refused(model, overrides, fragment):
    """Found by the flag-sensitivity matrix: these were accepted and changed nothing."""
    with pytest.raises(ConfigError, match=re.escape(fragment)):
        load_config(values={"model_name": model, **overrides})
