"""Training data in mlx-lm's jsonl formats, turned into windows: token ids and per-position weights.

Formats (one JSON object per line, in `train.jsonl` and optionally `valid.jsonl`):
  text         {"text": ...}                          every token is labelled
  completions  {"prompt": ..., "completion": ...}      the prompt is context (see mask_prompt)
  chat         {"messages": [...], "tools": [...]}     assistant turns are labelled; any message
                                                        with "train": false stays context
Chat is rendered through the tokenizer's chat template, prefix by prefix, to find each message's
tokens; a template whose rendering of a prefix is not a prefix of the whole is refused.
An example longer than the window is cut (`fit`: "left" keeps its start, "middle" keeps its start
and its end and drops the middle); one left with no labelled token is skipped. Both are counted.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

FITS = ("left", "middle")


class DataError(ValueError):
    """Bad training data, named in one line."""


@dataclass
class Example:
    ids: list[int]  # n + 1 tokens: inputs are ids[:-1], targets ids[1:]
    labels: list[float]  # per token: 1 if the model is trained to produce it

    @property
    def inputs(self) -> np.ndarray:
        return np.asarray(self.ids[:-1], np.int32)

    @property
    def targets(self) -> np.ndarray:
        return np.asarray(self.ids[1:], np.int32)

    @property
    def weights(self) -> np.ndarray:
        return np.asarray(self.labels[1:], np.float32)

    @property
    def trainable(self) -> int:
        return int(sum(1 for w in self.labels[1:] if w > 0))

    def __len__(self) -> int:
        return len(self.ids) - 1


@dataclass
class Dataset:
    examples: list[Example]
    skipped: int = 0  # no labelled token
    truncated: int = 0
    source: str = ""

    @property
    def trainable_tokens(self) -> int:
        return sum(e.trainable for e in self.examples)

    def fitted(self, window: int, how: str = "left") -> Dataset:
        """Every example cut to `window` positions (`fit`); one left with no label is skipped."""
        out = Dataset([], self.skipped, self.truncated, self.source)
        for example in self.examples:
            example, cut = fit(example, window, how)
            out.truncated += cut
            if example.trainable == 0:
                out.skipped += 1
            else:
                out.examples.append(example)
        return out


def read_jsonl(path: Path) -> list[dict]:
    rows = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{path}:{number}: not valid JSON ({e.msg})") from None
            if not isinstance(row, dict):
                raise DataError(f"{path}:{number}: expected a JSON object")
            rows.append(row)
    return rows


def _encode(tokenizer, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False))


def _render(tokenizer, messages, tools, generation_prompt=False) -> list[int]:
    text = tokenizer.apply_chat_template(
        messages, tools=tools or None, tokenize=False, add_generation_prompt=generation_prompt
    )
    return _encode(tokenizer, text)


def chat_example(tokenizer, messages: list[dict], tools=None, where: str = "") -> Example:
    """Token ids of the whole conversation; each trainable assistant turn labelled."""
    clean = [{k: v for k, v in m.items() if k != "train"} for m in messages]
    ids = _render(tokenizer, clean, tools)
    labels = [0.0] * len(ids)
    for i, m in enumerate(messages):
        if m.get("role") != "assistant" or m.get("train", True) is False:
            continue
        head = _render(tokenizer, clean[:i], tools, generation_prompt=True) if i else []
        upto = _render(tokenizer, clean[: i + 1], tools)
        if ids[: len(upto)] != upto or upto[: len(head)] != head:
            raise DataError(
                f"{where}: the chat template does not render prefix-stably (the conversation up "
                f"to message {i} is not a prefix of the whole), so turns can't be labelled"
            )
        for t in range(len(head), len(upto)):
            labels[t] = 1.0
    return Example(ids, labels)


def _check_row(row: dict, where: str) -> None:
    """The fields' types, so a bad row is named by file and line rather than failing deep."""
    for key in ("text", "prompt", "completion"):
        if key in row and not isinstance(row[key], str):
            raise DataError(f"{where}: {key!r} must be a string")
    if "messages" in row:
        msgs = row["messages"]
        if not isinstance(msgs, list) or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) for m in msgs
        ):
            raise DataError(f"{where}: 'messages' must be a list of objects with a 'role'")
    if "tools" in row and row["tools"] is not None and not isinstance(row["tools"], list):
        raise DataError(f"{where}: 'tools' must be a list")


def to_example(tokenizer, row: dict, where: str, mask_prompt: bool = True) -> Example:
    _check_row(row, where)
    if "messages" in row:
        return chat_example(tokenizer, row["messages"], row.get("tools"), where)
    if "prompt" in row and "completion" in row:
        if getattr(tokenizer, "chat_template", None):
            msgs = [
                {"role": "user", "content": row["prompt"]},
                {"role": "assistant", "content": row["completion"], "train": True},
            ]
            ex = chat_example(tokenizer, msgs, None, where)
            if not mask_prompt:
                ex.labels = [1.0] * len(ex.labels)
            return ex
        prompt, completion = (
            _encode(tokenizer, row["prompt"]),
            _encode(tokenizer, row["completion"]),
        )
        labels = [0.0 if mask_prompt else 1.0] * len(prompt) + [1.0] * len(completion)
        return Example(prompt + completion, labels)
    if "text" in row:
        ids = _encode(tokenizer, row["text"])
        eos = getattr(tokenizer, "eos_token_id", None)
        if eos is not None:
            ids.append(eos)
        return Example(ids, [1.0] * len(ids))
    raise DataError(f"{where}: expected 'text', 'prompt' and 'completion', or 'messages'")


def fit(example: Example, window: int, how: str) -> tuple[Example, bool]:
    """Cut an example to `window` positions (window + 1 tokens); True when it was cut."""
    if len(example) <= window:
        return example, False
    keep = window + 1
    if how == "left":
        return Example(example.ids[:keep], example.labels[:keep]), True
    head = keep // 2
    tail = keep - head
    ids = example.ids[:head] + example.ids[-tail:]
    return Example(ids, example.labels[:head] + example.labels[-tail:]), True


def load(
    folder: Path,
    split: str,
    tokenizer,
    window: int | None,
    how: str = "left",
    mask_prompt: bool = True,
) -> Dataset:
    """`split`.jsonl of `folder` as windows; window None keeps every example whole."""
    path = Path(folder) / f"{split}.jsonl"
    rows = read_jsonl(path)
    data = Dataset([], source=str(path))
    for number, row in enumerate(rows, 1):
        ex = to_example(tokenizer, row, f"{path}:{number}", mask_prompt)
        if len(ex) < 1 or ex.trainable == 0:
            data.skipped += 1
        else:
            data.examples.append(ex)
    return data if window is None else data.fitted(window, how)


def check_folder(folder) -> Path:
    path = Path(folder)
    if not path.is_dir():
        raise DataError(f"data folder {path} does not exist")
    if not (path / "train.jsonl").exists():
        raise DataError(f"data folder {path} has no train.jsonl")
    return path
