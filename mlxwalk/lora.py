"""`python -m mlxwalk.lora`: `mlx_lm.lora` with the walk as its trainer.

Takes mlx_lm.lora's arguments and YAML config (model, data, train, iters, fine-tune-type,
num-layers, lora_parameters, batch-size, learning-rate, adapter-path, save-every, mask-prompt,
grad-checkpoint as the walk's recompute, ...), loads data with mlx-lm's own loaders, and writes
mlx-lm's adapter files. Adds the walk's options (--walk, --chunk, --horizon, --cache-type,
--host-budget-mib, --memory-budget-mib). What the walk can't honour is refused in one line.
"""

from __future__ import annotations

import argparse
import sys
import types
from pathlib import Path

from .plan import PlanError

MLX_LM_FLAGS = {  # flag: (type, default)
    "model": (str, None),
    "train": (bool, False),
    "test": (bool, False),
    "data": (str, "data"),
    "fine_tune_type": (str, "lora"),
    "optimizer": (str, "adam"),
    "mask_prompt": (bool, False),
    "num_layers": (int, 16),
    "batch_size": (int, 1),
    "iters": (int, 1000),
    "val_batches": (int, 25),
    "learning_rate": (float, 1e-5),
    "steps_per_report": (int, 10),
    "steps_per_eval": (int, 200),
    "grad_accumulation_steps": (int, 1),
    "resume_adapter_file": (str, None),
    "adapter_path": (str, "adapters"),
    "save_every": (int, 100),
    "test_batches": (int, 500),
    "max_seq_length": (int, 2048),
    "grad_checkpoint": (bool, False),
    "seed": (int, 0),
    "report_to": (str, None),
    "project_name": (str, None),  # goes with report_to, which is refused when set
    "clear_cache_threshold": (int, 0),  # accepted; the walk evaluates chunk by chunk anyway
    "trust_remote_code": (bool, False),  # accepted; models load from local folders only
}
WALK_FLAGS = {
    "walk": (str, "exact"),
    "chunk": (int, 512),
    "horizon": (int, 0),
    "cache_type": (str, "float32"),
    "host_budget_mib": (float, None),
    "memory_budget_mib": (float, None),
}
YAML_ONLY = {"lora_parameters": {"rank": 8, "dropout": 0.0, "scale": 20.0}, "lr_schedule": None,
             "optimizer_config": {}}  # fmt: skip


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m mlxwalk.lora", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("-c", "--config")
    for name, (kind, _) in {**MLX_LM_FLAGS, **WALK_FLAGS}.items():
        flag = "--" + name.replace("_", "-")
        if kind is bool:
            p.add_argument(flag, action="store_true", default=None)
        else:
            p.add_argument(flag, type=kind, default=None)
    return p


def options(argv: list[str] | None) -> types.SimpleNamespace:
    args = parser().parse_args(argv)
    values = {k: d for k, (_, d) in {**MLX_LM_FLAGS, **WALK_FLAGS}.items()}
    values.update(YAML_ONLY)
    if args.config:
        from .options import read_mapping

        values.update(typed(read_mapping(args.config, set(values))))
    values.update({k: v for k, v in vars(args).items() if v is not None and k != "config"})
    return types.SimpleNamespace(**values)


def typed(values: dict) -> dict:
    """A YAML config's values as the flags' types (YAML reads 1e-5 as a string), or a refusal."""
    from .run import coerce

    kinds = {**MLX_LM_FLAGS, **WALK_FLAGS}
    out = dict(values)
    for key, value in values.items():
        if key in kinds:
            kind, default = kinds[key]
            out[key] = coerce(key, value, kind.__name__ + (" | None" if default is None else ""))
    return out


def refuse(o) -> None:
    if o.fine_tune_type != "lora":
        raise PlanError(f"fine-tune-type {o.fine_tune_type!r}: the walk trains LoRA adapters only")
    if o.optimizer not in ("adam", "adamw", "sgd"):
        raise PlanError(f"optimizer {o.optimizer!r}: the walk supports adam, adamw and sgd")
    if o.report_to:
        raise PlanError("report-to: not supported by the walk's trainer")
    if o.model is None:
        raise PlanError("--model is required")
    if o.walk not in ("exact", "plain"):
        raise PlanError(f"walk {o.walk!r} cannot train; choose exact or plain")


class PrintCallback:
    def on_train_loss_report(self, info: dict) -> None:
        print(f"Iter {info['iteration']}: Train loss {info['train_loss']:.3f}, "
              f"Learning Rate {info['learning_rate']:.3e}, "
              f"It/sec {info['iterations_per_second']:.3f}, "
              f"Tokens/sec {info['tokens_per_second']:.1f}, "
              f"Trained Tokens {info['trained_tokens']}, "
              f"Peak mem {info['peak_memory']:.3f} GB", flush=True)  # fmt: skip

    def on_val_loss_report(self, info: dict) -> None:
        print(f"Iter {info['iteration']}: Val loss {info['val_loss']:.3f}, "
              f"Val took {info['val_time']:.3f}s", flush=True)  # fmt: skip


def run(o) -> None:
    import mlx.core as mx
    import mlx.optimizers as optim
    from mlx_lm.tuner.datasets import CacheDataset, load_dataset
    from mlx_lm.tuner.trainer import TrainingArgs
    from mlx_lm.tuner.utils import build_schedule, linear_to_lora_layers
    from mlx_lm.utils import save_config

    from . import models, trainer
    from .walk import WalkConfig

    refuse(o)
    walk_config = WalkConfig(chunk=o.chunk, horizon=o.horizon, cache_type=o.cache_type,
                             recompute=bool(o.grad_checkpoint), host_budget_mib=o.host_budget_mib,
                             memory_budget_mib=o.memory_budget_mib).check()  # fmt: skip
    trainer.check(
        types.SimpleNamespace(
            batch_size=o.batch_size, grad_accumulation_steps=o.grad_accumulation_steps
        )
    )
    mx.random.seed(o.seed)
    model, tokenizer = models.load(o.model)
    train_set, valid_set, test_set = load_dataset(o, tokenizer)
    model.freeze()
    linear_to_lora_layers(model, o.num_layers, o.lora_parameters)
    if o.resume_adapter_file:
        model.load_weights(o.resume_adapter_file, strict=False)
    adapter_path = Path(o.adapter_path)
    adapter_path.mkdir(parents=True, exist_ok=True)
    save_config({**vars(o), "fine_tune_type": "lora"}, adapter_path / "adapter_config.json")
    args = TrainingArgs(
        batch_size=1, iters=o.iters, val_batches=o.val_batches,
        steps_per_report=o.steps_per_report, steps_per_eval=o.steps_per_eval,
        steps_per_save=o.save_every, adapter_file=str(adapter_path / "adapters.safetensors"),
        max_seq_length=o.max_seq_length, grad_checkpoint=bool(o.grad_checkpoint),
    )  # fmt: skip
    lr = build_schedule(o.lr_schedule) if o.lr_schedule else o.learning_rate
    opt = {"adam": optim.Adam, "adamw": optim.AdamW, "sgd": optim.SGD}[o.optimizer]
    optimizer = opt(learning_rate=lr, **o.optimizer_config.get(o.optimizer, {}))
    if o.train:
        trainer.train(model, optimizer, CacheDataset(train_set), CacheDataset(valid_set), args,
                      PrintCallback(), walk=o.walk, walk_config=walk_config)  # fmt: skip
    if o.test:
        loss = trainer.evaluate(model, CacheDataset(test_set), args, walk_config, o.test_batches)
        print(f"Test loss {loss:.3f}")


def main(argv: list[str] | None = None) -> int:
    try:
        run(options(argv))
    except (ValueError, FileNotFoundError, OSError) as e:
        print(f"mlxwalk.lora: error: {(str(e).splitlines() or [type(e).__name__])[0]}",
              file=sys.stderr)  # fmt: skip
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
