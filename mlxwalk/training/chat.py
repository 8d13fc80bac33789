"""Where each assistant turn lies in a whole conversation's rendering, in characters: plain string
work on the template's outputs, no tokenizer (data.py renders, then maps the spans to tokens).

First by alignment (`marked_span`): the conversation is rendered again with the turn's content
replaced by a marker, and the two renderings differ only where the content went, whatever the
template writes around it (line breaks or spaces, a think block or none). Where the template does
not render the marker verbatim (or the turn has tool calls and no content), `turn_span` places
the turn by its rendering as the last turn instead."""

from __future__ import annotations


def common(a: str, b: str) -> int:
    """The length of the longest common prefix of a and b."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo], a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if a[:mid] == b[:mid] else (lo, mid)
    return lo


MARK = "\ue000mlxwalk-turn\ue001"  # private-use characters: no content or template holds them


def common_tail(a: str, b: str) -> int:
    """The length of the longest common suffix of a and b."""
    return common(a[::-1], b[::-1])


def marked_span(
    whole: str, marked: str, head: str, before: str, upto_marked: str
) -> tuple[int, int] | None:
    """Where one assistant turn lies in `whole`, by alignment with `marked` (the same
    conversation, the turn's content replaced by MARK); None when the template did not render
    the marker verbatim.

    head, before: the conversation before the turn, with and without the generation prompt;
    upto_marked:  the conversation ending with the turn, its content replaced by MARK.
    The turn starts where the generation prompt stops matching `whole` (what the template writes
    after it, such as an empty think block, is the model's to generate), never before the
    generation prompt nor after the content; it ends after the content and as much of what the
    template closes a last turn with (its end-of-turn tokens) as `whole` holds there."""
    a = common(whole, marked)
    b = common_tail(whole[a:], marked[a:])
    if marked[a : len(marked) - b] != MARK or MARK not in upto_marked:
        return None
    base = common(head, before)  # where the generation prompt begins
    start = min(common(head, whole), a)
    if start < base:
        raise ValueError("the conversation before it renders differently in the whole")
    closing = upto_marked[upto_marked.rindex(MARK) + len(MARK) :]
    end = len(whole) - b
    return start, end + common(closing, whole[end:])


def turn_span(whole: str, head: str, before: str, upto: str, anchors: list[str]) -> tuple[int, int]:
    """Where one assistant turn lies in the whole conversation's rendering, in characters.

    head:   the conversation before the turn, with the generation prompt; before: without it;
    upto:   the conversation ending with the turn (rendered as the last turn);
    anchors: text the turn must hold (its content, its tool calls' names).
    The turn starts where `head` leaves `whole` (never inside what precedes the generation
    prompt). Its rendering as the last turn, `upto` past that point, may open with text the
    template gives only a final turn (Qwen3's empty think block): the turn ends where the longest
    tail of that rendering holding every anchor is found in `whole`, no further from the start
    than the text it skipped. Raises ValueError saying why when there is no such place."""
    base = common(head, before)  # where the generation prompt begins
    start = entered(head, whole, base)
    if start < base:
        raise ValueError("the conversation before it renders differently in the whole")
    last = upto[entered(head, upto, base) :]  # the turn as rendered when it is last
    for skip in range(len(last) + 1):
        tail = last[skip:]
        if not all(a in tail for a in anchors):
            break
        at = whole.find(tail, start, start + skip + len(tail))
        if at != -1 and (tail or at == start):
            return start, at + len(tail)
    raise ValueError(
        "its rendering in the whole conversation matches none of its rendering as the last turn"
    )


def entered(head: str, text: str, base: int) -> int:
    """Where `head` (a conversation and its generation prompt) leaves `text`. A generation prompt
    matched only in part (one that opens a think block, where this turn opens with a tag of its
    own) is backed off to its last line break, so the turn's first characters stay in the turn."""
    at = common(head, text)
    if at < len(head) and at > base:
        cut = head.rfind("\n", base, at)
        at = cut + 1 if cut != -1 else base
    return at


def contents(content) -> list[str]:
    """The text an assistant turn must hold: its content, or failing that (templates that drop
    or rewrite a think block) what follows its last </think>."""
    if not isinstance(content, str):
        return [""]
    out = [content.strip()]
    if "</think>" in content:
        out.append(content.rsplit("</think>", 1)[1].strip())
    return out


def call_name(call: dict) -> str:
    function = call.get("function", call)
    return str(function.get("name", "")) if isinstance(function, dict) else ""
