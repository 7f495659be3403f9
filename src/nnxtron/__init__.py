"""nnxtron: NNX-native JAX library for training and serving decoder-only language models."""

__version__ = "0.1.0"


def from_hf(path, dtype=None, **overrides):
    """Load a HuggingFace checkpoint directory (config.json + safetensors) as a Decoder."""
    from nnxtron.convert.hf import from_hf as _from_hf

    return _from_hf(path, dtype=dtype, **overrides)


def to_hf(model, path, overwrite=False):
    """Write a Decoder as a HuggingFace checkpoint directory."""
    from nnxtron.convert.hf import to_hf as _to_hf

    return _to_hf(model, path, overwrite=overwrite)


__all__ = ["from_hf", "to_hf", "__version__"]
