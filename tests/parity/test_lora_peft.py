"""LoRA against HF PEFT: an adapter PEFT wrote for the golden llama2
(``tests/assets/golden/llama2_lora``, ``scripts/make_peft_golden.py``: rank 4, alpha 8, the
seven dense layers, random A and B), put into nnxtron's adapters by the inverse of the
PEFT layout, gives PEFT's logits; and nnxtron's PEFT export of those adapters
(``convert/lora_adapter.py``) is PEFT's file again, tensor for tensor and bit for bit.
So the layout ``convert to-hf --adapter-only`` writes is the one PEFT reads."""

from __future__ import annotations

import json
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file

from nnxtron.convert.hf import from_hf, weight_maps
from nnxtron.convert.lora_adapter import PEFT_PREFIX, peft_tensors
from nnxtron.models.build import build_model
from tests.helpers import forward_logits

GOLDEN = Path(__file__).resolve().parents[1] / "assets" / "golden"
TOL = 5e-6  # measured 9.9e-7 (float32 logits of O(1); the unadapted base is 0.96 away)


def from_peft(cfg, tensors: dict[str, np.ndarray], abstract: dict) -> dict:
    """nnxtron adapters (shaped like ``abstract``) from PEFT's tensors: the inverse of ``peft_tensors``."""
    adapters = _skeleton(abstract)  # nested dicts with string keys, filled in below

    for m in weight_maps(cfg.model_copy(update={"lora_rank": 0})):
        node = abstract
        for part in m.path[:-1]:
            node = node.get(part, {}) if isinstance(node, dict) else {}
        if "lora_a" not in node:
            continue
        module = PEFT_PREFIX + "{}" + m.wm.hf_key[: -len(".weight")]
        a_shape, b_shape = node["lora_a"].shape, node["lora_b"].shape
        one_a, one_b = (a_shape[1:], b_shape[1:]) if m.stacked else (a_shape, b_shape)
        parts_a = [tensors[module.format(p) + ".lora_A.weight"].T.reshape(one_a) for p in m.layer_prefixes]
        parts_b = [tensors[module.format(p) + ".lora_B.weight"].T.reshape(one_b) for p in m.layer_prefixes]
        target = adapters
        for part in m.path[:-1]:
            target = target[str(part)]
        target["lora_a"] = np.stack(parts_a) if m.stacked else parts_a[0]
        target["lora_b"] = np.stack(parts_b) if m.stacked else parts_b[0]
    return adapters


def _skeleton(tree):
    return {str(k): _skeleton(v) for k, v in tree.items()} if isinstance(tree, dict) else None


@pytest.mark.parametrize("scan", [True, False])
def test_peft_adapters_give_peft_logits_and_export_back_exactly(scan):
    root = GOLDEN / "llama2_lora"
    config = json.loads((root / "adapter_config.json").read_text())
    tensors = load_file(str(root / "adapter_model.safetensors"))
    golden = load_file(str(root / "golden.safetensors"))
    base = from_hf(GOLDEN / "llama2", scan_layers=scan)
    cfg = base.config.model_copy(update={"lora_rank": config["r"], "lora_alpha": float(config["lora_alpha"])})
    graphdef, abstract, _, rest = nnx.split(build_model(cfg), nnx.LoRAParam, nnx.Param, ...)
    shapes = nnx.to_pure_dict(abstract)
    adapters = _keys_like(from_peft(cfg, tensors, shapes), shapes)
    frozen = nnx.to_pure_dict(nnx.state(base, nnx.Param))
    model = nnx.merge(graphdef, adapters, frozen, nnx.to_pure_dict(rest))
    logits = np.asarray(forward_logits(model, jnp.asarray(golden["input_ids"])))
    plain = np.asarray(forward_logits(base, jnp.asarray(golden["input_ids"])))
    assert np.max(np.abs(plain - golden["logits"])) > 100 * TOL  # the adapters move the logits
    assert np.max(np.abs(logits - golden["logits"])) <= TOL
    exported, modules = peft_tensors(cfg, adapters)
    assert modules == sorted(config["target_modules"])
    assert sorted(exported) == sorted(tensors)
    for key, value in tensors.items():
        np.testing.assert_array_equal(exported[key], value, err_msg=key)


def _keys_like(tree, like):
    """``tree`` (string keys) with the key types of ``like`` (layer indices are ints)."""
    if not isinstance(like, dict):
        return jnp.asarray(tree)
    return {key: _keys_like(tree[str(key)], value) for key, value in like.items()}
