"""The walk's cache for transformers models: a `transformers.Cache` whose attention layers read
the window's K/V store and whose gated delta-net layers read and write the walk's states, so the
model's own code runs a chunk against the positions before it, unchanged.

Two modes, as the MLX walk's caches:
- decode (no gradient): a chunk's K/V go into the store at [start, end), and attention reads
  the store up to `end` in place; a recurrent layer's exit state replaces its entry state.
- train (a graph): attention reads the fixed prefix [0, grad_from) and the tapped prefix
  [grad_from, start) as leaves that take a gradient, then the chunk's own K/V (kept as `own`
  for the surrogate); a recurrent layer starts from its entry states as leaves and keeps its exit
  states for the surrogate.
K/V are stored as the model hands them to attention: (B, heads, T, head dim), after RoPE.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache


class Store:
    """The window's K/V, one (K, V) pair per attention layer, allocated at the first write (the
    model says the shapes). On the device a pair is (B, kv heads, positions, head dim), the layout
    attention reads in place; in host memory (pinned under CUDA) it is (B, positions, kv heads,
    head dim), so a run of positions is one contiguous block that moves without staging."""

    def __init__(self, positions: int, dtype: torch.dtype | None = None, device=None, host=False):
        self.positions = positions
        self.dtype = dtype
        self.device = device
        self.host = host
        self.kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def _allocate(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        b, heads, _, dk = k.shape  # (B, kv heads, n, head dim)
        dtype = self.dtype or k.dtype
        if self.host:
            pin = k.device.type == "cuda"
            shapes = [(b, self.positions, heads, d) for d in (dk, v.shape[-1])]
            self.kv[layer] = tuple(
                torch.empty(s, dtype=dtype, device="cpu", pin_memory=pin) for s in shapes
            )
        else:
            device = self.device or k.device
            shapes = [(b, heads, self.positions, d) for d in (dk, v.shape[-1])]
            self.kv[layer] = tuple(torch.empty(s, dtype=dtype, device=device) for s in shapes)

    def write(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        if layer not in self.kv:
            self._allocate(layer, k, v)
        end = start + k.shape[2]
        for x, new in zip(self.kv[layer], (k, v)):
            if self.host:  # (B, n, heads, dim) on the device first: one block per copy
                x[:, start:end].copy_(new.transpose(1, 2).to(x.dtype), non_blocking=True)
            else:
                x[:, :, start:end].copy_(new, non_blocking=True)

    def read(self, layer: int, start: int, end: int, device, dtype) -> tuple[torch.Tensor, ...]:
        """Positions [start, end) as (B, kv heads, n, head dim): a view on the device when the
        dtype matches; from the host, a copy."""
        if self.host:
            return tuple(
                x[:, start:end].to(device, non_blocking=True).to(dtype).transpose(1, 2)
                for x in self.kv[layer]
            )
        return tuple(
            x[:, :, start:end].to(device, dtype, non_blocking=True) for x in self.kv[layer]
        )

    def bytes(self) -> int:
        return sum(x.numel() * x.element_size() for kv in self.kv.values() for x in kv)


class WalkCache(Cache):
    """One chunk's view of the window: positions [start, end) against the store."""

    def __init__(
        self,
        store: Store,
        start: int,
        end: int,
        states: dict | None = None,
        *,
        train: bool = False,
        grad_from: int = 0,
        tap_states: bool = False,
        write: bool = True,  # decode: write the chunk's K/V into the store (not on a re-decode)
    ):
        super().__init__(layers=[])
        self.store, self.start, self.end = store, start, end
        self.train, self.grad_from, self.write = train, grad_from, write
        self.taps: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # prefix leaves
        self.own: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # the chunk's K/V
        # recurrent layers: {layer: {"conv": tensor, "recurrent": tensor}}, entry and exit
        self.entry = {n: dict(s) for n, s in (states or {}).items()}
        if tap_states:
            for s in self.entry.values():
                for key, x in s.items():
                    s[key] = x.detach().requires_grad_()
        self.exit: dict[int, dict[str, torch.Tensor]] = {}

    # attention layers
    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        if not self.train and self.write:
            self.store.write(layer_idx, self.start, key_states, value_states)
            if not self.store.host:  # the whole [0, end) in place
                dev, dt = key_states.device, key_states.dtype
                return self.store.read(layer_idx, 0, self.end, dev, dt)
        if not self.train:  # the prefix from the store, the chunk's own K/V as they are
            prefix = self.store.read(layer_idx, 0, self.start, key_states.device, key_states.dtype)
            return tuple(
                torch.cat([p, x], dim=2) for p, x in zip(prefix, (key_states, value_states))
            )
        self.own[layer_idx] = (key_states, value_states)
        if self.start == 0:
            return key_states, value_states
        dev, dt = key_states.device, key_states.dtype
        fixed = self.store.read(layer_idx, 0, self.grad_from, dev, dt)
        tapped = self.store.read(layer_idx, self.grad_from, self.start, dev, dt)
        tapped = tuple(x.detach().requires_grad_() for x in tapped)
        self.taps[layer_idx] = tapped
        return tuple(
            torch.cat([f, t, o], dim=2)
            for f, t, o in zip(fixed, tapped, (key_states, value_states))
        )

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.start

    def get_query_offset(self, layer_idx: int = 0) -> int:
        return self.start

    def get_mask_sizes(self, query_length: int, layer_idx: int) -> tuple[int, int]:
        return self.start + query_length, 0

    # gated delta-net layers
    def has_previous_state(self, layer_idx=None, state_idx=None) -> bool:
        return layer_idx in self.entry if layer_idx is not None else bool(self.entry)

    def is_recording_past(self, layer_idx: int) -> bool:
        # True keeps a one-position chunk off the in-place conv update (states here are
        # checkpoints or graph leaves) and on update_conv_state below
        return True

    def get_recurrent_states_to_keep(self, layer_idx: int | None = None) -> int:
        # transformers 5.25 asks how many per-position states to keep (speculative decoding);
        # the walk keeps only a chunk's exit state, and this cache has no per-layer objects
        return 0

    def get_conv_state(self, layer_idx: int, state_idx: int = 0):
        return self.entry.get(layer_idx, {}).get("conv")

    def update_conv_state(self, conv_states, layer_idx, state_idx=0, conv_kernel_size=None, **kw):
        entry = self.get_conv_state(layer_idx)
        full = (
            conv_states
            if entry is None
            else torch.cat([entry.to(conv_states.dtype), conv_states], dim=-1)
        )
        width = conv_kernel_size or full.shape[-1]
        if full.shape[-1] < width:
            full = torch.nn.functional.pad(full, (width - full.shape[-1], 0))
        # a copy: a view would keep the whole chunk's conv input alive with the state
        self.exit.setdefault(layer_idx, {})["conv"] = full[..., -width:].clone()
        return full

    def get_recurrent_state(self, layer_idx: int, state_idx: int = 0):
        return self.entry.get(layer_idx, {}).get("recurrent")

    def update_recurrent_state(self, recurrent_states, layer_idx, state_idx=0, **kw):
        self.exit.setdefault(layer_idx, {})["recurrent"] = recurrent_states
        return recurrent_states
