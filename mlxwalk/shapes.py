"""Representative model shapes as mlx-lm config dicts: `mlxwalk kernels`' shapes without a model
(survey.py), and the random-weight models of the scripts' device measurements (scripts/lib/bench.py
builds them). Plain data, no array library."""

from __future__ import annotations

# Qwen2.5-0.5B (attention at head dim 64), Qwen3.5-0.8B and -27B (hybrids: full attention every
# 4th layer, gated delta-net layers between) and Llama-3-8B (head dim 128).
# Each family's fixed fields (mlx-lm's config keys).
QWEN2 = dict(
    model_type="qwen2",
    vocab_size=151936,
    rms_norm_eps=1e-6,
    rope_theta=1e6,
    max_position_embeddings=131072,
)
LLAMA3 = dict(
    model_type="llama",
    head_dim=128,
    vocab_size=128256,
    rms_norm_eps=1e-5,
    rope_theta=5e5,
    max_position_embeddings=131072,
)
QWEN3_5 = dict(
    model_type="qwen3_5",
    head_dim=256,
    vocab_size=248320,
    rms_norm_eps=1e-6,
    max_position_embeddings=262144,
    full_attention_interval=4,
    linear_num_key_heads=16,
    linear_key_head_dim=128,
    linear_value_head_dim=128,
    linear_conv_kernel_dim=4,
    rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25},
)


def sized(
    family: dict, hidden: int, layers: int, mlp: int, heads: int, kv_heads: int, **rest
) -> dict:
    """A family's config at one size: width, depth, MLP width, query and K/V heads, and the rest."""
    return dict(
        family,
        hidden_size=hidden,
        num_hidden_layers=layers,
        intermediate_size=mlp,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        **rest,
    )


SHAPES: dict[str, dict] = {
    "qwen2-0.5b": sized(QWEN2, 896, 24, 4864, 14, 2, tie_word_embeddings=True),
    "qwen3_5-0.8b": sized(
        QWEN3_5, 1024, 24, 3584, 8, 2, linear_num_value_heads=16, tie_word_embeddings=True
    ),
    "llama3-8b": sized(LLAMA3, 4096, 32, 14336, 32, 8, tie_word_embeddings=False),
    "qwen3_5-27b": sized(
        QWEN3_5, 5120, 64, 17408, 24, 4, linear_num_value_heads=48, tie_word_embeddings=False
    ),
}
# Every shape shrunk, to check a measurement script end to end on a CPU (its --small).
SMALL = dict(hidden_size=128, num_hidden_layers=4, intermediate_size=256, vocab_size=512)
