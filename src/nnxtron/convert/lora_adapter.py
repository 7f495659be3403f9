"""A LoRA run's adapters alone, for HF PEFT: ``adapter_model.safetensors`` + ``adapter_config.json``.

``nnxtron convert to-hf RUN DIR --adapter-only`` writes the trained adapters in PEFT's
layout for the HF model the base exports to (``convert/hf.py``): for a dense layer whose HF
``nn.Linear.weight`` is ``[out, in]`` = the nnxtron kernel ``[*in, *out]`` flattened and
transposed, ``lora_A.weight`` is ``A [*in, r]`` flattened to ``[in, r]`` and transposed,
``lora_B.weight`` is ``B [r, *out]`` flattened to ``[r, out]`` and transposed, under
``base_model.model.<HF module>``; ``r`` and ``lora_alpha`` are the run's. PEFT then adds
``lora_alpha / r * B @ A`` to the weight, as the merged export (``convert to-hf``) holds it.

Layers whose HF tensor is not such a Linear (GPT-2's ``Conv1D``, tensors that hold every
expert or several variables) are refused with one line: export the merged model instead.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np
from safetensors.numpy import save_file

from nnxtron.convert.hf import weight_maps
from nnxtron.convert.runs import run_config
from nnxtron.errors import CheckpointError, ConfigError
from nnxtron.layers.lora import base_config
from nnxtron.parallel.mesh import make_mesh
from nnxtron.train.state import model_shardings
from nnxtron.train.weights import load_weights

ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
PEFT_PREFIX = "base_model.model."


def _node(tree: dict, path: tuple) -> Any:
    for part in path:
        if not isinstance(tree, dict) or part not in tree:
            return None
        tree = tree[part]
    return tree


def peft_tensors(cfg: Any, adapters: dict) -> tuple[dict[str, np.ndarray], list[str]]:
    """``({PEFT key: tensor}, HF module names targeted)`` of the adapters of ``cfg``'s model."""
    tensors: dict[str, np.ndarray] = {}
    modules: set[str] = set()
    for m in weight_maps(base_config(cfg)):
        if m.path[-1] != "kernel":
            continue
        node = _node(adapters, m.path[:-1])
        if node is None or "lora_a" not in node:
            continue
        wm = m.wm
        if wm.conv1d or wm.per_expert or wm.split_parts > 1 or wm.linear_in_dims < 1 or not wm.hf_key.endswith(".weight"):
            raise CheckpointError(
                f"the adapters of {'/'.join(map(str, m.path[:-1]))} have no PEFT layout (HF {wm.hf_key}); export the "
                "merged model with `nnxtron convert to-hf` (without --adapter-only)"
            )
        a, b = np.asarray(node["lora_a"], np.float32), np.asarray(node["lora_b"], np.float32)
        module = wm.hf_key[: -len(".weight")]
        modules.add(module.rsplit(".", 1)[-1])
        for i, prefix in enumerate(m.layer_prefixes):
            one_a, one_b = (a[i], b[i]) if m.stacked else (a, b)
            rank = one_a.shape[-1]
            key = PEFT_PREFIX + prefix + module
            tensors[f"{key}.lora_A.weight"] = np.ascontiguousarray(one_a.reshape(-1, rank).T)
            tensors[f"{key}.lora_B.weight"] = np.ascontiguousarray(one_b.reshape(rank, -1).T)
    return tensors, sorted(modules)


def export_adapter(
    run_dir: str | os.PathLike, dest: str | os.PathLike, overrides: list[str] | None = None, overwrite: bool = False
) -> Path:
    """Write the LoRA run's adapters (latest checkpoint) to ``dest`` in PEFT's format."""
    cfg = run_config(run_dir, overrides or [])
    if not cfg.lora_rank:
        raise ConfigError(
            f"'{run_dir}' is not a LoRA run (lora_rank is 0); export it with `nnxtron convert to-hf` without --adapter-only"
        )
    root = Path(dest)
    if (root / ADAPTER_WEIGHTS).exists() and not overwrite:
        raise CheckpointError(f"'{root}' already holds {ADAPTER_WEIGHTS}; choose another directory or pass --overwrite")
    _, abstract, _, shardings, _ = model_shardings(cfg, make_mesh(cfg))
    adapters, _ = load_weights(run_dir, cfg, {"params": abstract}, {"params": shardings})
    tensors, modules = peft_tensors(cfg, adapters)
    config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": cfg.lora_rank, "lora_alpha": cfg.lora_alpha,
        "lora_dropout": cfg.lora_dropout, "bias": "none", "target_modules": modules, "fan_in_fan_out": False, "use_rslora": False,
        "init_lora_weights": True, "modules_to_save": None, "base_model_name_or_path": cfg.init_from or None,
    }  # fmt: skip
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f"{ADAPTER_WEIGHTS}.tmp"
    save_file(tensors, str(tmp), metadata={"format": "pt"})
    os.replace(tmp, root / ADAPTER_WEIGHTS)
    (root / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    return root
