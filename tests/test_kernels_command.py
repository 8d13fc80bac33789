"""`mlxwalk kernels`: the device, every kernel's build, check, race and auto's choice, as a table
and a JSON file; on the CPU the Metal bodies on the harness, with no race."""

import json

import mlx.core as mx
import pytest

from mlxwalk import cli, survey, tiny
from mlxwalk.ops import routing
from mlxwalk.survey import Device, Row, Survey

KERNELS = {"attention/forward", "attention/dq", "attention/dkdv", "delta/chunked"}
KERNELS |= {"delta/scan", "delta/scan_back"}


def faked() -> Survey:
    dev = Device("metal", "Apple M2 Max", 64 << 30, 48 << 30, "0.32.4")
    rows = [
        Row("attention/forward", "attention", "metal bfloat16 head dim 128 GQA 4", ["x"]),
        Row("delta/chunked", "delta-chunked", "metal bfloat16 chunked delta rule", ["x"]),
    ]
    rows[0].error, rows[0].passed, rows[0].race = 2.5e-3, True, "1024 queries over 4096 keys"
    rows[0].kernel_ms, rows[0].twin_ms = 12.25, 20.0
    rows[0].kernel_peak_bytes, rows[0].twin_peak_bytes = 300 << 20, 2 << 30
    rows[0].auto = "kernel"
    rows[1].build = "program_source:3:1: error: unknown type name 'simdgroup_float8x8x'"
    rows[1].auto = "twin (does not build)"
    return Survey(dev, rows, harness=False)


def test_the_table_and_the_json(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(survey, "survey", lambda model, echo=None: faked())
    path = tmp_path / "k.json"
    assert cli.main(["kernels", "--json", str(path)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == (
        "device: Apple M2 Max (metal), 64.0 GiB memory, recommended working set 48.0 GiB, "
        "MLX 0.32.4"
    )
    head, first, second = out[1:4]
    assert head.split() == [
        "kernel",
        "case",
        "build",
        "vs",
        "twin",
        "kernel",
        "race",
        "twin",
        "race",
        "auto",
    ]
    assert first.index("metal bfloat16") == head.index("case")  # aligned
    assert "2.5e-03 ok" in first and "12.2 ms, 300 MiB" in first and "20.0 ms, 2048 MiB" in first
    assert first.endswith("kernel")
    assert "program_source:3:1: error: unknown type name ..." in second
    assert out[4] == "race attention: 1024 queries over 4096 keys, forward and backward"
    assert out[-1] == f"wrote {path}: attach it to your bug report"
    data = json.loads(path.read_text())
    assert data["device"]["name"] == "Apple M2 Max" and data["device"]["mlx_version"] == "0.32.4"
    assert [r["kernel"] for r in data["rows"]] == ["attention/forward", "delta/chunked"]
    assert data["rows"][0]["kernel_peak_bytes"] == 300 << 20
    assert data["rows"][1]["build"].startswith("program_source:3:1: error")


def test_the_json_is_written_whole_or_not_at_all(tmp_path):
    path = tmp_path / "k.json"
    path.write_text("before")
    broken = faked()
    broken.rows[0].error = object()  # not JSON
    with pytest.raises(TypeError):
        survey.write_json(broken, path)
    assert path.read_text() == "before" and [p.name for p in tmp_path.iterdir()] == ["k.json"]


@pytest.mark.parametrize("model", ["/no/such/model-folder", "no-such-bundled"])
def test_a_model_that_is_not_there_is_one_line(capsys, model):
    assert cli.main(["kernels", "-m", model, "--json", "/tmp/unused.json"]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1
    assert captured.err.startswith("mlxwalk: error: model ") and model in captured.err


def test_a_json_folder_that_is_not_there_is_refused_first(monkeypatch, capsys):
    monkeypatch.setattr(survey, "survey", lambda *a, **k: pytest.fail("surveyed"))
    assert cli.main(["kernels", "--json", "/no/such/folder/k.json"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("mlxwalk: error: --json /no/such/folder/k.json")
    assert err.endswith(": the folder /no/such/folder does not exist\n")


def test_shapes_from_a_config():
    hybrid = survey.shape_of(tiny.MODELS["tiny-qwen3_5"].config, "h")
    assert (hybrid.head_dim, hybrid.gqa, hybrid.dtype) == (64, 2, "float32")
    assert (hybrid.key_heads, hybrid.value_heads, hybrid.key_dim) == (2, 4, 64)
    plain = survey.shape_of(tiny.MODELS["tiny-qwen2"].config, "q")
    assert (plain.head_dim, plain.gqa, plain.key_heads) == (64, 2, None)  # 256 / 4 heads
    nested = {"model_type": "qwen3_5", "text_config": {**tiny.MODELS["tiny-qwen3_5"].config}}
    nested["text_config"].update(head_dim=256, num_key_value_heads=1, torch_dtype="bfloat16")
    shape = survey.shape_of(nested, "n")
    assert (shape.head_dim, shape.gqa, shape.dtype, shape.value_heads) == (256, 4, "bfloat16", 4)


def test_what_auto_picks():
    def rows(kernel_ms=1.0, twin_ms=2.0, passed=True, build="ok"):
        r = Row("k", "op", "case", [], build=build, passed=passed)
        r.kernel_ms, r.twin_ms = kernel_ms, twin_ms
        return [r]

    metal = routing.AttentionCase("metal", mx.bfloat16, 128, 4)
    assert survey.auto(metal, rows(), harness=False) == "kernel"
    assert survey.auto(metal, rows(3.0), harness=False) == "twin (slower in its race)"
    assert survey.auto(metal, rows(None), harness=False) == "twin (failed in its race)"
    assert survey.auto(metal, rows(passed=False), False) == "twin (fails its self-check)"
    assert survey.auto(metal, rows(build="error: x"), False) == "twin (does not build)"
    assert survey.auto(metal, rows(), harness=True).startswith("twin (no GPU")
    cuda = routing.AttentionCase("cuda", mx.bfloat16, 256, 4)
    assert survey.auto(cuda, rows(3.0), harness=False) == "kernel"  # by the measured table
    cuda64 = routing.AttentionCase("cuda", mx.bfloat16, 64, 4)
    assert survey.auto(cuda64, rows(), False).startswith("MLX's fused path")
    chunked32 = routing.ChunkedDeltaCase("cuda", mx.float32, 1, 2, 64)
    assert survey.auto(chunked32, rows(), False) == "twin (not measured in this dtype)"


@pytest.mark.slow  # the harness compiles every kernel (about 30 s on two cores)
def test_on_the_cpu_end_to_end(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("MLXWALK_KERNELS", raising=False)
    path = tmp_path / "k.json"
    assert cli.main(["kernels", "--json", str(path)]) == 0
    out = capsys.readouterr().out
    assert "note: no GPU: the Metal kernels ran on the CPU harness" in out and "no race" in out
    data = json.loads(path.read_text())
    assert data["device"]["backend"] == "cpu" and data["device"]["mlx_version"] == mx.__version__
    assert data["harness"] is True
    assert {r["kernel"] for r in data["rows"]} == KERNELS and len(data["rows"]) == len(KERNELS)
    for r in data["rows"]:
        assert r["build"] == "ok" and r["passed"] is True, r
        assert r["error"] < 1e-4 and r["race"] is None and r["kernel_ms"] is None
    assert routing.backend() is None and routing.launch is not None  # the harness unrouted
