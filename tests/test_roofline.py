"""The roofline (metal_kernels/roofline.py): its numbers follow from the kernels' traffic models,
and no launch of a 64K exact walk is past LIMIT_S on the smallest M-series GPU, split over its
grid's independent threadgroups where one launch alone would be (the attention launches;
docs/MAC.md)."""

from __future__ import annotations

import math
import re

import mlx.core as mx
import pytest

from metal_kernels import roofline
from metal_kernels.attention import traffic as attention_traffic
from metal_kernels.delta import traffic as delta_traffic
from scripts.lib import bench

GPU = roofline.M1_7CORE
WALKS = [("qwen2-0.5b", 65536), ("llama3-8b", 65536), ("qwen3_5-27b", 67584)]


def launches(name: str, window: int) -> list[roofline.Launch]:
    return roofline.walk(roofline.Shape.of(bench.SHAPES[name]), window, 2048)


def cells(table: str) -> list[list[str]]:
    return [[c.strip() for c in line.strip("|").split("|")] for line in table.splitlines()[2:]]


@pytest.mark.parametrize("name,window", WALKS)
def test_table_follows_from_the_traffic_models(name, window):
    """Each row's FLOPs and bytes are the traffic model's at the last chunk's shape, its seconds
    the slower of the two at the GPU's peaks, its split the seconds over LIMIT_S."""
    cfg, walk = bench.SHAPES[name], launches(name, window)
    shape = roofline.Shape.of(cfg)
    start = (window - 1) // 2048 * 2048
    a = attention_traffic.Shape(
        1, shape.heads, shape.kv_heads, 2048, start, 0, shape.head_dim, mx.bfloat16, mx.bfloat16
    )
    expected = {}
    for kernel in ("forward", "dq", "dkdv"):
        t = attention_traffic.traffic(kernel, a)
        expected[f"attention/{kernel}"] = (t.flops, t.device_read_bytes + t.device_write_bytes)
    if shape.linear_key_heads:
        d = delta_traffic.Shape(
            1, 2048, shape.linear_key_heads, shape.linear_value_heads, shape.linear_dim, mx.bfloat16
        )
        for kernel in delta_traffic.blocks.KERNELS:
            t = delta_traffic.traffic(kernel, d, keep=kernel == "prepare")
            expected[f"delta/{kernel}"] = (t.flops, t.device_read_bytes + t.device_write_bytes)
    rows = cells(roofline.table(walk, GPU))
    assert [r[0] for r in rows] == [x.kernel for x in walk]
    for x, row in zip(walk, rows):
        if x.kernel in expected:
            assert (x.flops, x.bytes) == expected[x.kernel], x.kernel
        s = max(x.flops / (GPU.tflops * 1e12), x.bytes / (GPU.gbps * 1e9))
        assert float(row[2].replace(",", "")) == pytest.approx(x.flops / 1e9, abs=0.05)
        assert float(row[3].replace(",", "")) == pytest.approx(x.bytes / 1e6, abs=0.05)
        assert float(row[4]) == pytest.approx(s, abs=5e-4)
        assert row[6] == str(max(1, math.ceil(s / roofline.LIMIT_S)))
    assert set(expected) <= {x.kernel for x in walk}


def test_scans_follow_their_launch_shapes():
    """The scans' traffic: 3 products of c x dk x dv per chunk and head, every float32 array
    read or written once; doubling the positions doubles both."""
    one, two = roofline.scans(2048, 48, 128, 128), roofline.scans(4096, 48, 128, 128)
    assert one[0].flops == 3 * 2 * 8 * 256 * 128 * 48 * 128
    for a, b in zip(one, two):
        assert b.flops == 2 * a.flops
        assert b.bytes - 2 * a.bytes == -4 * 2 * 48 * 128 * 128  # the entry and exit states


def under_limit(walk: list[roofline.Launch]) -> list[str]:
    """The launches that no split keeps under LIMIT_S, and any scan or delta-net launch past
    it unsplit (their grids are not split anywhere), in words."""
    bad = [f"{x.kernel}: {x.seconds(GPU):.2f} s, no split" for x in walk if not x.splits(GPU)]
    bad += [
        f"{x.kernel}: {x.seconds(GPU):.2f} s"
        for x in roofline.over(walk, GPU)
        if x.kernel.startswith("delta/")
    ]
    return bad


@pytest.mark.parametrize("name,window", WALKS)
def test_every_launch_under_the_limit(name, window):
    walk = launches(name, window)
    assert not under_limit(walk), under_limit(walk)
    for x in walk:
        n = x.splits(GPU)
        assert x.seconds(GPU) / n <= roofline.LIMIT_S and n <= x.grid, x


def test_an_oversized_launch_fails():
    """A scan over 64 times the positions in one launch, and an attention launch of one
    threadgroup past the limit, are caught."""
    walk = launches("qwen3_5-27b", 67584)
    assert not under_limit(walk)
    scan = roofline.scans(64 * 67584, 48, 128, 128)[0]
    assert scan.seconds(GPU) > roofline.LIMIT_S
    said = f"delta/scan: {scan.seconds(GPU):.2f} s"
    assert under_limit(walk + [scan]) == [f"{said}, no split", said]
    lone = roofline.Launch("attention/dq", "one threadgroup", 1e9, 1e12, grid=1)
    assert under_limit([lone]) == ["attention/dq: 14.65 s, no split"]


def test_window_sums_every_chunk():
    """A window's launches: the decode of every chunk but the last through every layer, the
    reverse pass of every chunk above the stem; the dense part is two FLOPs a multiply-add per
    position per pass, the weights read once a pass."""
    shape = roofline.Shape.of(bench.SHAPES["llama3-8b"])
    kinds = ("attention",) * 4
    p = roofline.Products((10, 10, 10, 10), (100, 100, 100, 100), 7, 70)
    walk = roofline.window(shape, kinds, p, stem=2, length=5000, chunk=2048)
    dense = [x for x in walk if x.kernel.endswith("/products")]
    assert [x.flops for x in dense] == [
        2 * 40 * 2048,  # decode, chunk 0
        2 * 2 * 20 * 2048,  # reverse, chunk 0: recompute and backward, layers 2-3
        2 * 40 * 2048,
        2 * 2 * 20 * 2048,
        2 * 2 * 20 * 904,  # the last chunk: not decoded
    ]
    assert [x.bytes for x in dense] == [400, 400, 400, 400, 400]
    heads = [x for x in walk if x.kernel == "reverse/head"]
    assert [x.flops for x in heads] == [2 * 2 * 7 * 2048] * 2 + [2 * 2 * 7 * 904]
    last = roofline.attention(32, 8, 128, 904, 4096)
    reverse = [x for x in walk if x.kernel == "reverse/attention"]
    assert reverse[-1].flops == 2 * sum(x.flops for x in last)  # layers 2-3
    s = roofline.seconds(walk)
    assert s == pytest.approx(sum(x.seconds(GPU) for x in walk))
    assert re.fullmatch(r"\d+ queries x \d+ keys, 32/8 heads, dim 128", last[0].what)
