"""The paged KV cache gives the full forward's logits, for every attention kind (float32).

Sequences share block pools of 4-slot blocks: each prompt is prefilled alone in chunks
of 5 (chunked prefill), then the sequences decode together, one token per step, each at
its own position. Before them a third sequence writes real tokens into blocks and gives
them back, so the others run on reused, non-contiguous blocks that still hold its entries
(read as empty: they are not theirs). 40 tokens wrap every window and chunk ring (8).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from nnxtron.infer.decode import prompt_batch, with_caches
from nnxtron.infer.paging import PagedLayout, Paging
from nnxtron.models.build import build_model
from tests.conftest import tiny_config
from tests.helpers import forward_logits
from tests.parity.test_kv_cache import FAMILIES, RELATIVE, SEQ, TOLERANCE

BLOCK = 4
CHUNK = 5
# a recurrent decoding state, not per-token entries: paged caches refuse it by name
# (tests/unit/test_qwen3_next.py::test_paged_decoding_caches_are_refused)
NOT_PAGEABLE = {"qwen3-next-tiny"}


def _run_chunks(cached, layout, caches, sequence: int, tokens: np.ndarray, start: int = 0):
    """Prefill ``tokens`` of ``sequence`` from position ``start`` in chunks; logits of each token."""
    out = []
    for done in range(0, len(tokens), CHUNK):
        chunk = tokens[done : done + CHUNK]
        assert layout.reserve(sequence, start + done + len(chunk))
        batch = prompt_batch([chunk], 8)
        step_caches = layout.with_tables(caches, [sequence])
        logits, caches = cached.step(
            step_caches,
            *(jnp.asarray(batch[k] + (start + done if k == "positions" else 0)) for k in ("tokens", "positions", "segment_ids")),
        )
        out.append(np.asarray(logits)[0, : len(chunk)])
    return np.concatenate(out), caches


@pytest.mark.parametrize("model_name", sorted(set(FAMILIES) - NOT_PAGEABLE))
def test_paged_logits_equal_the_full_forward(model_name):
    cfg = tiny_config(model_name, **FAMILIES[model_name])
    model = build_model(cfg)
    tokens = np.random.default_rng(0).integers(3, cfg.vocab_size, size=(3, SEQ)).astype(np.int32)
    full = np.asarray(forward_logits(model, jnp.asarray(tokens[:2])))
    paging = Paging(block_size=BLOCK, max_sequences=3)
    cached = with_caches(model, 1, SEQ, paging)
    layout = PagedLayout(cached.caches, paging, SEQ)
    caches = cached.caches

    # another sequence fills blocks with its own tokens and releases them
    _, caches = _run_chunks(cached, layout, caches, 9, tokens[2, :17])
    layout.release(9)

    sequences, prompts = (3, 5), (11, 6)  # sequence ids; row r of `tokens` is sequence sequences[r]
    for row, (sequence, n) in enumerate(zip(sequences, prompts)):
        logits, caches = _run_chunks(cached, layout, caches, sequence, tokens[row, :n])
        np.testing.assert_allclose(logits, full[row, :n], atol=TOLERANCE, rtol=RELATIVE, err_msg=f"prefill of row {row}")

    position = np.array(prompts)
    while position.min() < SEQ:
        live = np.flatnonzero(position < SEQ)
        ids = [sequences[r] for r in live] + [0] * (2 - len(live))  # 0: a padding row
        for r in live:
            assert layout.reserve(sequences[r], position[r] + 1)
        rows = np.concatenate([live, np.zeros(2 - len(live), int)])
        step_tokens = tokens[rows, np.minimum(position[rows], SEQ - 1)][:, None]
        valid = (np.arange(2) < len(live)).astype(np.int32)[:, None]
        step_caches = layout.with_tables(caches, ids)
        logits, caches = cached.step(
            step_caches, jnp.asarray(step_tokens), jnp.asarray(position[rows][:, None]), jnp.asarray(valid)
        )
        for i, r in enumerate(live):
            np.testing.assert_allclose(
                np.asarray(logits)[i, 0],
                full[r, position[r]],
                atol=TOLERANCE,
                rtol=RELATIVE,
                err_msg=f"row {r} pos {position[r]}",
            )
            position[r] += 1

    # memory follows the live tokens: a global cache holds ceil(40 / 4) blocks per sequence, a ring its width
    for width, group in layout.groups.items():
        expected = 2 * (SEQ // BLOCK if group.growing else width)
        assert group.capacity - len(group.free) == expected, (width, group.growing)
    layout.release(3), layout.release(5)
    assert layout.blocks_in_use() == 0


def test_a_global_cache_takes_blocks_as_its_sequence_grows():
    paging = Paging(block_size=BLOCK, max_sequences=2, global_blocks=5)
    model = build_model(tiny_config("llama3.1-tiny"))
    layout = PagedLayout(with_caches(model, 1, SEQ, paging).caches, paging, SEQ)
    (group,) = layout.groups.values()
    assert group.growing and group.capacity == 5
    assert layout.reserve(1, 1) and layout.blocks_in_use() == 1
    assert layout.reserve(1, 8) and layout.blocks_in_use() == 2
    assert layout.reserve(2, 9) and layout.blocks_in_use() == 5
    assert not layout.reserve(1, 9)  # no block left: nothing taken
    assert layout.blocks_in_use() == 5
    layout.release(2)
    assert layout.reserve(1, 9) and layout.blocks_in_use() == 3
