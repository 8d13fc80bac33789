"""Preference rows in mlx-lm-lora's formats become two windows that differ only in the answer."""

import json

import mlx_lm
import numpy as np
import pytest

from mlxwalk import tiny
from mlxwalk.errors import DataError
from mlxwalk.preference import pairs

ROWS = [
    {"prompt": "Which is larger, 3 or 5?", "chosen": "5.", "rejected": "3."},
    {"system": "Be brief.", "prompt": "Name a colour.", "chosen": "Blue.", "rejected": "Seven."},
    {
        "prompt": [
            {"role": "user", "content": "Hi."},
            {"role": "assistant", "content": "Hello."},
            {"role": "user", "content": "Two plus two?"},
        ],
        "chosen": "Four.",
        "rejected": [{"role": "assistant", "content": "Five."}],
    },
    {
        "chosen": [
            {"role": "user", "content": "Capital of France?"},
            {"role": "assistant", "content": "Paris."},
        ],
        "rejected": [
            {"role": "user", "content": "Capital of France?"},
            {"role": "assistant", "content": "Rome."},
        ],
    },
]


@pytest.fixture(scope="module")
def tokenizer():
    return mlx_lm.load(tiny.path("tiny-qwen2"))[1]


def write(folder, rows):
    (folder / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return folder


def test_each_format_labels_only_the_answer(tmp_path, tokenizer):
    got = pairs.load(write(tmp_path, ROWS), "train", tokenizer, None)
    assert len(got.pairs) == len(ROWS) and got.skipped == 0
    for row, p in zip(ROWS, got.pairs):
        for window, side in ((p.chosen, "chosen"), (p.rejected, "rejected")):
            answer = row[side] if isinstance(row[side], str) else row[side][-1]["content"]
            labelled = bytes(window.targets[window.weights > 0].astype(np.uint8))
            assert answer.encode() in labelled  # the answer's tokens are labelled ...
            assert b"Hello" not in labelled and b"?" not in labelled  # ... and no context
        first = int(np.flatnonzero(p.chosen.weights)[0])
        assert (p.chosen.inputs[:first] == p.rejected.inputs[:first]).all()  # one prompt


def test_a_long_pair_is_cut_keeping_both_ends(tmp_path, tokenizer):
    row = {"prompt": "fact " * 300, "chosen": "yes", "rejected": "no"}
    got = pairs.load(write(tmp_path, [row]), "train", tokenizer, window=256)
    assert got.cut == 1 and len(got.pairs[0].chosen) == 256
    assert got.pairs[0].chosen.weights[-8:].any()  # the answer survived the cut


@pytest.mark.parametrize(
    "row, says",
    [
        ({"prompt": "x", "chosen": "a"}, "needs 'chosen' and 'rejected'"),
        ({"chosen": "a", "rejected": "b"}, "must be conversations"),
        ({"prompt": 3, "chosen": "a", "rejected": "b"}, "'prompt' must be"),
        ({"prompt": "x", "chosen": [], "rejected": "b"}, "'chosen' must be"),
    ],
)
def test_bad_rows_are_named(tmp_path, tokenizer, row, says):
    with pytest.raises(DataError, match=says) as e:
        pairs.load(write(tmp_path, [row]), "train", tokenizer, None)
    assert str(e.value).startswith(f"{tmp_path / 'train.jsonl'}:1: ")
