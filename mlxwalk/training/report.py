"""What a run shows and leaves behind: its first lines, a progress bar per window, the epoch
lines and table, and a JSON report (`summary`) with a loss-curve PNG beside it (each written to a
temporary file, then renamed)."""

from __future__ import annotations

import io
import json
import sys
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from ..plan import MIB
from .files import atomic_write

NAMES = {"dpo": "DPO", "simpo": "SimPO"}  # objectives as the plot names them


@dataclass
class Epoch:
    epoch: int
    train_loss: float
    eval_loss: float | None
    seconds: float
    train_tok_s: float
    windows: int = 0
    partial: bool = False  # stopped by --iters before the epoch's end
    windows_narrowed: int = 0  # windows whose horizon the memory budget narrowed (not exact)
    smallest_horizon: int | None = None  # the narrowest horizon one of them used
    metrics: dict = field(default_factory=dict)  # the objective's, the epoch's weighted means
    eval_metrics: dict = field(default_factory=dict)


def epoch_row(run, partial: bool = False) -> Epoch:
    """The epoch's row (run.Run's position now): its training loss and metrics, and the
    validation set's, evaluated now."""
    p = run.position
    items = run.train_set.examples
    tokens = sum(run.tokens(items[i]) for i in run.order(p.epoch)[: p.index])
    weight = max(p.tokens, 1)
    evaluated = run.evaluate()
    return Epoch(
        epoch=p.epoch + 1,
        train_loss=p.loss_sum / weight,
        eval_loss=evaluated[0] if evaluated else None,
        seconds=round(p.seconds, 2),
        train_tok_s=round(tokens / p.seconds, 1) if p.seconds else 0.0,
        windows=p.index,
        partial=partial,
        windows_narrowed=p.narrowed,
        smallest_horizon=p.horizon or None,
        metrics={k: round(v / weight, 6) for k, v in p.metrics.items()},
        eval_metrics={k: round(v, 6) for k, v in evaluated[1].items()} if evaluated else {},
    )


def metrics_said(objective, means: dict) -> str:
    """The objective's metrics as a line's tail: ", chosen_r 0.012, acc 0.750" ("" if none)."""
    labels = getattr(objective, "metrics", {})
    return "".join(f", {labels[k]} {v:.3f}" for k, v in means.items() if k in labels)


def opening(run) -> list[str]:
    """A run's (run.Run's) first lines: the model, the windows, where it writes; the memory."""
    cfg, admitted, windows = run.cfg, run.setup.admission, run.setup.windows
    lines = [
        f"model {cfg.model} ({run.setup.loaded.described}), {len(run.train_set.examples)} "
        f"training and {len(run.valid_set.examples)} validation windows of up to "
        f"{windows.window} tokens, chunk {cfg.chunk}, {cfg.walk} walk; adapter and report go to "
        f"{run.out}"
    ]
    if admitted is not None and admitted.total is not None:
        lines.append(
            f"memory estimate: {admitted.total / MIB:.1f} MiB (graph {admitted.graph / MIB:.1f}, "
            f"K/V store {admitted.store / MIB:.1f}, host {admitted.plan.host_bytes / MIB:.1f})"
        )
    if admitted is not None:
        lines += admitted.lines()
    if admitted is not None and admitted.total is None:
        lines.append(
            f"memory: K/V store {admitted.store / MIB:.1f} MiB, accumulators and checkpoints "
            f"{admitted.plan.host_bytes / MIB:.1f} MiB, beside the weights and one chunk's graph "
            "(mlxwalk plan estimates it all)"
        )
    return lines


class Progress:
    """A tqdm bar over windows on a terminal, its postfix the chunk in flight and the last
    window; elsewhere (a log, a pipe) one line per window. While the bar is drawn, what the run
    prints (epoch lines, evaluations) is written as tqdm.write writes, each line above the bar,
    not into it; the bar closes at its last window, so nothing after it is drawn over."""

    def __init__(self, total: int, initial: int, enabled: bool):
        from tqdm import tqdm

        self.live = enabled and sys.stderr.isatty()
        self.lines = enabled and not self.live
        self.total, self.done = total, initial
        self.bar = tqdm(
            total=total,
            initial=initial,
            unit="window",
            disable=not self.live,
            file=sys.stderr,
            dynamic_ncols=True,
        )
        self.last = ""
        self.stdout = None
        if self.live:
            self.stdout, sys.stdout = sys.stdout, AboveBar(sys.stdout, self.bar)

    def chunk(self, phase: str, done: int, of: int) -> None:
        if self.live:
            self.bar.set_postfix_str(f"{phase} chunk {done}/{of}{self.last}", refresh=True)

    def window(
        self,
        loss: float,
        tok_s: float,
        mem_mib: float,
        narrowed: int | None = None,
        windows: int = 1,
        said: str = "",
    ):
        """A step's `windows` done (their mean loss; `said`: the objective's metrics, as
        metrics_said says them); `narrowed`: the horizon the memory budget cut one to (not
        exact)."""
        self.done += windows
        cut = f", horizon narrowed to {narrowed} (not exact)" if narrowed is not None else ""
        self.last = f" | loss {loss:.3f}{said}, {tok_s:,.0f} tok/s, peak {mem_mib:,.0f} MiB{cut}"
        self.bar.update(windows)
        self.bar.set_postfix_str(self.last.lstrip(" |"), refresh=True)
        if self.lines:
            print(f"window {self.done}/{self.total}: {self.last.lstrip(' |')}", file=sys.stderr)
        if self.done >= self.total:
            self.close()

    def close(self) -> None:
        self.bar.close()
        if self.stdout is not None:
            if isinstance(sys.stdout, AboveBar):  # (unless replaced again since)
                sys.stdout, part = self.stdout, sys.stdout.part
                sys.stdout.write(part)  # a line begun and not ended, as it was
            self.stdout = None


class AboveBar:
    """The standard output while a bar is drawn: each whole line written as tqdm.write writes
    (the bar cleared, the line written, the bar drawn again below it). tqdm.write itself would
    not clear a bar on the standard error once the standard output is this object."""

    def __init__(self, out, bar):
        self.out, self.bar, self.part = out, bar, ""

    def write(self, text: str) -> int:
        self.part += text
        if "\n" in self.part:
            lines, _, self.part = self.part.rpartition("\n")
            with self.bar.get_lock():
                self.bar.clear(nolock=True)
                self.out.write(lines + "\n")
                self.out.flush()
                self.bar.refresh(nolock=True)
        return len(text)

    def __getattr__(self, name: str):  # flush, isatty, encoding, ...: the terminal's
        return getattr(self.out, name)


def progress(total: int, initial: int = 0, enabled: bool = True) -> Progress:
    return Progress(total, initial, enabled)


def epoch_line(e, objective=None) -> str:
    ev = "n/a" if e.eval_loss is None else f"{e.eval_loss:.4f}"
    part = f" (partial: {e.windows} windows, stopped by --iters)" if e.partial else ""
    cut = ""
    if e.windows_narrowed:
        cut = (
            f"; {e.windows_narrowed} window(s) not exact: the memory budget narrowed the "
            f"horizon to as few as {e.smallest_horizon} positions"
        )
    for side, means in (("train", e.metrics), ("eval", e.eval_metrics)):
        if said := metrics_said(objective, means):
            cut += f"; {side}{said[1:]}"
    return (
        f"epoch {e.epoch}{part}: train_loss {e.train_loss:.4f}, eval_loss {ev}, "
        f"{e.seconds:.1f} s, {e.train_tok_s:,.0f} tok/s{cut}"
    )


def table(epochs: list[dict], objective=None) -> str:
    """The epochs as a markdown table; an objective's metrics (train, then eval) as columns."""
    labels = getattr(objective, "metrics", {})
    heads = [*labels.values(), *(f"eval_{v}" for v in labels.values())]
    rows = [
        "| epoch | train_loss | eval_loss | seconds | train_tok_s |"
        + "".join(f" {h} |" for h in heads),
        "|---:|---:|---:|---:|---:|" + "---:|" * len(heads),
    ]
    for e in epochs:
        ev = "n/a" if e["eval_loss"] is None else f"{e['eval_loss']:.4f}"
        given = [e.get("metrics") or {}, e.get("eval_metrics") or {}]
        cells = [f" {m[k]:.3f} |" if k in m else " n/a |" for m in given for k in labels]
        rows.append(
            f"| {e['epoch']} | {e['train_loss']:.4f} | {ev} | {e['seconds']:.1f} |"
            f" {e['train_tok_s']:,.0f} |" + "".join(cells)
        )
    return "\n".join(rows)


def plot(
    epochs: list[dict], file, window_losses=None, evals_between=None, objective: str = "tokens"
) -> None:
    """Training loss per window (epochs marked by vertical lines) and eval loss at each epoch's
    end; without per-window losses, the epochs' mean training loss."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = [
        k for k in ("margins", "accuracies") if any(k in (e.get("metrics") or {}) for e in epochs)
    ]
    if shown:  # an objective's rewards beside the loss: DPO's margin and accuracy per epoch
        fig, (ax, side) = plt.subplots(1, 2, figsize=(10, 3.6), dpi=120)
        preference(side, epochs, shown)
    else:
        fig, ax = plt.subplots(figsize=(6, 3.6), dpi=120)
    ends, at = [], 0
    for e in epochs:
        at += e.get("windows") or 0
        ends.append(at)
    if window_losses:
        ax.plot(range(1, len(window_losses) + 1), window_losses, lw=1, label="train (per window)")
        for x in ends[:-1] if ends and ends[-1] >= len(window_losses) else ends:
            ax.axvline(x + 0.5, color="0.8", lw=0.8, zorder=0)
    else:
        ends = [e["epoch"] for e in epochs]
        ax.plot(ends, [e["train_loss"] for e in epochs], marker="o", label="train (epoch mean)")
    evals = [(x, e["eval_loss"]) for x, e in zip(ends, epochs) if e["eval_loss"] is not None]
    if window_losses and evals_between:
        evals = sorted([*evals, *map(tuple, evals_between)])
    if evals:
        ax.plot(*zip(*evals), marker="s", label="eval")
    ax.set_xlabel("window" if window_losses else "epoch")
    per = f"{NAMES.get(objective, objective)} loss per pair"
    ax.set_ylabel(per if shown else "loss (mean cross-entropy per labelled token)")
    ax.set_title("training and eval loss")
    ax.legend()
    fig.tight_layout()
    fig.savefig(file, format="png")
    plt.close(fig)


def preference(ax, epochs: list[dict], shown: list[str]) -> None:
    """Per epoch: the reward margin and accuracy, training (the epoch's mean) and eval."""
    xs = [e["epoch"] for e in epochs]
    for key in shown:
        for side, style in (("metrics", "-o"), ("eval_metrics", "--s")):
            ys = [(e.get(side) or {}).get(key) for e in epochs]
            if any(y is not None for y in ys):
                name = f"{'eval' if side == 'eval_metrics' else 'train'} {key.rstrip('s')}"
                ax.plot(xs, [float("nan") if y is None else y for y in ys], style, label=name)
    ax.set_xlabel("epoch")
    ax.set_ylabel("reward margin; accuracy")
    ax.set_title("preference: reward margin and accuracy")
    ax.legend()


def summary(run) -> dict:
    """report.json's contents for a run (run.Run) that has ended its loop."""
    cfg, admitted, position, watch = run.cfg, run.setup.admission, run.position, run.watch
    train, windows = run.train_set, run.setup.windows
    epochs = position.epochs + ([asdict(run.partial)] if run.partial else [])
    return {
        "model": cfg.model,
        "adapter_path": str(run.out),
        "walk": cfg.walk,
        "objective": run.objective.name,
        "window": windows.window,
        "window_asked": windows.window_asked,
        "chunk": cfg.chunk,
        "horizon": cfg.horizon,
        "horizon_used": watch.horizon_used,
        "windows_narrowed": watch.narrowed,
        "memory_estimate_mib": mib_or_none(admitted.total) if admitted else None,
        "host_mib": round(admitted.plan.host_bytes / MIB, 2) if admitted else 0.0,
        "graph_mib": mib_or_none(admitted.graph) if admitted else None,
        "given_up": [c.as_dict() for c in admitted.given_up] if admitted else [],
        "peak_mib": round(run.peak / MIB, 2),
        "windows_over_budget": watch.over_budget,
        "diverged_at_window": watch.collapsed,
        "windows_skipped_non_finite": position.skipped,
        "examples": len(train.examples),
        "examples_skipped": train.skipped,
        "examples_truncated": train.truncated,
        "examples_cut_away": train.cut_away,
        "trainable_tokens": train.trainable_tokens,
        "windows": position.windows,
        "window_losses": position.losses,
        "evals_between": position.evals,  # [window, eval loss] for --steps-per-eval
        "epochs": epochs,
        "config": {f.name: getattr(cfg, f.name) for f in fields(cfg)},
        "ranks": run.ranks.size,
        "reduce_seconds": round(run.reduce_seconds, 4),
        "backend": run.fw.name,
        **run.fw.report(),
    }


def mib_or_none(n: int | None) -> float | None:
    return None if n is None else round(n / MIB, 2)


def write(folder: Path, summary: dict) -> None:
    text = json.dumps(summary, indent=2)
    atomic_write(Path(folder) / "report.json", lambda p: Path(p).write_text(text))
    if summary["epochs"]:  # drawn in memory first: the temporary file lives only for the write
        png = io.BytesIO()
        plot(
            summary["epochs"],
            png,
            summary.get("window_losses"),
            summary.get("evals_between"),
            summary.get("objective", "tokens"),
        )
        atomic_write(Path(folder) / "loss.png", lambda p: Path(p).write_bytes(png.getvalue()))
