"""Files a run leaves behind: each written whole or not at all, with the user's permissions.

A file is written into a temporary sibling named `.<name>.tmp-<random>` and renamed over its
place, so a reader never sees half a file. A process killed between the two (SIGKILL) leaves the
temporary behind; `sweep` removes such leftovers when the next run opens the folder.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

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
