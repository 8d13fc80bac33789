"""Several processes training one PEFT adapter (under `torchrun`): torch.distributed's group
(gloo on the CPU, NCCL on GPUs), with the MLX run's rules (mlxwalk/training/ranks.py) and its
step (mlxwalk/training/step.py: what a step reduces, the same layout): one all_reduce of one
float32 vector per step; rank 0 writes and speaks; a failing rank stops every rank with one line
naming it."""

from __future__ import annotations

import os

import numpy as np
import torch
import torch.distributed as dist

from ..training.ranks import Ranks


class TorchRanks(Ranks):
    device: torch.device = torch.device("cpu")

    @classmethod
    def init(cls) -> TorchRanks:
        """The launch's group from torchrun's environment (a group of one without it)."""
        if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
            return cls(None)
        cuda = torch.cuda.is_available()
        if cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        if not dist.is_initialized():
            dist.init_process_group("nccl" if cuda else "gloo")
        ranks = cls(dist.group.WORLD, dist.get_rank(), dist.get_world_size())
        ranks.device = torch.device("cuda", torch.cuda.current_device()) if cuda else ranks.device
        return ranks

    def all_sum(self, x: torch.Tensor) -> torch.Tensor:
        if self.size > 1:
            dist.all_reduce(x)
        return x

    def sum_numpy(self, x: np.ndarray) -> np.ndarray:
        if self.size == 1:
            return x
        return self.all_sum(torch.from_numpy(x).to(self.device)).cpu().numpy()

    def reduce(
        self, head: np.ndarray, grads: list[torch.Tensor]
    ) -> tuple[np.ndarray, list[torch.Tensor]]:
        """A step's head (step.Layout) and gradient summed over the ranks in one all_reduce of
        one float32 vector; the gradient comes back in float32."""
        flat = torch.cat(
            [torch.from_numpy(head).to(self.device)]
            + [g.to(self.device, torch.float32).reshape(-1) for g in grads]
        )  # (len(head) + parameters,)
        self.all_sum(flat)
        summed, at = [], len(head)
        for g in grads:
            summed.append(flat[at : at + g.numel()].reshape(g.shape).to(g.device))
            at += g.numel()
        return flat[: len(head)].cpu().numpy(), summed


__all__ = ["TorchRanks"]
