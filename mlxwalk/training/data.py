"""Training data in mlx-lm's jsonl formats, turned into windows: token ids and per-position weights.

Formats (one JSON object per line, in `train.jsonl` and optionally `valid.jsonl`):
  text         {"text": ...}                          every token is labelled
  completions  {"prompt": ..., "completion": ...}      the prompt is context (see mask_prompt)
  chat         {"messages": [...], "tools": [...]}     assistant turns are labelled; any message
                                                        with "train": false stays context
A chat is rendered whole through the tokenizer's chat template; each assistant turn is found in
that rendering (`chat.turn_span`), so templates that render a final turn differently (Qwen3's empty
think block) or add text of their own (a date, a default system prompt) are labelled as the model
sees them, and a turn that truly cannot be placed is refused by file, line and message.
An example longer than the window is cut (`fit`: "left" keeps its start, "middle" keeps its start
and its end and drops the middle). A row with no labelled token is skipped; an example that loses
all its labels to the cut is cut away. All three are counted, with the rows' file:line.

A bad row is refused with a one-line `DataError` that starts with its `file:line:`; whatever the
tokenizer or chat template raise on a row is turned into one.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..errors import DataError
from . import chat

FITS = ("left", "middle")
ROLES = ("system", "developer", "user", "assistant", "tool")
QUOTE_LIMIT = 200  # characters of an underlying error message kept in a DataError


@dataclass
class Example:
    ids: list[int]  # n + 1 tokens: inputs are ids[:-1], targets ids[1:]
    labels: list[float]  # per token: 1 if the model is trained to produce it
    where: str = ""  # file:line of its row

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
        return int(np.count_nonzero(np.asarray(self.labels[1:], np.float32) > 0))

    def __len__(self) -> int:
        return max(len(self.ids) - 1, 0)  # an empty rendering has no position, not -1


@dataclass
class Dataset:
    examples: list[Example]
    skipped: int = 0  # rows with no labelled token
    truncated: int = 0  # examples cut to the window
    source: str = ""
    cut_away: int = 0  # examples whose every label fell outside the window when cut
    skipped_where: list[str] = field(default_factory=list)  # file:line of each, to name a few
    cut_away_where: list[str] = field(default_factory=list)

    @property
    def trainable_tokens(self) -> int:
        return sum(e.trainable for e in self.examples)

    def skip(self, example: Example) -> None:
        self.skipped += 1
        self.skipped_where.append(example.where)

    def fitted(self, window: int, how: str = "left") -> Dataset:
        """Every example cut to `window` positions (`fit`); one left with no label is cut away."""
        out = Dataset(
            [],
            self.skipped,
            self.truncated,
            self.source,
            self.cut_away,
            list(self.skipped_where),
            list(self.cut_away_where),
        )
        for example in self.examples:
            if example.trainable == 0:  # had none to begin with (a hand-made Dataset)
                out.skip(example)
                continue
            example, cut = fit(example, window, how)
            out.truncated += cut
            if example.trainable == 0:
                out.cut_away += 1
                out.cut_away_where.append(example.where)
            else:
                out.examples.append(example)
        return out

    def check_ids(self, vocab: int) -> None:
        """Refuse the first example holding a token id the model has no embedding for."""
        for example in self.examples:
            ids = np.asarray(example.ids, np.int64)
            bad = (ids < 0) | (ids >= vocab)
            if bad.any():
                i = int(ids[int(bad.argmax())])
                raise DataError(
                    f"{example.where or self.source}: token id {i} is outside the model's "
                    f"vocabulary of {vocab} ids (is the tokenizer the model's own?)"
                )


def _one_line(text: str, limit: int = QUOTE_LIMIT) -> str:
    """Whitespace collapsed, cut to `limit`, lone surrogates escaped so it can be printed."""
    text = " ".join(text.split())
    if len(text) > limit:
        text = text[: limit - 1] + "…"
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def _quote(error: BaseException) -> str:
    message = str(error)
    return _one_line(f"{type(error).__name__}: {message}" if message else type(error).__name__)


def _show(value: object) -> str:
    try:
        return _one_line(repr(value), 60)
    except RecursionError:  # a value nested nearly as deep as json.loads allows
        return _kind(value)


def _kind(value: object) -> str:
    """A JSON value's type, in JSON's words."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, str):
        return "a string"
    return "an array" if isinstance(value, list) else "an object"


@contextmanager
def _naming(where: str, what: str) -> Iterator[None]:
    """Whatever the tokenizer or template raise on a row becomes a one-line DataError naming it."""
    try:
        yield
    except DataError:
        raise
    except Exception as e:  # jinja2, TypeError, RecursionError, ...: the row is at fault
        raise DataError(f"{where}: {what} ({_quote(e)})") from e


def _decode(raw: bytes, path: Path, number: int) -> str:
    try:
        return raw.decode("utf-8-sig" if number == 1 else "utf-8")  # a BOM may open the file
    except UnicodeDecodeError as e:
        at = e.start + len(raw) - len(e.object)  # utf-8-sig reports offsets past the BOM
        raise DataError(
            f"{path}:{number}: not valid UTF-8 (byte 0x{raw[at]:02x} at byte {at + 1} of the line)"
        ) from None


def _parse(line: str, path: Path, number: int) -> dict:
    try:
        row = json.loads(line)
    except json.JSONDecodeError as e:
        raise DataError(f"{path}:{number}: not valid JSON ({e.msg} at column {e.colno})") from None
    except RecursionError:
        raise DataError(f"{path}:{number}: not valid JSON (nested too deeply)") from None
    except ValueError as e:  # e.g. an integer of more digits than Python converts
        raise DataError(f"{path}:{number}: not valid JSON ({_quote(e)})") from None
    if not isinstance(row, dict):
        raise DataError(f"{path}:{number}: expected a JSON object")
    return row


def numbered_rows(path: Path) -> list[tuple[int, dict]]:
    """(line number, row) of each non-blank line; read as bytes so bad UTF-8 is named by line."""
    try:
        with open(path, "rb") as f:
            lines = f.read().split(b"\n")
    except OSError as e:
        raise DataError(f"{path}: cannot be read ({e.strerror or _quote(e)})") from None
    rows = []
    for number, raw in enumerate(lines, 1):
        line = _decode(raw, path, number)
        if line.strip():
            rows.append((number, _parse(line, path, number)))
    return rows


def _encode(tokenizer, text: str, where: str) -> list[int]:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:  # tokenizers fail on these with an unhelpful TypeError
        raise DataError(
            f"{where}: holds an unpaired surrogate {_show(e.object[e.start])}, which is not "
            "valid Unicode (JSON escapes \\ud800-\\udfff must come in pairs)"
        ) from None
    with _naming(where, "the tokenizer failed"):
        return [int(t) for t in tokenizer.encode(text, add_special_tokens=False)]


def _render(tokenizer, messages, tools, where: str, generation_prompt: bool = False) -> str:
    with _naming(where, "the chat template failed"):
        text = tokenizer.apply_chat_template(
            messages, tools=tools or None, tokenize=False, add_generation_prompt=generation_prompt
        )
    if not isinstance(text, str):
        raise DataError(f"{where}: the chat template gave {_kind(text)}, not text")
    return text


def _offsets(tokenizer, text: str, where: str) -> tuple[list[int], list[int] | None]:
    """Token ids of `text` (no special tokens added) and each token's first character, where
    the tokenizer reports offsets (Hugging Face's fast tokenizers do)."""
    ids = _encode(tokenizer, text, where)
    fast = getattr(tokenizer, "_tokenizer", tokenizer)
    try:
        enc = fast(text, add_special_tokens=False, return_offsets_mapping=True)
        if [int(t) for t in enc["input_ids"]] == ids:
            return ids, [int(a) for a, _ in enc["offset_mapping"]]
    except Exception:  # a slow tokenizer: no offsets
        pass
    return ids, None


def _positions(tokenizer, text: str, ids, starts, span, where) -> tuple[int, int]:
    """The span of characters as token positions: tokens that start inside it."""
    a, b = span
    if starts is not None:
        first = next((t for t, s in enumerate(starts) if s >= a), len(ids))
        end = next((t for t, s in enumerate(starts) if s >= b), len(ids))
        return first, end
    head, upto = _encode(tokenizer, text[:a], where), _encode(tokenizer, text[:b], where)
    if ids[: len(upto)] != upto or upto[: len(head)] != head:
        raise DataError(
            f"{where}: a turn's edge falls inside a token, and the tokenizer gives "
            "no offsets to place it"
        )
    return len(head), len(upto)


def _before(tokenizer, clean, i, tools, where, whole, anchors) -> tuple[str, str]:
    """The conversation before message i, with and without the generation prompt. Before a
    first message, a template that can't render nothing starts the turn at its content."""
    try:
        head = _render(tokenizer, clean[:i], tools, where, generation_prompt=True)
        return head, _render(tokenizer, clean[:i], tools, where)
    except DataError:
        if i:
            raise
    at = whole.find(anchors[0]) if anchors else -1
    if at == -1:
        raise DataError(
            f"{where}: message 0 (assistant) can't be labelled: the template renders no "
            "conversation before it, and its content is not in the rendering"
        )
    return whole[:at], whole[:at]


def with_bos(tokenizer, ids: list[int]) -> list[int]:
    """`ids` with the BOS token in front where the tokenizer adds one when it encodes (as
    mlx-lm's text datasets and its generation do), never twice."""
    bos = getattr(tokenizer, "bos_token_id", None)
    if bos is None or (ids and ids[0] == bos):
        return ids
    try:
        adds = tokenizer.encode("a")[:1] == [bos]
    except Exception:
        adds = False
    return [bos, *ids] if adds else ids


def chat_example(tokenizer, messages: list[dict], tools=None, where: str = "") -> Example:
    """Token ids of the whole conversation; each trainable assistant turn labelled where it lies
    in the whole rendering (`chat.turn_span`), so templates that render a final turn differently
    label every turn as the model sees it."""
    if not messages:  # nothing to render or train on: skipped, like any unlabelled row
        return Example([], [], where)
    clean = [{k: v for k, v in m.items() if k != "train"} for m in messages]
    whole = _render(tokenizer, clean, tools, where)
    ids, starts = _offsets(tokenizer, whole, where)
    labels = [0.0] * len(ids)
    for i, m in enumerate(messages):
        if m.get("role") != "assistant" or m.get("train", True) is False:
            continue
        span = _turn(tokenizer, clean, i, tools, where, whole)
        first, end = _positions(tokenizer, whole, ids, starts, span, where)
        for t in range(first, end):
            labels[t] = 1.0
    return Example(ids, labels, where)


def _turn(tokenizer, clean: list[dict], i: int, tools, where: str, whole: str) -> tuple[int, int]:
    """Where assistant message i lies in `whole`, in characters: by alignment with a rendering
    that holds a marker in place of its content (chat.marked_span), else by its rendering as the
    last turn (chat.turn_span), trying its content and then what follows its think block."""
    m = clean[i]
    calls = [chat.call_name(c) for c in m.get("tool_calls") or []]
    if isinstance(m.get("content"), str) and m["content"]:
        marked = [*clean[:i], {**m, "content": chat.MARK}, *clean[i + 1 :]]
        head, before = _before(tokenizer, clean, i, tools, where, whole, [m["content"].strip()])
        try:
            span = chat.marked_span(
                whole,
                _render(tokenizer, marked, tools, where),
                head,
                before,
                _render(tokenizer, marked[: i + 1], tools, where),
            )
        except ValueError as e:
            raise DataError(f"{where}: message {i} (assistant) can't be labelled: {e}") from None
        if span is not None:
            return span
    upto = _render(tokenizer, clean[: i + 1], tools, where)
    error = None
    for content in chat.contents(m.get("content")):
        anchors = [a for a in [content, *calls] if a]
        head, before = _before(tokenizer, clean, i, tools, where, whole, anchors)
        try:
            return chat.turn_span(whole, head, before, upto, anchors)
        except ValueError as e:
            error = e
    raise DataError(f"{where}: message {i} (assistant) can't be labelled: {error}")


def _check_message(m: object, i: int, where: str) -> None:
    if not isinstance(m, dict):
        raise DataError(f"{where}: message {i} must be an object with a 'role'; got {_kind(m)}")
    if "role" not in m:
        raise DataError(f"{where}: message {i} has no 'role'")
    if m["role"] not in ROLES:  # a typo such as "assistnat" would otherwise train on nothing
        raise DataError(
            f"{where}: message {i} has role {_show(m['role'])}; expected one of {', '.join(ROLES)}"
        )
    calls = m.get("tool_calls")
    if calls is not None and not (
        isinstance(calls, list) and all(isinstance(c, dict) for c in calls)
    ):
        raise DataError(f"{where}: message {i} 'tool_calls' must be a list of objects")
    content = m.get("content")
    if not isinstance(content, str) and not (content is None and calls):
        got = "it has none" if "content" not in m else f"got {_kind(content)}"
        raise DataError(
            f"{where}: message {i} 'content' must be a string (or null when the message has "
            f"'tool_calls'); {got}"
        )
    if "train" in m and not isinstance(m["train"], bool):
        raise DataError(
            f"{where}: message {i} 'train' must be true or false; got {_show(m['train'])}"
        )


def _check_row(row: dict, where: str) -> None:
    """The fields' types, so a bad row is named by file and line rather than failing deep."""
    for key in ("text", "prompt", "completion"):
        if key in row and not isinstance(row[key], str):
            raise DataError(f"{where}: {key!r} must be a string; got {_kind(row[key])}")
    if "messages" in row:
        if not isinstance(row["messages"], list):
            raise DataError(f"{where}: 'messages' must be a list of objects with a 'role'")
        for i, m in enumerate(row["messages"]):
            _check_message(m, i, where)
    tools = row.get("tools")
    if tools is not None and not (
        isinstance(tools, list) and all(isinstance(t, dict) for t in tools)
    ):
        raise DataError(f"{where}: 'tools' must be a list of objects")


def _completion_example(tokenizer, row: dict, where: str, mask_prompt: bool) -> Example:
    if getattr(tokenizer, "chat_template", None):
        msgs = [
            {"role": "user", "content": row["prompt"]},
            {"role": "assistant", "content": row["completion"], "train": True},
        ]
        ex = chat_example(tokenizer, msgs, None, where)
        if not mask_prompt:
            ex.labels = [1.0] * len(ex.labels)
        return ex
    prompt = with_bos(tokenizer, _encode(tokenizer, row["prompt"], where))
    completion = _encode(tokenizer, row["completion"], where)
    eos = getattr(tokenizer, "eos_token_id", None)
    if eos is not None and completion[-1:] != [eos]:
        completion.append(eos)
    labels = [0.0 if mask_prompt else 1.0] * len(prompt) + [1.0] * len(completion)
    return Example(prompt + completion, labels, where)


def to_example(tokenizer, row: dict, where: str, mask_prompt: bool = True) -> Example:
    """The row's tokens and labels; a bad row raises a one-line DataError starting `where:`."""
    with _naming(where, "could not be turned into an example"):  # a failure not named below
        _check_row(row, where)
        if "messages" in row:
            return chat_example(tokenizer, row["messages"], row.get("tools"), where)
        if "prompt" in row and "completion" in row:
            return _completion_example(tokenizer, row, where, mask_prompt)
        if "text" in row:
            ids = with_bos(tokenizer, _encode(tokenizer, row["text"], where))
            eos = getattr(tokenizer, "eos_token_id", None)
            if eos is not None and ids[-1:] != [eos]:
                ids.append(eos)
            return Example(ids, [1.0] * len(ids), where)
    raise DataError(f"{where}: expected 'text', 'prompt' and 'completion', or 'messages'")


def fit(example: Example, window: int, how: str) -> tuple[Example, bool]:
    """Cut an example to `window` positions (window + 1 tokens); True when it was cut."""
    if len(example) <= window:
        return example, False
    keep = window + 1
    if how == "left":
        return Example(example.ids[:keep], example.labels[:keep], example.where), True
    head = keep // 2
    tail = keep - head
    ids = example.ids[:head] + example.ids[-tail:]
    labels = example.labels[:head] + example.labels[-tail:]
    return Example(ids, labels, example.where), True


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
    data = gather(
        Dataset([], source=str(path)),
        path,
        lambda row, where: to_example(tokenizer, row, where, mask_prompt),
    )
    return data if window is None else data.fitted(window, how)


def gather(into, path: Path, make):
    """`into` (a Dataset, or preference pairs) with `make(row, "file:line")` of each row of
    `path`: the example, kept if it has a labelled token, else counted as skipped."""
    for number, row in numbered_rows(path):
        example = make(row, f"{path}:{number}")
        if len(example) < 1 or example.trainable == 0:
            into.skip(example)
        else:
            into.examples.append(example)
    return into


def check_folder(folder) -> Path:
    path = Path(folder)
    if path.is_file():
        raise DataError(
            f"--data {path} is a file; give the folder that holds train.jsonl (and "
            "optionally valid.jsonl)"
        )
    if not path.is_dir():
        raise DataError(f"data folder {path} does not exist")
    if not (path / "train.jsonl").exists():
        raise DataError(f"data folder {path} has no train.jsonl")
    for name in ("train.jsonl", "valid.jsonl"):  # a named pipe would be waited on for ever
        file = path / name
        if file.exists() and not file.is_file():
            raise DataError(
                f"{file} is not a regular file (a named pipe, a device or a folder); "
                "give a file of jsonl rows"
            )
    return path
