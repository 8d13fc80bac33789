"""Preference pairs from jsonl rows in mlx-lm-lora's formats, each answer a window of its own.

Accepted rows (a row's other keys are ignored):
  {"prompt": str, "chosen": str, "rejected": str, "system": str (optional)}: mlx-lm-lora's DPO
      row; rendered as a chat (system, user, assistant) where the tokenizer has a chat template,
      else as prompt + completion;
  {"prompt": [messages], "chosen": str | [messages], "rejected": ...}: the chat form, the prompt a
      conversation and each answer a string or the assistant messages that end it;
  {"chosen": [messages], "rejected": [messages]}: two whole conversations that share a start.
Only the answer's tokens are labelled: an earlier assistant turn is context (it is the same in
both windows, so its log-probability cancels in DPO's margin).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from ..errors import DataError
from ..training import data
from ..walk.window import Window
from .rewards import Pair


@dataclass
class PairSet:
    pairs: list[Pair] = field(default_factory=list)
    skipped: int = 0  # pairs with an answer that has no token to score
    cut: int = 0  # pairs whose windows were cut to the run's window
    source: str = ""


def conversations(row: dict, where: str) -> tuple[list[dict], list[dict]]:
    """The chosen and rejected conversations of a row, the answer's turns last and trained."""
    if not isinstance(row, dict) or "chosen" not in row or "rejected" not in row:
        raise DataError(f"{where}: a preference row needs 'chosen' and 'rejected'")
    prompt = row.get("prompt")
    if prompt is None:
        chosen, rejected = row["chosen"], row["rejected"]
        if not (isinstance(chosen, list) and isinstance(rejected, list)):
            raise DataError(
                f"{where}: without 'prompt', 'chosen' and 'rejected' must be conversations "
                "(lists of messages)"
            )
        start = _shared_start(chosen, rejected)
        return _answer(chosen[:start], chosen[start:]), _answer(chosen[:start], rejected[start:])
    if isinstance(prompt, str):
        base = [{"role": "user", "content": prompt}]
        if isinstance(row.get("system"), str):
            base.insert(0, {"role": "system", "content": row["system"]})
    elif isinstance(prompt, list):
        base = list(prompt)
    else:
        raise DataError(f"{where}: 'prompt' must be a string or a list of messages")
    return (
        _answer(base, _turns(row["chosen"], "chosen", where)),
        _answer(base, _turns(row["rejected"], "rejected", where)),
    )


def _turns(answer, key: str, where: str) -> list[dict]:
    if isinstance(answer, str):
        return [{"role": "assistant", "content": answer}]
    if isinstance(answer, list) and answer:
        return list(answer)
    raise DataError(f"{where}: '{key}' must be a string or a non-empty list of messages")


def _shared_start(a: list, b: list) -> int:
    n = 0
    while n < min(len(a), len(b)) - 1 and a[n] == b[n]:
        n += 1
    return n


def _answer(base: list[dict], answer: list[dict]) -> list[dict]:
    """The conversation with only the answer's assistant turns trained."""
    context = [{**m, "train": False} if m.get("role") == "assistant" else m for m in base]
    return context + [dict(m) for m in answer]


def example(tokenizer, messages: list[dict], where: str) -> data.Example:
    """The conversation's tokens and labels: through the chat template where there is one, else
    as plain prompt + completion (system and user text, then the answer)."""
    if getattr(tokenizer, "chat_template", None):
        return data.to_example(tokenizer, {"messages": messages}, where)
    cut = next((i for i, m in enumerate(messages) if m.get("train", True) and _is_answer(m)), None)
    if cut is None:
        raise DataError(f"{where}: the answer has no assistant message")
    prompt = "\n".join(str(m.get("content", "")) for m in messages[:cut])
    completion = "".join(str(m.get("content", "")) for m in messages[cut:])
    return data.to_example(tokenizer, {"prompt": prompt, "completion": completion}, where)


def _is_answer(m: dict) -> bool:
    return m.get("role") == "assistant"


def load(folder: Path, split: str, tokenizer, window: int | None, how: str = "middle") -> PairSet:
    """`split`.jsonl of `folder` as pairs; a window cut keeps both ends by default (`how`), as an
    answer sits at a conversation's end."""
    path = Path(folder) / f"{split}.jsonl"
    out = PairSet(source=str(path))
    for number, row in data.numbered_rows(path):
        where = f"{path}:{number}"
        sides = [example(tokenizer, m, where) for m in conversations(row, where)]
        if window is not None:
            fitted = [data.fit(ex, window, how) for ex in sides]
            sides = [ex for ex, _ in fitted]
            out.cut += any(was_cut for _, was_cut in fitted)
        if any(len(ex) < 1 or ex.trainable == 0 for ex in sides):
            out.skipped += 1
            continue
        out.pairs.append(Pair(*(Window.of(e.inputs, e.targets, e.weights) for e in sides)))
    return out
