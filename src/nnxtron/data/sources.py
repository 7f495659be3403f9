"""Train and eval batch sources for a config."""

from __future__ import annotations

from nnxtron.config.schema import Config
from nnxtron.data.pipeline import BatchSource, CorpusBatches, SyntheticBatches, split_documents
from nnxtron.data.records import open_corpus
from nnxtron.data.stream import RowSpec
from nnxtron.data.tokenizer import Tokenizer, make_tokenizer
from nnxtron.errors import ConfigError

EVAL_SEED_OFFSET = 1_000_003  # synthetic eval batches come from a different stream


def tokenizer_for(cfg: Config) -> Tokenizer:
    """The config's tokenizer, checked against the model's vocabulary."""
    tokenizer = make_tokenizer(cfg.tokenizer_type, cfg.tokenizer_path)
    if cfg.vocab_size < tokenizer.vocab_size:
        raise ConfigError(
            f"vocab_size={cfg.vocab_size} is smaller than the {cfg.tokenizer_type} tokenizer's "
            f"{tokenizer.vocab_size} ids; set vocab_size >= {tokenizer.vocab_size}"
        )
    return tokenizer


def make_sources(cfg: Config, global_batch_size: int) -> tuple[BatchSource, BatchSource | None]:
    """(train, eval) sources; eval is None when periodic eval is off."""
    seq = cfg.max_target_length
    evaluate = cfg.eval_interval > 0
    if cfg.dataset_type == "synthetic":
        train = SyntheticBatches(cfg.vocab_size, seq, global_batch_size, seed=cfg.data_shuffle_seed)
        evaluation = SyntheticBatches(cfg.vocab_size, seq, global_batch_size, seed=cfg.data_shuffle_seed + EVAL_SEED_OFFSET)
        return train, evaluation if evaluate else None
    tokenizer = tokenizer_for(cfg)
    corpus = open_corpus(cfg.dataset_type, cfg.dataset_path, cfg.dataset_text_field)
    train_docs, eval_docs = split_documents(corpus, cfg.eval_split_fraction if evaluate else 0.0)  # no eval: all train
    spec = RowSpec(
        seq_len=seq,
        packing=cfg.packing,
        truncate_documents=cfg.truncate_documents,
        add_bos=cfg.add_bos,
        add_eos=cfg.add_eos,
        skip_bad_records=cfg.skip_bad_records,
    )
    common = dict(
        read_threads=cfg.data_read_threads, prefetch=cfg.data_prefetch_batches, stats_documents=cfg.data_stats_documents
    )
    epochs = None if cfg.data_num_epochs == -1 else cfg.data_num_epochs
    train = CorpusBatches(
        corpus, train_docs, tokenizer, spec, global_batch_size, split="train", seed=cfg.data_shuffle_seed, epochs=epochs, **common
    )
    evaluation = (
        CorpusBatches(corpus, eval_docs, tokenizer, spec, global_batch_size, split="eval", **common) if evaluate else None
    )
    return train, evaluation
