"""Train and eval batch sources for a config."""

from __future__ import annotations

from nnxtron.config.schema import Config
from nnxtron.data.pipeline import BatchSource, SyntheticBatches, TextBatches
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
    if cfg.dataset_type == "synthetic":
        train = SyntheticBatches(cfg.vocab_size, seq, global_batch_size, seed=cfg.data_shuffle_seed)
        evaluation = SyntheticBatches(cfg.vocab_size, seq, global_batch_size, seed=cfg.data_shuffle_seed + EVAL_SEED_OFFSET)
        return train, evaluation if cfg.eval_interval > 0 else None
    tokenizer = tokenizer_for(cfg)
    common = dict(
        tokenizer=tokenizer,
        seq_len=seq,
        global_batch_size=global_batch_size,
        seed=cfg.data_shuffle_seed,
        eval_fraction=cfg.eval_split_fraction if cfg.eval_interval > 0 else 0.0,  # no eval: every file trains
        add_bos=cfg.add_bos,
        add_eos=cfg.add_eos,
    )
    train = TextBatches(list(cfg.dataset_path), split="train", **common)
    evaluation = TextBatches(list(cfg.dataset_path), split="eval", **common) if cfg.eval_interval > 0 else None
    return train, evaluation
