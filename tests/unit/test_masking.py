"""Masks: packed documents never see each other; sliding window and causality."""

import numpy as np
import pytest

from nnxtron.layers.attention import attention_mask
from nnxtron.models.build import build_model
from tests.conftest import tiny_config


@pytest.mark.parametrize("model_name", ["llama3.1-tiny", "mistral-tiny"])
def test_packed_documents_do_not_attend_to_each_other(model_name):
    cfg = tiny_config(model_name)
    model = build_model(cfg)
    rng = np.random.default_rng(0)
    doc_a = rng.integers(3, cfg.vocab_size, 10).astype(np.int32)
    doc_b = rng.integers(3, cfg.vocab_size, 14).astype(np.int32)
    packed = np.concatenate([doc_a, doc_b])[None]
    positions = np.concatenate([np.arange(10), np.arange(14)])[None].astype(np.int32)
    segments = np.concatenate([np.full(10, 1), np.full(14, 2)])[None].astype(np.int32)
    together = model(packed, positions, segments).logits[0]
    alone_a = model(doc_a[None]).logits[0]
    alone_b = model(doc_b[None]).logits[0]
    np.testing.assert_allclose(together[:10], alone_a, atol=2e-5, rtol=1e-5)
    np.testing.assert_allclose(together[10:], alone_b, atol=2e-5, rtol=1e-5)
    # without segment ids the second document does see the first: the test can fail
    leaky = model(packed, positions).logits[0]
    assert np.max(np.abs(leaky[10:] - alone_b)) > 1e-2


def test_mask_formula():
    segments = np.array([[1, 1, 1, 2, 2, 2, 2, 0]])
    mask = np.asarray(attention_mask(segments, sliding_window=2))[0]
    for q in range(8):
        for k in range(8):
            expected = k <= q and q - k < 2 and segments[0, q] == segments[0, k]
            assert mask[q, k] == expected, (q, k)
    full = np.asarray(attention_mask(np.ones((1, 5), np.int32)))[0]
    np.testing.assert_array_equal(full, np.tril(np.ones((5, 5), bool)))
