"""The bundled models: deterministic, and loaded by mlx-lm like any model."""

import hashlib

import mlx_lm

from mlxwalk import tiny


def digest(folder):
    return {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(folder.iterdir())}


def test_generation_is_deterministic(tmp_path):
    for spec in tiny.MODELS.values():
        a = tiny.write(spec, tmp_path / f"{spec.name}-a")
        b = tiny.write(spec, tmp_path / f"{spec.name}-b")
        assert digest(a) == digest(b)


def test_loads_with_mlx_lm_and_has_a_chat_template(qwen2_path):
    model, tokenizer = mlx_lm.load(qwen2_path)
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    text = tokenizer.apply_chat_template(msgs, tokenize=False)
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nhello<|im_end|>\n"
    assert tokenizer.decode(tokenizer.encode(text)) == text
    attn = model.layers[0].self_attn
    assert attn.n_kv_heads < attn.n_heads  # grouped-query attention
