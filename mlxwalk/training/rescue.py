"""A run that stops early: what it keeps, what it says, and the signals that stop it.

A Ctrl-C saves what was trained (a window it interrupted is undone first) and says how to go on;
a run with no checkpoint leaves nothing behind and puts back a run it was to --overwrite; a
write that fails (a full disk) says which path and what is kept, saving the adapter outside the
folder when no checkpoint holds it. A second Ctrl-C or a SIGTERM waits until this is done.
"""

from __future__ import annotations

import errno
import signal
import tempfile
from dataclasses import replace
from pathlib import Path

from ..errors import NonFinite
from .runfolder import WriteFailed

SKIP_LIMIT = 5  # --on-nan skip: this many non-finite windows in a row stop the run


def fail(run, error: BaseException) -> BaseException:
    """What `run` (run.Run) leaves on the way out with `error`; the error to raise."""
    if run.ranks.leader:
        with shielded():
            leave(run, error)
    if isinstance(error, OSError):  # a write that failed: said with what is kept, and where
        return WriteFailed(lost_write(run, error))
    return error


def non_finite(run, items: list, error: BaseException) -> None:
    """A step on `items` that was not finite (the adapter already put back): skipped under
    --on-nan skip, up to SKIP_LIMIT in a row; else the run stops, saying what it keeps."""
    p, n = run.position, len(items)
    first = items[0].where or "an example"
    where = (
        f"window {p.windows + 1} (epoch {p.epoch + 1}, {first})"
        if n == 1
        else f"the step on windows {p.windows + 1}-{p.windows + n} (epoch {p.epoch + 1}, "
        f"from {first})"
    )
    run.streak += 1
    saved = kept(run.folder)
    if run.cfg.on_nan == "skip" and run.streak < SKIP_LIMIT:
        run.echo(f"warning: {where}: {error}; skipped (--on-nan skip), adapter unchanged")
        run.position = replace(p, index=p.index + n, windows=p.windows + n, skipped=p.skipped + n)
        return
    if run.cfg.on_nan == "skip":
        raise NonFinite(
            f"{where}: {error}; the {SKIP_LIMIT}th window in a row that is not "
            f"finite, so the run stops. {saved}"
        )
    raise NonFinite(
        f"{where}: {error}; stopped before its step. {saved} Lower --lr, "
        "or pass --on-nan skip to skip such windows"
    )


def leave(run, error: BaseException) -> None:
    folder = run.folder
    if isinstance(error, KeyboardInterrupt):
        if run.undo is not None and run.position is run.undo[0]:  # mid-window: undone
            run.fw.restore(run.undo[1])
        saved = folder.complete()
        done = run.position.windows
        if done and (not saved or not saved[-1].name.endswith(f"{done:07d}")):
            saved.append(run.checkpoint())
        if saved:
            error.args = (
                f"at window {done} of {run.total}; checkpoint {saved[-1]} holds it: to "
                f"continue, run the same command with --resume --adapter-path {run.out}",
            )
    if isinstance(error, OSError) and not folder.complete() and run.position.windows:
        run.rescued = rescue(run)
    if not folder.complete():
        folder.clear()
        folder.put_back()
        run.keep = False  # the folders it made go once the lock is dropped
        if isinstance(error, KeyboardInterrupt):
            error.args = ("before the first window finished; nothing was saved",)


def rescue(run) -> Path | None:
    """The adapter trained so far, saved outside the run's folder (which can't be written);
    None when that fails too."""
    try:
        folder = Path(tempfile.mkdtemp(prefix="mlxwalk-rescued-"))
        run.fw.save_adapter(folder, run.cfg)
        return folder
    except (OSError, RuntimeError, ValueError):
        return None


def lost_write(run, e: OSError) -> str:
    """What a failed write means to the user: which path, and what of the run is kept."""
    where = e.filename or run.out
    said = (
        f"no space left on {where}"
        if e.errno == errno.ENOSPC
        else f"can't write {where} ({e.strerror or e})"
    )
    saved = run.folder.complete()
    if saved:
        return (
            f"{said}; checkpoint {saved[-1]} is intact: once that is mended, run the same "
            f"command with --resume --adapter-path {run.out}"
        )
    if run.rescued:
        return f"{said}; the adapter trained so far is saved to {run.rescued} instead"
    if run.position.windows:
        return f"{said}; the adapter trained so far could not be saved elsewhere either"
    return f"{said}; nothing had been trained yet, and nothing was kept"


def kept(folder) -> str:
    """What a run stopped by a NaN keeps (runfolder.RunFolder `folder`), in words."""
    saved = folder.complete()
    if not saved:
        return "Nothing was saved."
    return f"The last checkpoint, {saved[-1]}, is as it was (resume with --resume)."


STOP_SIGNALS = tuple(
    getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGHUP") if hasattr(signal, name)
)


class noticed:
    """The loop's stop signals (Ctrl-C, and those handled as it) noted as they come, as well as
    handled: an interruption that code in the window swallows (an import interrupted, as numpy's
    lazy `numpy.random` is now and then) is raised again at the next chunk (`check`). Signals
    ignored, or left to their default action, are left so."""

    def __init__(self):
        self.came: int | None = None
        self.saved = {}
        for sig in STOP_SIGNALS:
            handler = signal.getsignal(sig)
            if not callable(handler):
                continue
            try:
                signal.signal(sig, self.noting(handler))
            except ValueError:  # not the main thread
                continue
            self.saved[sig] = handler

    def noting(self, handler):
        def note(signum, frame):
            self.came = signum
            handler(signum, frame)

        return note

    def check(self) -> None:
        if self.came is not None:
            self.came = None
            raise KeyboardInterrupt

    def close(self) -> None:
        for sig, handler in self.saved.items():
            signal.signal(sig, handler)
        self.saved = {}


class shielded:
    """The stop signals held off within the block (where the main thread can hold them)."""

    def __enter__(self):
        self.saved = {}
        for sig in STOP_SIGNALS:
            try:
                self.saved[sig] = signal.signal(sig, signal.SIG_IGN)
            except ValueError:  # not the main thread
                pass

    def __exit__(self, *exc):
        for sig, handler in self.saved.items():
            signal.signal(sig, handler)
