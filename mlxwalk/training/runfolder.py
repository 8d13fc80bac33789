"""A run's folder: whose it is, its checkpoints, and what `--resume` may continue.

A run writes `run.json` (its identity: the model's path and weight fingerprint, the LoRA layout,
the walk, the optimizer, the data's fingerprint and the options that order and cut it) before its
first window. A fresh run refuses a folder that holds another run unless told to `--overwrite` it;
`--resume` continues only a run whose identity matches, from that run's own checkpoints, and
loads them strictly. Checkpoints are complete folders renamed into place (`window-NNNNNNN`).
Before any of it, before anything is loaded, the folder is opened (`open_folder`): refused if it
can't be written (`writable`, `try_write`) or is the model's or the data's (`refuse_overlap`),
then made, locked and claimed; the run holds it until it ends (`RunFolder.release`).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import FolderError
from .files import TMP_MARK, FolderLock, NewFolder, sweep, write_text

if TYPE_CHECKING:
    from .framework import Framework

MANIFEST = "run.json"
RUN_FILES = (
    MANIFEST,
    "adapters.safetensors",
    "adapter_model.safetensors",
    "adapter_config.json",
    "report.json",
    "loss.png",
)  # (mlx-lm's adapter, or PEFT's)
CHECKPOINTS = "checkpoints"
KEEP = 2  # checkpoints kept; older ones are pruned


@dataclass
class Position:
    """Where a run stands: windows done in the current epoch and overall, epochs finished."""

    epoch: int = 0
    index: int = 0
    windows: int = 0
    loss_sum: float = 0.0
    tokens: int = 0
    seconds: float = 0.0
    epochs: list[dict] = field(default_factory=list)
    skipped: int = 0  # windows skipped for a non-finite loss or gradient (--on-nan skip)
    losses: list[float] = field(default_factory=list)  # each window's loss, for the curve
    evals: list[list] = field(default_factory=list)  # [window, eval loss], --steps-per-eval
    narrowed: int = 0  # windows of this epoch whose horizon the memory budget narrowed
    horizon: int = 0  # the smallest horizon those used
    metrics: dict = field(default_factory=dict)  # the objective's, summed x weight this epoch


# What must match for --resume to continue a run: (key in run.json, the flag that sets it).
LORA_FLAGS = {
    "rank": "--rank",
    "scale": "--scale",
    "dropout": "--dropout",
    "num_layers": "--num-layers",
    "keys": "--targets",
}
DATA_FLAGS = {
    "window": "--window",
    "fit": "--fit",
    "mask_prompt": "mask_prompt",
    "val_split": "--val-split",
    "seed": "--seed",
}


def files_digest(paths: list[Path]) -> str:
    h = hashlib.sha256()
    for path in paths:
        h.update(path.name.encode())
        if path.exists():
            with open(path, "rb") as f:
                for block in iter(lambda: f.read(1 << 20), b""):
                    h.update(block)
    return h.hexdigest()[:16]


def identity(cfg, loaded, data_folder: Path, window: int, backend: str, ranks: int) -> dict:
    """What must match for --resume (`mismatch`): of the run's settings, its model (`loaded`:
    framework.Loaded), its data and its processes."""
    lora = cfg.lora()
    data_files = [data_folder / "train.jsonl", data_folder / "valid.jsonl"]
    return {
        "model": {"path": str(loaded.path), "fingerprint": loaded.fingerprint},
        "lora": {
            "rank": lora.rank,
            "scale": lora.scale,
            "dropout": lora.dropout,
            "num_layers": lora.num_layers,
            "keys": lora.keys,
        },
        "walk": cfg.walk,
        "optimizer": cfg.optimizer,
        "data": {
            "fingerprint": files_digest(data_files),
            "window": window,
            "fit": cfg.fit,
            "mask_prompt": cfg.mask_prompt,
            "val_split": cfg.val_split,
            "seed": cfg.seed,
            "chunk": cfg.chunk,  # (the window is rounded up to it when --window is not given)
            "window_given": cfg.window is not None,
        },
        "backend": backend,
        "ranks": ranks,
        "windows_per_step": cfg.windows_per_step,
    }


def mismatch(saved: dict, now: dict, folder: Path) -> str | None:
    """The first difference that makes a run's checkpoints useless to this one, in words."""
    was = f"the run in {folder} was"
    backend, now_backend = saved.get("backend", "mlx"), now.get("backend", "mlx")
    if backend != now_backend:
        return f"{was} trained with --backend {backend}; this one asks for {now_backend}"
    ranks, now_ranks = saved.get("ranks", 1), now.get("ranks", 1)
    if ranks != now_ranks:
        return (
            f"{was} trained on {ranks} rank(s) (mlx.launch -n {ranks}); this launch has "
            f"{now_ranks}: resume it with the same number of ranks"
        )
    steps, now_steps = saved.get("windows_per_step", 1), now.get("windows_per_step", 1)
    if steps != now_steps:
        return f"{was} trained with --windows-per-step {steps}; this one asks for {now_steps}"
    if saved["model"]["fingerprint"] != now["model"]["fingerprint"]:
        return (
            f"{was} trained on model {saved['model']['path']} (weights "
            f"{saved['model']['fingerprint']}); this one loads {now['model']['path']} "
            f"(weights {now['model']['fingerprint']})"
        )
    for key, flag in LORA_FLAGS.items():
        if saved["lora"].get(key) != now["lora"].get(key):
            return f"{was} trained with {flag} {saved['lora'].get(key)}; this one asks for {now['lora'].get(key)}"  # noqa: E501
    for key, flag in (("walk", "--walk"), ("optimizer", "--optimizer")):
        if saved[key] != now[key]:
            return f"{was} trained with {flag} {saved[key]}; this one asks for {now[key]}"
    if saved["data"]["fingerprint"] != now["data"]["fingerprint"]:
        return f"{was} trained on other data (its train.jsonl and valid.jsonl have changed)"
    for key, flag in DATA_FLAGS.items():
        if key == "window" and (why := window_from_chunk(saved["data"], now["data"])):
            return f"{was} trained with {why}"
        if saved["data"].get(key) != now["data"].get(key):
            return f"{was} trained with {flag} {saved['data'].get(key)}; this one asks for {now['data'].get(key)}"  # noqa: E501
    return None


def window_from_chunk(saved: dict, now: dict) -> str | None:
    """A window that differs because --chunk does (the window rounded up to it), said so."""
    chunk, now_chunk = saved.get("chunk"), now.get("chunk")
    if saved.get("window") == now.get("window") or chunk in (None, now_chunk):
        return None
    if saved.get("window_given") and now.get("window_given"):
        return None  # both given by --window: that is what differs
    return (
        f"--chunk {chunk} (a window of {saved.get('window')}); this one asks for --chunk "
        f"{now_chunk} (a window of {now.get('window')})"
    )


class RunFolder:
    def __init__(self, folder: Path):
        self.folder = Path(folder)
        self.checkpoints = self.folder / CHECKPOINTS
        self.run_id: str | None = None
        self.made, self.lock = NewFolder(self.folder), FolderLock(self.folder)

    def release(self, keep: bool) -> None:
        """The lock dropped at the run's end; unless `keep`, the folders the run made removed as
        long as they hold nothing."""
        self.lock.release()
        if not keep:
            self.made.discard()

    def begin(self, ident: dict, overwrite: bool, resumed: bool) -> None:
        """The run starts here: a killed writer's leftovers swept, a run to --overwrite set
        aside, a fresh run's identity written."""
        sweep(self.folder)
        if overwrite:
            self.set_aside()
        if not resumed:
            self.start(ident)

    def held(self) -> list[str]:
        """What of another run this folder holds (empty: the folder is free)."""
        names = [n for n in RUN_FILES if (self.folder / n).exists()]
        if self.checkpoints.exists() and any(self.checkpoints.iterdir()):
            names.append(CHECKPOINTS + "/")
        return names

    def claim(self, overwrite: bool, resume: bool) -> None:
        """Refuse a fresh run in a folder that holds another (before anything is loaded)."""
        held = self.held()
        # run.json alone: a run that died before its first checkpoint, with nothing to keep
        if resume or not held or held == [MANIFEST]:
            return
        if not overwrite and MANIFEST not in held:
            raise FolderError(
                f"adapter path {self.folder} holds another run's files ({', '.join(held)}) but "
                f"no {MANIFEST} to resume it from; replace them with --overwrite, or choose "
                "another --adapter-path"
            )
        if not overwrite:
            raise FolderError(
                f"adapter path {self.folder} holds another run ({', '.join(held)}); continue it "
                "with --resume, replace it with --overwrite, or choose another --adapter-path"
            )

    def clear(self) -> None:
        """Remove this folder's run files and checkpoints."""
        for name in RUN_FILES:
            (self.folder / name).unlink(missing_ok=True)
        shutil.rmtree(self.checkpoints, ignore_errors=True)

    @property
    def aside(self) -> Path:
        return self.folder / ".overwritten.tmp-run"

    def set_aside(self) -> None:
        """--overwrite: the previous run moves aside until the new one has a checkpoint (then
        `drop_aside`), or comes back if the new one fails before (`put_back`)."""
        self.aside.mkdir()
        for name in [*RUN_FILES, CHECKPOINTS]:
            if (self.folder / name).exists():
                (self.folder / name).rename(self.aside / name)

    def drop_aside(self) -> None:
        shutil.rmtree(self.aside, ignore_errors=True)

    def put_back(self) -> None:
        if self.aside.exists():
            for item in self.aside.iterdir():
                item.rename(self.folder / item.name)
            self.aside.rmdir()

    # --- identity -------------------------------------------------------------------------------

    def start(self, ident: dict) -> None:
        self.run_id = uuid.uuid4().hex[:12]
        write_text(self.folder / MANIFEST, json.dumps({"run": self.run_id, **ident}, indent=2))

    def check_resume(self, ident: dict) -> None:
        """Adopt the run in this folder, or refuse by name what differs."""
        manifest = self.folder / MANIFEST
        if not manifest.exists():
            if not self.held():
                raise FolderError(
                    f"--resume: {self.folder} holds no run; nothing to resume: run the same "
                    "command without --resume to start one"
                )
            raise FolderError(
                f"--resume: {self.folder} holds no {MANIFEST} (no run's identity); nothing to "
                "resume: start a new run there with --overwrite instead of --resume"
            )
        try:
            saved = json.loads(manifest.read_text())
            self.run_id = saved["run"]
            problem = mismatch(saved, ident, self.folder)
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError):
            raise FolderError(f"--resume: {manifest} is damaged; start a new run") from None
        if not self.complete():  # it stopped before its first checkpoint
            raise FolderError(
                f"--resume: the run in {self.folder} stopped before its first checkpoint, so "
                f"there is nothing to resume; run the same command with --overwrite instead of "
                "--resume to start it again"
            )
        if problem:
            raise FolderError(f"--resume: {problem}; start a new run or match it")

    def resume(self, ident: dict, read_state, epochs: int, total: int) -> tuple[Path, Position]:
        """Adopt this folder's run (`check_resume`) and load its newest checkpoint strictly,
        refused when that run already trained what this one asks for (`epochs`, `total`
        windows)."""
        self.check_resume(ident)
        last, p = self.load(read_state)
        if (p.epoch >= epochs or p.windows >= total) and self.reported(p.windows):
            done = (
                f"its {p.epoch} epoch(s)"
                if p.epoch >= epochs
                else f"the {p.windows} windows --iters asks for"
            )
            raise FolderError(
                f"--resume: the run in {self.folder} has already trained {done}; raise "
                "--epochs or --iters to train on"
            )
        return last, p

    def reported(self, windows: int) -> bool:
        """Whether the run finished: its report counts these windows (a run stopped before its
        report, at its last window, resumes to close its epoch and write it)."""
        try:
            return json.loads((self.folder / "report.json").read_text())["windows"] == windows
        except (OSError, ValueError, KeyError, TypeError):
            return False

    # --- checkpoints ------------------------------------------------------------------------------

    def complete(self) -> list[Path]:
        """This run's complete checkpoints, oldest first."""
        if not self.checkpoints.exists():
            return []
        out = []
        for p in sorted(self.checkpoints.glob("window-*")):
            try:
                state = json.loads((p / "state.json").read_text())
            except (OSError, json.JSONDecodeError):
                continue
            if state.get("run") == self.run_id:
                out.append(p)
        return out

    def save(self, write_state: Callable[[Path], None], position: Position) -> Path:
        """A complete checkpoint in a fresh folder, renamed into place; older ones pruned.
        `write_state(folder)` writes the framework's tensors (the adapter, the optimizer)."""
        self.checkpoints.mkdir(exist_ok=True)
        sweep(self.checkpoints)
        final = self.checkpoints / f"window-{position.windows:07d}"
        tmp = self.checkpoints / f".{final.name}.tmp-new"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        try:
            write_state(tmp)
            write_text(tmp / "state.json", json.dumps({"run": self.run_id, **asdict(position)}))
        except BaseException:  # a full disk: the half-made checkpoint goes, the others stay
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        # An end-of-epoch checkpoint can share its window count with the last periodic one: the
        # older moves aside first, so a crash at any point leaves only complete checkpoints.
        aside = self.checkpoints / f".{final.name}.tmp-old"
        if final.exists():
            shutil.rmtree(aside, ignore_errors=True)
            final.rename(aside)
        tmp.rename(final)
        shutil.rmtree(aside, ignore_errors=True)
        for old in self.complete()[:-KEEP]:
            shutil.rmtree(old, ignore_errors=True)
        return final

    def load(self, read_state: Callable[[Path], None]) -> tuple[Path, Position]:
        """The newest checkpoint: its tensors through `read_state(folder)` (strict), its
        position."""
        last = self.complete()[-1]
        try:
            state = json.loads((last / "state.json").read_text())
        except (OSError, ValueError) as e:
            raise FolderError(f"--resume: checkpoint {last} can't be read ({e})") from None
        read_state(last)
        known = {f.name for f in fields(Position)}
        return last, Position(**{k: v for k, v in state.items() if k in known})


def open_folder(cfg, fw: Framework, model_folder: Path, data_folder: Path) -> RunFolder:
    """The run's folder, opened before anything is loaded: refused if it can't be written or is
    the model's or the data's; made, locked and claimed by the rank that writes (a refusal
    there leaves it as it was)."""
    out = writable(Path(cfg.adapter_path or default_path(cfg.model)))
    refuse_overlap(out, model_folder, data_folder)
    folder = RunFolder(out)
    if fw.ranks.leader:  # the folder is this run's from here until it ends
        folder.made.make()
        folder.lock.acquire()
        try:
            folder.claim(cfg.overwrite, cfg.resume)
            try_write(out, fw)
        except BaseException:
            folder.release(keep=False)
            raise
    return folder


def default_path(model: str) -> Path:
    name = Path(model).name or model.replace("/", "-")
    return Path("runs") / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}"


def writable(folder: Path) -> Path:
    """The adapter folder, checked writable before any training (and not created yet, so a run
    refused later leaves nothing behind)."""
    probe = folder
    while not probe.exists():
        probe = probe.parent
    if not probe.is_dir() or not os.access(probe, os.W_OK | os.X_OK):
        raise FolderError(
            f"adapter path {folder} is not writable ({probe} is not a writable folder)"
        )
    return folder


class WriteFailed(FolderError):
    """A write the run could not make (a full disk), said with what of the run is kept."""


def try_write(folder: Path, fw: Framework) -> None:
    """Write and remove a small file in the run's folder through the very calls that will write
    its checkpoints (the framework's), so a folder they can't write is refused before any
    training."""
    probe = folder / f".write-check{TMP_MARK}{os.getpid()}.safetensors"
    try:
        fw.write_check(probe)
    except (OSError, RuntimeError) as e:
        raise FolderError(f"adapter path {folder} can't be written ({e})") from None
    finally:
        probe.unlink(missing_ok=True)


def refuse_overlap(out: Path, model: Path, data_folder: Path) -> None:
    """An adapter path that is the model's or the data's folder (or holds or sits in them)."""
    mine = out.resolve()
    for what, other in (("model", model), ("data", data_folder)):
        theirs = Path(other).resolve()
        if mine == theirs or theirs in mine.parents:
            raise FolderError(
                f"adapter path {out} is inside the {what} folder {other}; choose "
                "another --adapter-path"
            )
        if mine in theirs.parents:
            raise FolderError(
                f"adapter path {out} holds the {what} folder {other}; choose another --adapter-path"
            )
