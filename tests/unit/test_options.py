"""Every closed list of option values has one definition (``config/options.py``): the schema
accepts exactly those values, the module that acts on an option handles every one of them,
and ``base.yml`` holds each "not used" value the checks compare against."""

from __future__ import annotations

import typing

import jax
import jax.numpy as jnp
import pytest
import yaml

from nnxtron.config import deepseek4, options
from nnxtron.config.loader import PRESET_DIR
from nnxtron.config.schema import Config
from nnxtron.data.tokenizer import TOKENIZERS
from nnxtron.infer.sample import sample_logits
from nnxtron.models.quant import MODES
from nnxtron.models.registry import FAMILIES
from nnxtron.parallel.remat import RematSpec, jax_policy

BASE = yaml.safe_load((PRESET_DIR / "base.yml").read_text())

SCHEMA_LISTS = {  # config key -> the option list its Literal is built from
    "decoder_block": options.DECODER_BLOCKS,
    "dtype": options.DTYPES,
    "weight_dtype": options.DTYPES,
    "rope_type": options.ROPE_TYPES,
    "attention_type": options.ATTENTION_TYPES,
    "attention": options.ATTENTION_CHOICES,
    "routed_score_func": options.ROUTER_SCORE_FUNCS,
    "remat_policy": options.REMAT_POLICIES,
    "query_proj": options.REMAT_CHOICES,
    "quantization": ("", *options.QUANTIZATION_MODES),
    "dataset_type": options.DATASET_TYPES,
    "tokenizer_type": options.TOKENIZER_TYPES,
    "packing": options.PACKING_MODES,
    "non_finite_policy": options.NON_FINITE_POLICIES,
    "decode_sampling_strategy": options.SAMPLING_STRATEGIES,
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
    [options.PIPELINE_OPTIONS_OFF, options.QUANTIZATION_OPTIONS_OFF, deepseek4.OPTIONS_OFF],
    ids=["pipeline", "quantization", "deepseek4"],
)
def test_base_yml_holds_the_off_values(table):
    values = {key: tuple(BASE[key]) if isinstance(BASE[key], list) else BASE[key] for key in table}
    assert values == table
