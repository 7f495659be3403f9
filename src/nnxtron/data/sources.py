"""Train and eval batch sources for a config."""

from __future__ import annotations

from pathlib import Path

from nnxtron.config.checks import mixture_sources
from nnxtron.config.loader import RUN_TOKENIZER_DIR
from nnxtron.config.schema import Config
from nnxtron.data.chat_template import RenderLimits, find_chat_template, template_directory
from nnxtron.data.mixture import MixtureBatches, source_seed
from nnxtron.data.pipeline import BatchSource, CorpusBatches, SyntheticBatches, split_documents
from nnxtron.data.records import open_corpus
from nnxtron.data.sft import SFTFormat, check_tokenizer
from nnxtron.data.stream import RowSpec
from nnxtron.data.tokenizer import Tokenizer, make_tokenizer
from nnxtron.data.tokenizer_files import copy_tokenizer, write_chat_template
from nnxtron.errors import ConfigError, DataError, UserError

EVAL_SEED_OFFSET = 1_000_003  # synthetic eval batches come from a different stream
BYTE_MODEL_VOCAB_LIMIT = 512  # the byte tokenizer's 259 ids, padded; a larger vocabulary is another tokenizer's


def tokenizer_for(cfg: Config) -> Tokenizer:
    """The config's tokenizer, checked against the model's vocabulary."""
    tokenizer = make_tokenizer(cfg.tokenizer_type, cfg.tokenizer_path)
    if cfg.tokenizer_type == "byte" and cfg.vocab_size > BYTE_MODEL_VOCAB_LIMIT:
        raise ConfigError(
            f"vocab_size={cfg.vocab_size} but tokenizer_type=byte covers {tokenizer.vocab_size} ids: the model is made "
            "for another tokenizer; set tokenizer_type and tokenizer_path to its tokenizer (an HF directory or a run "
            f"carries its own), or vocab_size <= {BYTE_MODEL_VOCAB_LIMIT} for a byte-level model"
        )
    if cfg.vocab_size < tokenizer.vocab_size:
        raise ConfigError(
            f"vocab_size={cfg.vocab_size} is smaller than the {cfg.tokenizer_type} tokenizer's "
            f"{tokenizer.vocab_size} ids; set vocab_size >= {tokenizer.vocab_size}"
        )
    return tokenizer


def tokenizer_directories(cfg: Config, model: str | Path | None = None) -> list[Path]:
    """Where a model's chat template and generation settings may be, in order: its tokenizer's
    directory (a run's ``tokenizer/``, an HF directory), the ``tokenizer/`` of the model
    directory ``model`` (a run: there even with the byte tokenizer) and ``model`` itself, then
    the same of ``init_from`` (what a new run starts from)."""
    found = []
    if cfg.tokenizer_path:
        path = Path(cfg.tokenizer_path).expanduser()
        found.append(path if path.is_dir() else path.parent)
    for source in (model, cfg.init_from or None):
        if source is not None:
            found += [Path(source).expanduser() / RUN_TOKENIZER_DIR, Path(source).expanduser()]
    unique: list[Path] = []
    for directory in found:
        if directory.is_dir() and directory.resolve() not in [d.resolve() for d in unique]:
            unique.append(directory)
    return unique


def sft_format(cfg: Config, tokenizer: Tokenizer) -> SFTFormat:
    """How ``use_sft`` and ``use_dpo`` render records: ``chat_template_path``, else the template
    that came with the model (``tokenizer_directories``; none: only plain-text records are usable),
    under the ``chat_template_timeout`` / ``_memory_mib`` / ``_max_chars`` limits."""
    check_tokenizer(tokenizer)
    file = chat_template_file(cfg)
    limits = RenderLimits(cfg.chat_template_timeout, cfg.chat_template_memory_mib, cfg.chat_template_max_chars)
    try:
        template, _ = find_chat_template(tokenizer_directories(cfg), tokenizer, None if file is None else str(file), limits)
    except UserError as err:
        raise ConfigError(f"{'use_dpo' if cfg.use_dpo else 'use_sft'}=true: {err}") from None
    return SFTFormat(template, completion_only=cfg.sft_train_on_completion_only)


def chat_template_file(cfg: Config) -> Path | None:
    """``chat_template_path`` (checked to be a file), or None."""
    file = Path(cfg.chat_template_path).expanduser() if cfg.chat_template_path else None
    if file is not None and not file.is_file():
        raise ConfigError(f"chat_template_path={cfg.chat_template_path!r} is not a file; point it at a Jinja chat template")
    return file


def keep_tokenizer(cfg: Config, dest: Path) -> str:
    """Copy the config's tokenizer files into a run's ``dest`` (``copy_tokenizer``) with the chat
    template the run uses when they do not hold it (``chat_template_path``, or one that came from
    ``init_from``), so that the run's later users (``serve``, ``generate --chat``, ``init_from``,
    ``convert to-hf``) find it; the path to read the tokenizer back from."""
    tokenizer = make_tokenizer(cfg.tokenizer_type, cfg.tokenizer_path)
    kept = copy_tokenizer(tokenizer, dest)
    file = chat_template_file(cfg)
    if file is None:
        source = template_directory(tokenizer_directories(cfg))
        if source is None or (dest.is_dir() and template_directory([dest]) is not None):
            return kept  # no template, or the copied files hold it
        template, _ = find_chat_template([source], tokenizer)
        text = template.template
    else:
        text = file.read_text(encoding="utf-8")
    write_chat_template(tokenizer, dest, text)
    return kept


def row_spec(cfg: Config, tokenizer: Tokenizer) -> RowSpec:
    """How the config's documents become rows of ``max_target_length``."""
    return RowSpec(
        seq_len=cfg.max_target_length,
        packing=cfg.packing,
        truncate_documents=cfg.truncate_documents,
        add_bos=cfg.add_bos,
        add_eos=cfg.add_eos,
        skip_bad_records=cfg.skip_bad_records,
        sft=sft_format(cfg, tokenizer) if cfg.use_sft else None,
        preference=sft_format(cfg, tokenizer) if cfg.use_dpo else None,
    )


def make_sources(cfg: Config, global_batch_size: int) -> tuple[BatchSource, BatchSource | None]:
    """(train, eval) sources; eval is None when periodic eval is off. Several sources (``dataset_weights``,
    ``grain_train_files``) make a :class:`MixtureBatches` of one :class:`CorpusBatches` per source."""
    seq = cfg.max_target_length
    evaluate = cfg.eval_interval > 0
    if cfg.dataset_type == "synthetic":
        train = SyntheticBatches(cfg.vocab_size, seq, global_batch_size, seed=cfg.data_shuffle_seed)
        evaluation = SyntheticBatches(cfg.vocab_size, seq, global_batch_size, seed=cfg.data_shuffle_seed + EVAL_SEED_OFFSET)
        return train, evaluation if evaluate else None
    tokenizer = tokenizer_for(cfg)
    spec = row_spec(cfg, tokenizer)
    common = dict(
        read_threads=cfg.data_read_threads, prefetch=cfg.data_prefetch_batches, stats_documents=cfg.data_stats_documents
    )
    epochs = None if cfg.data_num_epochs == -1 else cfg.data_num_epochs
    mixture = mixture_sources(cfg)
    trains, evals = [], []
    for i, (patterns, _) in enumerate(mixture):
        try:
            corpus = open_corpus(cfg.dataset_type, patterns, cfg.dataset_text_field, records=cfg.use_sft or cfg.use_dpo)
            train_docs, eval_docs = split_documents(corpus, cfg.eval_split_fraction if evaluate else 0.0)  # no eval: all train
            seed = source_seed(cfg.data_shuffle_seed, i)
            trains.append(CorpusBatches(corpus, train_docs, tokenizer, spec, global_batch_size, split="train", seed=seed,
                                        epochs=epochs, **common))  # fmt: skip
            if evaluate:
                evals.append(CorpusBatches(corpus, eval_docs, tokenizer, spec, global_batch_size, split="eval", **common))
        except DataError as err:
            if len(mixture) == 1:
                raise
            raise DataError(f"dataset source {i + 1} of {len(mixture)} {_label(patterns)}: {err}") from None
    if len(mixture) == 1:  # one corpus: today's pipeline and iterator state, unchanged
        return trains[0], evals[0] if evaluate else None
    weights, labels = [w for _, w in mixture], [_label(p) for p, _ in mixture]
    mix = dict(seed=cfg.data_shuffle_seed, prefetch=cfg.data_prefetch_batches)
    return MixtureBatches(trains, weights, labels, **mix), MixtureBatches(evals, weights, labels, **mix) if evaluate else None


def _label(patterns: tuple[str, ...]) -> str:
    return ", ".join(repr(p) for p in patterns)
