"""The data loader on random and broken rows: it loads them, skips them, or refuses the row at
fault in one line that starts `file:line:`; it never lets another exception out."""

import json
import re
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from mlxwalk.training import data
from mlxwalk.training.data import DataError

VOCAB = 320  # the tiny models' (mlxwalk.tiny.VOCAB_SIZE)
FUZZ = settings(
    max_examples=120,
    deadline=None,
    derandomize=True,  # the same cases on every run, so CI is repeatable
    database=None,  # and no .hypothesis folder in the checkout
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


@pytest.fixture(scope="module")
def tok():
    import mlx_lm

    from mlxwalk import tiny

    _, tokenizer = mlx_lm.load(str(tiny.path("tiny-qwen2")))
    return tokenizer


# --- strategies -------------------------------------------------------------------------------

ODD = ["", " ", "\n", "\ud800", "a\udfffb", "\ud83d\ude00", "\x00", "<|im_end|>", "{{ x }}", "é"]
KEYS = ["text", "prompt", "completion", "messages", "tools", "train", "role", "content"]
BAD_ROLES = ["assistnat", "", "Assistant", "bot", "function"]


def _long(pair: tuple[str, int]) -> str:
    seed, n = pair
    return (seed * (n // len(seed) + 1))[:n]


def _rarely(common, rare, odds: int = 40):
    """`rare` about once in `odds` draws (hypothesis's one_of would pick it half the time)."""
    return st.integers(0, odds - 1).flatmap(lambda k: rare if k == 0 else common)


strings = _rarely(
    st.one_of(
        st.text(max_size=24),
        st.sampled_from(ODD),
        st.lists(st.sampled_from(ODD), max_size=4).map("".join),  # lone surrogates mixed in
    ),
    st.tuples(st.text(min_size=1, max_size=6), st.integers(50_000, 200_000)).map(_long),
)
scalars = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), strings)
keys = st.one_of(st.sampled_from(KEYS), st.text(max_size=8))
values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(keys, inner, max_size=3),
    max_leaves=8,
)
role = st.sampled_from(data.ROLES)
calls = st.lists(st.dictionaries(keys, values, max_size=2), max_size=2)
sound_message = st.one_of(
    st.fixed_dictionaries(
        {"role": role, "content": strings},
        optional={"train": st.booleans(), "name": strings},
    ),
    st.fixed_dictionaries(
        {"role": st.just("assistant"), "content": st.none(), "tool_calls": calls}
    ),
)
wild_message = st.one_of(
    st.fixed_dictionaries(
        {"role": st.sampled_from(BAD_ROLES) | values, "content": strings | values},
        optional={"train": values, "tool_calls": calls | values},
    ),
    st.fixed_dictionaries({"role": role}, optional={"content": values, "train": values}),
    st.dictionaries(keys, values, max_size=3),
    values,
)
message = _rarely(sound_message, wild_message, odds=10)  # most conversations get deep
tools = st.one_of(
    st.none(), st.lists(st.dictionaries(keys, values, max_size=2), max_size=2), values
)
shaped = st.one_of(
    st.fixed_dictionaries({"text": strings}),
    st.fixed_dictionaries({"prompt": strings, "completion": strings}),
    st.fixed_dictionaries({"messages": st.lists(message, max_size=5)}, optional={"tools": tools}),
    st.fixed_dictionaries({"messages": st.lists(message, max_size=5)}, optional={"tools": tools}),
    st.fixed_dictionaries({"messages": values}),
    st.dictionaries(keys, values, max_size=4),
)
extras = _rarely(st.just({}), st.dictionaries(keys, values, max_size=2), odds=3)
rows = st.tuples(shaped, extras).map(lambda t: {**t[1], **t[0]})
GARBAGE = [
    b"",
    b"  ",
    b"{",
    b"[1, 2]",
    b"3",
    b'"s"',
    b"null",
    b"\xff\xfe",
    b"[" * 5000,
    b"1" * 5000,
    b'{"text": "a\xffb"}',
    b'{"text": "\xed\xa0\x80"}',
    b"{}",
    b'\xef\xbb\xbf{"text": "bom"}',
]
garbage = st.one_of(st.sampled_from(GARBAGE), st.binary(max_size=30))


def _line(row: dict, raw: bool) -> bytes:
    if raw:  # unescaped, so a lone surrogate lands in the file as bytes UTF-8 forbids
        return json.dumps(row, ensure_ascii=False).encode("utf-8", "surrogatepass")
    return json.dumps(row).encode()


raw = _rarely(st.just(False), st.just(True), odds=8)
lines = _rarely(st.builds(_line, rows, raw), garbage, odds=6)  # so most files get past line 1


# --- the property -----------------------------------------------------------------------------


def _assert_named(error: DataError, path: Path, n_lines: int) -> None:
    message = str(error)
    assert "\n" not in message and "\r" not in message, message
    message.encode("utf-8")  # printable: no lone surrogate quoted raw
    assert len(message) < len(str(path)) + 400, message
    m = re.match(re.escape(str(path)) + r":(\d+): \S", message)
    assert m, message
    assert 1 <= int(m.group(1)) <= n_lines, message


def _assert_sound(ds: data.Dataset, path: Path, window: int | None) -> None:
    for e in ds.examples:
        assert len(e.ids) == len(e.labels) and e.trainable > 0
        assert e.where.startswith(f"{path}:")
        assert window is None or len(e) <= window
    assert len(ds.skipped_where) == ds.skipped and len(ds.cut_away_where) == ds.cut_away
    ds.check_ids(VOCAB)  # the tokenizer's ids fit the model's embedding


@FUZZ
@given(
    body=st.lists(lines, min_size=1, max_size=6),
    window=st.sampled_from([None, 1, 16, 64, 4096]),
    how=st.sampled_from(data.FITS),
)
def test_any_file_loads_or_is_refused_in_one_line_naming_the_row(tok, body, window, how):
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "train.jsonl"
        path.write_bytes(b"\n".join(body) + b"\n")
        try:
            ds = data.load(Path(folder), "train", tok, window, how)
        except DataError as e:
            _assert_named(e, path, path.read_bytes().count(b"\n") + 1)
            event(" ".join(str(e)[len(str(path)) :].split()[1:4]))  # --hypothesis-show-statistics
        else:
            _assert_sound(ds, path, window)
            event(f"loaded {len(ds.examples)}, skipped {ds.skipped}, cut away {ds.cut_away}")


# --- explicit cases ---------------------------------------------------------------------------


def _write(folder: Path, *lines: str | bytes | dict) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "train.jsonl"
    raw = [
        x if isinstance(x, bytes) else (json.dumps(x) if isinstance(x, dict) else x).encode()
        for x in lines
    ]
    path.write_bytes(b"\n".join(raw) + b"\n")
    return path


def _refused(tmp_path, tok, *lines) -> tuple[Path, str]:
    path = _write(tmp_path, *lines)
    with pytest.raises(DataError) as e:
        data.load(tmp_path, "train", tok, None)
    return path, str(e.value)


def chat(*turns: tuple[str, str]) -> dict:
    return {"messages": [{"role": r, "content": c} for r, c in turns]}


OK = chat(("user", "hi"), ("assistant", "hello"))


def test_a_misspelt_role_is_refused_by_name(tmp_path, tok):
    row = chat(("system", "s"), ("user", "q"), ("assistant", "a"), ("assistnat", "b"))
    path, message = _refused(tmp_path, tok, OK, row)
    assert message == (
        f"{path}:2: message 3 has role 'assistnat'; "
        "expected one of system, developer, user, assistant, tool"
    )


@pytest.mark.parametrize(
    "message, says",
    [
        ({"role": "user", "content": 3}, "message 0 'content' must be a string"),
        ({"role": "user"}, "message 0 'content' must be a string"),
        (
            {"role": "user", "content": "q", "train": "no"},
            "message 0 'train' must be true or false; got 'no'",
        ),
        ({"content": "q"}, "message 0 has no 'role'"),
        ("hi", "message 0 must be an object with a 'role'; got a string"),
    ],
)
def test_bad_message_fields_are_refused(tmp_path, tok, message, says):
    path, text = _refused(tmp_path, tok, {"messages": [message]})
    assert text.startswith(f"{path}:1: {says}"), text


def test_null_content_is_fine_beside_tool_calls(tmp_path, tok):
    call = {"function": {"name": "f", "arguments": {}}}
    row = {
        "messages": [
            {"role": "user", "content": "q"},
            {"role": "assistant", "content": None, "tool_calls": [call]},
        ]
    }
    _write(tmp_path, row)
    ds = data.load(tmp_path, "train", tok, None)
    assert len(ds.examples) == 1 and ds.examples[0].trainable > 0


@pytest.mark.parametrize("row", [{"text": "a\ud800"}, chat(("user", "q"), ("assistant", "\udfff"))])
def test_a_lone_surrogate_is_refused_in_one_line(tmp_path, tok, row):
    path, message = _refused(tmp_path, tok, OK, row)
    assert (
        message.startswith(f"{path}:2: holds an unpaired surrogate '\\ud") and "\n" not in message
    )


def test_invalid_utf8_is_named_by_line(tmp_path, tok):
    path, message = _refused(tmp_path, tok, OK, b"", b'{"text": "caf\xe9"}')
    assert message.startswith(f"{path}:3: not valid UTF-8"), message


def test_blank_lines_keep_the_line_numbers(tmp_path, tok):
    path, message = _refused(tmp_path, tok, "", "  ", OK, "[1]")
    assert message == f"{path}:4: expected a JSON object"


def test_check_ids_names_the_row_of_an_id_outside_the_vocabulary(tmp_path, tok):
    path = _write(tmp_path, OK, {"text": "plain"})
    ds = data.load(tmp_path, "train", tok, None)
    ds.check_ids(VOCAB)
    ds.examples[1].ids[2] = VOCAB
    with pytest.raises(DataError) as e:
        ds.check_ids(VOCAB)
    assert str(e.value) == (
        f"{path}:2: token id {VOCAB} is outside the model's vocabulary of {VOCAB} ids "
        "(is the tokenizer the model's own?)"
    )
    ds.examples[1].ids[2] = -1
    with pytest.raises(DataError, match="token id -1 is outside"):
        ds.check_ids(VOCAB)


def test_fitted_counts_cut_away_apart_from_skipped(tmp_path, tok):
    path = _write(
        tmp_path,
        {"text": "x" * 100},  # labelled from its start: cut, kept
        chat(("user", "only a question")),  # no label at all: skipped
        chat(("user", "y" * 100), ("assistant", "z")),  # its label lies past the window
        OK,
    )
    whole = data.load(tmp_path, "train", tok, None)
    assert (whole.skipped, whole.skipped_where) == (1, [f"{path}:2"])
    ds = whole.fitted(32)
    assert (ds.skipped, ds.skipped_where) == (1, [f"{path}:2"])
    assert (ds.cut_away, ds.cut_away_where) == (1, [f"{path}:3"])
    assert ds.truncated == 2
    assert [e.where for e in ds.examples] == [f"{path}:1", f"{path}:4"]


class Failing:
    """A tokenizer whose template or encoder fails as real ones do."""

    chat_template = "..."
    eos_token_id = 0

    def __init__(self, error: Exception, where: str):
        self.error, self.at = error, where

    def apply_chat_template(self, *args, **kwargs):
        if self.at == "template":
            raise self.error
        return "rendered"

    def encode(self, text, add_special_tokens=False):
        raise self.error


@pytest.mark.parametrize(
    "error, at, says",
    [
        (None, "template", "the chat template failed (TemplateError: roles must alternate user/"),
        (RecursionError("maximum recursion depth exceeded"), "encode", "the tokenizer failed"),
        (TypeError("x\n" * 500), "encode", "the tokenizer failed (TypeError: x x x"),
    ],
)
def test_template_and_tokenizer_failures_become_one_line(tmp_path, error, at, says):
    import jinja2

    error = error or jinja2.TemplateError("roles must alternate\nuser/assistant/user/...")
    path, message = _refused(tmp_path, Failing(error, at), OK)
    assert message.startswith(f"{path}:1: {says}"), message
    assert "\n" not in message and len(message) < len(str(path)) + 260
