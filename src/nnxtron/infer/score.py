"""Scoring text with a model: per-token log-likelihoods, and a corpus's loss, perplexity and
bits per byte (``nnxtron eval``).

A corpus is read by the training data pipeline (the config's ``dataset_*`` keys, its
tokenizer, BOS/EOS, packing with per-document segments, ``use_sft`` records), once, in
order; every target the loss mask keeps is scored by the training loss's per-token
negative log-likelihood (``models.loss.token_nll``). Bits per byte divide the total by
``ln 2`` times the UTF-8 bytes of the documents' text (the EOS predictions included in
the total, as the loss includes them); with ``use_sft`` the scored tokens are the answers
and bits per byte is not defined.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
from collections.abc import Iterator

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from nnxtron.config.checks import mixture_sources
from nnxtron.config.schema import Config
from nnxtron.data.packing import row_arrays
from nnxtron.data.records import BadRecord, Corpus, open_corpus
from nnxtron.data.sources import row_spec, tokenizer_for
from nnxtron.data.stream import RowPacker, document_iterator
from nnxtron.errors import ConfigError
from nnxtron.models.loss import token_nll

__all__ = ["CorpusScore", "score_corpus", "score_tokens", "token_logprobs"]


@dataclasses.dataclass(frozen=True)
class CorpusScore:
    """Totals over a corpus: negative log-likelihood (nats) of ``tokens`` scored targets."""

    documents: int
    bad_records: int
    tokens: int
    nll: float
    bytes: int | None  # UTF-8 bytes of the documents' text (None: instruction records)

    @property
    def loss(self) -> float:
        return self.nll / max(self.tokens, 1)

    @property
    def perplexity(self) -> float:
        return math.exp(self.loss)

    @property
    def bits_per_byte(self) -> float | None:
        return None if not self.bytes else self.nll / (math.log(2) * self.bytes)

    def as_dict(self) -> dict:
        names = ("loss", "perplexity", "bits_per_byte")
        return {**dataclasses.asdict(self), **{name: getattr(self, name) for name in names}}


@functools.lru_cache(maxsize=8)
def _scorer(graphdef: nnx.GraphDef):
    def score(state, inputs, positions, segment_ids, targets):
        logits = nnx.merge(graphdef, state)(inputs, positions, segment_ids).logits.astype(jnp.float32)
        return -token_nll(logits, targets), jnp.argmax(logits, axis=-1).astype(jnp.int32)

    return jax.jit(score)


def score_tokens(model: nnx.Module, batch: dict[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """(``log p(targets[b, s] | inputs[b, :s+1])`` float32 ``[B, S]``, the most likely token at
    each position int32 ``[B, S]``) of a batch with ``inputs``, ``positions``, ``segment_ids``
    and ``targets`` (the loss mask is not applied)."""
    graphdef, state = nnx.split(model)
    keys = ("inputs", "positions", "segment_ids", "targets")
    logprobs, greedy = _scorer(graphdef)(state, *(jnp.asarray(batch[k]) for k in keys))
    return np.asarray(logprobs), np.asarray(greedy)


def token_logprobs(model: nnx.Module, batch: dict[str, np.ndarray]) -> np.ndarray:
    """``log p(targets[b, s] | inputs[b, :s+1])`` for every position, float32 ``[B, S]``
    (the batch keys of ``data.packing.BATCH_KEYS``; the loss mask is not applied)."""
    return score_tokens(model, batch)[0]


def score_corpus(model: nnx.Module, cfg: Config, batch_rows: int = 8) -> CorpusScore:
    """Score every document of the config's corpus (all its ``dataset_path`` sources) once."""
    if cfg.dataset_type == "synthetic":
        raise ConfigError("nnxtron eval needs a corpus: set dataset_type (text, jsonl, parquet, arrayrecord) and dataset_path")
    if batch_rows < 1:
        raise ConfigError(f"--batch-rows must be at least 1, got {batch_rows}")
    if cfg.use_dpo:
        raise ConfigError("nnxtron eval scores text or instruction answers, not preference pairs: unset use_dpo")
    tokenizer = tokenizer_for(cfg)
    spec = row_spec(cfg, tokenizer)
    patterns = [pattern for sources, _ in mixture_sources(cfg) for pattern in sources]
    corpus = open_corpus(cfg.dataset_type, patterns, cfg.dataset_text_field, records=cfg.use_sft)
    documents = document_iterator(corpus, np.arange(len(corpus)), tokenizer, spec, seed=None, epochs=1, read_threads=2)
    packer = RowPacker(documents, spec, tokenizer.pad_id)
    nll = 0.0
    try:
        for rows in _batches(packer, batch_rows, spec.seq_len + 1, tokenizer.pad_id):
            batch = row_arrays(*(np.stack(part) for part in zip(*rows)))
            logprobs = token_logprobs(model, batch).astype(np.float64)
            nll -= float(np.sum(logprobs * batch["loss_mask"]))
    finally:
        documents.close()
    counts = packer.counts
    text_bytes = None if cfg.use_sft else _text_bytes(corpus)
    return CorpusScore(counts["documents"], counts["bad_records"], counts["loss_targets"], nll, text_bytes)


def _batches(packer: RowPacker, rows: int, width: int, pad_id: int) -> Iterator[list]:
    """Rows of the packer in groups of ``rows``; the last group is padded with empty rows."""
    empty = (np.full(width, pad_id, np.int32), np.full(width, -1, np.int32), np.zeros(width, np.int32), np.ones(width, bool))
    while group := list(itertools.islice(packer, rows)):
        yield group + [empty] * (rows - len(group))


def _text_bytes(corpus: Corpus) -> int:
    total = 0
    for index in range(len(corpus)):
        try:
            total += len(corpus.text(index).encode("utf-8"))
        except BadRecord:
            continue  # skipped by the packer too (skip_bad_records), or it stopped the scoring
    return total
