"""The `mlxwalk` command: one subcommand per job. Errors are one line and a non-zero exit."""

from __future__ import annotations

import argparse
import importlib
import os
import signal
import sys

from . import commands


class Subcommand(argparse.ArgumentParser):
    """A subcommand's parser: an argument it doesn't know is refused with its own usage line
    (argparse's default hands it up to `mlxwalk`'s, which shows the top-level usage)."""

    def parse_known_args(self, args=None, namespace=None):
        namespace, extras = super().parse_known_args(args, namespace)
        if extras:
            self.error(f"unrecognized arguments: {' '.join(extras)}")
        return namespace, extras


def parser() -> argparse.ArgumentParser:
    from . import __version__

    p = argparse.ArgumentParser(prog="mlxwalk", description=__doc__)
    p.add_argument("--version", action="version", version=f"mlxwalk {__version__}")
    sub = p.add_subparsers(dest="command", parser_class=Subcommand)
    for name, module in commands.NAMES.items():
        command = importlib.import_module(f"mlxwalk.commands.{module}")
        c = sub.add_parser(name, help=command.HELP)
        command.add_arguments(c)
        c.set_defaults(run=command.run)
    return p


def on_sigterm(*_) -> None:
    raise KeyboardInterrupt  # a kill is handled like Ctrl-C: what was trained is saved


STOPS = ("SIGTERM", "SIGHUP")  # a kill, a closed terminal: each handled like Ctrl-C


def catch_stops() -> None:
    """Every entry point's stops (STOPS) handled as Ctrl-C is: what was trained is saved."""
    for name in STOPS:
        if hasattr(signal, name):
            signal.signal(getattr(signal, name), on_sigterm)


def fail(prog: str, e: BaseException) -> int:
    """A refusal or failure as one line on stderr and exit 2; an interruption as one line, 130."""
    if isinstance(e, KeyboardInterrupt):
        how = f" {e.args[0]}" if e.args else ""
        print(f"{prog}: interrupted{how}", file=sys.stderr)
        return 130
    if not getattr(e, "quiet", False):  # (a rank that is not the leader: the leader says it)
        print(f"{prog}: error: {(str(e).splitlines() or [type(e).__name__])[0]}", file=sys.stderr)
        sys.stderr.flush()
    if hasattr(e, "settle"):  # several ranks: none exits before the leader has said it
        e.settle()
    return 2


def setup() -> None:
    """What every entry point does first: the environment switches checked by name, and MLX's
    CPU matrix products moved to OpenBLAS where MLX's CPU does the work (_blas.py)."""
    from ._blas import at_first_use
    from .ops import routing

    routing.mode()
    check_tmpdir()
    at_first_use()


def check_tmpdir() -> None:
    """A TMPDIR that names no folder, refused by name: MLX's CPU backend compiles its kernels
    there and would fail at the first window with a bare filesystem error."""
    from .errors import ConfigError

    tmp = os.environ.get("TMPDIR")
    if tmp and not os.path.isdir(tmp):
        what = "is not a folder" if os.path.exists(tmp) else "does not exist"
        raise ConfigError(f"TMPDIR={tmp} {what}; create it, or point TMPDIR at a folder")


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.command is None:
        parser().print_help()
        return 2
    catch_stops()
    try:
        setup()
        return args.run(args)
    except (ValueError, FileNotFoundError, OSError, RuntimeError, KeyboardInterrupt) as e:
        return fail("mlxwalk", e)


if __name__ == "__main__":
    sys.exit(main())
