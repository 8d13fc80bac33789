"""What a walk's "auto" settings become, and what the exact walk's admission gave up to fit its
memory budget. Without a budget "auto" is lossless: a K/V store at the model's own K/V precision
(float16 or bfloat16; float32 otherwise) and float32 accumulators. Only under a memory budget may
the admission (admission.py) make them lossy, and it reports each setting it changed (`Choice`)."""

from __future__ import annotations

from dataclasses import dataclass, replace

from .config import WalkConfig

MIN_CHUNK = 256  # the smallest chunk the admission halves to unless --min-chunk says otherwise
HALF = ("float16", "bfloat16")


def lossless_store(kv_dtype: str) -> str:
    """The store that holds the model's K/V bit for bit: its own half precision, else float32."""
    return kv_dtype if kv_dtype in HALF else "float32"


def dtype_name(dtype) -> str:
    """An MLX (or NumPy-like) dtype's name: "bfloat16", "float32"."""
    return str(dtype).rsplit(".", 1)[-1]


def lossless(config: WalkConfig, kv_dtype: str) -> WalkConfig:
    """`config` with "auto" store and accumulators as the lossless choice; explicit ones kept."""
    store = lossless_store(kv_dtype) if config.cache_type == "auto" else config.cache_type
    acc = "float32" if config.accumulator_dtype == "auto" else config.accumulator_dtype
    return replace(config, cache_type=store, accumulator_dtype=acc)


def chunk_floor(config: WalkConfig) -> int:
    """The smallest chunk the admission may halve to: --min-chunk, else MIN_CHUNK (never above
    the asked chunk: a chunk already that small is held)."""
    least = MIN_CHUNK if config.min_chunk is None else config.min_chunk
    return min(config.chunk, least)


WHY = {
    "K/V store": "lossy: the prefix is read back at 8 bits (test-walk-exact row 1b)",
    "accumulators": "lossy: K/V gradients summed in bfloat16 (test-walk-exact row 1c)",
    "chunk": "exact; more, smaller chunks take longer",
    "checkpoint stride": "exact; states re-decoded from fewer checkpoints (a binomial schedule)",
    "kept inputs": "exact; the reverse pass records the forward it no longer keeps",
    "head products": "exact; the head dequantized a slice of its vocabulary at a time (row 1d)",
}
LOSSY = ("K/V store", "accumulators")


@dataclass(frozen=True)
class Choice:
    """One setting the admission changed to fit the memory budget."""

    setting: str  # a key of WHY
    asked: object  # what it was (auto's lossless choice, or the default)
    chosen: object

    @property
    def lossy(self) -> bool:
        return self.setting in LOSSY

    def said(self) -> str:
        return f"{self.setting} {self.chosen} (not {self.asked}): {WHY[self.setting]}"

    def as_dict(self) -> dict:
        return {
            "setting": self.setting,
            "asked": self.asked,
            "chosen": self.chosen,
            "lossy": self.lossy,
        }


def lines(given_up: list[Choice]) -> list[str]:
    """`mlxwalk plan`'s, `mlxwalk train`'s and the drop-in's account of the choices."""
    if not given_up:
        return []
    return ["to fit the memory budget:", *(f"  {c.said()}" for c in given_up)]
