"""A large text file read with the byte tokenizer: its ids read from the file as they are packed.

A ``dataset_type=text`` document is a whole file. Tokenized whole, a 100 MB file became a
400 MB array of ids, made through its bytes, its text and an int64 copy, in each reader thread,
and kept for each copy waiting in the reader threads' buffer (up to 64 documents): ``nnxtron
train`` on one 100 MB file held 5.6 GB, on one 3 MB file 1.4 GB. The byte tokenizer's ids are
the file's bytes plus a constant, one per byte, so they need not be made in advance:
:class:`FileTokens` knows its size from the file's and reads the ids of the slices the packer
asks for, through a window of ``WINDOW_BYTES``. Before the document is used,
:class:`TextFileCheck` reads the file once in pieces for what reading it whole checks: valid
UTF-8, not only whitespace (the same messages).

A file over ``STREAM_BYTES`` is read this way (so the buffer holds at most 64 x 256 KiB of
text read whole); the rows are exactly those of reading it whole. Other tokenizers read a file
whole: the ids at a point of the text depend on the text around it.
"""

from __future__ import annotations

import codecs
import pathlib
import threading
from collections import OrderedDict
from collections.abc import Sequence

import numpy as np

from nnxtron.errors import DataError

__all__ = ["STREAM_BYTES", "FileTokens", "TextFileCheck"]

STREAM_BYTES = 1 << 18  # a text file larger than this (256 KiB) is read in pieces with the byte tokenizer
WINDOW_BYTES = 1 << 20  # bytes read at a time


class FileTokens:
    """The ids ``head + [b + offset for each byte b of the file] + tail``: ``size`` and slices
    ``[start:stop]`` (an int32 array), as the packer reads a document's tokens."""

    def __init__(self, path: pathlib.Path, offset: int, head: Sequence[int], tail: Sequence[int]) -> None:
        self.path, self.offset = path, offset
        self.head, self.tail = np.asarray(head, np.int32), np.asarray(tail, np.int32)
        self.file_bytes = path.stat().st_size
        self.size = self.head.size + self.file_bytes + self.tail.size
        self._start, self._ids = 0, np.zeros(0, np.int32)  # the ids of the file's bytes [start, start + len)

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, key: slice) -> np.ndarray:
        if not isinstance(key, slice) or key.step not in (None, 1):
            raise TypeError(f"FileTokens are read by contiguous slices, not {key!r}")
        start, stop, _ = key.indices(self.size)
        head, end = self.head.size, self.head.size + self.file_bytes
        parts = [self.head[start:stop]]
        if max(start, head) < min(stop, end):
            parts.append(self._file_ids(max(start, head) - head, min(stop, end) - head))
        parts.append(self.tail[max(start - end, 0) : max(stop - end, 0)])
        parts = [part for part in parts if part.size]
        return parts[0] if len(parts) == 1 else np.concatenate(parts) if parts else np.zeros(0, np.int32)

    def _file_ids(self, start: int, stop: int) -> np.ndarray:
        """The ids of the file's bytes ``[start, stop)``, from the window (read again when it does not hold them)."""
        if not (self._start <= start and stop <= self._start + self._ids.size):
            count = min(max(WINDOW_BYTES, stop - start), self.file_bytes - start)
            try:
                with open(self.path, "rb") as file:
                    file.seek(start)
                    raw = file.read(count)
            except OSError as err:
                raise DataError(f"'{self.path}' cannot be read any more ({err.strerror or err}); fix the file") from None
            if len(raw) < count:
                raise DataError(f"'{self.path}' became shorter while it was read; leave the training data as it is")
            self._start, self._ids = start, np.frombuffer(raw, np.uint8).astype(np.int32) + np.int32(self.offset)
        return self._ids[start - self._start : stop - self._start]


class TextFileCheck:
    """Whether a text file is a usable document, read in pieces (``WINDOW_BYTES``): its problem, as
    reading it whole words it, or "" — remembered per file, size and modification time (for the
    last ``REMEMBERED`` files), so that a file read again (the next epoch, a corpus of one file
    repeated) is not read again."""

    REMEMBERED = 4096

    def __init__(self) -> None:
        self._known: OrderedDict[tuple[str, int, int], str] = OrderedDict()
        self._lock = threading.Lock()

    def problem(self, path: pathlib.Path) -> str:
        try:
            stat = path.stat()
        except OSError as err:
            return f"cannot be read ({err.strerror or err})"
        key = (str(path), stat.st_size, stat.st_mtime_ns)
        with self._lock:
            known = self._known.get(key)
        if known is None:
            known = _read_problem(path)
            with self._lock:
                self._known[key] = known
                while len(self._known) > self.REMEMBERED:
                    self._known.popitem(last=False)
        return known


def _read_problem(path: pathlib.Path) -> str:
    decoder = codecs.getincrementaldecoder("utf-8")()
    read, text_seen = 0, False
    try:
        with open(path, "rb", buffering=0) as file:
            while True:
                raw = file.read(WINDOW_BYTES)
                pending = len(decoder.getstate()[0])  # bytes of a character cut by the previous piece
                try:
                    text = decoder.decode(raw, final=not raw)
                except UnicodeDecodeError as err:
                    return f"the file is not valid UTF-8 (bad byte at offset {read - pending + err.start})"
                text_seen = text_seen or bool(text.strip())
                read += len(raw)
                if not raw:
                    break
    except OSError as err:
        return f"cannot be read ({err.strerror or err})"
    return "" if text_seen else "the document is empty (or only whitespace)"
