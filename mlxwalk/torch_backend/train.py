"""`mlxwalk train --backend torch`: a training run over jsonl data on a transformers model with a
PEFT adapter, one window per example, through the torch walk.

The data, the windows, the epoch table, the report and the loss curve are the MLX run's
(mlxwalk/training); what differs is the model, the optimizer and the files: the adapter is
PEFT's (`adapter_model.safetensors` + `adapter_config.json`, which `mlxwalk convert-adapter`
turns into mlx-lm's), and a checkpoint (`checkpoints/window-NNNNNNN`: the adapter, the
optimizer's state, the position in the data) is a folder written whole, then renamed into place.
`--resume` continues from the newest one when the run's identity (run.json) matches.
Under --memory-budget-mib (GPU memory, as torch's CUDA allocator counts it) the walk places the
K/V store and accumulators in pinned host memory as needed (budget.py) and a window it had to
narrow is said so on the bar and in the epoch's line. Flags the torch walk does not take
(--recompute, a q8 cache, dropout) are refused before anything is written.
"""

from __future__ import annotations

import json
import math
import shutil
import tempfile
import time
from dataclasses import asdict, replace
from pathlib import Path

import numpy as np
import torch

from ..errors import ConfigError, FolderError, ModelError, RanksError
from ..training import data as datasets
from ..training import report, samples, windows
from ..training.config import TrainConfig
from ..training.files import write_text
from ..training.run import Epoch
from ..training.runfolder import CHECKPOINTS, MANIFEST, Position, files_digest, mismatch
from ..walk.config import Window
from . import model as models
from .ranks import TorchRanks, reduce_grads
from .walk import DTYPES, ExactWalk, PlainWalk, TorchWalkConfig, train_window

DEFAULT_KEYS = ("q_proj", "v_proj", "in_proj_qkv", "in_proj_z")  # attention and delta-net


def refuse_unsupported(cfg: TrainConfig) -> None:
    if cfg.recompute:
        raise ConfigError("--recompute is not taken by the torch backend yet")
    if cfg.memory_budget_mib is not None and not torch.cuda.is_available():
        raise ConfigError(
            "--memory-budget-mib counts CUDA memory, and there is no CUDA device here"
        )
    if cfg.cache_type not in DTYPES:
        raise ConfigError(
            f"--cache-type {cfg.cache_type}: the torch backend stores K/V as {', '.join(DTYPES)}"
        )
    if cfg.dropout:
        raise ConfigError("--dropout: the torch walk trains without LoRA dropout")


def model_folder(name: str) -> Path:
    from .. import tiny

    if name in {**tiny.MODELS, **tiny.FAMILIES}:
        return models.tiny_folder(name)
    folder = Path(name)
    if not (folder / "config.json").is_file():
        raise ModelError(
            f"{name}: the torch backend loads a local transformers folder (with "
            "config.json and safetensors weights)"
        )
    return folder


def fingerprint(model) -> str:
    import hashlib

    h = hashlib.sha256()
    for name, p in sorted(model.state_dict().items()):
        flat = p.detach().reshape(-1)
        picks = flat[:: max(1, flat.numel() // 64)][:64].float().cpu().numpy()
        h.update(f"{name}:{tuple(p.shape)}:{p.dtype};".encode() + picks.tobytes())
    return h.hexdigest()[:16]


class TorchRun:
    """Setup (every refusal here, before the folder is touched), then epochs of windows."""

    def __init__(self, cfg: TrainConfig, echo=print, ranks: TorchRanks | None = None):
        from transformers import AutoTokenizer

        self.cfg = cfg.check()
        self.ranks = ranks or TorchRanks(None)
        self.echo = echo = echo if self.ranks.leader else (lambda *a: None)
        refuse_unsupported(cfg)
        if cfg.walk == "plain" and self.ranks.size > 1:
            raise RanksError(
                "--walk plain steps once per chunk; across ranks only the exact "
                "walk's steps combine"
            )
        self.out = Path(cfg.adapter_path or f"runs/{Path(cfg.model).name}-torch")
        held = self.out / MANIFEST
        if held.exists() and not (cfg.resume or cfg.overwrite):
            raise FolderError(f"{self.out} holds another run; give --resume or --overwrite")
        if cfg.resume and not held.exists():
            raise FolderError(f"--resume: {self.out} holds no run to continue")
        folder = model_folder(cfg.model)
        data_folder = datasets.check_folder(cfg.data) if cfg.data else samples.folder()
        self.device = (
            torch.device("cuda", torch.cuda.current_device())
            if torch.cuda.is_available()
            else torch.device("cpu")
        )
        dtype = torch.bfloat16 if self.device.type == "cuda" else torch.float32
        base = models.load(folder, dtype=dtype, device=str(self.device))
        tokenizer = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
        vocab = models.text_config(base).vocab_size
        limit = getattr(models.text_config(base), "max_position_embeddings", None)
        loaded = windows.load(cfg, data_folder, tokenizer, vocab, limit, echo)
        self.train_set, self.valid_set, self.window = loaded.train, loaded.valid, loaded.window
        self.identity = {
            "backend": "torch",
            "model": {"path": str(folder.resolve()), "fingerprint": fingerprint(base)},
            "lora": {
                "rank": cfg.rank,
                "scale": cfg.scale,
                "dropout": cfg.dropout,
                "num_layers": cfg.num_layers,
                "keys": cfg.targets,
            },
            "walk": cfg.walk,
            "optimizer": cfg.optimizer,
            "data": {
                "fingerprint": files_digest(
                    [data_folder / "train.jsonl", data_folder / "valid.jsonl"]
                ),
                "window": self.window,
                "fit": cfg.fit,
                "mask_prompt": cfg.mask_prompt,
                "val_split": cfg.val_split,
                "seed": cfg.seed,
            },
            "ranks": self.ranks.size,
            "windows_per_step": cfg.windows_per_step,
        }
        torch.manual_seed(cfg.seed)
        layers = None if cfg.num_layers == -1 else cfg.num_layers
        keys = tuple(k.rsplit(".", 1)[-1] for k in cfg.targets) if cfg.targets else DEFAULT_KEYS
        self.model = models.add_lora(
            base, rank=cfg.rank, alpha=cfg.scale * cfg.rank, layers=layers, keys=keys
        )
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer, self.schedule = self.make_optimizer()
        self.position = Position()
        self.partial: Epoch | None = None  # the row of an epoch --iters stopped
        self.walk_config = TorchWalkConfig(
            chunk=cfg.chunk,
            horizon=cfg.horizon,
            store_dtype=cfg.cache_type,
            host_budget_mib=cfg.host_budget_mib,
            memory_budget_mib=cfg.memory_budget_mib,
            strict_exact=cfg.strict_exact,
            follow_runs=cfg.follow_runs,
        )
        largest = max(self.train_set.examples, key=lambda e: np.flatnonzero(e.weights).max())
        win = Window.of(largest.inputs, largest.targets, largest.weights)
        # a refusal (host memory, the memory budget, --strict-exact) comes here, before any step
        self.plan = ExactWalk(self.model, win, self.walk_config).plan
        if cfg.resume:
            self.resume(held)

    def make_optimizer(self):
        cfg = self.cfg
        decay = cfg.weight_decay or 0.0
        if cfg.optimizer == "sgd":
            opt = torch.optim.SGD(self.params, lr=cfg.lr, weight_decay=decay)
        elif cfg.optimizer == "adamw":
            opt = torch.optim.AdamW(self.params, lr=cfg.lr, weight_decay=decay)
        else:
            opt = torch.optim.Adam(self.params, lr=cfg.lr)
        steps = max(1, math.ceil(self.total / self.per_step))

        def factor(step: int) -> float:
            if cfg.warmup and step < cfg.warmup:
                return (step + 1) / cfg.warmup
            done = min(1.0, (step - cfg.warmup) / max(1, steps - cfg.warmup))
            if cfg.lr_schedule == "cosine_decay":
                return 0.5 * (1 + math.cos(math.pi * done))
            return 1.0 - done if cfg.lr_schedule == "linear_schedule" else 1.0

        return opt, torch.optim.lr_scheduler.LambdaLR(opt, factor)

    @property
    def per_step(self) -> int:
        """Windows one optimizer step covers, over every rank."""
        return self.cfg.windows_per_step * self.ranks.size

    @property
    def total(self) -> int:
        every = self.cfg.epochs * len(self.train_set.examples)
        return every if self.cfg.iters is None else min(self.cfg.iters, every)

    def resume(self, held: Path) -> None:
        from peft import set_peft_model_state_dict
        from safetensors.torch import load_file

        why = mismatch(json.loads(held.read_text()), self.identity, self.out)
        if why:
            raise FolderError(f"--resume: {why}")
        saved = sorted((self.out / CHECKPOINTS).glob("window-*"))
        if not saved:
            raise FolderError(f"--resume: {self.out} holds no checkpoint yet")
        last = saved[-1]
        weights = load_file(str(last / "adapter_model.safetensors"), device=str(self.device))
        set_peft_model_state_dict(self.model, weights)
        state = torch.load(last / "optimizer.pt", map_location=self.device, weights_only=True)
        self.optimizer.load_state_dict(state["optimizer"])
        self.schedule.load_state_dict(state["schedule"])
        self.position = Position(**json.loads((last / "position.json").read_text()))
        self.echo(
            f"resumed from {last} (epoch {self.position.epoch + 1}, window {self.position.windows})"
        )

    # --- the loop ---------------------------------------------------------------------------

    def train(self) -> dict:
        fresh = not self.out.exists()
        if self.ranks.leader:
            self.out.mkdir(parents=True, exist_ok=True)
            if not self.cfg.resume:
                shutil.rmtree(self.out / CHECKPOINTS, ignore_errors=True)
                write_text(self.out / MANIFEST, json.dumps(self.identity, indent=2))
        shown = self.cfg.progress and self.ranks.leader
        bar = report.progress(self.total, self.position.windows, enabled=shown)
        try:
            while self.position.epoch < self.cfg.epochs and self.position.windows < self.total:
                order = np.random.default_rng(self.cfg.seed + self.position.epoch).permutation(
                    len(self.train_set.examples)
                )
                while self.position.index < len(order) and self.position.windows < self.total:
                    p = self.position
                    n = min(self.per_step, len(order) - p.index, self.total - p.windows)
                    chosen = order[p.index : p.index + n]
                    self.step([self.train_set.examples[i] for i in chosen], bar)
                    every = self.cfg.save_every
                    if every and self.position.windows // every > p.windows // every:
                        self.checkpoint()
                self.end_epoch(partial=self.position.index < len(order))
        except KeyboardInterrupt:
            if self.position.windows and self.ranks.leader:
                last = self.checkpoint()
                raise KeyboardInterrupt(
                    f"at window {self.position.windows}; checkpoint {last} "
                    "holds it: run the same command with --resume"
                ) from None
            raise
        except Exception:
            self.tidy(fresh)
            raise
        finally:
            bar.close()
        if self.ranks.leader:
            self.save_adapter(self.out)
        return self.finish()

    def tidy(self, fresh: bool) -> None:
        """A run that fails before its first checkpoint leaves nothing it made."""
        if not self.ranks.leader or self.cfg.resume or any((self.out / CHECKPOINTS).glob("w*")):
            return
        if fresh:
            shutil.rmtree(self.out, ignore_errors=True)
        else:
            (self.out / MANIFEST).unlink(missing_ok=True)
            shutil.rmtree(self.out / CHECKPOINTS, ignore_errors=True)

    def step(self, examples: list, bar) -> None:
        """One optimizer step on the windows `examples` (this rank walks its share); one window
        in one process steps as the walk does on its own (train_window)."""
        p = self.position
        if self.device.type == "cuda":  # the bar shows each step's own peak
            torch.cuda.reset_peak_memory_stats(self.device)
        tic = time.perf_counter()
        if len(examples) == 1 and self.ranks.size == 1:
            ex = examples[0]
            window = Window.of(ex.inputs, ex.targets, ex.weights)
            walk = train_window(
                self.model,
                self.optimizer,
                window,
                self.walk_config,
                self.cfg.walk,
                clip=self.cfg.grad_clip,
            )
            used = getattr(walk, "horizon_used", self.cfg.horizon)
            losses, horizons = [walk.loss], [used if used != self.cfg.horizon else 0]
        else:
            losses, horizons = self.combined_step(examples)
        self.schedule.step()
        seconds = time.perf_counter() - tic
        narrowed = [int(h) for h in horizons if h]
        self.position = replace(
            p,
            index=p.index + len(examples),
            windows=p.windows + len(examples),
            loss_sum=p.loss_sum + sum(float(v) * e.trainable for v, e in zip(losses, examples)),
            tokens=p.tokens + sum(e.trainable for e in examples),
            seconds=p.seconds + seconds,
            losses=[*p.losses, *(round(float(v), 6) for v in losses)],
            narrowed=p.narrowed + len(narrowed),
            horizon=min([p.horizon or min(narrowed), *narrowed]) if narrowed else p.horizon,
        )
        peak = torch.cuda.max_memory_allocated() if self.device.type == "cuda" else 0
        tokens = sum(len(e) for e in examples)
        bar.window(
            float(np.mean(losses)),
            tokens / seconds,
            peak / 2**20,
            min(narrowed) if narrowed else None,
            windows=len(examples),
        )

    def combined_step(self, examples: list) -> tuple[np.ndarray, np.ndarray]:
        """This rank's windows walked, their gradients weighted by their labelled weight; one
        all_reduce with every rank's; one step on the mean over the step's labelled positions.
        A rank's failure stops every rank (RankFailed); a non-finite one, the run."""
        slots, size = len(examples), self.ranks.size
        head = np.zeros(3 * slots + 1 + size, np.float32)  # losses x w, w, horizons, flags
        acc = [torch.zeros_like(q, dtype=torch.float32) for q in self.params]
        error = None
        for i in self.ranks.mine(list(range(slots)), self.cfg.windows_per_step):
            ex = examples[i]
            window = Window.of(ex.inputs, ex.targets, ex.weights)
            self.optimizer.zero_grad(set_to_none=True)
            try:
                walk = ExactWalk(self.model, window, self.walk_config)
                loss = walk.run()
            except Exception as e:
                if size == 1:
                    raise
                error = e
                break
            grads = [q.grad for q in self.params]
            if not np.isfinite(loss) or not all(
                torch.isfinite(g).all() for g in grads if g is not None
            ):
                head[3 * slots] = 1
                continue
            for a, g in zip(acc, grads):
                if g is not None:
                    a.add_(g.float(), alpha=float(window.total))
            used = walk.horizon_used
            head[i], head[slots + i] = loss * window.total, window.total
            head[2 * slots + i] = used if used != self.cfg.horizon else 0
        head[3 * slots + 1 + self.ranks.rank] = error is not None
        summed, head = reduce_grads(self.ranks, acc, head)
        failed = head[3 * slots + 1 :]
        if failed.any():
            self.ranks._raise(int(np.flatnonzero(failed)[0]), error)
        if head[3 * slots] or not np.isfinite(head[:slots]).all():
            raise FloatingPointError("a non-finite loss or gradient in the step; no step taken")
        weights = head[slots : 2 * slots]
        whole = float(weights.sum())
        for q, g in zip(self.params, summed):
            q.grad = (g / whole).to(q.dtype)
        if self.cfg.grad_clip is not None:
            torch.nn.utils.clip_grad_norm_(self.params, self.cfg.grad_clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        losses = np.divide(
            head[:slots], weights, out=np.zeros(slots, np.float32), where=weights > 0
        )
        return losses, head[2 * slots : 3 * slots]

    def evaluate(self) -> float | None:
        if not self.valid_set.examples:
            return None
        total = weight = 0.0
        for ex in self.valid_set.examples[self.ranks.rank :: self.ranks.size]:
            walk = PlainWalk(
                self.model, Window.of(ex.inputs, ex.targets, ex.weights), self.walk_config
            )
            total += walk.loss_only() * ex.trainable
            weight += ex.trainable
        total, weight = self.ranks.sum_numpy(np.array([total, weight], np.float64))
        return float(total / weight)

    def end_epoch(self, partial: bool) -> None:
        p = self.position
        done = p.index if partial else len(self.train_set.examples)
        examples = self.train_set.examples
        tokens = sum(len(e) for e in examples) * done / max(1, len(examples))
        row = Epoch(
            epoch=p.epoch + 1,
            train_loss=p.loss_sum / max(p.tokens, 1),
            eval_loss=self.evaluate(),
            seconds=round(p.seconds, 2),
            train_tok_s=round(tokens / p.seconds, 1) if p.seconds else 0.0,
            windows=p.index,
            partial=partial,
            windows_narrowed=p.narrowed,
            smallest_horizon=p.horizon or None,
        )
        self.echo(report.epoch_line(row))
        if partial:  # --iters stopped mid-epoch: a resumed run goes on with this epoch's sums
            self.partial = row
        else:
            self.position = replace(
                p,
                epoch=p.epoch + 1,
                index=0,
                loss_sum=0.0,
                tokens=0,
                seconds=0.0,
                narrowed=0,
                horizon=0,
                epochs=[*p.epochs, asdict(row)],
            )
        self.checkpoint()

    # --- files --------------------------------------------------------------------------------

    def save_adapter(self, folder: Path) -> None:
        """PEFT's adapter files into `folder`, each written whole (a temporary sibling first)."""
        with tempfile.TemporaryDirectory(dir=folder, prefix=".tmp-") as tmp:
            self.model.save_pretrained(tmp)
            for name in ("adapter_model.safetensors", "adapter_config.json"):
                Path(tmp, name).replace(folder / name)

    def checkpoint(self) -> Path | None:
        """The adapter, the optimizer and the position, as one folder renamed into place."""
        if not self.ranks.leader:
            return None
        root = self.out / CHECKPOINTS
        root.mkdir(parents=True, exist_ok=True)
        final = root / f"window-{self.position.windows:07d}"
        tmp = Path(tempfile.mkdtemp(dir=root, prefix=".tmp-"))
        self.save_adapter(tmp)
        torch.save(
            {"optimizer": self.optimizer.state_dict(), "schedule": self.schedule.state_dict()},
            tmp / "optimizer.pt",
        )
        (tmp / "position.json").write_text(json.dumps(asdict(self.position)))
        if final.exists():
            shutil.rmtree(final)
        tmp.rename(final)
        for old in sorted(root.glob("window-*"))[:-2]:  # the two newest are kept
            shutil.rmtree(old)
        return final

    def finish(self) -> dict:
        cfg = self.cfg
        summary = {
            "backend": "torch",
            "model": cfg.model,
            "adapter_path": str(self.out),
            "adapter_format": "peft",
            "walk": cfg.walk,
            "window": self.window,
            "chunk": cfg.chunk,
            "horizon": cfg.horizon,
            "device": str(self.device),
            "host_mib": round(self.plan.host_bytes / 2**20, 2),
            "examples": len(self.train_set.examples),
            "windows": self.position.windows,
            "window_losses": self.position.losses,
            "epochs": self.position.epochs,
            "config": asdict(cfg),
            "ranks": self.ranks.size,
        }
        if self.ranks.leader:
            report.write(self.out, summary)
        return summary


def train_run(cfg: TrainConfig, echo=print) -> dict:
    ranks = TorchRanks.init()
    run = ranks.together(lambda: TorchRun(cfg, echo, ranks))  # a refusal anywhere stops every rank
    echo = run.echo
    echo(
        f"model {cfg.model} (torch {torch.__version__} on {run.device}), "
        f"{len(run.train_set.examples)} training and {len(run.valid_set.examples)} validation "
        f"windows of up to {run.window} tokens, chunk {cfg.chunk}, {cfg.walk} walk; the PEFT "
        f"adapter and report go to {run.out}"
    )
    summary = run.train()
    echo(report.table(summary["epochs"]))
    echo(f"adapter (PEFT's format) and report written to {run.out}")
    return summary
