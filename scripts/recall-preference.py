#!/usr/bin/env python3
"""Recall as a preference: DPO whose preferred answer depends on a fact dozens of chunks back.

scripts/recall-curriculum.py's conversations, model and curriculum (docs/RECALL.md), trained by
DPO instead of the answer's cross-entropy. Each conversation is a pair of windows with the same
tokens: chosen, the answer the true code's letter; rejected, another code's letter (fixed per
conversation, drawn from its tokens). Only the answer is labelled, so the preferred answer
depends on nothing but the fact in the window's first chunk. Trainers (mlxwalk/preference/dpo.py,
`pair_gradient`, one optimizer step per pair):

  one-graph  each window as one graph (the reference, where it fits)
  exact      the exact walk in chunks of --chunk: the pair's whole gradient, one chunk's memory
  plain      the plain walk, the same objective with the gradient cut at every chunk boundary

The reference model is each seed's initial model: the policy's own random init, frozen (rebuilt
from the seed, so there is nothing to save or resume). DPO reads the reference only through the
log-ratio difference ref(chosen) - ref(rejected), and at the random init that is small noise the
same for every trainer (they start from the same init); each pair's loss starts at ln 2 (margin
0). An SFT warm-up was not used: on these conversations it would teach recall itself (the
cross-entropy task), and on conversations without the fact no more than a prior over the codes,
which DPO's log-ratios against that same model take out again.

Held-out, on --valid conversations per stage, each a pair the same way:
  preference  the share of pairs whose DPO margin is positive (chance 0.5; 0 at the init,
              where every margin is 0): DPO's own measure, the one the driver advances on
  recall      exact match of the greedy answer among the 16 codes (chance 1/16 = 0.062): DPO
              moves the chosen and rejected letters' logits, not the rest of the vocabulary's
and the answer's loss over the whole vocabulary (as the other recall scripts report it), DPO's
held-out loss and mean margin, and greedy exact match over the whole vocabulary (in the JSON).

The curriculum is recall-curriculum.py's own, imported from it (the driver, by default one
graph, sets each stage's epochs by --advance on held-out preference accuracy; the followers
train the same schedule), and so are its state saving and --resume, --stop-after-s, --parallel
and --table.

    scripts/recall-preference.py --stages 256 512 1024 2048 4096 --chunk 128 --seeds 3
        [--trainers one-graph,exact,plain] [--beta 0.1] [--out runs/recall-preference]
        [--parallel] [--stop-after-s 520] [--resume]
    scripts/recall-preference.py ... --table [--plot docs/recall-preference.png]
    scripts/recall-preference.py --quick            a smoke run of seconds
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import statistics
import sys
import time
import zlib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location(
    "recall_curriculum", ROOT / "scripts" / "recall-curriculum.py"
)
curriculum = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(curriculum)  # first: through recall.py it sets OpenBLAS's threads
bench = curriculum.bench  # scripts/recall.py: the model and the held-out pass

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402
from lib import recall  # noqa: E402

from mlxwalk.preference import dpo, groups  # noqa: E402
from mlxwalk.preference.rewards import Pair, softplus  # noqa: E402
from mlxwalk.training import files  # noqa: E402
from mlxwalk.walk import WalkConfig, Window  # noqa: E402
from mlxwalk.walk.api import apply_step  # noqa: E402

TRAINERS = dpo.WALKS  # exact, plain, one-graph
CODE_IDS = np.array([ord(c) for c in recall.CODES])  # (16,) the codes' token ids


def rejected_code(inputs: np.ndarray, code: int) -> int:
    """The rejected answer of a conversation (its token ids) whose code is `code`: one of the
    other 15 codes, uniformly by a hash of the tokens, so each conversation is one fixed pair,
    the same for every trainer and after --resume."""
    offset = 1 + zlib.crc32(np.ascontiguousarray(inputs, np.int32).tobytes()) % (len(CODE_IDS) - 1)
    return (code + offset) % len(CODE_IDS)


def pair_of(window: Window) -> Pair:
    """The pair of a conversation's window (its answer the true code): the same window with
    another code as the answer rejected."""
    code = int(np.flatnonzero(CODE_IDS == window.targets[-1])[0])
    targets = window.targets.copy()
    targets[-1] = CODE_IDS[rejected_code(window.inputs, code)]
    return Pair(window, Window.of(window.inputs, targets, window.weights))


def answer_logprobs(model, inputs: np.ndarray, batch: int = 32) -> np.ndarray:
    """Log-probabilities of the answer over the whole vocabulary (count x vocab, float64), one
    forward per batch of conversations (count x window), only the last column kept."""
    out = []
    batch = max(1, min(batch, bench.EVAL_POSITIONS // inputs.shape[1]))
    for i in range(0, len(inputs), batch):
        logits = model(mx.array(inputs[i : i + batch]))[:, -1]  # (b, vocab)
        mx.eval(logits)
        out.append(np.array(logits.astype(mx.float32)).astype(np.float64))
    z = np.concatenate(out)  # (count, vocab)
    z -= z.max(-1, keepdims=True)
    return z - np.log(np.exp(z).sum(-1, keepdims=True))


def group_of(window: Window) -> Window:
    """The conversation's answer group (--rejected all): its true code chosen against each of the
    other 15, one window of 16 targets at the answer (preference/groups.py)."""
    code = int(np.flatnonzero(CODE_IDS == window.targets[-1])[0])
    others = np.delete(CODE_IDS, code)  # (15,)
    rejected = np.repeat(window.targets[:, None], len(others), axis=1)  # (n, 15)
    rejected[-1] = others
    return groups.group_window(window.inputs, window.targets, rejected, window.weights)


def group_step(walk: str, model, reference, optimizer, config: WalkConfig, beta: float, kept):
    """dpo_step's twin for --rejected all: one step on the mean DPO loss of a conversation's 15
    pairs, by one decode and one walk."""

    def step(window: Window) -> float:
        group = group_of(window)
        key = hashlib.blake2b(window.inputs.tobytes() + window.targets.tobytes()).digest()
        if key not in kept:
            kept[key] = groups.reference_scores(reference, group, config)
        pairs, grads = groups.group_gradient(model, group, kept[key], beta, config, walk=walk)
        apply_step(model, optimizer, grads)
        mx.eval(model.parameters(), optimizer.state)
        return statistics.fmean(t.loss for t in pairs)

    return step


def dpo_step(walk: str, model, reference, optimizer, config: WalkConfig, beta: float, kept: dict):
    """A function that takes one DPO step on a conversation's pair, given its chosen window, and
    returns the pair's loss (before the step). `kept`: the reference's scores per pair, decoded
    once and kept (as `mlxwalk train --objective dpo` keeps them), shared by every step."""

    def step(window: Window) -> float:
        pair = pair_of(window)
        key = hashlib.blake2b(window.inputs.tobytes() + window.targets.tobytes()).digest()
        if key not in kept:  # decoded chunk by chunk, in one chunk's memory
            kept[key] = dpo.reference_scores(reference, pair, config)
        ref = kept[key]
        t, grads = dpo.pair_gradient(model, pair, ref, beta, config, walk=walk)
        apply_step(model, optimizer, grads)  # ClippedAdam clips
        mx.eval(model.parameters(), optimizer.state)
        return t.loss

    return step


def preference_scores(model, reference_logp: np.ndarray, data: dict, beta: float, batch: int):
    """Held-out recall among the codes, preference accuracy, DPO loss and mean margin of a
    stage's conversations (`reference_logp`: their answer log-probabilities under the
    reference)."""
    logp = answer_logprobs(model, data["inputs"], batch)  # (count, vocab)
    rows = np.arange(len(logp))
    codes = data["codes"]
    others = np.array([rejected_code(x, int(c)) for x, c in zip(data["inputs"], codes)])
    ratio = logp - reference_logp  # (count, vocab)
    margin = beta * (ratio[rows, CODE_IDS[codes]] - ratio[rows, CODE_IDS[others]])  # (count,)
    return {
        "recall": float((logp[:, CODE_IDS].argmax(-1) == codes).mean()),
        "preference": float((margin > 0).mean()),
        "dpo_loss": float(np.mean([softplus(-m) for m in margin])),
        "margin": float(margin.mean()),
    }


class PreferenceTrainee(curriculum.Trainee):
    """The curriculum's trainee (its model, optimizer, saving and epoch loop) with a DPO step on
    pairs and the preference scores held out."""

    def __init__(self, a, trainer: str, seed: int):
        super().__init__(a, trainer, seed)
        self.reference = bench.build_model(seed, a.width, a.layers, rope_theta=a.rope_theta)
        self.kept: dict = {}  # per pair: the reference's scores
        self.held_out: dict[int, np.ndarray] = {}  # per window: the reference's log-probs

    def make_step(self, config: WalkConfig):
        """The DPO step in place of the curriculum's cross-entropy one."""
        m, opt = self.model, self.optimizer
        make = group_step if self.a.rejected == "all" else dpo_step
        return make(self.trainer, m, self.reference, opt, config, self.a.beta, self.kept)

    def epoch(self, stage: int, window: int, train: dict, valid: dict, budget) -> dict:
        """The curriculum's epoch over the stage's conversations (each step a pair's), its row's
        accuracy then held-out preference accuracy (what the driver advances on); recall among
        the codes and the greedy exact match over the whole vocabulary kept beside it."""
        row = super().epoch(stage, window, train, valid, budget)
        if window not in self.held_out:
            self.held_out[window] = answer_logprobs(
                self.reference, valid["inputs"], self.a.eval_batch
            )
        got = preference_scores(
            self.model, self.held_out[window], valid, self.a.beta, self.a.eval_batch
        )
        row["vocab_accuracy"], row["accuracy"] = row["accuracy"], got.pop("preference")
        return row | got


# The curriculum module above is this script's own copy: its run builds this script's trainees,
# and its --parallel starts this script's processes.
curriculum.Trainee = PreferenceTrainee
curriculum.__file__ = __file__


def under_way(a, runs: dict) -> dict:
    """The runs with the stage under way as a stage of its own, after its finished epochs (the
    numbers of its last), where it has any: --under-way's table."""
    out = {}
    for key, run in runs.items():
        done, epochs = run.get("stages", []), run.get("epochs", [])
        if run.get("done") or not epochs or len(done) >= len(a.stages):
            out[key] = run
            continue
        last = epochs[-1]
        stage = {
            "window": a.stages[len(done)],
            "epochs": len(epochs),
            "per_epoch": epochs,
            "seconds": sum(e["seconds"] for e in epochs),
            **{k: last[k] for k in ("accuracy", "loss", "s_per_window", "peak_mib")},
        }
        out[key] = run | {"stages": [*done, stage]}
    return out


def summary(a, runs: dict) -> list[dict]:
    """The curriculum's rows per stage and trainer (its accuracy: preference accuracy), with
    recall's mean and range and the mean margin over the seeds."""
    if getattr(a, "under_way", False):
        runs = under_way(a, runs)
    rows = curriculum.summary(a, runs)
    for r in rows:
        last = [
            s["per_epoch"][-1]
            for key, run in runs.items()
            if key.split("/")[0] == r["trainer"]
            for s in run.get("stages", [])
            if s["window"] == r["window"]
        ]
        got = [e["recall"] for e in last]
        r["recall"] = {"mean": statistics.fmean(got), "min": min(got), "max": max(got)}
        r["margin"] = statistics.fmean(e["margin"] for e in last)
        r["chunks"] = r["window"] // a.chunks[r["window"]]
    return rows


def table(rows: list[dict]) -> str:
    out = [
        "| window | chunks | trainer | seeds | epochs | preference | spread | range | recall "
        "| recall range | margin | answer loss | s/pair | peak MiB | stage s |",
        "|---:|---:|---|---:|---:|---:|---:|---|---:|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        p = r["recall"]
        out.append(
            f"| {r['window']:,} | {r['chunks']} | {r['trainer']} | {r['seeds']} | "
            f"{r['epochs']:.1f} | {r['accuracy']:.3f} | {r['spread']:.3f} | "
            f"{r['min']:.3f}-{r['max']:.3f} | {p['mean']:.3f} | {p['min']:.3f}-{p['max']:.3f} | "
            f"{r['margin']:.2f} | {r['loss']:.3f} | {r['s_per_window']:.3f} | "
            f"{r['peak_mib']:.0f} | {r['seconds']:.0f} |"
        )
    return "\n".join(out)


def plot(rows: list[dict], path: str, title: str, notes: list[str] = ()) -> None:
    """Per stage, held-out preference accuracy (left) and recall among the codes (right): each
    trainer's mean over the seeds that reached the stage, the band its range, chance dotted."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10.0, 4.4))
    panels = (
        ("held-out preference accuracy", lambda r: (r["accuracy"], r["min"], r["max"])),
        (
            "held-out recall among the codes",
            lambda r: (r["recall"]["mean"], r["recall"]["min"], r["recall"]["max"]),
        ),
    )
    chance = (0.5, 1 / len(recall.CODES))
    chunks = {r["window"]: r["chunks"] for r in rows}
    for ax, (label, read), level in zip(axes, panels, chance):
        for trainer in dict.fromkeys(r["trainer"] for r in rows):
            mine = [r for r in rows if r["trainer"] == trainer]
            x = [r["window"] for r in mine]
            mean, low, high = zip(*map(read, mine))
            seeds = "/".join(str(r["seeds"]) for r in mine)
            ax.plot(x, mean, marker="o", label=f"{trainer} (seeds {seeds})")
            ax.fill_between(x, low, high, alpha=0.2)
        ax.axhline(level, color="gray", linestyle=":", label="chance")
        ax.set_xscale("log", base=2)
        ax.set_xticks(list(chunks), [f"{w:,}\n{c}" for w, c in chunks.items()])
        ax.set(xlabel="window (positions; chunks)", ylabel=label, ylim=(0, 1.02))
    # below the panels: the curves cross each panel's middle
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=len(labels), fontsize="small")
    if notes:
        fig.text(0.5, 0.07, "; ".join(notes), ha="center", va="bottom", fontsize="small")
    fig.suptitle(title)
    fig.tight_layout(rect=(0, 0.12 if notes else 0.06, 1, 1))
    files.atomic_write(Path(path), lambda tmp: fig.savefig(tmp, dpi=120, format="png"))


def report(a, runs: dict, start: float) -> int:
    """The table over seeds per stage and trainer, where unfinished runs stand, the JSON."""
    rows = summary(a, runs)
    seeds = sorted({int(key.split("/")[1]) for key in runs})
    print(
        f"\nrecall as a preference (DPO, beta {a.beta:g}, rejected: {a.rejected}): stages "
        f"{a.stages}, chunk {curriculum.chunk_label(a)}, {curriculum.schedule_label(a)}, "
        f"seeds {seeds}, qwen2 {a.layers}x{a.width}, the reference its init; chance: "
        f"recall {1 / len(recall.CODES):.3f}, preference 0.5; {time.perf_counter() - start:.0f} s"
    )
    print(table(rows))
    for key, progress in runs.items():
        if progress.get("ended"):
            print(f"{key}: {progress['ended']}")
        elif not progress.get("done"):
            at = a.stages[min(len(progress["stages"]), len(a.stages) - 1)]
            part = progress.get("partial") or {"windows": 0}
            print(
                f"{key}: not finished, at {at} after {len(progress['epochs'])} epochs and "
                f"{part['windows']} pairs of the next"
            )
    if a.plot and rows:
        title = f"recall as a preference (DPO), chunk {curriculum.chunk_label(a)}, seeds {seeds}"
        plot(rows, a.plot, title, curriculum.endings(runs))
        print(f"plot: {a.plot}")
    run_only = (*curriculum.RUN_ONLY, "child", "under_way")
    settings = {k: v for k, v in vars(a).items() if k not in run_only}
    out = {"settings": settings, "runs": runs, "summary": rows}
    name = "preference.json" if a.seed is None else f"preference-seed{a.seed}.json"
    files.write_text(Path(a.out) / name, json.dumps(out, indent=1))
    print(f"JSON: {Path(a.out) / name}")
    return 0


def arguments(argv: list[str] | None):
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter, allow_abbrev=False
    )
    p.add_argument("--stages", type=int, nargs="+", default=[256, 512, 1024, 2048, 4096])
    curriculum.stage_options(p, "pairs")
    p.add_argument("--beta", type=float, default=0.1, help="DPO's beta")
    p.add_argument(
        "--rejected",
        default="one",
        choices=("one", "all"),
        help="one: a pair per conversation (one rejected code), two walks a step; all: the "
        "true code against each of the other 15, one step on their mean DPO loss by one "
        "decode and one walk (held out: the same single pairs either way)",
    )
    p.add_argument(
        "--advance", type=float, default=0.9, help="held-out preference accuracy to move on"
    )
    p.add_argument("--max-epochs", type=int, default=8, help="epochs the driver gives a stage")
    p.add_argument("--driver", default="one-graph", choices=("one-graph", "exact"))
    p.add_argument("--trainers", default="one-graph,exact,plain")
    p.add_argument("--seeds", type=int, help="seeds 0 .. N-1, one after another (default 3)")
    p.add_argument("--seed", type=int, help="run this seed only (seeds run side by side)")
    p.add_argument("--valid", type=int, default=256, help="held-out pairs a stage")
    p.add_argument("--decoys", type=float, default=recall.DECOY_RATE)
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--rope-theta", type=float, default=1e4, help="RoPE's base")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--clip", type=float, default=1.0)
    p.add_argument("--eval-batch", type=int, default=32)
    p.add_argument("--out", default="runs/recall-preference")
    p.add_argument("--resume", action="store_true", help="continue every trainer from --out")
    p.add_argument("--stop-after", type=int, help="stop after this many epochs in all")
    p.add_argument(
        "--stop-after-windows", type=int, help="stop after this many pairs in all, saved part-way"
    )
    p.add_argument(
        "--stop-after-s",
        type=float,
        help="stop before a pair that would end past this many seconds, saved part-way",
    )
    p.add_argument(
        "--parallel",
        action="store_true",
        help="each seed's driver, then each of its followers, in its own process "
        "(logs: OUT/seedN-TRAINER.log), then the table",
    )
    p.add_argument("--margin", type=float, default=curriculum.MARGIN, help=argparse.SUPPRESS)
    p.add_argument(
        "--table", action="store_true", help="the table of the saved states; nothing trained"
    )
    p.add_argument("--plot", help="write preference accuracy and recall per stage to this PNG")
    p.add_argument(
        "--under-way",
        action="store_true",
        help="with --table: the stage under way too, after its finished epochs",
    )
    p.add_argument("--quick", action="store_true", help="a smoke run of seconds")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)  # --parallel's own
    a = p.parse_args(argv)
    if a.quick:
        a.stages, a.chunk, a.train, a.valid = [128, 256], [32], [6], 6
        a.width, a.layers, a.warmup = 32, 1, 2
    if a.seeds is None:
        a.seeds = 1 if a.quick else 3
    curriculum.per_stage(p, a)
    a.cap_gib = None  # the curriculum's memory cap: not offered here
    a.trainers = a.trainers.split(",")
    if unknown := set(a.trainers) - set(TRAINERS):
        p.error(f"--trainers: unknown {sorted(unknown)}; choose from {', '.join(TRAINERS)}")
    if a.driver not in a.trainers and not a.epochs:
        p.error(f"--driver {a.driver} is not among --trainers")
    if not a.beta > 0:
        p.error(f"--beta must be positive, got {a.beta}")
    if a.parallel and a.seed is not None:
        p.error("--parallel runs every seed: give --seeds, not --seed")
    return a


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    a = arguments(argv)
    start = time.perf_counter()
    if a.table:
        return report(a, curriculum.saved(a), start)
    if a.parallel:
        if (code := curriculum.side_by_side(a, argv)) != 0:
            print("a seed stopped or failed; --resume continues", flush=True)
            return code
        a.resume = True  # every seed is done: the table from their states
    try:
        runs = curriculum.run(a)
    except curriculum.Stop:
        print("stopped (a limit or a signal), every state saved; --resume continues", flush=True)
        return curriculum.STOPPED
    if a.child:  # one of --parallel's processes: the table and its files are the parent's
        return 0
    return report(a, runs, start)


if __name__ == "__main__":
    sys.exit(main())
