"""The recall benchmark: its data is deterministic, labels only the answer and puts the fact in an
earlier chunk than the question; its scoring; and the script's smoke run."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np

from scripts.lib import recall

ROOT = Path(__file__).resolve().parent.parent


def data(seed=3, count=20):
    return recall.dataset(seed, count, recall.WINDOW, recall.CHUNK)


def test_generator_is_deterministic():
    a, b, c = data(), data(), data(seed=4)
    assert all(np.array_equal(a[k], b[k]) for k in a)
    assert not np.array_equal(a["inputs"], c["inputs"])


def test_only_the_answer_is_labelled():
    d = data()
    assert d["inputs"].shape == d["weights"].shape == (20, recall.WINDOW)
    assert (d["weights"].sum(1) == 1).all() and (d["weights"][:, -1] == 1).all()
    letters = np.array([ord(recall.CODES[c]) for c in d["codes"]])
    assert (d["targets"][:, -1] == letters).all()
    assert np.array_equal(d["inputs"][:, 1:], d["targets"][:, :-1])  # one token stream


def test_fact_sits_in_an_earlier_chunk_than_the_question():
    d = data(count=200)
    question = list(b"What is the code?")
    for x, fact, code in zip(d["inputs"], d["facts"], d["codes"]):
        assert (
            bytes(x[fact - 12 : fact + 1].tolist()) == f"The code is {recall.CODES[code]}".encode()
        )
        asked = next(i for i in range(len(x)) if x[i : i + len(question)].tolist() == question)
        assert (
            fact // recall.CHUNK == 0 and asked // recall.CHUNK == recall.WINDOW // recall.CHUNK - 1
        )
    assert len(set(d["facts"].tolist())) > 5  # the fact's position varies


def test_answer_scores_a_known_case():
    logits = np.zeros((2, 3, 5), np.float32)  # 2 examples, 3 positions, 5 tokens
    targets = np.array([[0, 1, 2], [0, 1, 3]])
    weights = np.array([[0, 1, 1], [0, 0, 1]], np.float32)
    logits[0, 1, 1] = logits[0, 2, 2] = 10  # example 0: both labelled tokens right
    logits[1, 2, 4] = 10  # example 1: its one labelled token wrong
    accuracy, loss = recall.answer_scores(logits, targets, weights)
    assert accuracy == 0.5
    lse = np.log(np.exp(10) + 4)
    assert np.isclose(loss, ((lse - 10) * 2 + lse) / 3)  # the mean CE over 3 labelled tokens


def test_the_quick_run(tmp_path):
    out = tmp_path / "recall.json"
    cmd = [
        sys.executable,
        str(ROOT / "scripts" / "recall.py"),
        "--quick",
        "--trainers",
        "one-graph,exact,plain",
        "--json",
        str(out),
    ]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert "| exact | 1 |" in run.stdout
    report = json.loads(out.read_text())
    by = {r["trainer"]: r["epochs"] for r in report["runs"]}
    assert set(by) == {"one-graph", "exact", "plain"}
    # one window per step from the same init: the exact walk's model is one graph's
    assert np.isclose(by["exact"][1]["loss"], by["one-graph"][1]["loss"], rtol=1e-3)


def test_stated_letters_are_the_facts_values():
    d = data(count=50)
    stated = recall.stated_letters(d["inputs"])
    letters = [ord(recall.CODES[c]) for c in d["codes"]]
    assert all(code in s for code, s in zip(letters, stated))  # the code's letter is stated
    text = "The gate is K. the sun is red. The code is B."
    row = np.array([list(text.encode())])
    assert recall.stated_letters(row) == [{ord("K"), ord("B")}]
    copied, guess = recall.stated_scores(np.array([ord("K")]), row)
    assert (copied, guess) == (1.0, 0.5)
    assert recall.stated_scores(np.array([ord("Q")]), row)[0] == 0.0


def test_the_exact_walk_is_one_graph_on_the_benchmarks_model():
    """The benchmark's model (every weight trainable, the embedding included, head untied) at its
    chunk: the exact walk's gradient of a window is one graph's to float32 rounding, so the two
    trainers part only as rounding grows over thousands of steps."""
    import importlib.util

    import mlx.core as mx
    from mlx.utils import tree_flatten

    from mlxwalk.walk import WalkConfig, Window
    from mlxwalk.walk.api import exact_gradient, one_graph

    spec = importlib.util.spec_from_file_location("recall_script", ROOT / "scripts" / "recall.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    model = script.build_model(seed=1, width=64, layers=2)
    d = data(seed=1, count=1)
    window = Window.of(d["inputs"][0], d["targets"][0], d["weights"][0])
    _, reference = one_graph(model, window)
    _, walked = exact_gradient(model, window, WalkConfig(chunk=recall.CHUNK, follow_runs=False))
    a, b = dict(tree_flatten(reference)), dict(tree_flatten(walked))
    assert a.keys() == b.keys() and "model.embed_tokens.weight" in a
    err = sum(float(mx.sum((a[k] - b[k]) ** 2)) for k in a) ** 0.5
    norm = sum(float(mx.sum(a[k] ** 2)) for k in a) ** 0.5
    assert err / norm < 1e-5, err / norm
