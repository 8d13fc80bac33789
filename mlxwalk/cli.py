"""The `mlxwalk` command: one subcommand per job. Errors are one line and a non-zero exit."""

from __future__ import annotations

import argparse
import sys

from . import tiny


def _test_walk_exact(args: argparse.Namespace) -> int:
    from . import exactness, models

    if args.model:
        chosen = [(args.model, str(models.resolve(args.model)))]
    else:
        chosen = [(name, str(tiny.path(name))) for name in tiny.MODELS]
    return 0 if exactness.run(chosen, as_json=args.json) else 1


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="mlxwalk", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    t = sub.add_parser("test-walk-exact", help="the walk's gradient against one graph, row by row")
    t.add_argument("-m", "--model", help="a model folder or hub id (default: every bundled model)")
    t.add_argument("--json", action="store_true", help="print the rows as JSON")
    t.set_defaults(run=_test_walk_exact)
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        return args.run(args)
    except (ValueError, FileNotFoundError, OSError) as e:
        print(f"mlxwalk: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("mlxwalk: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
