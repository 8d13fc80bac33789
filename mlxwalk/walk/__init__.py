"""The walk: a window trained chunk by chunk (`exact` carries every cached K/V's and recurrent
state's gradient back to the chunk that made it; `plain` cuts it at chunk boundaries).

  config.py     WalkConfig and Window: the settings and the window, checked
  runner.py     what both walks do with a chunk: caches, decode, graph, dropout seeds
  exact.py      the exact walk: decode forward, then train chunk by chunk in reverse
  plain.py      the plain walk: a step per chunk
  api.py        window_loss, one_graph (the reference), window_gradient, train_window,
                exact_gradient and apply_step (a step on several windows)
  taps.py       the caches a chunk's graph runs through: taps, surrogates, recompute
  accum.py      the K/V and state adjoints and the adapter's gradient, summed per window
  store.py      the K/V store at the cache's precision
  layerwise.py  a chunk's gradient one layer at a time (recompute)
  loss.py       a chunk's loss, from logits or from hidden states in blocks
  arch.py       what the walk needs of a model: its attention and recurrent layers
  budget.py     memory: the estimate and admission; probe.py measures one chunk's graph
  guards.py     token ids within the vocabulary; a finite loss and gradient before a step
"""

from .api import apply_step, exact_gradient, one_graph, train_window, window_gradient, window_loss
from .config import ATTENTIONS, WALKS, WalkConfig, Window
from .exact import ExactWalk
from .plain import PlainWalk
from .runner import ChunkRunner, walking

__all__ = [
    "ATTENTIONS",
    "WALKS",
    "ChunkRunner",
    "ExactWalk",
    "PlainWalk",
    "WalkConfig",
    "Window",
    "apply_step",
    "exact_gradient",
    "one_graph",
    "train_window",
    "walking",
    "window_gradient",
    "window_loss",
]
