"""Files a run leaves behind: each written whole or not at all, with the user's permissions.

A file is written into a temporary sibling named `.<name>.tmp-<random>` and renamed over its
place, so a reader never sees half a file. A process killed between the two (SIGKILL) leaves the
temporary behind; `sweep` removes such leftovers when the next run opens the folder.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import socket
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from ..errors import ConfigError, FolderError, ModelError

TMP_MARK = ".tmp-"


def umask() -> int:
    """The process's umask (read by setting it, then putting it back)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def atomic_write(path: Path, write: Callable[[str], object]) -> None:
    """Write through `write(tmp_path)` into a temporary sibling, then rename it over `path`.
    The file gets the mode a plain `open` would give it (0666 less the umask)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    prefix = f".{path.name}{TMP_MARK}"
    fd, tmp = tempfile.mkstemp(prefix=prefix, suffix=path.suffix, dir=path.parent)
    os.close(fd)
    try:
        write(tmp)
        os.chmod(tmp, 0o666 & ~umask())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def write_text(path: Path, text: str) -> None:
    atomic_write(path, lambda p: Path(p).write_text(text))


# MLX's own save and load take a path as text and encode it themselves, which fails (std::bad_cast)
# on a path that is not valid in this locale's encoding (a non-ASCII folder under LANG=C). Through
# a file object Python opens, with the format named, MLX takes any path the OS does.


def save_safetensors(path: Path, arrays: dict, metadata: dict | None = None) -> None:
    """MLX's `arrays` to `path`, written whole (atomic_write). (MLX is imported here, not at the
    top: the training loop imports this module and stays free of array libraries.)"""
    import mlx.core as mx

    def write(tmp: str) -> None:
        with open(tmp, "wb") as f:
            mx.save_safetensors(f, arrays, metadata=metadata)

    atomic_write(path, write)


def load_safetensors(path: Path) -> dict:
    """The arrays of a safetensors file as MLX's, or a refusal naming the file (truncated, or not
    one)."""
    import mlx.core as mx

    # Not through a Python file object: then each array's load is a task on MLX's threads that
    # holds the reader, a Python object, and one disposed as the interpreter exits (a refusal
    # after loading) takes the GIL there and aborts the process. By a name MLX reads in C++, one
    # that is ASCII whatever the path (see above): the open file's own.
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError as e:
        raise ModelError(f"{path} is not a readable safetensors file ({e.strerror})") from None
    try:
        arrays = mx.load(open_name(fd, path), format="safetensors")
        mx.eval(arrays)  # read while the name is open
    except (RuntimeError, ValueError) as e:
        why = str(e).split("] ", 1)[-1]
        raise ModelError(f"{path} is not a readable safetensors file ({why})") from None
    finally:
        os.close(fd)
    return arrays


def open_name(fd: int, path: Path) -> str:
    """A name of the open file `fd` (Linux's /proc/self/fd, macOS's /dev/fd), else its path."""
    for folder in ("/proc/self/fd", "/dev/fd"):
        if os.path.isdir(folder):
            return f"{folder}/{fd}"
    return str(path)


def load_json(path: Path) -> dict:
    """A JSON object from a file, or a refusal naming the file."""
    try:
        value = json.loads(Path(path).read_text())
    except ValueError as e:
        raise ConfigError(f"{path} is not valid JSON ({e})") from None
    if not isinstance(value, dict):
        raise ConfigError(f"{path} holds no JSON object")
    return value


def sweep(folder: Path) -> None:
    """Remove what a killed writer left in `folder`: temporary files and half-made folders."""
    folder = Path(folder)
    if not folder.is_dir():
        return
    for leftover in folder.glob(f".*{TMP_MARK}*"):
        if leftover.is_dir():
            shutil.rmtree(leftover, ignore_errors=True)
        else:
            leftover.unlink(missing_ok=True)


def is_empty(folder: Path) -> bool:
    return Path(folder).is_dir() and not any(Path(folder).iterdir())


class NewFolder:
    """A folder made for a run, removed again if the run ends with nothing in it worth keeping
    (`keep` decides), so a failed run leaves no empty folders behind."""

    def __init__(self, folder: Path):
        self.folder = Path(folder)
        self.made: list[Path] = []  # the folders this made, innermost last

    def make(self) -> Path:
        missing, probe = [], self.folder
        while not probe.exists():
            missing.append(probe)
            probe = probe.parent
        self.folder.mkdir(parents=True, exist_ok=True)
        self.made = list(reversed(missing))
        return self.folder

    def discard(self) -> None:
        """Remove the folders this made, innermost first, as long as they are empty."""
        for folder in reversed(self.made):
            sweep(folder)
            if is_empty(folder):
                folder.rmdir()


class FolderLock:
    """One run per folder: an exclusive lock on `<folder>/.mlxwalk.lock`, held for the run's
    life. It is an flock, which the kernel drops when its process dies, so the file a killed run
    leaves behind is a stale lock that the next run simply takes; the file names its owner for
    the refusal of a second run."""

    NAME = ".mlxwalk.lock"

    def __init__(self, folder: Path):
        self.path = Path(folder) / self.NAME
        self.fd: int | None = None

    def acquire(self) -> None:
        for _ in range(5):  # the owner may remove the file between our open and our lock
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o666 & ~umask())
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                owner = os.read(fd, 200).decode(errors="replace").strip() or "owner unknown"
                os.close(fd)
                raise FolderError(
                    f"adapter path {self.path.parent} is in use by another run ({owner}); wait "
                    "for it to end, or choose another --adapter-path"
                ) from None
            try:
                same = os.fstat(fd).st_ino == os.stat(self.path).st_ino
            except FileNotFoundError:
                same = False
            if same:
                os.ftruncate(fd, 0)
                started = time.strftime("%Y-%m-%d %H:%M:%S")
                os.write(fd, f"pid {os.getpid()} on {socket.gethostname()}, {started}".encode())
                self.fd = fd
                return
            os.close(fd)
        raise FolderError(f"adapter path {self.path.parent}: its lock keeps changing hands")

    def __del__(self) -> None:  # a run object dropped without ending (an API caller's)
        self.release()

    def release(self) -> None:
        if self.fd is None:
            return
        self.path.unlink(missing_ok=True)
        fcntl.flock(self.fd, fcntl.LOCK_UN)
        os.close(self.fd)
        self.fd = None


@contextmanager
def owned(folder: Path) -> Iterator[Path]:
    """`folder` for a run's life: made if missing, locked (FolderLock), and on the way out
    unlocked and removed again if the run left it empty."""
    made, lock = NewFolder(folder), FolderLock(folder)
    made.make()
    try:
        lock.acquire()
        yield Path(folder)
    finally:
        lock.release()
        made.discard()
