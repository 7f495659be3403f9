"""Scoring text with a model: per-token log-likelihoods, and a corpus's loss, perplexity and
bits per byte (``nnxtron eval``).

A corpus is read by the training data pipeline (the config's ``dataset_*`` keys, its
tokenizer, BOS/EOS, packing with per-document segments, ``use_sft`` records), once, in
order (all of it, or the split a training run held out: ``held_out``); every target the
loss mask keeps is scored by the training loss's per-token negative log-likelihood
(``models.loss.token_nll``). Bits per byte divide the total by
``ln 2`` times the UTF-8 bytes of the documents' text (the EOS predictions included in
the total, as the loss includes them); with ``use_sft`` the scored tokens are the answers
and bits per byte is not defined.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
from collections.abc import Callable, Iterator

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from nnxtron.config.checks import mixture_sources
from nnxtron.config.schema import Config
from nnxtron.data.packing import row_arrays
from nnxtron.data.pipeline import split_documents
from nnxtron.data.records import BadRecord, Corpus, open_corpus
from nnxtron.data.sources import row_spec, tokenizer_for
from nnxtron.data.stream import RowPacker, document_iterator
from nnxtron.errors import ConfigError
from nnxtron.models.loss import token_nll

__all__ = [
    "CORPUS_KEYS",
    "CorpusScore",
    "held_out_by_training",
    "run_corpus_line",
    "score_corpus",
    "score_tokens",
    "token_logprobs",
]

# the keys that choose a corpus: `nnxtron eval RUN` without any of them scores the run's own
CORPUS_KEYS = ("dataset_type", "dataset_path", "dataset_weights", "grain_train_files")


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


def held_out_by_training(cfg: Config) -> bool:
    """Whether a run trained with ``cfg`` held documents out of training: its eval split
    (``eval_split_fraction``) is taken only with periodic eval on (``data/sources.py``)."""
    return cfg.dataset_type != "synthetic" and cfg.eval_interval > 0 and cfg.eval_split_fraction > 0


def run_corpus_line(cfg: Config, held_out: bool, described: str) -> str:
    """The start-up line of `nnxtron eval RUN` scoring the run's own training corpus."""
    another = "give dataset_type= and dataset_path= to score another corpus"
    if held_out:
        return (
            f"scoring the run's training corpus, its held-out split: {described} (eval_split_fraction="
            f"{cfg.eval_split_fraction:g}, the documents training did not see); {another}"
        )
    why = f"eval_interval={cfg.eval_interval}: the run held none out" if cfg.eval_split_fraction > 0 else "eval_split_fraction=0"
    return f"scoring the run's training corpus, all of it: {described} ({why}, so training saw them); {another}"


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


def score_corpus(
    model: nnx.Module,
    cfg: Config,
    batch_rows: int = 8,
    held_out: bool = False,
    announce: Callable[[str], None] | None = None,
) -> CorpusScore:
    """Score every document of the config's corpus (all its ``dataset_path`` sources) once;
    with ``held_out``, only the documents a training run with this config holds out for its
    eval (each source's ``eval_split_fraction`` split, ``data.pipeline.split_documents``).
    ``announce`` is called with what will be scored (``1 of 3 text files in 'docs/*.txt'``)
    once the corpus is open, before the scoring starts."""
    if cfg.dataset_type == "synthetic":
        raise ConfigError("nnxtron eval needs a corpus: set dataset_type (text, jsonl, parquet, arrayrecord) and dataset_path")
    if batch_rows < 1:
        raise ConfigError(f"--batch-rows must be at least 1, got {batch_rows}")
    if cfg.use_dpo:
        raise ConfigError("nnxtron eval scores text or instruction answers, not preference pairs: unset use_dpo")
    tokenizer = tokenizer_for(cfg)
    spec = row_spec(cfg, tokenizer)
    parts, described = [], []
    for patterns, _ in mixture_sources(cfg):  # without dataset_weights: one source, all of dataset_path
        corpus = open_corpus(cfg.dataset_type, patterns, cfg.dataset_text_field, records=cfg.use_sft)
        chosen = split_documents(corpus, cfg.eval_split_fraction)[1] if held_out else np.arange(len(corpus))
        parts.append((corpus, chosen))
        share = f"{len(chosen):,} of " if held_out else ""
        described.append(f"{share}{corpus.describe()} in {', '.join(repr(str(p)) for p in patterns)}")
    if announce is not None:
        announce("; ".join(described))
    totals, nll, text_bytes = {"documents": 0, "bad_records": 0, "loss_targets": 0}, 0.0, 0
    for corpus, chosen in parts:
        stream = document_iterator(corpus, chosen, tokenizer, spec, seed=None, epochs=1, read_threads=2)
        packer = RowPacker(stream, spec, tokenizer.pad_id)
        try:
            for rows in _batches(packer, batch_rows, spec.seq_len + 1, tokenizer.pad_id):
                batch = row_arrays(*(np.stack(part) for part in zip(*rows)))
                logprobs = token_logprobs(model, batch).astype(np.float64)
                nll -= float(np.sum(logprobs * batch["loss_mask"]))
        finally:
            stream.close()
        totals = {key: value + packer.counts[key] for key, value in totals.items()}
        text_bytes += 0 if cfg.use_sft else _text_bytes(corpus, chosen)
    counts = (totals["documents"], totals["bad_records"], totals["loss_targets"])
    return CorpusScore(*counts, nll, None if cfg.use_sft else text_bytes)


def _batches(packer: RowPacker, rows: int, width: int, pad_id: int) -> Iterator[list]:
    """Rows of the packer in groups of ``rows``; the last group is padded with empty rows."""
    empty = (np.full(width, pad_id, np.int32), np.full(width, -1, np.int32), np.zeros(width, np.int32), np.ones(width, bool))
    while group := list(itertools.islice(packer, rows)):
        yield group + [empty] * (rows - len(group))


def _text_bytes(corpus: Corpus, chosen: np.ndarray) -> int:
    total = 0
    for index in chosen:
        try:
            total += len(corpus.text(int(index)).encode("utf-8"))
        except BadRecord:
            continue  # skipped by the packer too (skip_bad_records), or it stopped the scoring
    return total
