"""A run directory: where it is, that it can be written, and its one writer.

``<base_output_directory>/<run_name>`` holds a run's ``config.yml``, ``checkpoints/`` and
``metrics.jsonl``. ``run_name`` is one directory name (checked by the schema), so every
write stays inside ``base_output_directory``. One process at a time may write a run: the
writer holds an OS lock on ``<run>/.lock`` (``fcntl.flock``, released by the OS when the
process ends, however it ends) and writes its host, pid and start time into the file, so
a second writer is refused with one line naming the holder, and a lock file left by a
writer that died is taken over (and said so). With several processes, process 0 holds
the lock for all of them.
"""

from __future__ import annotations

import datetime
import errno
import fcntl
import os
import socket
from pathlib import Path

import jax

from nnxtron.config.schema import Config
from nnxtron.errors import UserError

LOCK_FILE = ".lock"


class RunDirError(UserError):
    """The run directory cannot be used: not writable, not a directory, or held by another writer."""


def resolve_run_dir(cfg: Config) -> Path:
    name = cfg.run_name or datetime.datetime.now().strftime("run-%Y%m%d-%H%M%S")
    return Path(cfg.base_output_directory).expanduser() / name


def make_run_dir(run_dir: Path) -> None:
    """Create ``run_dir`` (and ``base_output_directory``), or say in one line why it cannot be."""
    for path in (run_dir.parent, run_dir):
        if path.exists() and not path.is_dir():
            what = "base_output_directory" if path == run_dir.parent else "the run directory"
            raise RunDirError(f"{what} '{path}' is a file, not a directory; choose another directory")
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise RunDirError(
            f"cannot create run directory '{run_dir}' ({err.strerror or err}); choose a writable directory"
        ) from None


def refuse_links(run_dir: Path) -> None:
    """One line when ``run_dir`` or an entry in it (``checkpoints/``, ``metrics.jsonl``...) is a
    symbolic link: writes through it would land outside ``base_output_directory``."""
    entries = sorted(run_dir.iterdir()) if run_dir.is_dir() and not run_dir.is_symlink() else []
    for path in (run_dir, *entries):
        if path.is_symlink():
            raise RunDirError(
                f"'{path}' is a symbolic link (to '{os.readlink(path)}'): a run writes only inside base_output_directory; "
                "replace the link with a real directory or file, or point base_output_directory at that disk"
            )


def disk_error(err: OSError) -> str:
    """``'no space left on device: ENOSPC'``: the reason of a failed write, with its errno name."""
    name = errno.errorcode.get(err.errno or 0, "")
    reason = (err.strerror or str(err)).lower()
    return f"{reason}: {name}" if name else reason


def remove_unused_run_dir(run_dir: Path) -> None:
    """Remove a run directory this start created and left unused: its lock file and empty
    folders (an empty ``checkpoints/``). Anything else in it is kept, and so is the directory."""
    for path in (run_dir / LOCK_FILE, run_dir / "checkpoints", run_dir):
        try:
            path.rmdir() if path.is_dir() else path.unlink()
        except OSError:  # not empty, or already gone: keep what is there
            pass


class RunLock:
    """The one-writer lock of a run directory (see the module docstring)."""

    def __init__(self, run_dir: Path):
        self.path = run_dir / LOCK_FILE
        self.fd: int | None = None
        self.previous = ""  # the holder recorded by a writer that ended without releasing

    def acquire(self) -> None:
        """Take the lock (process 0; the others only learn whether it succeeded)."""
        message = self._try() if jax.process_index() == 0 else ""
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils

            taken = multihost_utils.broadcast_one_to_all(jax.numpy.int32(not message))
            if not message and not bool(taken):
                message = f"run '{self.path.parent}' is held by another writer (see process 0's error)"
        if message:
            raise RunDirError(message)

    def _try(self) -> str:
        """Lock the file; '' on success, else the error line."""
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as err:
            return f"cannot open the run lock '{self.path}' ({err.strerror or err}); choose a writable base_output_directory"
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as err:
            holder = _read(fd)
            os.close(fd)
            if err.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                return (
                    f"run '{self.path.parent}' is in use by {holder or 'another process'}; wait for it to finish, "
                    "or choose another run_name"
                )
            return f"cannot lock the run '{self.path.parent}' ({err.strerror or err}); use a local base_output_directory"
        self.previous = _read(fd)
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"pid {os.getpid()} on host {socket.gethostname()} since {_now()}\n".encode(), 0)
        except OSError as err:  # a full or read-only disk
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)
            return (
                f"cannot write the run lock '{self.path}' ({disk_error(err)}); free space on that disk or choose "
                "another base_output_directory"
            )
        self.fd = fd
        return ""

    def release(self) -> None:
        if self.fd is None:
            return
        try:
            os.ftruncate(self.fd, 0)  # a lock file that names nobody: the run ended cleanly
        finally:
            fcntl.flock(self.fd, fcntl.LOCK_UN)
            os.close(self.fd)
            self.fd = None


def _read(fd: int) -> str:
    try:
        return os.pread(fd, 512, 0).decode("utf-8", errors="replace").strip()
    except OSError:
        return ""


def _now() -> str:
    return datetime.datetime.now().astimezone().isoformat(timespec="seconds")
