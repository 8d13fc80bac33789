"""`python -m mlxwalk.lora`: `mlx_lm.lora` with the walk as its trainer.

Takes every argument and YAML key of mlx_lm.lora (numbers read as mlx-lm reads them), loads data
with mlx-lm's loaders and batches it with its iterate_batches (the same labels and data order for
the same seed), and writes mlx-lm's adapter files. Differences, each by design:
  batch_size          1 (one window per step), or the number of ranks under mlx.launch (a
                      window per rank, the step's gradient the mean over all their labelled
                      tokens); grad_accumulation_steps 1
  max_seq_length      cuts only when given (mlx-lm's default cuts at 2,048), and says so
  grad_checkpoint     the walk's recompute (each chunk's graph layer by layer)
  fine_tune_type      lora only (dora and full are refused)
  report_to           wandb/swanlab through mlx-lm's callbacks, when installed
Adds the walk's options (--walk, --chunk, --horizon, --cache-type, --accumulator-dtype,
--min-chunk, --host-budget-mib, --memory-budget-mib, --strict-exact, --overwrite) and `mlxwalk
train`'s objectives: --objective dpo or simpo (--beta, --gamma) trains on preference pairs in
mlx-lm-lora's formats (preference.py). What the walk can't honour is refused in one line.
"""

from __future__ import annotations

import argparse
import copy
import math
import sys
import types
from contextlib import nullcontext
from dataclasses import replace
from pathlib import Path

from ..errors import ConfigError, DataError, FolderError, ModelError
from ..training.files import owned
from ..training.options import with_default
from ..training.ranks import Ranks
from ..walk import WalkConfig, arch, machine
from ..walk.store import check_cache_type
from .preference import metrics_said
from .trainer import NO_CUT

# mlx_lm.lora's own options, from its own table of defaults, with the walk's differences.
DIFFERENCES = {
    "model": None,  # required: nothing is downloaded
    "data": "data",  # a local folder (mlx-lm's default is a hub dataset)
    "batch_size": 1,  # one window per step
    "max_seq_length": None,  # mlx-lm cuts at 2,048; the walk only when asked
}
YAML_ONLY = {"lora_parameters", "lr_schedule", "optimizer_config"}  # mappings, as in mlx-lm
FEATURES = {
    "hf_dataset": None,
    "prompt_feature": "prompt",
    "completion_feature": "completion",
    "text_feature": "text",
    "chat_feature": "messages",
}  # mlx-lm's loaders
WALK_OPTIONS = (
    "walk",
    "chunk",
    "horizon",
    "cache_type",
    "accumulator_dtype",
    "min_chunk",
    "host_budget_mib",
    "memory_budget_mib",
    "strict_exact",
    "follow_runs",
    "overwrite",
    "objective",
    "beta",
    "gamma",
)


def _kind(name: str, default) -> type:
    if name in ("max_seq_length",):
        return int
    return type(default) if default is not None else str


def mlx_lm_flags() -> dict[str, tuple[type, object]]:
    """flag: (type, default), for every option of mlx_lm.lora that is not a mapping."""
    from mlx_lm.lora import CONFIG_DEFAULTS

    out = {}
    for k, v in CONFIG_DEFAULTS.items():
        if k not in YAML_ONLY and k != "config":
            default = DIFFERENCES.get(k, v)
            out[k] = (_kind(k, default), default)
    return out


def walk_flags() -> dict[str, tuple[type, object]]:
    """The walk's options, as `mlxwalk train` defines them (training/config.py)."""
    from dataclasses import fields

    from ..training.config import TrainConfig

    kinds = {"int": int, "float": float, "bool": bool, "str": str}
    return {
        f.name: (kinds[str(f.type).split("|")[0].strip()], f.default)
        for f in fields(TrainConfig)
        if f.name in WALK_OPTIONS
    }


def yaml_defaults() -> dict:
    from mlx_lm.lora import CONFIG_DEFAULTS

    return {**{k: copy.deepcopy(CONFIG_DEFAULTS[k]) for k in YAML_ONLY}, **FEATURES}


OPTIMIZERS = ("adam", "adamw", "sgd", "muon", "adafactor")  # the walk hands any of them gradients


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m mlxwalk.lora",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    from .. import __version__

    texts = helps()
    p.add_argument("--version", action="version", version=f"mlxwalk {__version__}")
    p.add_argument("-c", "--config", help=texts["config"])
    for name, (kind, _) in {**mlx_lm_flags(), **walk_flags()}.items():
        flag = "--" + name.replace("_", "-")
        if kind is bool:
            p.add_argument(flag, action="store_true", default=None, help=texts.get(name))
        else:
            p.add_argument(flag, type=kind, default=None, help=texts.get(name))
    return p


# Where the drop-in's option differs from mlx_lm.lora's: its help in place of mlx-lm's (OWN_HELP)
# or said after it (HELP_NOTES).
OWN_HELP = {
    "model": "The path to the local model directory, or a Hugging Face repo in the local cache "
    "(required; nothing is downloaded).",
    "data": "Directory with {train, valid, test}.jsonl files (default: data; nothing is "
    "downloaded).",
}
HELP_NOTES = {
    "fine_tune_type": "The walk trains lora only.",
    "batch_size": "1 (one window per step), or the number of ranks under mlx.launch.",
    "max_seq_length": "Cuts only when given (the walk needs no cut), and says so.",
    "grad_checkpoint": "The walk's recompute: each chunk's graph layer by layer.",
    "grad_accumulation_steps": "1 only.",
}


def helps() -> dict[str, str]:
    """Each option's help: mlx_lm.lora's own (its parser's texts, with the walk's differences)
    and, for the walk's options, `mlxwalk train`'s (training/config.py)."""
    from dataclasses import fields

    from mlx_lm.lora import build_parser

    from ..training.config import TrainConfig

    out = {a.dest: a.help for a in build_parser()._actions if a.help and a.dest != "help"}
    for name, note in HELP_NOTES.items():
        out[name] = f"{out[name]} {note}" if name in out else note
    out.update(OWN_HELP)
    for f in fields(TrainConfig):
        if f.name in WALK_OPTIONS:
            out[f.name] = with_default(f.metadata["help"], f.default)
    return out


def options(argv: list[str] | None) -> types.SimpleNamespace:
    args = parser().parse_args(argv)
    values = {k: d for k, (_, d) in {**mlx_lm_flags(), **walk_flags()}.items()}
    values.update(yaml_defaults())
    if args.config:
        from ..training.options import read_mapping

        values.update(typed(read_mapping(args.config, set(values) | {"config"})))
    values.update({k: v for k, v in vars(args).items() if v is not None and k != "config"})
    values["config"] = args.config
    return types.SimpleNamespace(**values)


def typed(values: dict) -> dict:
    """A YAML config's values as the flags' types, or a refusal naming the key."""
    from ..training.config import coerce

    kinds = {**mlx_lm_flags(), **walk_flags()}
    out = dict(values)
    for key, value in values.items():
        if key in kinds:
            kind, default = kinds[key]
            out[key] = coerce(key, value, kind.__name__ + (" | None" if default is None else ""))
    return out


def refuse(o) -> None:
    """What the walk can't honour, or values that make no sense, each named by its flag."""
    from ..training.config import at_least, layers, objective, positive

    o.optimizer = str(o.optimizer).lower()  # as mlx_lm.lora reads it
    given = o.lora_parameters
    if isinstance(given, dict) and "alpha" in given and "scale" not in given:  # as mlx-lm refuses
        raise ConfigError(
            "lora_parameters has 'alpha' but no 'scale': mlx-lm's LoRA config uses 'scale', "
            "not 'alpha' (unlike some other LoRA frameworks)"
        )
    if isinstance(o.lora_parameters, dict):  # a partial mapping keeps mlx-lm's other defaults
        o.lora_parameters = {**yaml_defaults()["lora_parameters"], **o.lora_parameters}
    if not (o.train or o.test):
        raise ConfigError("give --train, --test or both")
    if o.fine_tune_type != "lora":
        raise ConfigError(
            f"fine-tune-type {o.fine_tune_type!r}: the walk trains LoRA adapters only"
        )
    if o.optimizer not in OPTIMIZERS:
        raise ConfigError(f"optimizer {o.optimizer!r} is unknown; choose {', '.join(OPTIMIZERS)}")
    if not isinstance(o.optimizer_config, dict):
        raise ConfigError("optimizer_config must map an optimizer's name to its arguments")
    if o.lr_schedule is not None and not (
        isinstance(o.lr_schedule, dict) and isinstance(o.lr_schedule.get("name"), str)
    ):
        raise ConfigError(
            "lr_schedule must be a mapping with a name, as in mlx-lm "
            "({name: cosine_decay, warmup: 100, arguments: [1e-5, 1000, 1e-7]})"
        )
    if o.model is None:
        raise ConfigError("--model is required")
    if o.walk not in ("exact", "plain"):
        raise ConfigError(f"walk {o.walk!r} cannot train; choose exact or plain")
    objective(o.objective, o.beta, o.gamma, o.walk)
    if o.objective != "tokens" and o.hf_dataset:
        raise ConfigError(
            f"--objective {o.objective} reads preference pairs from a local --data folder, "
            "not hf_dataset"
        )
    for name in (
        "iters",
        "steps_per_report",
        "steps_per_eval",
        "save_every",
        "max_seq_length",
        "chunk",
    ):
        at_least(name, getattr(o, name), 1)
    layers(o.num_layers)  # -1: every layer, as in mlx-lm
    if not o.hf_dataset and Path(o.data).is_file():
        raise DataError(
            f"--data {o.data} is a file; give the folder that holds train.jsonl, "
            "valid.jsonl and test.jsonl"
        )
    if not o.hf_dataset and not Path(o.data).is_dir():
        raise DataError(f"--data {o.data} is not a folder (nothing is downloaded)")
    for split, wanted in (("train", o.train), ("valid", o.train), ("test", o.test)):
        file = Path(o.data) / f"{split}.jsonl"
        if wanted and not o.hf_dataset and file.is_file() and not file.read_text().strip():
            raise DataError(f"{file} is empty: {split} needs at least one example")
    at_least("horizon", o.horizon, 0, " (0 = the whole window)")
    for name in ("val_batches", "test_batches"):
        if getattr(o, name) == 0 or getattr(o, name) < -1:
            raise ConfigError(f"--{name.replace('_', '-')} must be at least 1 (or -1 for all)")
    positive("learning_rate", o.learning_rate)
    at_least("seed", o.seed, 0)
    lp = o.lora_parameters
    if not isinstance(lp, dict) or not isinstance(lp.get("rank"), int) or lp["rank"] < 1:
        raise ConfigError(f"lora_parameters: rank must be an integer of at least 1, got {lp!r}")
    dropout, scale = lp.get("dropout", 0.0), lp.get("scale", 20.0)
    if not isinstance(dropout, (int, float)) or not 0 <= dropout < 1:
        raise ConfigError(f"lora_parameters: dropout must be a number in [0, 1), got {dropout!r}")
    if not isinstance(scale, (int, float)) or isinstance(scale, bool):
        raise ConfigError(f"lora_parameters: scale must be a number, got {scale!r}")
    positive("scale", float(scale))


def claim(o) -> None:
    """A training run never replaces another's adapter unless asked to, or continuing it."""
    folder = Path(o.adapter_path)
    held = [n for n in ("adapters.safetensors", "adapter_config.json") if (folder / n).exists()]
    resuming = o.resume_adapter_file and Path(o.resume_adapter_file).resolve().parent == (
        folder.resolve()
    )
    if held and not (o.overwrite or resuming):
        raise FolderError(
            f"adapter path {folder} holds an adapter already ({', '.join(held)}); pass "
            f"--overwrite to replace it, --resume-adapter-file {folder / 'adapters.safetensors'} "
            "to continue it, or another --adapter-path"
        )


def load_adapter(model, folder: str) -> None:
    """The adapter under test, as mlx-lm builds it from adapter_config.json, loaded strictly."""
    from mlx_lm.tuner.utils import linear_to_lora_layers

    from ..training.adapters import load_strict
    from ..training.files import load_json, load_safetensors

    path = Path(folder)
    for name in ("adapter_config.json", "adapters.safetensors"):
        if not (path / name).exists():
            raise FolderError(
                f"adapter path {path} has no {name} to test (train one with --train, "
                "or give --adapter-path '' to test the base model)"
            )
    config = load_json(path / "adapter_config.json")
    model.freeze()
    linear_to_lora_layers(model, config["num_layers"], config["lora_parameters"])
    load_strict(model, load_safetensors(path / "adapters.safetensors"), str(path))
    print(
        f"Testing the adapter in {path} (rank {config['lora_parameters']['rank']}, "
        f"{config['num_layers']} layers)",
        flush=True,
    )


def announce_cuts(dataset, max_seq_length: int | None) -> None:
    """The walk cuts only at a max_seq_length given; when it does, it says how much."""
    if max_seq_length is None:
        return
    lengths = [len(dataset[i][0]) for i in range(len(dataset))]
    long = [n for n in lengths if n > max_seq_length]
    if long:
        print(
            f"[WARNING] {len(long)} of {len(lengths)} training items are longer than "
            f"max_seq_length ({max_seq_length}) and are cut to it (the longest has "
            f"{max(long)} tokens); the walk needs no cut: drop --max-seq-length to keep them "
            "whole",
            flush=True,
        )


class PrintCallback:
    """mlx-lm's report lines, then each callback it wraps (--report-to's, a caller's)."""

    def __init__(self, *wrapped):
        self.wrapped = [w for w in wrapped if w is not None]

    def on_train_loss_report(self, info: dict) -> None:
        print(
            f"Iter {info['iteration']}: Train loss {info['train_loss']:.3f}"
            f"{metrics_said(info, 'train')}, "
            f"Learning Rate {info['learning_rate']:.3e}, "
            f"It/sec {info['iterations_per_second']:.3f}, "
            f"Tokens/sec {info['tokens_per_second']:.1f}, "
            f"Trained Tokens {info['trained_tokens']}, "
            f"Peak mem {info['peak_memory']:.3f} GB",
            flush=True,
        )
        for w in self.wrapped:
            w.on_train_loss_report(info)

    def on_val_loss_report(self, info: dict) -> None:
        print(
            f"Iter {info['iteration']}: Val loss {info['val_loss']:.3f}"
            f"{metrics_said(info, 'val')}, "
            f"Val took {info['val_time']:.3f}s",
            flush=True,
        )
        for w in self.wrapped:
            w.on_val_loss_report(info)


def reporting(o, callback=None) -> PrintCallback:
    """mlx-lm's reporting callbacks for --report-to (wandb, swanlab), when installed."""
    from mlx_lm.tuner.callbacks import get_reporting_callbacks

    if not o.report_to:
        return PrintCallback(callback)
    try:
        wrapped = get_reporting_callbacks(
            o.report_to, project_name=o.project_name, log_dir=o.adapter_path, config=vars(o)
        )
    except ImportError as e:  # mlx-lm's says "wandb is not installed. please install ..."
        missing = e.name or str(e).split()[0]
        raise ConfigError(
            f"--report-to {o.report_to}: {missing} is not installed (pip install {missing})"
        ) from None
    except ValueError as e:
        raise ConfigError(f"--report-to {o.report_to}: {e}") from None
    return PrintCallback(wrapped, callback)


def run(o, training_callback=None) -> None:
    """mlx_lm.lora's run with the walk as trainer; `training_callback` also gets the reports."""

    from . import trainer

    refuse(o)
    walk_config = WalkConfig(
        chunk=o.chunk,
        horizon=o.horizon,
        cache_type=o.cache_type,
        accumulator_dtype=o.accumulator_dtype,
        min_chunk=o.min_chunk,
        recompute=bool(o.grad_checkpoint),
        host_budget_mib=o.host_budget_mib,
        memory_budget_mib=o.memory_budget_mib,
        strict_exact=bool(o.strict_exact),
        follow_runs=bool(o.follow_runs),
    ).check()
    ranks = Ranks.init()
    trainer.check(o, ranks=ranks.size)
    with owned(Path(o.adapter_path)) if o.train and ranks.leader else nullcontext():
        if o.train and ranks.leader:
            claim(o)
        fine_tune(o, walk_config, ranks, training_callback)


def fine_tune(o, walk_config, ranks: Ranks, training_callback=None) -> None:
    """Train, test or both, as mlx_lm.lora's run does."""
    import numpy as np
    from mlx_lm.tuner.datasets import CacheDataset, load_dataset

    from ..training import models
    from ..training import objective as objectives
    from . import preference, trainer

    np.random.seed(o.seed)  # the data order, as mlx_lm.lora seeds it
    callback = reporting(o, training_callback) if o.train else None
    model, tokenizer = models.load(o.model, trust_remote_code=bool(o.trust_remote_code))
    check_cache_type(o.cache_type, arch.inspect(model).head_dims)
    budget_mib, memory = machine.default_budget_mib(o.memory_budget_mib)
    if memory is not None and o.train and o.walk == "exact" and ranks.leader:
        print(f"memory budget: {memory.said()}, as no --memory-budget-mib is given", flush=True)
    walk_config = replace(walk_config, memory_budget_mib=budget_mib)
    objective = objectives.of(o) if o.objective != "tokens" else None
    if objective is not None:  # preference pairs: mlx-lm's loaders know none
        vocab = arch.inspect(model).vocab
        train_set, valid_set, test_set = preference.load(o, tokenizer, objective, vocab)
    else:
        train_set, valid_set, test_set = map(CacheDataset, load_dataset(o, tokenizer))
    args = training_args(o)
    if o.train:
        train(o, model, train_set, valid_set, args, walk_config, callback, objective)
    elif o.adapter_path:
        load_adapter(model, o.adapter_path)
    else:
        print("Testing the base model (no adapter)", flush=True)
    if o.test and objective is not None:
        preference.test(model, test_set, objective, walk_config, o.test_batches, ranks)
    elif o.test:
        loss = trainer.evaluate(model, test_set, args, walk_config, o.test_batches, ranks=ranks)
        if ranks.leader:
            print(f"Test loss {loss:.3f}, Test ppl {math.exp(loss):.3f}.", flush=True)


def training_args(o):
    from mlx_lm.tuner.trainer import TrainingArgs

    from ..training.config import from_fields

    return from_fields(
        TrainingArgs,
        o,
        steps_per_save=o.save_every,
        adapter_file=str(Path(o.adapter_path) / "adapters.safetensors"),
        max_seq_length=o.max_seq_length or NO_CUT,
        grad_checkpoint=bool(o.grad_checkpoint),
    )


def make_optimizer(o):
    """mlx_lm.lora's optimizer: its class, its optimizer_config, its lr_schedule (with warmup)."""
    import mlx.optimizers as optim
    from mlx_lm.tuner.utils import build_schedule

    try:
        lr = build_schedule(o.lr_schedule) if o.lr_schedule else o.learning_rate
    except (AttributeError, KeyError, TypeError, ValueError) as e:
        raise ConfigError(f"lr_schedule {o.lr_schedule!r}: {e}") from None
    classes = {
        "adam": optim.Adam,
        "adamw": optim.AdamW,
        "sgd": optim.SGD,
        "muon": optim.Muon,
        "adafactor": optim.Adafactor,
    }
    settings = o.optimizer_config.get(o.optimizer, {}) or {}
    try:
        return classes[o.optimizer](learning_rate=lr, **settings)
    except TypeError as e:
        raise ConfigError(f"optimizer_config for {o.optimizer}: {e}") from None


def train(o, model, train_set, valid_set, args, walk_config, callback, objective=None) -> None:
    """The adapter on `model` as mlx_lm.lora makes it, then the walk's training: mlx-lm's
    batches, or with `objective` (DPO's, SimPO's) preference pairs (preference.py)."""
    import mlx.core as mx
    from mlx_lm.tuner.utils import linear_to_lora_layers

    from ..training import adapters
    from ..training.files import load_safetensors
    from . import preference, trainer

    mx.random.seed(o.seed)  # the adapter's initial values, as mlx_lm.lora seeds them
    model.freeze()
    if o.num_layers != -1 and o.num_layers > len(model.layers):
        raise ModelError(
            f"--num-layers {o.num_layers} exceeds the model's {len(model.layers)} layers"
        )
    lora = adapters.LoraConfig(
        o.lora_parameters["rank"],
        o.lora_parameters["scale"],
        o.lora_parameters["dropout"],
        o.num_layers,
        o.lora_parameters.get("keys"),
    )
    adapters.check(model, lora)
    linear_to_lora_layers(model, o.num_layers, o.lora_parameters)
    if o.resume_adapter_file:
        file = Path(o.resume_adapter_file)
        if file.is_dir():
            raise ConfigError(
                f"--resume-adapter-file {file} is a folder; give the adapter's "
                f"file, such as {file / 'adapters.safetensors'}"
            )
        if not file.is_file():
            raise ConfigError(f"--resume-adapter-file {file} does not exist")
        adapters.load_strict(model, load_safetensors(file), str(file))
        print(f"Loading fine-tuned weights from {file}", flush=True)
    if objective is None:
        announce_cuts(train_set, o.max_seq_length)
    optimizer = make_optimizer(o)
    config = {**{k: v for k, v in vars(o).items() if k != "overwrite"}, "fine_tune_type": "lora"}
    common = dict(training_callback=callback, walk_config=walk_config, adapter_config=config)
    if objective is not None:
        preference.train(model, optimizer, train_set, valid_set, args, objective, **common)
    else:
        trainer.train(model, optimizer, train_set, valid_set, args, walk=o.walk, **common)


def main(argv: list[str] | None = None) -> int:
    from ..cli import catch_stops, fail, setup

    catch_stops()
    try:
        setup()
        run(options(argv))
    except (ValueError, FileNotFoundError, OSError, RuntimeError, KeyboardInterrupt) as e:
        return fail("mlxwalk.lora", e)
    return 0


if __name__ == "__main__":
    sys.exit(main())
