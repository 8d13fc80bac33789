"""The static proxy of Apple's compiler (metal_kernels/harness/proxy.py): every Metal instantiation
compiled by clang at -O2 keeps no per-lane tile array in private memory; planted runtime-indexed
tile arrays (and one planted in a project kernel) are reported, their compile-time twins are not;
the proxy's threadgroup bytes and threads are the block tables'; the live-float estimate follows
the tiles a kernel holds; the script prints the table."""

import fcntl
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import pytest

from metal_kernels import build
from metal_kernels.build import Launch, Spec
from metal_kernels.harness import proxy

from .extras import PROXY, missing, why_proxy
from .kernel_edits import mutating

pytestmark = [
    pytest.mark.proxy,  # `python -m pytest -m proxy`, with the proxy extra
    pytest.mark.slow,  # compiles every instantiation (cached by source afterwards)
    pytest.mark.skipif(bool(missing(*PROXY)), reason=why_proxy()),
]

INSTANCES = proxy.instances()
ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def measured() -> dict[str, dict]:
    """Every instance's estimate, compiled in parallel once: one pytest-xdist worker compiles
    (every core), the others wait and read its IR from the cache."""
    proxy.CACHE.mkdir(parents=True, exist_ok=True)
    with open(proxy.CACHE / "proxy.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return dict(zip((i.label for i in INSTANCES), proxy.estimates(INSTANCES)))


@pytest.mark.parametrize("label", [i.label for i in INSTANCES])
def test_no_tile_array_stays_in_private_memory(measured, label):
    """After -O2 every per-lane array of the kernel is in registers: an alloca left is private
    memory on an Apple GPU (a run-time index, or a loop clang did not unroll)."""
    kept = [str(p) for p in measured[label]["private"]]
    assert not kept, f"{label}: " + "\n".join(kept)


def test_every_block_table_entry_is_an_instance():
    from metal_kernels.attention import blocks as attention_blocks
    from metal_kernels.delta import blocks as delta_blocks

    want = {("attention/" + k, d, w) for k, d, w in attention_blocks.METAL}
    want |= {("delta/" + k, d, w) for k, d, w in delta_blocks.METAL}
    got = {(i.kernel, i.dim, "float" if i.dtype == mx.float32 else "half") for i in INSTANCES}
    assert want <= got
    assert len(INSTANCES) == len({i.label for i in INSTANCES})


def test_threadgroup_bytes_and_threads_are_the_block_tables(measured):
    """What the proxy reads from the IR (address-space-3 globals, the launch's threadgroup)
    is what the block tables say each body declares."""
    from metal_kernels.attention import blocks as attention_blocks
    from metal_kernels.delta import blocks as delta_blocks

    tables = {"attention": attention_blocks, "delta": delta_blocks}
    checked = set()
    for inst in INSTANCES:
        family, kind = inst.kernel.split("/")
        blocks = tables[family]
        if (kind, inst.dim, blocks.width(inst.dtype)) not in blocks.METAL:
            continue  # the scans have no block table
        row = measured[inst.label]
        want = blocks.metal_threadgroup_bytes(kind, inst.dim, inst.dtype)
        assert row["threadgroup_bytes"] == want, inst.label
        assert row["threads"] == blocks.metal(kind, inst.dim, inst.dtype).threads, inst.label
        per_core = min(proxy.CORE_THREADGROUP_MEMORY // want * row["simdgroups"], 24)
        assert row["simdgroups_per_core"] == per_core, inst.label
        checked.add((inst.kernel, inst.dim, inst.dtype))
    assert len(checked) == 63  # an entry of the tables and a dtype each (half: float16, bfloat16)


# Kernels written here, through MLX's generator like the project's own.
SOURCES: dict[str, str] = {}


@pytest.fixture(autouse=True)
def kernels_written_here(monkeypatch):
    original = build.source

    def source(spec, backend):
        return ("", SOURCES[spec.stem]) if spec.stem in SOURCES else original(spec, backend)

    monkeypatch.setattr(build, "source", source)


def planted(stem: str, body: str, template=()) -> Launch:
    SOURCES["proxy_test/" + stem] = body
    spec = Spec("proxy_test/" + stem, ("x", "n"), ("out",), (), ("metal",))
    inputs = [mx.zeros((16 * 64,)), mx.array([3], mx.int32)]
    return Launch(spec, inputs, [(256,)], [mx.float32], (32, 1, 1), (32, 1, 1), list(template))


# A lane's 16 floats, one of them read back at INDEX.
FLOATS = """
const uint lane = thread_index_in_simdgroup;
float t[16];
for (int i = 0; i < 16; ++i) {
  t[i] = x[i * 32 + lane];
}
out[lane] = t[INDEX];
"""

# Four 8x8 accumulators, one updated each step of a loop holding barriers; BOUND steps.
TILES = """
threadgroup float stage[64];
const uint lane = thread_index_in_simdgroup;
simdgroup_float8x8 acc[4];
for (int j = 0; j < 4; ++j) {
  acc[j] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
}
for (int j = 0; j < BOUND; ++j) {
  stage[lane] = x[64 * j + lane];
  stage[lane + 32] = x[64 * j + lane + 32];
  threadgroup_barrier(mem_flags::mem_threadgroup);
  simdgroup_float8x8 a;
  simdgroup_load(a, stage, 8);
  simdgroup_multiply_accumulate(acc[j % 4], a, a, acc[j % 4]);
  threadgroup_barrier(mem_flags::mem_threadgroup);
}
for (int j = 0; j < 4; ++j) {
  simdgroup_store(acc[j], out + 64 * j, 8);
}
"""


def private(call: Launch) -> list[proxy.PrivateArray]:
    return proxy.estimate(call)["private"]


@pytest.mark.parametrize(
    "stem, body, runtime, constant",
    [
        ("floats", FLOATS, ("INDEX", "n[0] % 16"), ("INDEX", "5")),
        ("tiles", TILES, ("BOUND", "n[0]"), ("BOUND", "4")),
    ],
)
def test_a_runtime_indexed_tile_array_is_reported(stem, body, runtime, constant):
    """Indexed by a value known only at run time (an input, or the step of a loop whose trip
    count is an input), the array stays an alloca, reported with its declaration and the line
    that indexes it; with compile-time indices (a loop clang unrolls) it is promoted."""
    kept = private(planted(stem + "_runtime", body.replace(*runtime)))
    assert len(kept) == 1 and kept[0].tile, kept
    name = "t" if stem == "floats" else "acc"
    assert kept[0].name == name and kept[0].bytes == (64 if stem == "floats" else 32)
    line = f"out[lane] = t[{runtime[1]}];" if stem == "floats" else "acc[j % 4], a, a, acc[j % 4]"
    assert any(line in site for site in kept[0].indexed), kept[0].indexed
    assert private(planted(stem + "_constant", body.replace(*constant))) == []


def test_a_project_kernel_with_a_runtime_index_fails(monkeypatch):
    """The check of every instantiation above, on the scan with its state row written at an
    index that depends on the chunk: reported."""
    (scan,) = [i for i in INSTANCES if i.label == "delta/scan 64 float32"]
    assert private(scan.call) == []
    mutating(monkeypatch, "delta/scan", ("s[j] = acc;", "s[(j + i) % (DK / 32)] = acc;"))
    (kept,) = private(scan.call)
    assert kept.name == "s" and kept.bytes == 8 and "scan.metal" in kept.declared
    assert any("s[(j + i) % (DK / 32)] = acc;" in site for site in kept.indexed)


ACCUMULATE = """
const uint lane = thread_index_in_simdgroup;
simdgroup_float8x8 acc[TILES];
for (int j = 0; j < TILES; ++j) {
  acc[j] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
}
for (int k = 0; k < n[0]; ++k) {
  simdgroup_float8x8 a;
  simdgroup_load(a, x + 64 * k, 8);
  for (int j = 0; j < TILES; ++j) {
    simdgroup_multiply_accumulate(acc[j], a, a, acc[j]);
  }
}
for (int j = 0; j < TILES; ++j) {
  simdgroup_store(acc[j], out + 64 * (j % 4), 8);
}
"""


def test_the_live_float_estimate_counts_the_tiles_held():
    """Accumulators carried across a loop are live together: 4 more tiles, 8 more floats a
    lane (two elements each)."""
    live = {}
    for tiles in (4, 8):
        call = planted(f"accumulate_{tiles}", ACCUMULATE, [("TILES", tiles)])
        row = proxy.estimate(call)
        assert row["private"] == []
        live[tiles] = row["live_floats"]
    assert live[4] >= 8 and live[8] - live[4] == 8, live


def test_the_script_prints_the_table():
    script = ROOT / "scripts" / "metal-proxy.py"
    args = [sys.executable, str(script), "--kernels", "delta/scan", "--check"]  # none kept
    out = subprocess.run(args, capture_output=True, text=True, check=True).stdout
    assert out.startswith("| kernel | head dim | dtype | threadgroup bytes | threads |")
    assert "| delta/scan | 64 | float32 | 2,048 | 128 | 24 |" in out
    assert "| delta/scan | 128 | float32 | 3,072 | 128 | 24 |" in out
