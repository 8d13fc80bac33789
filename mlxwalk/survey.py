"""What `mlxwalk kernels` reports: this machine's device and, for every kernel routing knows at a
model's shapes, whether it builds, its error against its pure-MLX twin, its race against the twin
at the walk's sizes (milliseconds and peak memory each) and what MLXWALK_KERNELS=auto picks.

On a GPU the kernels run there (Metal, or CUDA's twins of them). Without one the Metal bodies run
on the CPU harness (metal_kernels/harness, compiled with g++): the self-check still means what it
says, a race would not (the harness runs a threadgroup at a time on CPU threads), so none is run.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

import mlx.core as mx

import metal_kernels.attention as attention_kernels
import metal_kernels.delta as delta_kernels
from metal_kernels.delta import chunked

from .errors import ModelError
from .ops import routing
from .ops.attention import CUDA_DTYPES, CUDA_HEAD_DIMS, check
from .ops.delta import chunk_kernel, gated_delta, mlx_fast, scan

DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}
# The kernels each op's self-check reports on, by routing's op name.
KERNELS = {
    "attention": ("attention/forward", "attention/dq", "attention/dkdv"),
    "delta-chunked": ("delta/chunked",),
    "delta": ("delta/scan", "delta/scan_back"),
    "mlx-delta": ("mlx gated_delta_update",),
}
# Without `--model`: on a GPU, shapes from shapes.SHAPES (Qwen2.5-0.5B's attention at head dim 64,
# an 8B's at 128, Qwen3.5-27B's hybrid at 256 with its gated delta-net layers); on the CPU the
# bundled tiny models', small enough for the harness.
GPU_SHAPES = {
    "qwen2-0.5b": "Qwen2.5-0.5B",
    "llama3-8b": "Qwen3-8B/Llama-3-8B",
    "qwen3_5-27b": "Qwen3.5-27B",
}
CPU_SHAPES = ("tiny-qwen2", "tiny-qwen3_5")


@dataclass(frozen=True)
class Device:
    """Where the kernels ran."""

    backend: str  # "metal", "cuda", or "cpu" (the Metal bodies on the CPU harness)
    name: str
    memory_bytes: int | None
    working_set_bytes: int | None  # Metal: the recommended working set; CUDA: free memory
    mlx_version: str

    def said(self) -> str:
        def gib(n):
            return "unknown" if n is None else f"{n / (1 << 30):.1f} GiB"

        spare = {"metal": "recommended working set", "cuda": "free"}.get(self.backend)
        extra = f", {spare} {gib(self.working_set_bytes)}" if spare else ""
        return (
            f"{self.name} ({self.backend}), {gib(self.memory_bytes)} memory{extra}, "
            f"MLX {self.mlx_version}"
        )


@dataclass(frozen=True)
class Shape:
    """A model's shapes as the kernels meet them: its attention (head dim, query heads per
    key/value head) and its gated delta-net layers (heads and dims), either may be absent."""

    label: str
    dtype: str  # "float32", "float16" or "bfloat16"
    head_dim: int | None = None
    gqa: int | None = None
    key_heads: int | None = None
    value_heads: int | None = None
    key_dim: int | None = None
    value_dim: int | None = None


@dataclass
class Row:
    """One kernel in one case."""

    kernel: str  # routing's name for it, as its notices say it
    op: str  # routing's op: attention, delta-chunked, delta (the scans), mlx-delta
    case: str  # the case as routing says it (backend, dtype, dims)
    shapes: list[str]  # the models' shapes it comes from
    build: str = "ok"  # "ok", "not taken (...)", or the first line of the error
    error: float | None = None  # relative L2 error against the twin on the self-check's case
    passed: bool | None = None  # error within routing.TOLERANCE for the case's dtype
    race: str | None = None  # the race's size in words; None: not raced
    kernel_ms: float | None = None
    twin_ms: float | None = None
    kernel_peak_bytes: int | None = None
    twin_peak_bytes: int | None = None
    auto: str = ""  # "kernel", or the twin and why, as MLXWALK_KERNELS=auto routes it


@dataclass
class Survey:
    device: Device
    rows: list[Row]
    harness: bool  # the Metal bodies ran on the CPU harness (no race)
    notes: list[str] = field(default_factory=list)

    def to_json(self) -> dict:
        return {
            "device": asdict(self.device),
            "harness": self.harness,
            "notes": self.notes,
            "rows": [asdict(r) for r in self.rows],
        }


def device() -> Device:
    """This machine's device, as MLX reports it."""
    from .walk import machine

    info = mx.device_info()
    backend = machine.backend()
    name = str(info.get("device_name") or info.get("architecture") or backend)
    if backend == "metal":
        memory, spare = info.get("memory_size"), info.get("max_recommended_working_set_size")
    elif backend == "cuda":
        memory, spare = info.get("total_memory"), info.get("free_memory")
    else:
        memory, spare = machine.physical(), None
    return Device(backend, name, memory, spare, mx.__version__)


def shape_of(config: dict, label: str) -> Shape:
    """A model's Shape from its config.json (a multimodal one's `text_config` where it has one).

    Args:
        config: the parsed config.json.
        label: what the rows call it.

    Returns:
        The Shape; fields the model lacks (no attention, no gated delta-net) stay None.
    """
    c = {**config, **config.get("text_config", {})}
    dtype = str(c.get("torch_dtype") or c.get("dtype") or "bfloat16")
    dtype = dtype if dtype in DTYPES else "bfloat16"
    heads = c.get("num_attention_heads")
    head_dim = c.get("head_dim") or (
        c["hidden_size"] // heads if heads and "hidden_size" in c else None
    )
    gqa = heads // (c.get("num_key_value_heads") or heads) if heads else None
    linear = {}
    if c.get("linear_num_key_heads"):
        linear = {
            "key_heads": c["linear_num_key_heads"],
            "value_heads": c["linear_num_value_heads"],
            "key_dim": c["linear_key_head_dim"],
            "value_dim": c["linear_value_head_dim"],
        }
    return Shape(label, dtype, head_dim, gqa, **linear)


def shapes(model: str | None, gpu: bool) -> list[Shape]:
    """The shapes to survey: `model`'s (a bundled name, a folder, a cached hub id), else the
    representative set (GPU_SHAPES on a GPU, the bundled tiny models' on the CPU)."""
    from .training.models import resolve

    if model is not None:
        file = resolve(model) / "config.json"
        try:
            return [shape_of(json.loads(file.read_text()), model)]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise ModelError(f"{file} does not give the model's shapes ({e})") from None
    if gpu:
        from .shapes import SHAPES

        return [shape_of(SHAPES[k], f"{v}-like") for k, v in GPU_SHAPES.items()]
    from . import tiny

    return [shape_of(tiny.MODELS[name].config, name) for name in CPU_SHAPES]


@contextmanager
def on_harness() -> Iterator[None]:
    """Routing as on a Metal GPU, each launch on the CPU harness (no verdicts kept)."""
    from metal_kernels import harness

    saved = routing.backend, routing.launch, routing._verdicts
    routing.backend, routing.launch, routing._verdicts = (lambda: "metal"), harness.launch, {}
    try:
        yield
    finally:
        routing.backend, routing.launch, routing._verdicts = saved


@contextmanager
def twins_pure() -> Iterator[None]:
    """MLXWALK_KERNELS=off inside: a twin that would itself route (the delta rule's ops on the
    scans) stays on the ops, so each kernel is measured against MLX alone."""
    saved = os.environ.get("MLXWALK_KERNELS")
    os.environ["MLXWALK_KERNELS"] = "off"
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("MLXWALK_KERNELS")
        else:
            os.environ["MLXWALK_KERNELS"] = saved


def _cases(shape: Shape, backend: str, harness: bool) -> list[tuple[routing.Case, str | None]]:
    """(case, why it is not taken or None) for each op the shape meets."""
    dtype = DTYPES[shape.dtype]
    out = []
    if shape.head_dim and shape.gqa:
        case = routing.AttentionCase(backend, dtype, shape.head_dim, shape.gqa)
        x = mx.zeros((1, shape.gqa, 1, shape.head_dim), dtype)
        ok = attention_kernels.supports(x, x[:, :1], x[:, :1], None, backend)
        out.append((case, None if ok else f"not taken (head dim {shape.head_dim})"))
    if shape.key_heads and shape.key_dim:
        hk, hv = shape.key_heads, shape.value_heads
        if harness:  # one key head keeps the harness quick; the grouping ratio stays
            hk, hv = 1, hv // hk
        case = routing.ChunkedDeltaCase(backend, dtype, hk, hv, shape.key_dim)
        q = mx.zeros((1, 1, hk, shape.key_dim), dtype)
        v = mx.zeros((1, 1, hv, shape.value_dim), dtype)
        ok = chunked.supports(q, q, v, backend)
        out.append((case, None if ok else f"not taken (dims {shape.key_dim}/{shape.value_dim})"))
        chunk = 256 if not harness else 64  # chunk_size() on a GPU, on the CPU
        scan_case = routing.ScanCase(backend, shape.key_dim, chunk)
        ok = delta_kernels.supports(shape.key_dim, chunk)
        out.append((scan_case, None if ok else f"not taken (key dim {shape.key_dim})"))
        if backend == "metal" and not harness:
            mlx = routing.MlxDeltaCase(backend, dtype, hk, hv, shape.key_dim, shape.value_dim)
            out.append((mlx, None))
    return out


def _checker(op: str) -> tuple[routing.Checker, routing.Racer]:
    if op == "attention":
        return check.kernel_vs_twin, check.race
    if op == "delta-chunked":
        return (
            lambda c: chunk_kernel.kernel_vs_twin(c, gated_delta),
            lambda c, size: chunk_kernel.race(c, size, gated_delta),
        )
    if op == "delta":
        return scan.kernel_vs_twin, scan.race
    return mlx_fast.kernel_vs_twin, mlx_fast.race


def _first_line(e: BaseException) -> str:
    return (str(e).splitlines() or [type(e).__name__])[0][:300]


def auto(case: routing.Case, rows: list[Row], harness: bool) -> str:
    """What MLXWALK_KERNELS=auto does with the case, given its rows' build, check and race."""
    if harness:
        return "twin (no GPU: the ops twin runs on the CPU)"
    if any(r.build != "ok" for r in rows):
        return (
            "twin ("
            + ("not taken" if rows[0].build.startswith("not taken") else "does not build")
            + ")"
        )
    if not all(r.passed for r in rows):
        return "twin (fails its self-check)"
    if case.backend == "cuda":
        if case.op == "attention" and not (
            case.head_dim in CUDA_HEAD_DIMS and case.dtype in CUDA_DTYPES
        ):
            # the race above is against the ops twin; at these head dims MLX's fused path (cuDNN)
            # beat the kernels in the H200's op table (docs/BENCHMARKS.md)
            return "MLX's fused path (cuDNN: faster in the op table; the kernel: attention='tiled')"
        if case.op == "delta-chunked" and case.dtype not in chunk_kernel.CUDA_CHUNKED:
            return "twin (not measured in this dtype)"
        if case.op == "delta" and not scan.CUDA_SCANS:
            return "twin (measured slower)"
        if case.op == "mlx-delta":
            return "twin (never routed on CUDA)"
        return "kernel"
    race = rows[0]
    if race.kernel_ms is None:
        return "twin (failed in its race)"
    return "kernel" if race.kernel_ms <= race.twin_ms else "twin (slower in its race)"


def survey(model: str | None = None, echo: Callable[[str], None] | None = None) -> Survey:
    """Build, self-check and race every kernel routing knows at the model's shapes.

    Args:
        model: a bundled model's name, a model folder or a cached hub id; None: the
            representative shapes (GPU_SHAPES on a GPU, CPU_SHAPES on the CPU).
        echo: told each case as it starts (a run on the harness takes tens of seconds).

    Returns:
        The device and one Row per kernel per case (cases met by several shapes once).
    """
    dev = device()
    harness = dev.backend == "cpu"
    survey_ = Survey(dev, [], harness)
    found = shapes(model, gpu=not harness)
    backend = "metal" if harness else dev.backend
    cases: dict[routing.Case, tuple[str | None, list[str]]] = {}
    for shape in found:
        for case, skip in _cases(shape, backend, harness):
            cases.setdefault(case, (skip, []))[1].append(shape.label)
    if harness:
        survey_.notes.append(
            "no GPU: the Metal kernels ran on the CPU harness (metal_kernels/harness, g++), one "
            "threadgroup at a time; the self-check holds, times would not be a GPU's, so no race"
        )
        if shutil.which("g++") is None:
            survey_.notes.append("g++ is not on PATH: the harness could not build the kernels")
    with on_harness() if harness else _nothing(), twins_pure():
        for case, (skip, labels) in cases.items():
            if echo is not None:
                echo(f"checking {case} ...")
            survey_.rows += _survey_case(case, skip, labels, harness)
    return survey_


@contextmanager
def _nothing() -> Iterator[None]:
    yield


def _survey_case(
    case: routing.Case, skip: str | None, labels: list[str], harness: bool
) -> list[Row]:
    names = KERNELS[case.op]
    rows = [Row(name, case.op, str(case), labels) for name in names]
    checker, racer = _checker(case.op)
    if skip is None and harness and shutil.which("g++") is None:
        skip = "not run (the CPU harness needs g++)"
    if skip is not None:
        for r in rows:
            r.build = skip
    else:
        try:
            errors = checker(case)
        except Exception as e:  # a build or launch failure is what this reports
            for r in rows:
                r.build = _first_line(e)
        else:
            for r in rows:
                r.error = errors.get(r.kernel)
                r.passed = r.error is not None and r.error <= routing.TOLERANCE[case.dtype]
    ran = all(r.passed for r in rows)
    if ran and not harness and routing.RACE and case.op in routing.RACE:
        size = routing.RACE[case.op]
        said = routing._RACE_SIZE[case.op].format(*size)
        try:
            with routing.timed() as sides:
                racer(case, size)
            kernel, twin = sides[0], sides[1]
        except Exception as e:
            for r in rows:
                r.race = f"{said}: failed ({_first_line(e)})"
        else:
            for r in rows:  # the race times the op's kernels together (forward and backward)
                r.race = said
                r.kernel_ms, r.twin_ms = kernel.seconds * 1e3, twin.seconds * 1e3
                r.kernel_peak_bytes, r.twin_peak_bytes = kernel.peak_bytes, twin.peak_bytes
    choice = auto(case, rows, harness)
    for r in rows:
        r.auto = choice
    return rows


def write_json(survey_: Survey, path: str | Path) -> Path:
    """The survey as JSON at `path`, written whole or not at all (a temporary file beside it,
    then renamed)."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent or ".")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(survey_.to_json(), f, indent=1)
            f.write("\n")
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path
