"""Data layer: tokenizer, text files, packing and deterministic, resumable batch sources."""

from nnxtron.data.packing import BATCH_KEYS, PackStats, pack_documents, pack_documents_with_stats
from nnxtron.data.pipeline import BatchSource, SyntheticBatches, TextBatches, eval_bucket
from nnxtron.data.text import load_documents, resolve_paths
from nnxtron.data.tokenizer import ByteTokenizer, Tokenizer, make_tokenizer

__all__ = [
    "BATCH_KEYS",
    "BatchSource",
    "ByteTokenizer",
    "PackStats",
    "SyntheticBatches",
    "TextBatches",
    "Tokenizer",
    "eval_bucket",
    "load_documents",
    "make_tokenizer",
    "pack_documents",
    "pack_documents_with_stats",
    "resolve_paths",
]
