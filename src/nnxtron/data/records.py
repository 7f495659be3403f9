"""Random-access documents of a corpus: text files, JSON Lines, Parquet and ArrayRecord.

A :class:`Corpus` numbers its documents ``0 .. len-1`` in sorted file order and reads any one
of them on demand (from several threads at once), so the pipeline can shuffle, shard and
resume by index without loading the corpus. Problems with a whole file (missing, unreadable,
not the format, no such field or column, no documents) raise :class:`DataError` when the
corpus is opened; a problem with one document raises :class:`BadRecord`, which names the file
and the record and which the pipeline either reports or counts and skips.
"""

from __future__ import annotations

import abc
import hashlib
import json
import os
import pathlib
import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import numpy as np

from nnxtron.config.options import DATASET_FORMATS
from nnxtron.data.text import resolve_paths
from nnxtron.errors import DataError

__all__ = ["ArrayRecords", "BadRecord", "Corpus", "JsonLines", "ParquetColumn", "TextFiles", "open_corpus"]

_SCAN_CHUNK = 1 << 24  # bytes per newline scan of a JSON Lines file


class BadRecord(Exception):
    """One unusable document: its message names the file, the record and what is wrong."""


class Corpus(abc.ABC):
    """The documents of some files, numbered in sorted file order."""

    kind: str
    unit: str = "record"  # what one document is, for messages: "file", "line", "row", "record"

    def __init__(self, paths: Sequence[pathlib.Path], counts: Sequence[int]) -> None:
        self.paths = list(paths)
        self.counts = np.asarray(counts, dtype=np.int64)
        self.offsets = np.concatenate([[0], np.cumsum(self.counts)])
        if self.offsets[-1] == 0:
            names = ", ".join(f"'{p}'" for p in self.paths[:3]) + (" ..." if len(self.paths) > 3 else "")
            raise DataError(f"dataset file(s) {names} hold no {self.unit}s of text; add documents or fix dataset_path")

    def __len__(self) -> int:
        return int(self.offsets[-1])

    def locate(self, index: int) -> tuple[int, int]:
        """(file number, index within that file) of document ``index``."""
        if not 0 <= index < len(self):
            raise IndexError(f"document {index} of {len(self)}")
        file = int(np.searchsorted(self.offsets, index, side="right")) - 1
        return file, index - int(self.offsets[file])

    def where(self, index: int) -> str:
        """Where document ``index`` lives, for messages: ``'path' line 7``."""
        file, local = self.locate(index)
        return f"'{self.paths[file]}'" + ("" if self.unit == "file" else f" {self.unit} {local + self.first_number}")

    first_number = 0  # how records are numbered in messages (lines count from 1)

    def text(self, index: int) -> str:
        """The text of document ``index``; :class:`BadRecord` when it has none."""
        file, local = self.locate(index)
        try:
            text = self._read(file, local)
        except BadRecord as err:
            raise BadRecord(f"{self.where(index)}: {err}") from None
        if not text.strip():
            raise BadRecord(f"{self.where(index)}: the document is empty (or only whitespace)")
        return text

    def whole_file(self, index: int) -> pathlib.Path | None:
        """The file that is document ``index`` when a document is a whole file (``text``), else None."""
        return None

    @abc.abstractmethod
    def _read(self, file: int, local: int) -> str:
        """Text of record ``local`` of file ``file``; BadRecord(reason) if unusable."""

    def record(self, index: int) -> dict:
        """The whole record of document ``index`` (a JSON object, a Parquet row): what an
        instruction (SFT) row is read from; :class:`BadRecord` when it is not an object."""
        file, local = self.locate(index)
        try:
            value = self._object(file, local)
            if not isinstance(value, dict):
                raise BadRecord(f"is a JSON {type(value).__name__}, not an object")
        except BadRecord as err:
            raise BadRecord(f"{self.where(index)}: {err}") from None
        return value

    def _object(self, file: int, local: int) -> object:
        raise DataError(
            f"dataset_type={self.kind} holds plain text, not records; instruction data (use_sft=true) needs "
            "dataset_type jsonl, parquet or arrayrecord (JSON records)"
        )

    def keys(self) -> np.ndarray:
        """A stable 64-bit key per document: its file's path relative to the corpus root and its
        index in the file, so a split by key is the same wherever the corpus lives and adding a
        file does not move the documents of the others."""
        root = os.path.commonpath([str(p.parent) for p in self.paths])
        parts = []
        for path, count in zip(self.paths, self.counts):
            digest = hashlib.sha256(os.path.relpath(path, root).encode("utf-8")).digest()
            salt = np.uint64(int.from_bytes(digest[:8], "big"))
            parts.append(_mix(np.arange(count, dtype=np.uint64) ^ salt))
        return np.concatenate(parts) if parts else np.zeros(0, np.uint64)

    def describe(self) -> str:
        """``168 text files`` or ``1,000 jsonl lines in 3 files``."""
        if self.unit == "file":
            return f"{len(self):,} {self.kind} files"
        return f"{len(self):,} {self.kind} {self.unit}s in {len(self.paths):,} file{'s' if len(self.paths) != 1 else ''}"


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64 finaliser: well-spread 64-bit keys from nearby integers."""
    with np.errstate(over="ignore"):
        x = (x + np.uint64(0x9E3779B97F4A7C15)) & np.uint64(0xFFFFFFFFFFFFFFFF)
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return x ^ (x >> np.uint64(31))


def _decode(raw: bytes, what: str) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise BadRecord(f"{what} is not valid UTF-8 (bad byte at offset {e.start})") from None


def _loads(text: str) -> object:
    """``json.loads``; a document nested too deeply for the parser is invalid JSON like any other."""
    try:
        return json.loads(text)
    except RecursionError:
        raise ValueError("nested too deeply to parse") from None


def _field(value: object, field: str) -> str:
    """``value[field]`` of a parsed JSON document, which must be a string."""
    if not isinstance(value, dict):
        raise BadRecord(f"is a JSON {type(value).__name__}, not an object with a {field!r} field")
    if field not in value:
        shown = ", ".join(repr(k) for k in list(value)[:8])
        raise BadRecord(f"has no {field!r} field (it has {shown}); set dataset_text_field to the text field")
    text = value[field]
    if not isinstance(text, str):
        raise BadRecord(f"field {field!r} is a {type(text).__name__}, not a string")
    return text


class TextFiles(Corpus):
    """One document per file: the file's UTF-8 text."""

    kind, unit = "text", "file"

    def __init__(self, paths: Sequence[pathlib.Path]) -> None:
        super().__init__(paths, [1] * len(paths))

    def whole_file(self, index: int) -> pathlib.Path | None:
        return self.paths[self.locate(index)[0]]

    def _read(self, file: int, local: int) -> str:
        path = self.paths[file]
        try:
            raw = path.read_bytes()
        except OSError as e:
            raise BadRecord(f"cannot be read ({e.strerror or e})") from None
        return _decode(raw, "the file")


class JsonLines(Corpus):
    """One document per non-blank line: the string ``field`` of the JSON object on it."""

    kind, unit, first_number = "jsonl", "line", 1

    def __init__(self, paths: Sequence[pathlib.Path], field: str | None) -> None:
        self.field = field  # None: whole records (record(), not text())
        self._lines = []  # (start byte, end byte, line number) of each line holding a document
        for path in paths:
            try:
                self._lines.append(self._index(path))
            except OSError as e:
                raise DataError(
                    f"cannot read dataset file '{path}' ({e.strerror or e}); fix its permissions or remove it"
                ) from None
        super().__init__(paths, [len(lines[0]) for lines in self._lines])
        for path, (starts, ends, _) in zip(self.paths, self._lines):
            if len(starts) and field is not None:  # the first document shows a wrong field name at once
                first = _read_range(path, int(starts[0]), int(ends[0]))
                try:
                    value = _loads(first)
                except ValueError:
                    continue  # a bad line is a bad record (reported or skipped when read)
                if isinstance(value, dict) and field not in value:
                    shown = ", ".join(repr(k) for k in list(value)[:8])
                    raise DataError(
                        f"the first line of '{path}' has no {field!r} field (it has {shown}); "
                        "set dataset_text_field to the field holding the text"
                    )

    @staticmethod
    def _index(path: pathlib.Path) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Byte ranges and 1-based numbers of the lines of ``path`` that are not blank (a blank
        line holds only JSON whitespace: spaces, tabs, carriage returns)."""
        size = path.stat().st_size
        ends, filled = [], []  # newline positions; non-whitespace bytes before each of them
        seen = 0
        if size:
            data = np.memmap(path, dtype=np.uint8, mode="r")
            for start in range(0, size, _SCAN_CHUNK):
                chunk = data[start : start + _SCAN_CHUNK]
                newline = chunk == 10
                text = ~(newline | (chunk == 32) | (chunk == 9) | (chunk == 13))
                counts = np.cumsum(text, dtype=np.int64)
                at = np.flatnonzero(newline)
                ends.append(at + start)
                filled.append(counts[at] + seen)
                seen += int(counts[-1])
            del data
        ends = np.concatenate([*ends, [size]]).astype(np.int64)
        filled = np.concatenate([*filled, [seen]])
        starts = np.concatenate([[0], ends[:-1] + 1])
        numbers = np.arange(1, len(starts) + 1)
        keep = np.diff(filled, prepend=0) > 0
        return starts[keep], ends[keep], numbers[keep]

    def where(self, index: int) -> str:
        file, local = self.locate(index)
        return f"'{self.paths[file]}' line {int(self._lines[file][2][local])}"

    def _object(self, file: int, local: int) -> object:
        starts, ends, _ = self._lines[file]
        raw = _read_range(self.paths[file], int(starts[local]), int(ends[local]))
        line = _decode(raw, "the line")
        try:
            return _loads(line)
        except ValueError as e:
            raise BadRecord(f"is not valid JSON ({e})") from None

    def _read(self, file: int, local: int) -> str:
        return _field(self._object(file, local), self.field or "text")


def _read_range(path: pathlib.Path, start: int, end: int) -> bytes:
    try:
        fd = os.open(path, os.O_RDONLY)
        try:
            return os.pread(fd, end - start, start)
        finally:
            os.close(fd)
    except OSError as e:
        raise BadRecord(f"cannot be read ({e.strerror or e})") from None


class ParquetColumn(Corpus):
    """One document per row: the string ``column`` of a Parquet file. Row groups are read
    whole and the last few are kept (reads of nearby rows are cheap)."""

    kind, unit = "parquet", "row"
    cached_groups = 4

    def __init__(self, paths: Sequence[pathlib.Path], column: str | None) -> None:
        import pyarrow as pa
        import pyarrow.parquet as pq

        self.column = column  # None: whole rows (record(), not text())
        self._files, self._group_starts = [], []
        for path in paths:
            try:
                handle = pq.ParquetFile(path)
            except (pa.ArrowException, OSError) as e:
                raise DataError(f"'{path}' is not a readable Parquet file ({_first_line(e)}); repair or remove it") from None
            if column is not None:
                _check_text_column(handle, path, column)
            rows = [handle.metadata.row_group(g).num_rows for g in range(handle.num_row_groups)]
            self._files.append(handle)
            self._group_starts.append(np.concatenate([[0], np.cumsum(rows, dtype=np.int64)]))
        super().__init__(paths, [int(s[-1]) for s in self._group_starts])
        self._lock = threading.Lock()
        self._cache: OrderedDict[tuple[int, int], list] = OrderedDict()

    def _group(self, file: int, group: int) -> list:
        key = (file, group)
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
            try:
                table = self._files[file].read_row_group(group, columns=None if self.column is None else [self.column])
                values = table.to_pylist() if self.column is None else table.column(0).to_pylist()
            except Exception as e:  # noqa: BLE001 - pyarrow raises many kinds for damaged pages
                raise BadRecord(f"row group {group} cannot be read ({_first_line(e)})") from None
            self._cache[key] = values
            while len(self._cache) > self.cached_groups:
                self._cache.popitem(last=False)
            return values

    def _object(self, file: int, local: int) -> object:
        starts = self._group_starts[file]
        group = int(np.searchsorted(starts, local, side="right")) - 1
        return self._group(file, group)[local - int(starts[group])]

    def _read(self, file: int, local: int) -> str:
        value = self._object(file, local)
        if value is None:
            raise BadRecord(f"column {self.column!r} is null")
        return value


def _check_text_column(handle: Any, path: pathlib.Path, column: str) -> None:
    import pyarrow as pa

    names = handle.schema_arrow.names
    if column not in names:
        shown = ", ".join(repr(n) for n in names[:12])
        raise DataError(
            f"Parquet file '{path}' has no column {column!r} (it has {shown}); set dataset_text_field to the text column"
        )
    kind = handle.schema_arrow.field(column).type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
        raise DataError(f"column {column!r} of Parquet file '{path}' holds {kind}, not strings; choose a text column")


class ArrayRecords(Corpus):
    """One document per ArrayRecord record: UTF-8 text, or with ``field`` a JSON object whose
    string ``field`` is the text. (``tf.train.Example`` records would need TensorFlow.)"""

    kind = "arrayrecord"

    def __init__(self, paths: Sequence[pathlib.Path], field: str = "") -> None:
        from array_record.python.array_record_module import ArrayRecordReader

        self.field = field
        self._readers, self._locks = [], []
        for path in paths:
            try:
                reader = ArrayRecordReader(str(path))
                ok, count = reader.ok(), reader.num_records()
            except Exception as e:  # noqa: BLE001 - the C++ reader raises plain RuntimeErrors
                ok, count, why = False, 0, _first_line(e)
            else:
                why = "damaged, truncated or another format"
            if not ok:
                raise DataError(f"'{path}' is not a readable ArrayRecord file ({why}); repair or remove it") from None
            self._readers.append((reader, count))
            self._locks.append(threading.Lock())
        super().__init__(paths, [count for _, count in self._readers])

    def _raw(self, file: int, local: int) -> bytes:
        with self._locks[file]:
            try:
                return self._readers[file][0].read([local])[0]
            except Exception as e:  # noqa: BLE001
                raise BadRecord(f"cannot be read ({_first_line(e)})") from None

    def _object(self, file: int, local: int) -> object:
        try:
            return _loads(_decode(self._raw(file, local), "the record"))
        except ValueError as e:
            raise BadRecord(f"is not a JSON object ({e})") from None

    def _read(self, file: int, local: int) -> str:
        raw = self._raw(file, local)
        if not self.field:
            try:
                return raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise BadRecord(
                    f"is not UTF-8 text (bad byte at offset {e.start}); ArrayRecord records must hold the document "
                    "text, or a JSON object with dataset_text_field set (tf.train.Example is not supported)"
                ) from None
        try:
            value = _loads(_decode(raw, "the record"))
        except ValueError as e:
            raise BadRecord(f"is not a JSON object ({e}) although dataset_text_field is set") from None
        return _field(value, self.field)


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


def open_corpus(
    kind: str, patterns: Sequence[str | os.PathLike] | str | os.PathLike, text_field: str = "", records: bool = False
) -> Corpus:
    """The corpus of ``kind`` over the files named by ``patterns`` (files, directories, globs).

    ``text_field`` is the JSON field / Parquet column holding the text (default ``"text"``);
    for ArrayRecord it means the records are JSON objects. Plain text files take none.
    ``records``: the documents are whole records (``Corpus.record``), e.g. instruction rows."""
    paths = resolve_paths(patterns)
    if records:
        if kind == "text":
            raise DataError(
                "dataset_type=text holds plain text, not records; instruction data (use_sft=true) needs "
                "dataset_type jsonl, parquet or arrayrecord (JSON records)"
            )
        if text_field:
            raise DataError("dataset_text_field is not read with use_sft=true (rows are whole records); unset it")
        return {"jsonl": JsonLines, "parquet": ParquetColumn, "arrayrecord": ArrayRecords}[kind](paths, None)
    if kind == "text":
        if text_field:
            raise DataError("dataset_text_field is not read for dataset_type=text (one document per file); unset it")
        return TextFiles(paths)
    if kind == "jsonl":
        return JsonLines(paths, text_field or "text")
    if kind == "parquet":
        return ParquetColumn(paths, text_field or "text")
    if kind == "arrayrecord":
        return ArrayRecords(paths, text_field)
    raise DataError(f"unknown dataset_type {kind!r}; use one of: synthetic, {', '.join(DATASET_FORMATS)}")
