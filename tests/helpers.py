"""Helpers only the tests use (the package keeps what it runs itself)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
from flax import nnx

from nnxtron.config import load_config
from nnxtron.config.schema import Config
from nnxtron.params import LayerCounts, convert_layers
from nnxtron.train.weights import load_weights


def load_parameters(path: str | Path, cfg: Config, abstract_params: Any, param_shardings: Any) -> Any:
    """The parameters alone of ``nnxtron.train.weights.load_weights``."""
    return load_weights(path, cfg, {"params": abstract_params}, {"params": param_shardings})[0]


def stack_layers(flat: dict[str, Any], num_layers: LayerCounts, stack) -> dict[str, Any]:
    """Layer-list layout -> scanned layout (``nnxtron.params.unstack_layers`` backwards);
    ``stack`` is np.stack or jnp.stack."""
    return convert_layers(flat, num_layers, scanned=True, stack=stack)


def is_quantized(model: nnx.Module) -> bool:
    """Whether qwix replaced ``model``'s type with a quantized one."""
    return hasattr(type(model), "_unquantized_type")


def tiny_config(model: str = "llama3.1-tiny", **overrides):
    """A tiny test config; overrides are typed values."""
    return load_config(values={"model_name": model, **overrides})


def random_batch(cfg, batch: int = 4, seq: int = 24, seed: int = 0, packed: bool = False) -> dict:
    """A deterministic batch; ``packed`` puts two documents in each row."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(3, cfg.vocab_size, size=(batch, seq + 1)).astype(np.int32)
    positions = np.broadcast_to(np.arange(seq, dtype=np.int32), (batch, seq)).copy()
    segments = np.ones((batch, seq), np.int32)
    mask = np.ones((batch, seq), np.float32)
    if packed:
        cut = seq // 3
        segments[:, cut:] = 2
        positions[:, cut:] = np.arange(seq - cut)
        mask[:, cut - 1] = 0.0
    return {
        "inputs": tokens[:, :-1],
        "targets": tokens[:, 1:],
        "positions": positions,
        "segment_ids": segments,
        "loss_mask": mask,
    }


@nnx.jit
def forward_logits(model: nnx.Module, input_ids: Any) -> Any:
    """``model(input_ids).logits`` as one compiled program: run eagerly, a model dispatches (and
    compiles, per shape) each of its operations one by one — DeepSeek-V4's unrolled layers took
    7.7 s that way against 1.9 s compiled. Matmul precision is read when it is traced."""
    return model(input_ids).logits
