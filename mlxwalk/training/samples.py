"""The bundled sample data, generated from a fixed seed (`scripts/make-samples.py` writes it into
mlxwalk/data/).

  conversations: long chats with one assistant persona whose replies follow a consistent style,
                 the default `mlxwalk train` learns from;
  recall:        a fact (a code) is stated at the start of a long conversation and asked for many
                 turns later; only the final answer is labelled, so its signal reaches the fact
                 only through K/V several chunks back (the exact walk's case).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

TOPICS = [
    "tides",
    "bread",
    "compilers",
    "owls",
    "glaciers",
    "chess",
    "lanterns",
    "rivers",
    "bees",
    "clocks",
    "maps",
    "violins",
    "comets",
    "gardens",
    "bridges",
    "paper",
    "salt",
    "wind",
]
ASKS = [
    "Tell me something about {t}.",
    "What do you think of {t}?",
    "Why do people care about {t}?",
    "Give me one fact on {t}, please.",
    "How would you explain {t} to a child?",
]
FILLER = [
    "I walked to the market this morning.",
    "The weather turned cold again.",
    "My neighbour painted the fence green.",
    "I am reading a book about old ships.",
    "We had soup for dinner yesterday.",
    "The train was late by ten minutes.",
]


def persona_reply(topic: str, rng: random.Random) -> str:
    n = rng.randint(2, 4)
    return (
        f"Wren here. On {topic}: {topic} are patient things. "
        + " ".join(f"Point {i + 1}: {topic} reward a second look." for i in range(n))
        + f" That is all on {topic}."
    )


def conversation(rng: random.Random, turns: int) -> dict:
    msgs = [{"role": "system", "content": "You are Wren, a calm and orderly assistant."}]
    for _ in range(turns):
        topic = rng.choice(TOPICS)
        msgs.append({"role": "user", "content": rng.choice(ASKS).format(t=topic)})
        msgs.append({"role": "assistant", "content": persona_reply(topic, rng)})
    return {"messages": msgs}


def recall(rng: random.Random, filler_turns: int) -> dict:
    code = " ".join(str(rng.randint(0, 9)) for _ in range(6))
    msgs = [
        {"role": "user", "content": f"Remember this: my locker code is {code}."},
        {"role": "assistant", "content": "Noted.", "train": False},
    ]
    for _ in range(filler_turns):
        msgs.append({"role": "user", "content": rng.choice(FILLER)})
        msgs.append({"role": "assistant", "content": "I see.", "train": False})
    msgs.append({"role": "user", "content": "What is my locker code?"})
    msgs.append({"role": "assistant", "content": f"Your locker code is {code}."})
    return {"messages": msgs}


def write_split(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def make(root: Path) -> None:
    rng = random.Random(7)  # small enough that `mlxwalk train` shows the walk in about a minute
    convs = [conversation(rng, rng.randint(6, 7)) for _ in range(6)]
    write_split(root / "conversations" / "train.jsonl", convs[:4])
    write_split(root / "conversations" / "valid.jsonl", convs[4:])
    rng = random.Random(11)
    facts = [recall(rng, rng.randint(28, 36)) for _ in range(40)]
    write_split(root / "recall" / "train.jsonl", facts[:32])
    write_split(root / "recall" / "valid.jsonl", facts[32:])


def folder(name: str = "conversations") -> Path:
    return Path(__file__).resolve().parent.parent / "data" / name
