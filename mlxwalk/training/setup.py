"""A run's setup, top to bottom, every refusal in it: the options checked; the folder opened and
claimed before anything is loaded; the model, the windows, the adapter and the optimizer made;
the largest window admitted; then the run's identity and --resume checked together. A refusal
after the folder was opened leaves it as it was."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import ConfigError, RanksError
from . import data, runfolder, samples, windows
from .config import TrainConfig
from .framework import Admission, Framework, Loaded
from .objective import Objective
from .optimizer_spec import OptimizerSpec
from .runfolder import Position, RunFolder
from .watch import Watch
from .windows import Windows

LR_WARN = 0.1  # an Adam learning rate above this is announced as one that will diverge


@dataclass
class Setup:
    """What the loop starts from."""

    cfg: TrainConfig  # checked, with the framework's memory budget
    folder: RunFolder  # opened, locked and claimed (the leader)
    loaded: Loaded
    windows: Windows
    spec: OptimizerSpec
    watch: Watch
    admission: Admission | None  # the exact walk's plan for the largest window
    identity: dict  # run.json's
    position: Position  # where the run starts (a resumed run's checkpoint)
    resumed_from: Path | None
    echo: object


def prepare(cfg: TrainConfig, fw: Framework, echo, objective: Objective) -> Setup:
    cfg, ranks = cfg.check(), fw.ranks
    echo = echo if ranks.leader else quiet  # one voice: the rank that writes
    fw.refuse(cfg)
    if cfg.walk == "plain" and ranks.size > 1:
        raise RanksError(
            "--walk plain steps once per chunk; across ranks only the exact walk's steps combine"
        )
    if cfg.walk == "plain" and objective.name != "tokens":
        raise ConfigError(f"--walk plain trains token cross-entropy only, not {objective.name}")
    data_folder = data.check_folder(cfg.data) if cfg.data else samples.folder()
    model_folder = fw.model_folder(cfg.model)
    folder = runfolder.open_folder(cfg, fw, model_folder, data_folder)
    try:  # the folder is claimed: every refusal from here leaves it as it was
        loaded = fw.load(cfg)
        sets = windows.load(cfg, data_folder, loaded, ranks.size, echo, objective)
        spec = OptimizerSpec.of(cfg, sets.steps)
        fw.adapt(cfg, spec)
        cfg = fw.budget(cfg, echo)
        watch = Watch(cfg, loaded.vocab, echo)
        if cfg.optimizer != "sgd" and cfg.lr > LR_WARN:
            echo(
                f"warning: --lr {cfg.lr:g} is far above what Adam trains LoRA with (1e-6 to "
                "1e-3); expect the loss to diverge"
            )
        admission = None  # the exact walk's plan sized by the window labelled furthest
        if cfg.walk == "exact":
            every = [w for item in sets.train.examples for w in objective.windows(item)]
            largest = max(every, key=lambda w: np.flatnonzero(w.weights).max())
            admission = fw.admit(cfg, largest)
        ident = runfolder.identity(cfg, loaded, data_folder, sets.window, fw.name, ranks.size)
        position, resumed_from = Position(), None
        if cfg.resume:
            resumed_from, position = folder.resume(ident, fw.load_state, cfg.epochs, sets.total)
            was = fw.resume_lr(spec)
            if was is not None:
                echo(f"learning rate {spec.lr:g} from here on (the run's was {was:g})")
    except BaseException:
        folder.release(keep=False)
        raise
    return Setup(
        cfg, folder, loaded, sets, spec, watch, admission, ident, position, resumed_from, echo
    )


def quiet(*args) -> None:
    """The echo of a rank that is not the leader."""
