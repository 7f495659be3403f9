"""Per-token log-likelihoods (``nnxtron eval``'s scores) equal HF's: log-softmax of the stored golden logits."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

from nnxtron.convert.hf import from_hf
from nnxtron.infer.score import token_logprobs

GOLDEN = Path(__file__).parents[1] / "assets" / "golden"


def _log_softmax(logits: np.ndarray) -> np.ndarray:
    logits = logits.astype(np.float64)
    top = logits.max(-1, keepdims=True)
    return logits - top - np.log(np.exp(logits - top).sum(-1, keepdims=True))


@pytest.mark.parametrize("case", ["llama2", "qwen3", "deepseek3", "gemma3"])
def test_token_logprobs_equal_hf(case):
    golden = load_file(str(GOLDEN / case / "golden.safetensors"))
    ids = golden["input_ids"].astype(np.int32)
    inputs, targets = ids[:, :-1], ids[:, 1:]
    batch = {
        "inputs": inputs, "targets": targets, "segment_ids": np.ones_like(inputs),
        "positions": np.broadcast_to(np.arange(inputs.shape[1], dtype=np.int32), inputs.shape).copy(),
    }  # fmt: skip
    ours = token_logprobs(from_hf(GOLDEN / case), batch)
    expected = np.take_along_axis(_log_softmax(golden["logits"][:, :-1]), targets[..., None], axis=-1)[..., 0]
    np.testing.assert_allclose(ours, expected, atol=2e-5, rtol=0)
