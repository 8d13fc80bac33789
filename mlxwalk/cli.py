"""The `mlxwalk` command: one subcommand per job. Errors are one line and a non-zero exit."""

from __future__ import annotations

import argparse
import signal
import sys

from . import tiny


def _test_walk_exact(args: argparse.Namespace) -> int:
    if args.backend == "torch":
        return _test_walk_exact_torch(args)
    from . import exactness
    from .training import models

    if args.model:
        chosen = [(args.model, str(models.resolve(args.model)))]
    else:
        chosen = [(name, str(tiny.path(name))) for name in tiny.MODELS]
    return 0 if exactness.run(chosen, as_json=args.json) else 1


def _test_walk_exact_torch(args: argparse.Namespace) -> int:
    try:
        from .torch_backend import exactness, model
    except ImportError as e:
        raise RuntimeError(f"the torch backend needs pip install 'mlxwalk[torch]' ({e})") from None
    names = [args.model] if args.model else list(tiny.MODELS)
    chosen = [
        (n, str(model.tiny_folder(n) if n in {**tiny.MODELS, **tiny.FAMILIES} else n))
        for n in names
    ]
    return 0 if exactness.run(chosen, as_json=args.json, device=args.device) else 1


def _plan(args: argparse.Namespace) -> int:
    from . import planning

    return planning.run(args)


def _train(args: argparse.Namespace) -> int:
    from .training.options import config_from

    cfg = config_from(args)
    if cfg.backend == "torch":
        try:
            from .torch_backend.train import train_run
        except ImportError as e:
            raise RuntimeError(
                f"the torch backend needs pip install 'mlxwalk[torch]' ({e})"
            ) from None
    else:
        from .training.run import train_run
    train_run(cfg)
    return 0


def _convert_adapter(args: argparse.Namespace) -> int:
    from .training.convert import convert

    written = convert(args.src, args.dst, args.model)
    print(f"{args.dst}: the adapter in {'mlx-lm' if written == 'mlx' else 'PEFT'}'s format")
    return 0


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="mlxwalk", description=__doc__)
    sub = p.add_subparsers(dest="command")
    from .training.options import add_flags

    tr = sub.add_parser("train", help="train an adapter (no arguments: the bundled sample)")
    add_flags(tr)
    tr.set_defaults(run=_train)
    t = sub.add_parser("test-walk-exact", help="the walk's gradient against one graph, row by row")
    t.add_argument("-m", "--model", help="a model folder or hub id (default: every bundled model)")
    t.add_argument("--json", action="store_true", help="print the rows as JSON")
    t.add_argument(
        "--backend",
        choices=("mlx", "torch"),
        default="mlx",
        help="torch: transformers + PEFT through the torch walk (extra [torch])",
    )
    t.add_argument("--device", help="torch's device for --backend torch (default: the CPU)")
    t.set_defaults(run=_test_walk_exact)

    c = sub.add_parser("convert-adapter", help="a LoRA adapter from PEFT to mlx-lm or back")
    c.add_argument("src", help="a folder holding adapter_model.safetensors or adapters.safetensors")
    c.add_argument("dst", help="a new or empty folder for the other format")
    c.add_argument("--model", help="the base model's folder (its layer count, PEFT to mlx-lm)")
    c.set_defaults(run=_convert_adapter)

    p_plan = sub.add_parser("plan", help="what a walk will need, and whether it fits")
    add_flags(p_plan, plan=True)
    p_plan.set_defaults(run=_plan)
    return p


def on_sigterm(*_) -> None:
    raise KeyboardInterrupt  # a kill is handled like Ctrl-C: what was trained is saved


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
    from ._blas import use_openblas
    from .ops import routing

    routing.mode()
    use_openblas()


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.command is None:
        parser().print_help()
        return 2
    signal.signal(signal.SIGTERM, on_sigterm)
    try:
        setup()
        return args.run(args)
    except (ValueError, FileNotFoundError, OSError, RuntimeError, KeyboardInterrupt) as e:
        return fail("mlxwalk", e)


if __name__ == "__main__":
    sys.exit(main())
