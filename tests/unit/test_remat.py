"""Remat policies do what their names say: which named activations the backward pass keeps
on device, offloads to host memory, or recomputes (checked with jax's saved-residual list)."""

import re

import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from jax._src.ad_checkpoint import saved_residuals  # public as print_saved_residuals

from nnxtron.config import load_config
from nnxtron.config.options import REMAT_POLICIES
from nnxtron.errors import ConfigError
from nnxtron.models.build import build_model
from nnxtron.parallel.remat import ACTIVATIONS, QKV, RematSpec
from tests.conftest import tiny_config

DOTS = ("query_proj", "key_proj", "value_proj", "out_proj", "mlpwi_0", "mlpwi_1", "mlpwo")
EXPECTED_NAMED = {  # policy -> named activations kept on device
    "full": set(),
    "minimal": set(),
    "minimal_with_context": {"context"},
    "save_dot_with_context_except_mlp": {*QKV, "context", "out_proj"},
    # mlpwo feeds only the residual add, whose backward needs no saved value: never a residual
    "save_dot_except_mlpwi": {*QKV, "out_proj"},
    "save_dot_except_mlp": {*QKV, "out_proj"},
    "save_qkv_proj": set(QKV),
    "save_out_proj": {"out_proj"},
    "qkv_proj_offloaded": set(),
    "minimal_offloaded": set(),
}


def _residuals(**overrides):
    cfg = tiny_config("llama2-tiny", scan_layers=False, base_num_decoder_layers=1, **overrides)
    graphdef, state = nnx.split(build_model(cfg))
    tokens = jnp.ones((2, 8), jnp.int32)
    found = saved_residuals(lambda s: nnx.merge(graphdef, s)(tokens).logits.sum(), state)
    named, host, dots = set(), 0, 0
    for aval, description in found:
        match = re.search(r"named '(\w+)'", description)
        if match:
            named.add(match.group(1))
        if "<host>" in str(aval) or getattr(aval, "memory_space", None) == jax.memory.Space.Host:
            host += 1
        if "dot_general" in description:
            dots += 1
    return named, host, dots, len(found)


@pytest.mark.parametrize("policy", sorted(EXPECTED_NAMED))
def test_named_activations_saved_by_each_policy(policy):
    named, host, dots, _ = _residuals(remat_policy=policy)
    assert named == EXPECTED_NAMED[policy]
    if policy in ("minimal", "minimal_with_context"):
        assert dots >= len(DOTS) - 1  # dot outputs kept (matmuls not recomputed)
    if policy == "full":
        assert dots == 0
    if policy == "qkv_proj_offloaded":
        assert host == 3  # q, k, v projections moved to host memory
    elif policy == "minimal_offloaded":
        assert host >= len(DOTS) - 1
    else:
        assert host == 0


def test_no_remat_keeps_everything():
    *_, count_none = _residuals(remat_policy="none")
    *_, count_full = _residuals(remat_policy="full")
    assert count_none > 2 * count_full


def test_custom_policy_per_activation():
    named, host, _, _ = _residuals(
        remat_policy="custom", qkv_proj="device", value_proj="offload", context="device", mlpwi_0="offload"
    )
    assert named == {"query_proj", "key_proj", "context"}  # qkv_proj shorthand, value_proj's own key wins
    assert host == 2  # value_proj and mlpwi_0 offloaded


@pytest.mark.parametrize(
    "overrides",
    [
        dict(remat_policy="save_qkv_proj"),
        dict(remat_policy="custom", qkv_proj="device"),
        dict(remat_policy="custom", query_proj="device", key_proj="device", value_proj="device"),
    ],
    ids=["save_qkv_proj", "custom-shorthand", "custom-all-three"],
)
def test_a_fused_qkv_projection_follows_the_qkv_choices(overrides):
    """GPT-3's fused projection is one activation named qkv_proj: the policies and custom
    choices that keep q, k and v keep it (they had no effect on it before)."""
    found = saved_residuals(*_gpt3_loss(**overrides))
    assert any("named 'qkv_proj'" in description for _, description in found)
    assert not any("named 'qkv_proj'" in description for _, description in saved_residuals(*_gpt3_loss(remat_policy="full")))


def _gpt3_loss(**overrides):
    cfg = tiny_config("gpt3-52k", scan_layers=False, base_num_decoder_layers=1, **overrides)
    graphdef, state = nnx.split(build_model(cfg))
    tokens = jnp.ones((2, 8), jnp.int32)
    return (lambda s: nnx.merge(graphdef, s)(tokens).logits.sum()), state


def test_a_fused_qkv_projection_refuses_different_choices():
    with pytest.raises(ConfigError, match="set qkv_proj=remat|device|offload instead"):
        tiny_config("gpt3-52k", remat_policy="custom", query_proj="device")


def test_custom_spec_resolution():
    cfg = load_config(overrides=["remat_policy=custom", "mlpwi=offload", "mlpwi_1=device"])
    spec = dict(RematSpec.from_config(cfg).custom)
    assert spec == {**{n: "remat" for n in ACTIVATIONS}, "mlpwi_0": "offload", "mlpwi_1": "device"}


def test_unknown_policy_fails_at_config_load():
    with pytest.raises(ConfigError, match="remat_policy"):
        load_config(overrides=["remat_policy=save_everything"])
    with pytest.raises(ConfigError, match="query_proj"):
        load_config(overrides=["query_proj=keep"])
    assert "custom" in REMAT_POLICIES and len(REMAT_POLICIES) == 12


def test_remat_reduces_compiled_temporary_memory():
    """full < minimal < none in XLA's temp bytes for the train gradient (deterministic)."""
    temps = {}
    for policy in ("full", "minimal", "none"):
        cfg = tiny_config("llama2-tiny", remat_policy=policy, base_num_decoder_layers=4, base_emb_dim=128, base_mlp_dim=512)
        graphdef, state = nnx.split(build_model(cfg))
        tokens = jnp.ones((8, 128), jnp.int32)

        def loss(s, graphdef=graphdef, tokens=tokens):
            return nnx.merge(graphdef, s)(tokens).logits.mean()

        grad = jax.jit(jax.grad(loss))
        temps[policy] = grad.lower(state).compile().memory_analysis().temp_size_in_bytes
    assert temps["full"] < temps["minimal"] < temps["none"], temps
