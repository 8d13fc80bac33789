"""The bundled preference sample (mlxwalk/data/preference), generated from a fixed seed: a locker
code is stated at the start of a conversation and asked for at its end; the chosen answer gives
it, the rejected one another code. Which answer is right depends only on a fact the answer's
window holds many chunks back: DPO can learn it only through the K/V of that far chunk."""

from __future__ import annotations

import random
from pathlib import Path

from ..training.samples import FILLER, write_split


def code(rng: random.Random) -> str:
    return " ".join(str(rng.randint(0, 9)) for _ in range(6))


def pair(rng: random.Random, filler_turns: int) -> dict:
    """One row in mlx-lm-lora's chat form: the prompt a conversation, two answers."""
    right = code(rng)
    wrong = code(rng)
    while wrong == right:
        wrong = code(rng)
    msgs = [
        {"role": "user", "content": f"Remember this: my locker code is {right}."},
        {"role": "assistant", "content": "Noted."},
    ]
    for _ in range(filler_turns):
        msgs.append({"role": "user", "content": rng.choice(FILLER)})
        msgs.append({"role": "assistant", "content": "I see."})
    msgs.append({"role": "user", "content": "What is my locker code?"})
    return {
        "prompt": msgs,
        "chosen": f"Your locker code is {right}.",
        "rejected": f"Your locker code is {wrong}.",
    }


def make(root: Path) -> None:
    rng = random.Random(13)  # small enough that `mlxwalk train --objective dpo` takes a minute
    rows = [pair(rng, rng.randint(28, 36)) for _ in range(20)]
    write_split(root / "preference" / "train.jsonl", rows[:16])
    write_split(root / "preference" / "valid.jsonl", rows[16:])
