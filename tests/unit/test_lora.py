"""LoRA (``layers/lora.py``): which layers get adapters, their shapes and shardings; the model
equals its base at the start (B = 0); the loss and every adapter gradient equal a direct
implementation (the base model run on the kernels with ``scale * A @ B`` added); the merged
model computes what the adapted one does; with a quantized base the adapter products stay
float; the optimizer holds state for the adapters only; bad settings are one line."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from nnxtron.errors import ConfigError
from nnxtron.layers.lora import base_config, layout_free_path, merge_adapters, with_adapters
from nnxtron.models.build import abstract_model, build_model
from nnxtron.parallel.sharding import variable_names
from nnxtron.params import flatten_with_treedef
from nnxtron.train.step import compute_gradients
from tests.conftest import random_batch, tiny_config

LORA = {"lora_rank": 4, "lora_alpha": 8.0}


def adapter_paths(cfg) -> dict[str, tuple]:
    params = nnx.to_flat_state(nnx.state(abstract_model(cfg), nnx.LoRAParam))
    return {layout_free_path(path): variable.get_value().shape for path, variable in params}


def split(model):
    graphdef, adapters, frozen, rest = nnx.split(model, nnx.LoRAParam, nnx.Param, ...)
    return graphdef, *(nnx.to_pure_dict(part) for part in (adapters, frozen, rest))


def with_random_b(adapters: dict, seed: int = 1) -> dict:
    """Adapters whose B is not zero (so that A's gradient is not zero either)."""
    flat, treedef = flatten_with_treedef(adapters)
    keys = jax.random.split(jax.random.key(seed), len(flat))
    values = {
        name: 0.05 * jax.random.normal(key, value.shape) if name.endswith("lora_b") else value
        for key, (name, value) in zip(keys, flat.items(), strict=True)
    }
    return jax.tree.unflatten(treedef, list(values.values()))


def test_adapters_follow_the_regex_the_layout_and_the_kernel_sharding():
    scanned = adapter_paths(tiny_config("llama2-tiny", **LORA))
    assert sorted({path.rsplit("/", 1)[0] for path in scanned}) == [
        f"layers/layers/{m}" for m in ("attention/key", "attention/out", "attention/query", "attention/value",
                                       "mlp/wi_0", "mlp/wi_1", "mlp/wo")
    ]  # fmt: skip
    cfg = tiny_config("llama2-tiny", **LORA, lora_target_modules="attention/(query|value)$")
    layers, emb, heads, head_dim = cfg.base_num_decoder_layers, cfg.base_emb_dim, cfg.base_num_query_heads, cfg.head_dim
    assert adapter_paths(cfg) == {
        "layers/layers/attention/query/lora_a": (layers, emb, 4),
        "layers/layers/attention/query/lora_b": (layers, 4, heads, head_dim),
        "layers/layers/attention/value/lora_a": (layers, emb, 4),
        "layers/layers/attention/value/lora_b": (layers, 4, cfg.base_num_kv_heads, head_dim),
    }
    unrolled = tiny_config("llama2-tiny", **LORA, lora_target_modules="attention/(query|value)$", scan_layers=False)
    assert sorted(set(adapter_paths(unrolled))) == sorted(adapter_paths(cfg))  # one choice whatever the layout
    query = abstract_model(cfg).layers.layers.attention.query
    assert variable_names(query.lora_a)[1:] == ("embed", None)
    assert variable_names(query.lora_b)[1:] == (None, "q_heads", "head_dim")


def test_the_model_equals_its_base_at_the_start_and_the_merged_model_equals_the_adapted_one():
    cfg = tiny_config("llama2-tiny", **LORA)
    base = build_model(base_config(cfg))
    model = build_model(cfg)
    graphdef, adapters, frozen, rest = split(model)
    base_params = nnx.to_pure_dict(nnx.state(base, nnx.Param))
    assert jax.tree.all(jax.tree.map(lambda a, b: bool(jnp.array_equal(a, b)), frozen, base_params))  # the same base
    tokens = jnp.asarray(random_batch(cfg)["inputs"])
    np.testing.assert_array_equal(np.asarray(model(tokens).logits), np.asarray(base(tokens).logits))  # B = 0: exact
    trained = with_random_b(adapters)
    adapted = nnx.merge(graphdef, trained, frozen, rest)(tokens).logits
    assert float(jnp.max(jnp.abs(adapted - base(tokens).logits))) > 1e-3  # the adapters act
    merged = merge_adapters(with_adapters(frozen, trained), cfg.lora_alpha / cfg.lora_rank)
    base_graphdef, _, base_rest = nnx.split(base, nnx.Param, ...)
    merged_logits = nnx.merge(base_graphdef, merged, base_rest)(tokens).logits
    np.testing.assert_allclose(np.asarray(merged_logits), np.asarray(adapted), atol=2e-5)


@pytest.mark.parametrize("accumulation", [1, 2])
def test_loss_and_adapter_gradients_equal_the_base_model_with_merged_kernels(accumulation):
    cfg = tiny_config("llama2-tiny", **LORA)
    graphdef, adapters, frozen, rest = split(build_model(cfg))
    adapters = with_random_b(adapters)
    batch = {key: jnp.asarray(value) for key, value in random_batch(cfg, packed=True).items()}
    ours = compute_gradients(graphdef, adapters, rest, batch, accumulation, frozen=frozen)

    base_graphdef, _, base_rest = nnx.split(build_model(base_config(cfg)), nnx.Param, ...)

    def direct(adapters):
        params = merge_adapters(with_adapters(frozen, adapters), cfg.lora_alpha / cfg.lora_rank)
        out = nnx.merge(base_graphdef, params, base_rest)(batch["inputs"], batch["positions"], batch["segment_ids"])
        logp = jax.nn.log_softmax(out.logits.astype(jnp.float32), axis=-1)
        picked = jnp.take_along_axis(logp, batch["targets"][..., None], axis=-1)[..., 0]
        return -jnp.sum(picked * batch["loss_mask"]) / jnp.sum(batch["loss_mask"])

    loss, grads = jax.value_and_grad(direct)(adapters)
    assert abs(float(ours.loss) - float(loss)) < 2e-5
    flat_ours, flat_direct = flatten_with_treedef(ours.grads)[0], flatten_with_treedef(grads)[0]
    assert sorted(flat_ours) == sorted(flat_direct) and all(k.endswith(("lora_a", "lora_b")) for k in flat_ours)
    total = np.sqrt(sum(float(jnp.sum(g**2)) for g in flat_direct.values()))
    for name, g in flat_direct.items():
        norm = float(jnp.linalg.norm(g))
        assert norm > 0, name  # every adapter gets a gradient
        assert float(jnp.linalg.norm(flat_ours[name] - g)) <= 1e-4 * max(norm, 1e-3 * total), name


def test_with_a_quantized_base_the_adapter_products_stay_float():
    from nnxtron.models.quant import quantized_structure

    quant = {"use_qwix_quantization": True, "quantization": "int8"}
    plain = quantized_structure(tiny_config("llama2-tiny", **quant)).ops
    lora = quantized_structure(tiny_config("llama2-tiny", **quant, **LORA)).ops
    assert plain == lora and plain  # the same weight products quantized, none of the adapters'
    cfg = tiny_config("llama2-tiny", **quant, **LORA)
    tokens = jnp.asarray(random_batch(cfg)["inputs"])
    base, model = build_model(base_config(cfg)), build_model(cfg)
    np.testing.assert_array_equal(np.asarray(model(tokens).logits), np.asarray(base(tokens).logits))


def test_the_optimizer_holds_state_for_the_adapters_only():
    from nnxtron.parallel.mesh import make_mesh
    from nnxtron.train.state import setup

    cfg = tiny_config("llama2-tiny", **LORA)
    model_setup = setup(cfg, make_mesh(cfg), optax.adamw(1e-3))
    adapter_elements = sum(math_prod(s) for s in adapter_paths(cfg).values())
    state = model_setup.abstract_state
    assert sum(x.size for x in jax.tree.leaves(state["params"])) == adapter_elements
    moments = [x.size for x in jax.tree.leaves(state["opt_state"]) if x.size > 1]
    assert sum(moments) == 2 * adapter_elements  # Adam's two moments, of the adapters
    frozen = sum(x.size for x in jax.tree.leaves(model_setup.abstract_frozen))
    base = sum(x.size for x in jax.tree.leaves(nnx.state(abstract_model(base_config(cfg)), nnx.Param)))
    assert frozen == base > 10 * adapter_elements


def math_prod(shape: tuple) -> int:
    return int(np.prod(shape))


def test_lora_settings_are_checked():
    with pytest.raises(ConfigError, match="lora_target_modules='nothing' matches no dense layer.*attention/query"):
        abstract_model(tiny_config("llama2-tiny", **LORA, lora_target_modules="nothing"))
    with pytest.raises(ConfigError, match="is not a regular expression"):
        tiny_config("llama2-tiny", **LORA, lora_target_modules="(query")
    with pytest.raises(ConfigError, match="lora_alpha is read only with lora_rank > 0"):
        tiny_config("llama2-tiny", lora_alpha=32.0)
    with pytest.raises(ConfigError, match="parameter_memory_host_offload=false"):
        tiny_config("llama2-tiny", **LORA, parameter_memory_host_offload=True)


def test_plan_reports_lora_against_full_fine_tuning():
    """`nnxtron plan lora_rank=8`: the trained parameters are the adapters, the frozen base is
    counted in the state and in the compiled step's arguments, and the full fine-tuning column
    is the plan of the same config without adapters."""
    from nnxtron.tools.plan import format_plan, make_plan

    cfg = tiny_config("llama2-tiny", **LORA)
    lora = make_plan(cfg)
    full = make_plan(base_config(cfg))
    rows = {row["label"]: row for row in lora["lora"]["compared"]}
    adapters = sum(math_prod(s) for s in adapter_paths(cfg).values())
    assert rows["parameters trained"]["lora"] == lora["params"]["trained"] == adapters
    assert rows["parameters trained"]["full"] == full["params"]["trained"] == full["params"]["total"]
    state = lora["state_per_device"]
    assert state["frozen_base_bytes"] == full["state_per_device"]["params_bytes"]
    assert rows["compiled step: arguments"]["full"] == full["memory"]["argument_bytes"]
    assert state["params_bytes"] + state["frozen_base_bytes"] <= lora["memory"]["argument_bytes"]
    assert rows["  optimizer state"]["lora"] < rows["  optimizer state"]["full"] / 2  # (the adapters shard less)
    text = format_plan(lora)
    assert "LoRA: rank 4, alpha 8, adapters on 7 dense layers" in text and "+ the frozen base (LoRA)" in text
    assert "LoRA" not in format_plan(full)


def test_adapter_dropout_acts_in_training_only_and_is_checked():
    """With ``lora_dropout`` the adapters' input is dropped per row (the step's dropout keys):
    the adapter gradients change, the base path and the eval forward do not."""
    from nnxtron.parallel.row_keys import row_keys

    cfg = tiny_config("llama2-tiny", **LORA, lora_dropout=0.5)
    graphdef, adapters, frozen, rest = split(build_model(cfg))
    adapters = with_random_b(adapters)
    batch = {key: jnp.asarray(value) for key, value in random_batch(cfg).items()}
    plain = compute_gradients(graphdef, adapters, rest, batch, frozen=frozen)
    keyed = {**batch, "dropout_keys": row_keys(0, jnp.int32(0), batch["inputs"].shape[0])}
    dropped = compute_gradients(graphdef, adapters, rest, keyed, frozen=frozen)
    again = compute_gradients(graphdef, adapters, rest, keyed, frozen=frozen)
    diff = jax.tree.map(lambda a, b: float(jnp.max(jnp.abs(a - b))), plain.grads, dropped.grads)
    assert all(d > 1e-6 for d in jax.tree.leaves(diff))  # every adapter saw dropped inputs
    assert float(dropped.loss) != float(plain.loss)
    assert jax.tree.all(jax.tree.map(lambda a, b: bool(jnp.array_equal(a, b)), dropped.grads, again.grads))
    no_lora_dropout = tiny_config("llama2-tiny", **LORA)
    assert compute_gradients(*split(build_model(no_lora_dropout))[:1], adapters, rest, keyed, frozen=frozen).loss == plain.loss
    with pytest.raises(ConfigError, match="lora_dropout > 0 with enable_dropout=false"):
        tiny_config("llama2-tiny", **LORA, lora_dropout=0.1, enable_dropout=False)
    with pytest.raises(
        ConfigError, match="lora_dropout > 0 acts inside the decoder layers, but lora_target_modules also matches logits"
    ):
        abstract_model(tiny_config("llama2-tiny", **LORA, lora_dropout=0.1, lora_target_modules="(query|logits)$"))
