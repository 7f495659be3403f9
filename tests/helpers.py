"""Helpers only the tests use (the package keeps what it runs itself)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from flax import nnx

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
