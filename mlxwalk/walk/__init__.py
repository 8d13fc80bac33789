"""The walk: a window trained chunk by chunk (`exact` carries every cached K/V's and recurrent
state's gradient back to the chunk that made it; `plain` cuts it at chunk boundaries).

Framework-free (the torch backend imports these without MLX):
  algorithm.py   both walks' algorithms, once: the order of their steps, the horizon narrowed
                 under a memory budget, the refusals
  window.py      Window: a window's ids and weights, checked
  activations.py one chunk's graph in numbers: Activations, graph_bytes
On MLX:
  config.py      WalkConfig: the settings, checked
  runner.py      what both walks do with a chunk: caches, decode, graph, dropout seeds
  exact.py       the exact walk's MLX mechanics
  plain.py       the plain walk's MLX mechanics
  api.py         window_loss, target_scores, one_graph (the reference), window_gradient,
                 train_window, exact_gradient and apply_step (a step on several windows)
  taps.py        the caches a chunk's graph runs through: taps, surrogates, how a layer runs
  accum.py       the K/V and state adjoints and the adapter's gradient, summed per window
  store.py       the K/V store at the cache's precision
  layerwise.py   a chunk's gradient one layer at a time (recompute)
  loss.py        a chunk's loss, from logits or from hidden states in blocks
  arch.py        what the walk needs of a model: its attention and recurrent layers
  budget.py      memory: the estimate and the refusal; admission.py settles an exact walk's plan
                 against it, probe.py measures one chunk's graph, choices.py what "auto"
                 settings become and what the admission changed to fit
  guards.py      token ids within the vocabulary; a finite loss and gradient before a step

Importing the package loads no array library: a name below is imported where it is first used.
"""

from __future__ import annotations

import importlib

_LAZY = {
    "ATTENTIONS": ".config",
    "WALKS": ".config",
    "WalkConfig": ".config",
    "Window": ".window",
    "ExactWalk": ".exact",
    "PlainWalk": ".plain",
    "ChunkRunner": ".runner",
    "walking": ".runner",
    **{
        name: ".api"
        for name in (
            "apply_step",
            "exact_gradient",
            "one_graph",
            "train_window",
            "window_gradient",
            "window_loss",
            "target_scores",
        )
    },
}

__all__ = sorted(_LAZY)


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    try:  # a submodule not imported yet (`from mlxwalk import walk; walk.budget`)
        return importlib.import_module(f".{name}", __name__)
    except ModuleNotFoundError as e:
        if e.name != f"{__name__}.{name}":
            raise
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
