"""`mlxwalk train --backend torch`: the one training loop (mlxwalk/training/run.py) on a
transformers model with a PEFT adapter, through the torch walk: `TorchFramework` is torch's
mechanics for it.

Everything but the mechanics is the MLX run's: the data, the windows, the objective and the step
with its one reduction (training/step.py), the folder's lock and identity, checkpoints, resume,
the NaN guard, Ctrl-C, the epoch table, the report and the loss curve. So is the optimizer: both
backends take the run's training/optimizer_spec.py (mlx-lm's schedule, MLX's Adam/AdamW/SGD with
its defaults: no bias correction, AdamW's weight decay 0.01), torch's built as `SpecOptimizer`
under a LambdaLR. The adapter is PEFT's
(`adapter_model.safetensors` + `adapter_config.json`, which `mlxwalk convert-adapter` turns into
mlx-lm's); a checkpoint holds it, the optimizer's and the schedule's state (`optimizer.pt`) and
the position.
Under --memory-budget-mib (GPU memory, as torch's CUDA allocator counts it) the walk places the
K/V store and accumulators in pinned host memory as needed (budget.py) and a window it had to
narrow is said so on the bar and in the epoch's line. Flags the torch walk does not take
(--recompute, a q8 cache, dropout) are refused before anything is written.
"""

from __future__ import annotations

import copy
import math
import tempfile
from contextlib import nullcontext
from pathlib import Path

import numpy as np
import torch

from ..errors import ConfigError, ModelError, NonFinite
from ..training import run
from ..training.config import TrainConfig
from ..training.framework import Admission, Framework, Loaded
from ..training.optimizer_spec import OptimizerSpec
from ..walk.window import Window
from . import model as models
from .ranks import TorchRanks
from .walk import DTYPES, ExactWalk, PlainWalk, TorchWalkConfig, torch_store, train_window

DEFAULT_KEYS = ("q_proj", "v_proj", "in_proj_qkv", "in_proj_z")  # attention and delta-net


def refuse_unsupported(cfg: TrainConfig) -> None:
    if cfg.recompute:
        raise ConfigError("--recompute is not taken by the torch backend yet")
    if cfg.memory_budget_mib is not None and not torch.cuda.is_available():
        raise ConfigError(
            "--memory-budget-mib counts CUDA memory, and there is no CUDA device here"
        )
    if cfg.cache_type not in (*DTYPES, "auto"):
        raise ConfigError(
            f"--cache-type {cfg.cache_type}: the torch backend stores K/V as {', '.join(DTYPES)}"
        )
    if cfg.dropout:
        raise ConfigError("--dropout: the torch walk trains without LoRA dropout")
    if cfg.accumulator_dtype == "bfloat16":
        raise ConfigError("--accumulator-dtype bfloat16: the torch walk accumulates in float32")
    if cfg.min_chunk is not None:
        raise ConfigError("--min-chunk: the torch walk keeps --chunk under a memory budget")


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


class TorchFramework(Framework):
    """torch's mechanics for the training loop."""

    name = "torch"
    adapter_files = ("adapter_model.safetensors", "adapter_config.json")
    ranks_kind = TorchRanks

    def __init__(self, ranks: TorchRanks | None = None):
        super().__init__(ranks)
        cuda = torch.cuda.is_available()
        self.device = torch.device("cuda", torch.cuda.current_device()) if cuda else None
        self.device = self.device or torch.device("cpu")

    def model_folder(self, model: str) -> Path:
        return model_folder(model)

    def refuse(self, cfg: TrainConfig) -> None:
        refuse_unsupported(cfg)

    def load(self, cfg: TrainConfig) -> Loaded:
        from transformers import AutoTokenizer

        folder = model_folder(cfg.model)
        dtype = torch.bfloat16 if self.device.type == "cuda" else torch.float32
        self.base = models.load(folder, dtype=dtype, device=str(self.device))
        tokenizer = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
        text = models.text_config(self.base)
        limit = getattr(text, "max_position_embeddings", None)
        described = f"torch {torch.__version__} on {self.device}"
        return Loaded(
            tokenizer, text.vocab_size, limit, fingerprint(self.base), folder.resolve(), described
        )

    def walk_config(self, cfg: TrainConfig) -> TorchWalkConfig:
        return TorchWalkConfig.from_fields(cfg, store_dtype=torch_store(cfg.cache_type))

    def adapt(self, cfg: TrainConfig, spec: OptimizerSpec) -> None:
        torch.manual_seed(cfg.seed)
        layers = None if cfg.num_layers == -1 else cfg.num_layers
        keys = tuple(k.rsplit(".", 1)[-1] for k in cfg.targets) if cfg.targets else DEFAULT_KEYS
        self.model = models.add_lora(
            self.base, rank=cfg.rank, alpha=cfg.scale * cfg.rank, layers=layers, keys=keys
        )
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer, self.schedule = make_optimizer(spec, self.params)

    def admit(self, cfg: TrainConfig, example) -> Admission:
        window = Window.of(example.inputs, example.targets, example.weights)
        walk = ExactWalk(self.model, window, self.walk_config(cfg))
        store = walk.plan.computed * walk.footprint.kv_width * walk.store_element()
        if walk.estimate is None:
            return Admission(walk.plan, store)
        return Admission(walk.plan, store, walk.estimate.gpu, walk.estimate.chunk_graph)

    def snapshot(self):
        """Copies: torch updates its tensors in place."""
        return (
            [p.detach().clone() for p in self.params],
            copy.deepcopy(self.optimizer.state_dict()),
            self.schedule.state_dict(),
        )

    def restore(self, snap) -> None:
        params, state, schedule = snap
        with torch.no_grad():
            for p, saved in zip(self.params, params):
                p.copy_(saved)
        self.optimizer.load_state_dict(state)
        self.schedule.load_state_dict(schedule)
        self.optimizer.zero_grad(set_to_none=True)

    def reset_peak(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)

    def peak(self) -> int:
        return torch.cuda.max_memory_allocated(self.device) if self.device.type == "cuda" else 0

    def walk_plain(self, window, cfg: TrainConfig, seed: int, on_chunk) -> tuple[float, int]:
        window = Window.of(window.inputs, window.targets, window.weights)
        config = self.walk_config(cfg)
        try:
            walk = train_window(self.model, self.optimizer, window, config, "plain", cfg.grad_clip)
        except FloatingPointError as e:
            raise NonFinite(str(e)) from None
        self.schedule.step()
        return walk.loss, cfg.horizon

    def zeros(self) -> list[torch.Tensor]:
        self.touched = [False] * len(self.params)  # which the walks gave a gradient
        return [torch.zeros_like(q, dtype=torch.float32) for q in self.params]

    def gradient(self, window, cfg: TrainConfig, seed: int, on_chunk) -> tuple:
        window = Window.of(window.inputs, window.targets, window.weights)
        self.optimizer.zero_grad(set_to_none=True)
        walk = ExactWalk(self.model, window, self.walk_config(cfg))
        loss = walk.run()
        if not np.isfinite(loss):
            raise NonFinite(f"the window's loss is {loss}; no step taken")
        grads = [q.grad for q in self.params]
        if not all(torch.isfinite(g).all() for g in grads if g is not None):
            raise NonFinite("a non-finite gradient; no step taken")
        return loss, grads, walk.horizon_used

    def accumulate(self, acc: list, grads: list, scale: float) -> list:
        for a, g in zip(acc, grads):
            if g is not None:
                a.add_(g.float(), alpha=scale)
        self.touched = [t or g is not None for t, g in zip(self.touched, grads)]
        return acc

    def apply(self, grads: list, whole: float | None, clip: float | None) -> None:
        """(One window: the walk's gradient as it is, none where the walk gave none.)"""
        for q, g, touched in zip(self.params, grads, self.touched):
            alone = whole is None
            q.grad = None if alone and not touched else (g if alone else g / whole).to(q.dtype)
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(self.params, clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.schedule.step()

    def window_loss(self, example, cfg: TrainConfig, reference: bool = False) -> float:
        window = Window.of(example.inputs, example.targets, example.weights)
        with self.model.disable_adapter() if reference else nullcontext():  # PEFT's
            return PlainWalk(self.model, window, self.walk_config(cfg)).loss_only()

    def write_check(self, path: Path) -> None:
        from safetensors.torch import save_file

        save_file({"check": torch.zeros(1)}, str(path))

    def save_adapter(self, folder: Path, cfg: TrainConfig) -> None:
        """PEFT's adapter files into `folder`, each written whole (a temporary sibling first)."""
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=folder, prefix=".tmp-") as tmp:
            self.model.save_pretrained(tmp)
            for name in self.adapter_files:
                Path(tmp, name).replace(folder / name)

    def save_state(self, folder: Path, cfg: TrainConfig) -> None:
        self.save_adapter(folder, cfg)
        state = {"optimizer": self.optimizer.state_dict(), "schedule": self.schedule.state_dict()}
        torch.save(state, folder / "optimizer.pt")

    def load_state(self, folder: Path) -> None:
        from peft import set_peft_model_state_dict
        from safetensors.torch import load_file

        weights = load_file(str(folder / "adapter_model.safetensors"), device=str(self.device))
        set_peft_model_state_dict(self.model, weights)
        state = torch.load(folder / "optimizer.pt", map_location=self.device, weights_only=True)
        self.optimizer.load_state_dict(state["optimizer"])
        self.schedule.load_state_dict(state["schedule"])

    def resume_lr(self, spec: OptimizerSpec) -> float | None:
        """Without a schedule, --lr from here on (the checkpoint's schedule holds the old)."""
        if spec.scheduled:
            return None
        was = float(self.schedule.base_lrs[0])
        self.schedule.base_lrs = [spec.lr for _ in self.schedule.base_lrs]
        for group in self.optimizer.param_groups:
            group["lr"] = spec.lr
        return None if math.isclose(was, spec.lr, rel_tol=1e-6) else was

    def report(self) -> dict:
        return {"adapter_format": "peft", "device": str(self.device)}


class SpecOptimizer(torch.optim.Optimizer):
    """The update rule of training/optimizer_spec.py on torch tensors: MLX's Adam and AdamW
    (no bias correction unless the spec asks, `m / (sqrt(v) + eps)`, AdamW's decay before the
    update) and SGD without momentum. Each group's "lr" is the learning rate (a schedule sets
    it); the rest is the spec's. The moments are kept under torch Adam's names."""

    def __init__(self, params, spec: OptimizerSpec):
        self.spec = spec
        super().__init__(params, {"lr": spec.lr})

    @torch.no_grad()
    def step(self, closure=None):
        loss = None if closure is None else closure()
        spec = self.spec
        b1, b2 = spec.betas
        for group in self.param_groups:
            lr = group["lr"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                g = p.grad
                if spec.name == "sgd":
                    if spec.weight_decay:
                        g = g.add(p, alpha=spec.weight_decay)
                    p.add_(g, alpha=-lr)
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = torch.zeros((), dtype=torch.float32)
                    state["exp_avg"] = torch.zeros_like(p)
                    state["exp_avg_sq"] = torch.zeros_like(p)
                state["step"] += 1
                m, v = state["exp_avg"], state["exp_avg_sq"]
                if spec.name == "adamw" and spec.weight_decay:
                    p.mul_(1 - lr * spec.weight_decay)
                m.mul_(b1).add_(g, alpha=1 - b1)
                v.mul_(b2).addcmul_(g, g, value=1 - b2)
                if spec.bias_correction:
                    t = float(state["step"])
                    denom = v.sqrt().mul_(1 / math.sqrt(1 - b2**t)).add_(spec.eps)
                    p.addcdiv_(m, denom, value=-lr / (1 - b1**t))
                else:
                    p.addcdiv_(m, v.sqrt().add_(spec.eps), value=-lr)
        return loss


def make_optimizer(spec: OptimizerSpec, params: list):
    """The optimizer `spec` describes (training/optimizer_spec.py, which MLX's is built from too)
    and a LambdaLR giving each update the spec's learning rate: mlx-lm's schedule."""
    opt = SpecOptimizer(params, spec)
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda step: spec.factor(step))


def train_run(cfg: TrainConfig, echo=print) -> dict:
    """`mlxwalk train --backend torch`: the training loop on torch's mechanics."""
    return run.train_run(cfg, echo, framework=TorchFramework)
