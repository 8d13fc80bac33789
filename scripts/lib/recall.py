"""A recall benchmark: a code is stated early in a conversation and asked for at its end.

Each example is one ChatML conversation in the bundled tiny models' byte-level vocabulary (token
id = byte value; `<|im_start|>` and `<|im_end|>` are ids 257 and 258). A few filler turns (random
lowercase words, so the fact's position varies), then the fact ("The code is K."), then filler
turns up to the window's length, then the question; the assistant answers with the code's one
letter. Only that letter is labelled, so the loss reads nothing but recall: chance is one letter
in `len(CODES)` (loss ln 16).

Half the filler turns (DECOY_RATE) state a decoy fact in the same letters ("The gate is K."),
so the letter after "is" does not answer: the model has to find the one after "The code is".
What a chunk-cut trainer lacks is the gradient that would teach the fact's chunk to write a key
and value that the question's chunk can find.
"""

from __future__ import annotations

import math
import re

import numpy as np

IM_START, IM_END = 257, 258
CODES = "ABCDEFGHJKLMNPQR"  # 16 one-byte answers: not in the template or the filler words
CHANCE_LOSS = math.log(len(CODES))
WINDOW, CHUNK = 256, 32  # the benchmark's default window and walk chunk (an eighth of it)
DECOY_RATE = 0.5  # the share of filler turns that state a decoy fact
DECOYS = ("room", "gate", "seat", "desk", "door", "lane", "shelf", "floor")
WORDS = (
    "apple river stone cloud green table music light paper quiet window garden bread under "
    "happy winter summer market yellow little orange simple coffee letter silver bottle "
    "forest pencil mirror rabbit candle ticket planet jacket butter bridge valley basket "
    "engine violin kitten meadow harbor castle pepper rocket tunnel saddle"
).split()


def _encode(text: str) -> list[int]:
    return list(text.encode("ascii"))


def _turn(role: str, text: str) -> list[int]:
    return [IM_START, *_encode(f"{role}\n{text}"), IM_END, *_encode("\n")]


def _filler_turn(rng: np.random.Generator, decoys: float) -> list[int]:
    if rng.random() < decoys:  # a fact about something else, in the code's own letters
        text = f"The {rng.choice(DECOYS)} is {CODES[rng.integers(len(CODES))]}."
    else:
        text = " ".join(rng.choice(WORDS, size=int(rng.integers(3, 9)))) + "."
    return _turn("user", text) + _turn("assistant", "ok")


def _question(code: str) -> list[int]:
    # the answer is the last token; the <|im_end|> that would follow is not needed
    return _turn("user", "What is the code?") + [IM_START, *_encode(f"assistant\n{code}")]


def _fill(rng: np.random.Generator, length: int, decoys: float) -> list[int]:
    """Exactly `length` tokens of filler turns, the last cut to fit (spaces if under 9)."""
    turns: list[list[int]] = []
    pad = length  # what the turns so far leave to fill
    while len(turn := _filler_turn(rng, decoys)) <= pad:
        turns.append(turn)
        pad -= len(turn)
    while 0 < pad < 9 and turns:  # too short for a turn (8 tokens of template): give one back
        pad += len(turns.pop())
    if pad >= 9:
        turns.append(_turn("user", " ".join(rng.choice(WORDS, size=pad))[: pad - 8]))
    elif pad:
        turns.append(_encode(" " * pad))
    return [t for turn in turns for t in turn]


def conversation(
    rng: np.random.Generator, window: int, fact_within: int, decoys: float = DECOY_RATE
) -> tuple[list[int], int, int]:
    """One conversation of exactly window + 1 tokens: (tokens, fact position, code index).

    The fact's letter sits at a position uniform below `fact_within`, after filler; the question
    closes the conversation; filler fills the gap."""
    code = int(rng.integers(len(CODES)))
    fact = _turn("user", f"The code is {CODES[code]}.") + _turn("assistant", "Noted.")
    letter_at = len(_turn("user", "The code is ")) - 2  # the letter's offset in `fact`
    if letter_at >= fact_within:
        raise ValueError(f"fact_within must exceed {letter_at}, the letter's offset in its turn")
    slack = int(rng.integers(fact_within - letter_at))  # the letter sits at letter_at + slack
    head = _fill(rng, slack, decoys)
    tail = _question(CODES[code])
    body = head + fact
    room = window + 1 - len(body) - len(tail)
    if room < 0:
        raise ValueError(f"window {window} is too short for a conversation")
    middle = _fill(rng, room, decoys)
    tokens = body + middle + tail
    assert len(tokens) == window + 1, (len(tokens), window)
    return tokens, len(head) + letter_at, code


def dataset(
    seed: int, count: int, window: int, fact_within: int, decoys: float = DECOY_RATE
) -> dict[str, np.ndarray]:
    """`count` conversations from `seed`: inputs and targets (count x window, int32), weights
    (count x window, float32: 1 on the answer only), the fact's position and the code (count)."""
    rng = np.random.default_rng(seed)
    inputs = np.zeros((count, window), np.int32)
    targets = np.zeros((count, window), np.int32)
    weights = np.zeros((count, window), np.float32)
    facts = np.zeros(count, np.int32)
    codes = np.zeros(count, np.int32)
    for i in range(count):
        tokens, facts[i], codes[i] = conversation(rng, window, fact_within, decoys)
        inputs[i], targets[i] = tokens[:-1], tokens[1:]
        weights[i, -1] = 1.0  # the last target is the answer letter
    return {
        "inputs": inputs,
        "targets": targets,
        "weights": weights,
        "facts": facts,
        "codes": codes,
    }


def answer_scores(logits: np.ndarray, targets: np.ndarray, weights: np.ndarray) -> tuple:
    """(exact-match accuracy, mean answer-token loss) of logits (count x window x vocab): an
    example is right when the argmax over the whole vocabulary equals the target at every
    labelled position; the loss is the mean cross-entropy over labelled positions."""
    logits = logits.astype(np.float64)
    shifted = logits - logits.max(-1, keepdims=True)
    logp = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))  # (count, window, vocab)
    ce = -np.take_along_axis(logp, targets[..., None], -1)[..., 0]  # (count, window)
    labelled = weights > 0
    right = (logits.argmax(-1) == targets) | ~labelled  # (count, window)
    accuracy = float(right.all(-1).mean())
    loss = float(ce[labelled].mean())
    return accuracy, loss


_STATED = re.compile(rb" is ([A-Z])\.")


def stated_letters(inputs: np.ndarray) -> list[set[int]]:
    """Per conversation (count x window token ids), the letters stated as a fact's value: the
    code's and every decoy's ("The gate is K."), as token ids."""
    out = []
    for row in inputs:
        text = bytes(int(t) if t < 256 else 0 for t in row)
        out.append({m[0] for m in _STATED.findall(text)})
    return out


def stated_scores(answers: np.ndarray, inputs: np.ndarray) -> tuple[float, float]:
    """(the share of answers, token ids (count), that are a letter the conversation states as some
    fact's value; the accuracy of picking one of those letters uniformly): a trainer that learned
    to copy a stated letter but not to tell the code's from the decoys' sits at the second."""
    stated = stated_letters(inputs)
    copied = float(np.mean([int(a) in s for a, s in zip(answers, stated)]))
    guess = float(np.mean([1 / len(s) for s in stated]))
    return copied, guess
