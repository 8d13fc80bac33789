"""What the walk needs to know of an mlx-lm model: which layers attend, which recur, their shapes.

The layout is read off the model's own caches after a one-token decode, so it follows whatever
the architecture does (grouped-query heads, head dimensions, the gated delta-net's state) without
per-family code. Families outside SUPPORTED are refused by name.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import mlx.core as mx
from mlx import nn
from mlx.utils import tree_flatten
from mlx_lm.models.cache import ArraysCache, KVCache, make_prompt_cache

from ..errors import ModelError
from ..plan import Footprint

# Families whose attention goes through cache.update_and_fetch with a plain causal mask and whose
# recurrent layers keep their state in an ArraysCache; each is exercised by the tests.
SUPPORTED = ("llama", "mistral", "qwen2", "qwen3", "qwen3_5", "qwen3_next")


class UnsupportedModel(ModelError):
    pass


@dataclass(frozen=True)
class Layout:
    model_type: str
    kinds: tuple[str, ...]  # per layer: "attention" or "recurrent"
    kv_shapes: tuple[tuple[int, int, int], ...]  # per attention layer: (kv_heads, k_dim, v_dim)
    state_shapes: tuple[tuple[tuple[int, ...], ...], ...]  # per recurrent layer, per state array
    state_dtypes: tuple[tuple[mx.Dtype, ...], ...]
    dtype: mx.Dtype  # the K/V the model computes
    vocab: int  # token ids the model takes and predicts: [0, vocab)
    hidden: int = 0  # the width of a decoder layer's input (0: unknown)

    @property
    def attention(self) -> list[int]:
        return [i for i, k in enumerate(self.kinds) if k == "attention"]

    @property
    def recurrent(self) -> list[int]:
        return [i for i, k in enumerate(self.kinds) if k == "recurrent"]

    @property
    def head_dims(self) -> tuple[int, ...]:
        """Every attention layer's K and V head dimensions."""
        return tuple(sorted({d for _, dk, dv in self.kv_shapes for d in (dk, dv)}))

    def footprint(self, stem: int = 0, states_from: int = 0) -> Footprint:
        """The plan's numbers; with a stem, only the attention layers above it are tapped; the
        states held are the recurrent layers' from `states_from` on (walk/exact.py `to_hold`)."""
        width = sum(h * (dk + dv) for h, dk, dv in self.kv_shapes)
        tapped = sum(
            h * (dk + dv) for i, (h, dk, dv) in zip(self.attention, self.kv_shapes) if i >= stem
        )
        state = sum(
            _numel(s) * d.size
            for i, shapes, dtypes in zip(self.recurrent, self.state_shapes, self.state_dtypes)
            if i >= states_from
            for s, d in zip(shapes, dtypes)
        )
        return Footprint(kv_width=width, state_bytes=state, tapped_width=tapped)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def model_type(model: nn.Module) -> str:
    return str(getattr(model, "model_type", None) or type(model).__module__.rsplit(".", 1)[-1])


def inspect(model: nn.Module) -> Layout:
    """The model's layout, or UnsupportedModel naming what the walk can't take."""
    name = model_type(model)
    if name not in SUPPORTED:
        raise UnsupportedModel(
            f"model type {name!r} is not supported by the walk; supported: {', '.join(SUPPORTED)}"
        )
    caches = make_prompt_cache(model)
    for c in caches:
        if type(c) not in (KVCache, ArraysCache):
            raise UnsupportedModel(
                f"model type {name!r} uses a {type(c).__name__}, which the walk does not support"
            )
    logits = model(mx.array([[0]]), cache=caches)
    kinds, kv, shapes, dtypes, dtype = [], [], [], [], mx.float32
    for c in caches:
        if isinstance(c, KVCache):
            kinds.append("attention")
            kv.append((c.keys.shape[1], c.keys.shape[-1], c.values.shape[-1]))
            dtype = c.keys.dtype
        else:
            kinds.append("recurrent")
            shapes.append(tuple(tuple(a.shape) for a in c.cache))
            dtypes.append(tuple(a.dtype for a in c.cache))
    vocab = min(logits.shape[-1], embedding_rows(model) or logits.shape[-1])
    return Layout(
        name,
        tuple(kinds),
        tuple(kv),
        tuple(shapes),
        tuple(dtypes),
        dtype,
        vocab,
        hidden_size(model),
    )


def stem(model: nn.Module) -> int:
    """How many of the first decoder layers are frozen with nothing trainable beneath them (the
    embedding, an encoder): their K/V and states carry no gradient to any trainable parameter, so
    the walk taps none of them and the reverse pass differentiates no layer below the first one
    that trains. 0 when anything before the layers trains, or the model is shaped otherwise."""
    lm = getattr(model, "language_model", model)
    inner = getattr(lm, "model", None)
    layers = getattr(inner, "layers", None)
    if layers is None:
        return 0
    counts = [len(tree_flatten(layer.trainable_parameters())) for layer in layers]
    after = 0  # trainable arrays the layers' output alone reaches: the final norm, an untied head
    if getattr(inner, "norm", None) is not None:
        after += len(tree_flatten(inner.norm.trainable_parameters()))
    if not getattr(getattr(lm, "args", None), "tie_word_embeddings", True):
        after += len(tree_flatten(getattr(lm, "lm_head", nn.Module()).trainable_parameters()))
    if len(tree_flatten(model.trainable_parameters())) != sum(counts) + after:
        return 0  # something beneath the layers trains (the embedding, a vision tower)
    # The last layer is always differentiated: the reverse pass starts from its output.
    return min(next((i for i, n in enumerate(counts) if n), len(counts)), len(counts) - 1)


def hidden_size(model: nn.Module) -> int:
    """The model's hidden size from its arguments (the text model's, for a multimodal one)."""
    lm = getattr(model, "language_model", model)
    args = getattr(lm, "args", None)
    for source in (args, getattr(args, "text_config", None)):
        value = (
            source.get("hidden_size")
            if isinstance(source, dict)
            else (getattr(source, "hidden_size", None))
        )
        if isinstance(value, int):
            return value
    return 0


def embedding_rows(model: nn.Module) -> int | None:
    """Rows of the input embedding (an id at or past them reads memory out of bounds)."""
    for name, m in model.named_modules():
        if name.endswith("embed_tokens"):
            rows = getattr(m, "num_embeddings", None)
            weight = getattr(m, "weight", None)
            return int(rows) if rows is not None else int(weight.shape[0])
    return None


@dataclass(frozen=True)
class Head:
    """The model split at its output projection: `body(x, cache)` gives the hidden states and
    `project(h)` the logits, as the model's own `__call__` composes them. `module` owns the
    projection's parameters (the embedding, when tied)."""

    body: Callable[[mx.array, list], mx.array]
    project: Callable[[mx.array], mx.array]
    module: nn.Module
    norm: Callable[[mx.array], mx.array]  # what `body` applies after its last layer


def head(model: nn.Module) -> Head | None:
    """The split for the supported families (all compose `lm_head` or the tied embedding after
    `model`); None for a model shaped otherwise, which then runs whole."""
    lm = getattr(model, "language_model", model)
    inner, args = getattr(lm, "model", None), getattr(lm, "args", None)
    tied = getattr(args, "tie_word_embeddings", None)
    if inner is None or tied is None or model_type(model) not in SUPPORTED:
        return None
    if getattr(lm, "sharding_group", None) is not None:
        return None
    module = inner.embed_tokens if tied else getattr(lm, "lm_head", None)
    if module is None:
        return None
    project = module.as_linear if tied else module
    norm = getattr(inner, "norm", None)
    if norm is None:
        return None
    return Head(lambda x, cache: inner(x, cache), project, module, norm)
