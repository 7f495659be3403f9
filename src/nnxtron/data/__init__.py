"""Data layer: corpora of several formats, tokenizers, packing and resumable grain pipelines."""

from nnxtron.data.mixture import MixtureBatches, RowSchedule
from nnxtron.data.packing import BATCH_KEYS, PackStats, pack_documents, pack_documents_with_stats, row_arrays
from nnxtron.data.pipeline import BatchSource, CorpusBatches, DataIterator, SyntheticBatches, split_documents
from nnxtron.data.records import BadRecord, Corpus, open_corpus
from nnxtron.data.stream import RowSpec
from nnxtron.data.text import resolve_paths
from nnxtron.data.tokenizer import ByteTokenizer, Tokenizer, make_tokenizer

__all__ = [
    "BATCH_KEYS",
    "BadRecord",
    "BatchSource",
    "ByteTokenizer",
    "Corpus",
    "CorpusBatches",
    "DataIterator",
    "MixtureBatches",
    "PackStats",
    "RowSchedule",
    "RowSpec",
    "SyntheticBatches",
    "Tokenizer",
    "make_tokenizer",
    "open_corpus",
    "pack_documents",
    "pack_documents_with_stats",
    "resolve_paths",
    "row_arrays",
    "split_documents",
]
