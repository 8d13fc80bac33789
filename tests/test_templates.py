"""Chat templates that render a turn differently when it is last, or add text of their own: each
assistant turn is labelled as it appears in the whole conversation. BOS as mlx-lm adds it."""

from pathlib import Path

import pytest

from mlxwalk.training import chat, data

TEMPLATES = Path(__file__).parent / "templates"
# Qwen3's shape: an assistant turn after the last user turn, when it is the final message, opens
# with an empty think block; earlier turns render without one.
QWEN3_LIKE = (TEMPLATES / "qwen3_like.jinja").read_text()
# The same with spaces where Qwen3 breaks lines, and its generation prompt carrying the empty
# think block (thinking off), which earlier turns render without.
SPACED_THINK = (TEMPLATES / "spaced_think.jinja").read_text()
# A default system prompt with a date when none is given (Llama 3's shape).
DATED = (TEMPLATES / "dated.jinja").read_text()
# A template that renders earlier turns from a summary of the last: nothing to anchor.
UNLABELLABLE = (TEMPLATES / "unlabellable.jinja").read_text()

CHAT = [
    {"role": "user", "content": "Name a bird."},
    {"role": "assistant", "content": "The owl."},
    {"role": "user", "content": "And a fish?"},
    {"role": "assistant", "content": "The trout."},
]


@pytest.fixture(scope="module")
def tokenizer(qwen2_path):
    import mlx_lm

    _, tok = mlx_lm.load(qwen2_path)
    return tok


def labelled_text(tok, template, messages):
    tok._tokenizer.chat_template = template
    ex = data.chat_example(tok, messages, where="t.jsonl:1")
    runs, cur = [], []
    for i, lab in zip(ex.ids, ex.labels):
        if lab:
            cur.append(i)
        elif cur:
            runs.append(tok.decode(cur))
            cur = []
    if cur:
        runs.append(tok.decode(cur))
    return runs


def test_qwen3_think_block_on_the_last_turn(tokenizer):
    runs = labelled_text(tokenizer, QWEN3_LIKE, CHAT)
    assert runs == ["The owl.<|im_end|>\n", "<think>\n\n</think>\n\nThe trout.<|im_end|>\n"]


def test_a_template_without_line_breaks_and_a_think_block_in_its_prompt(tokenizer):
    """Found by alignment: the turn's content replaced by a marker, the renderings compared."""
    runs = labelled_text(tokenizer, SPACED_THINK, CHAT)
    assert runs == ["The owl.<|im_end|> ", "The trout.<|im_end|> "]


def test_a_template_that_adds_a_date_and_a_system_prompt(tokenizer):
    runs = labelled_text(tokenizer, DATED, CHAT)
    assert runs == ["The owl.<|im_end|>\n", "The trout.<|im_end|>\n"]


def test_prefix_stable_template_unchanged(tokenizer, qwen2_path):
    from mlxwalk import tiny

    runs = labelled_text(tokenizer, tiny.CHAT_TEMPLATE, CHAT)
    assert runs == ["The owl.<|im_end|>\n", "The trout.<|im_end|>\n"]


def test_context_turns_stay_context(tokenizer):
    chat = [dict(m) for m in CHAT]
    chat[1]["train"] = False
    assert labelled_text(tokenizer, QWEN3_LIKE, chat) == [
        "<think>\n\n</think>\n\nThe trout.<|im_end|>\n"
    ]


def test_a_turn_that_cannot_be_placed_is_refused_by_line_and_message(tokenizer):
    with pytest.raises(data.DataError, match=r"^t\.jsonl:1: message 1 \(assistant\) can't be"):
        labelled_text(tokenizer, UNLABELLABLE, CHAT)


def test_turn_span_places_a_last_turn_rendering_inside_the_whole():
    whole = "U:a|A:x|U:b|A:<t></t>y|"
    # the first assistant turn, rendered last, carries the think block the whole gives it not
    assert chat.turn_span(whole, "U:a|A:", "U:a|", "U:a|A:<t></t>x|", ["x"]) == (6, 8)
    with pytest.raises(ValueError):
        chat.turn_span(whole, "U:a|A:", "U:a|", "U:a|A:<t></t>z|", ["z"])


class BosTokenizer:
    """Encodes bytes; adds BOS 1 the way Llama's tokenizers do."""

    bos_token_id, eos_token_id, chat_template = 1, 2, None

    def encode(self, text, add_special_tokens=True):
        ids = [10 + b for b in text.encode()]
        return [1, *ids] if add_special_tokens else ids


def test_text_and_completion_rows_get_bos_once_and_eos():
    tok = BosTokenizer()
    ex = data.to_example(tok, {"text": "hi"}, "t:1")
    assert ex.ids == [1, 10 + ord("h"), 10 + ord("i"), 2]
    ex = data.to_example(tok, {"prompt": "a", "completion": "b"}, "t:2")
    assert ex.ids == [1, 10 + ord("a"), 10 + ord("b"), 2] and ex.labels == [0, 0, 1, 1]
    assert data.with_bos(tok, [1, 5]) == [1, 5]  # already there: not twice


def test_no_bos_where_the_tokenizer_adds_none(tokenizer):
    ex = data.to_example(tokenizer, {"text": "hi"}, "t:1")
    assert ex.ids == tokenizer.encode("hi") + [tokenizer.eos_token_id]


# DeepSeek-R1's shape: reasoning dropped from every rendered turn; the generation prompt opens a
# think block.
R1_LIKE = (TEMPLATES / "r1_like.jinja").read_text()


def test_a_template_that_drops_the_reasoning_labels_what_it_keeps(tokenizer):
    chat = [dict(m) for m in CHAT]
    chat[1]["content"] = "<think>\nan owl hoots\n</think>\n\nThe owl."
    chat[3]["content"] = "<b>The trout.</b>"  # opens with '<', as the prompt's '<think>' does
    runs = labelled_text(tokenizer, R1_LIKE, chat)
    assert runs == ["The owl.<|im_end|>\n", "<b>The trout.</b><|im_end|>\n"]


def test_an_assistant_first_chat_labels_only_the_turn(tokenizer):
    chat = [{"role": "assistant", "content": "Hello there."}, *CHAT[:2]]
    runs = labelled_text(tokenizer, QWEN3_LIKE, chat)
    assert runs == ["Hello there.<|im_end|>\n", "<think>\n\n</think>\n\nThe owl.<|im_end|>\n"]
