"""A quantized base's products on the dequantized weight (ops/products.py): the product and its
input's gradient equal MLX's quantized product's in float32, only the decoder layers' affine
projections are swapped (and back), and the walk on them equals one graph on MLX's own; an untied
head held whole or sliced by its vocabulary (walk/loss.py) equals MLX's quantized head."""

import mlx.core as mx
import mlx_lm
import numpy as np
import pytest
from mlx import nn

from mlxwalk import tiny, window_gradient
from mlxwalk.commands.walk_exact import prepare
from mlxwalk.grading import compare
from mlxwalk.ops import products
from mlxwalk.ops.products import (
    DequantizedLinear,
    SlicedLinear,
    dequantized_matmul,
    dequantized_products,
)
from mlxwalk.plan import MIB
from mlxwalk.walk.algorithm import LOSS_BLOCK
from mlxwalk.walk.arch import Head
from mlxwalk.walk.loss import head_loss, sliced_loss_and_grad
from scripts.lib import bench


def rel(a: mx.array, b: mx.array) -> float:
    return (mx.linalg.norm(a - b) / mx.linalg.norm(b)).item()


@pytest.mark.parametrize("bits", [4, 8])
def test_the_dequantized_product_and_its_gradient_equal_the_quantized_ones(bits):
    mx.random.seed(bits)
    w, scales, biases = mx.quantize(mx.random.normal((96, 128)), 64, bits)  # float32 scales
    x = mx.random.normal((2, 40, 128))
    dy = mx.random.normal((2, 40, 96))

    def quantized(x):
        return mx.quantized_matmul(x, w, scales, biases, True, 64, bits)

    def dequantized(x):
        return dequantized_matmul(64, bits)(x, w, scales, biases)

    (y_q,), (dx_q,) = mx.vjp(quantized, [x], [dy])
    (y_d,), (dx_d,) = mx.vjp(dequantized, [x], [dy])
    assert rel(y_d, y_q) < 1e-6
    assert rel(dx_d, dx_q) < 1e-6


def test_the_decoder_layers_affine_projections_and_an_untied_head_are_swapped_and_restored():
    model, _ = bench.shaped("llama3-8b", small=True, bits=4)  # its head is an untied projection
    assert type(model.lm_head) is nn.QuantizedLinear
    in_layers = [m for layer in model.layers for _, m in layer.named_modules()]
    quantized = [m for m in in_layers if isinstance(m, nn.QuantizedLinear)] + [model.lm_head]
    assert len(quantized) > 1
    with dequantized_products(model, "dequantized") as n:
        assert n == len(quantized)
        assert all(type(m) is DequantizedLinear for m in quantized)
    assert all(type(m) is nn.QuantizedLinear for m in quantized)
    with dequantized_products(model, "quantized") as n:
        assert n == 0
    with dequantized_products(model, "dequantized", head=False) as n:
        assert n == len(quantized) - 1
        assert type(model.lm_head) is nn.QuantizedLinear


def test_a_held_head_is_dequantized_once_for_every_block_and_equals_the_quantized_loss(
    monkeypatch,
):
    mx.random.seed(3)
    lin = nn.Linear(64, 300, bias=False)
    head_module = nn.QuantizedLinear.from_linear(lin, 64, 4)
    n = LOSS_BLOCK + 200  # two blocks
    h = mx.random.normal((1, n, 64))
    y = mx.random.randint(0, 300, (1, n))
    w = mx.ones((1, n))

    def loss(h):
        return head_loss(Head(None, head_module, head_module, lambda x: x), h, y, w, float(n))

    quantized = mx.value_and_grad(loss)(h)
    head_module.__class__ = DequantizedLinear
    calls = []
    dequantize = mx.dequantize

    def counted(*args, **kwargs):  # every dequantization, the backward's recomputes included
        calls.append(1)
        return dequantize(*args, **kwargs)

    monkeypatch.setattr(mx, "dequantize", counted)
    dequantized = mx.value_and_grad(loss)(h)
    mx.eval(dequantized)
    assert len(calls) == 1  # one dequantization for the two blocks' products and gradients
    assert abs(dequantized[0].item() - quantized[0].item()) < 1e-5
    assert rel(dequantized[1], quantized[1]) < 1e-5


def wide_head(vocab: int, hidden: int = 64) -> nn.QuantizedLinear:
    mx.random.seed(5)
    return nn.QuantizedLinear.from_linear(nn.Linear(hidden, vocab, bias=False), 64, 4)


def head_loss_and_grad(module, h, y, w):
    def loss(h):
        return head_loss(Head(None, module, module, lambda x: x), h, y, w, float(w.sum().item()))

    return mx.value_and_grad(loss)(h)


def test_a_sliced_head_dequantizes_one_slice_at_a_time_and_equals_the_quantized_loss(
    monkeypatch,
):
    head = wide_head(300)
    n = LOSS_BLOCK + 200  # two blocks
    h = mx.random.normal((1, n, 64))
    y = mx.random.randint(0, 300, (1, n))
    w = mx.random.uniform(shape=(1, n))
    quantized = head_loss_and_grad(head, h, y, w)
    head.__class__ = SlicedLinear
    rows = []
    dequantize = mx.dequantize

    def counted(wq, *args, **kwargs):  # every dequantization, the backward's recomputes included
        rows.append(wq.shape[0])
        return dequantize(wq, *args, **kwargs)

    monkeypatch.setattr(mx, "dequantize", counted)
    with products.vocab_slice(128):  # 300 rows: 128, 128, 44
        sliced = head_loss_and_grad(head, h, y, w)
        mx.eval(sliced)
    # each block's slices once in the forward and once in the backward's recompute
    assert sorted(rows) == sorted([128, 128, 44] * 4)
    assert abs(sliced[0].item() - quantized[0].item()) < 1e-5
    assert rel(sliced[1], quantized[1]) < 1e-5


@pytest.mark.parametrize("per_target", [False, True])
def test_several_targets_a_position_agree_on_every_head(per_target):
    """Window.of_targets' loss (signed weights, T columns) is the same from the quantized, the
    held and the sliced head, and per column equals the one-target loss of that column."""
    head = wide_head(300)
    n, T = LOSS_BLOCK + 200, 3
    h = mx.random.normal((1, n, 64))
    y = mx.random.randint(0, 300, (1, n, T))
    w = mx.random.normal((1, n, T))

    def run(cls, y, w):
        head.__class__ = cls

        def loss(h):  # (T,) or a scalar
            return head_loss(Head(None, head, head, lambda x: x), h, y, w, 7.0, per_target)

        with products.vocab_slice(128):
            out, dh = loss(h), mx.grad(lambda h: loss(h).sum())(h)
            mx.eval(out, dh)
        return out, dh

    ref = run(nn.QuantizedLinear, y, w)
    for cls in (DequantizedLinear, SlicedLinear):
        got = run(cls, y, w)
        assert rel(got[0], ref[0]) < 1e-5 and rel(got[1], ref[1]) < 1e-5
    if per_target:  # column t alone, as a plain window's targets
        head.__class__ = nn.QuantizedLinear
        for t in range(T):
            one = head_loss(Head(None, head, head, lambda x: x), h, y[..., t], w[..., t], 7.0)
            assert abs(one.item() - ref[0][t].item()) < 1e-5 * max(1.0, abs(one.item()))


def test_a_sliced_head_holds_a_fraction_of_what_the_held_head_does():
    vocab, hidden, n = 16384, 256, LOSS_BLOCK
    head = wide_head(vocab, hidden)
    h = mx.random.normal((1, n, hidden))
    y = mx.random.randint(0, vocab, (1, n))
    w = mx.ones((1, n))
    mx.eval(head.parameters(), h, y, w)
    peaks = {}
    for cls in (DequantizedLinear, SlicedLinear):
        head.__class__ = cls
        with products.vocab_slice(vocab // 8):
            mx.synchronize()
            mx.reset_peak_memory()
            base = mx.get_active_memory()
            mx.eval(head_loss_and_grad(head, h, y, w))
            peaks[cls.__name__] = (mx.get_peak_memory() - base) / MIB
    # the held head: its copy (16 MiB), a block's float32 logits (64 MiB) and their gradient,
    # 289 MiB in all on the CPU; sliced in eight, 147 MiB (MLX's CPU stream runs ahead of its
    # frees, several slices deep): a loss that built the block's whole logits fails this
    assert peaks["SlicedLinear"] < 0.6 * peaks["DequantizedLinear"], peaks


N = 160
IDS = np.random.default_rng(7).integers(0, 256, N + 1)


@pytest.mark.parametrize("name", ["tiny-qwen2-4bit", "tiny-qwen3_5-4bit"])
def test_the_walk_on_dequantized_products_equals_one_graph_on_quantized_ones(name):
    model, _ = mlx_lm.load(str(tiny.path(name)))
    prepare(model)
    w = np.r_[np.zeros(30), np.ones(N - 30)]
    _, one = window_gradient(
        model, IDS[:-1], IDS[1:], w, chunk=N, walk="one-graph", products="quantized"
    )
    _, exact = window_gradient(model, IDS[:-1], IDS[1:], w, chunk=40, products="dequantized")
    cosine, err = compare(exact, one)
    print(f"{name}: exact (dequantized) vs one graph (quantized): relative L2 error {err:.1e}")
    assert cosine >= 0.99999 and err <= 2e-5


def test_auto_gives_up_the_dequantized_head_first_when_a_budget_would_not_hold_it(monkeypatch):
    from mlxwalk.plan import OutOfMemory
    from mlxwalk.walk import ExactWalk, WalkConfig, Window, admission, budget

    model, _ = bench.shaped("llama3-8b", small=True, bits=4)  # an untied quantized head
    seen = []

    def probe(walk, model, config, reach=None, echo=None):  # the dequantized head's graph is huge
        seen.append(config.head_products)
        graph = 1e6 * MIB if config.head_products == "dequantized" else MIB
        return budget.Activations(config.chunk, graph, 0.0, 0.0)

    monkeypatch.setattr(admission, "probe", probe)
    ids = np.random.default_rng(0).integers(0, 256, 257)
    window = Window.of(ids[:-1], ids[1:], np.ones(256))

    def walk(head: str, budget_mib: float, recompute: bool = True) -> ExactWalk:
        seen.clear()
        config = WalkConfig(
            chunk=64, recompute=recompute, memory_budget_mib=budget_mib, head_products=head
        )
        return ExactWalk(model, window, config)

    tight = walk("auto", 4096)
    assert seen == ["dequantized", "sliced"] and tight.head_products == "sliced"
    with tight.walking():
        assert type(model.lm_head) is SlicedLinear
        assert type(model.layers[0].mlp.up_proj.linear) is DequantizedLinear
    roomy = walk("auto", 2e6)
    assert seen == ["dequantized"] and roomy.head_products == "dequantized"
    with roomy.walking():
        assert type(model.lm_head) is DequantizedLinear
    with pytest.raises(OutOfMemory):  # asked for by name: refused, not given up
        walk("dequantized", 4096)
    one_graph = walk("auto", 4096, recompute=False)  # its chunk one graph: not sliced
    assert seen == ["dequantized", "quantized"] and one_graph.head_products == "quantized"
    quantized = walk("quantized", 4096)
    assert seen == ["quantized"]
    with quantized.walking():
        assert type(model.lm_head) is nn.QuantizedLinear


@pytest.mark.parametrize("several", [False, True])
def test_the_eager_sliced_loss_equals_the_quantized_head_and_holds_one_slice(several):
    """sliced_loss_and_grad (the layer-by-layer walk's, outside any transformation): the loss
    and its gradient in h of MLX's quantized head, one slice of logits alive at a time."""
    vocab, hidden, n, T = 16384, 256, LOSS_BLOCK, 3
    head = wide_head(vocab, hidden)
    h = mx.random.normal((1, n, hidden))
    y = mx.random.randint(0, vocab, (1, n, T) if several else (1, n))
    w = mx.random.normal(y.shape) if several else mx.random.uniform(shape=(1, n))
    mx.eval(head.parameters(), h, y, w)
    module = Head(None, head, head, lambda x: x)
    want = mx.value_and_grad(lambda h: head_loss(module, h, y, w, 7.0))(h)
    head.__class__ = DequantizedLinear
    mx.synchronize()
    mx.reset_peak_memory()
    base = mx.get_active_memory()
    mx.eval(mx.value_and_grad(lambda h: head_loss(module, h, y, w, 7.0))(h))
    held = mx.get_peak_memory() - base
    head.__class__ = SlicedLinear
    with products.vocab_slice(vocab // 8):
        mx.synchronize()
        mx.reset_peak_memory()
        base = mx.get_active_memory()
        loss, dh = sliced_loss_and_grad(head, h, y, w, 7.0)
        mx.eval(loss, dh)
        sliced = mx.get_peak_memory() - base
    assert abs(loss.item() - want[0].item()) < 1e-5 * abs(want[0].item())
    assert rel(dh, want[1]) < 1e-5
    # the held head's copy, a block's float32 logits and their gradient: 289 MiB on the CPU;
    # eager, one slice of the eight: 30 MiB (the checkpointed slices of head_loss: 138)
    assert sliced < 0.2 * held, (sliced / MIB, held / MIB)


def test_the_walk_on_a_sliced_head_without_recompute_equals_one_graph():
    """Row (1d) walks the sliced head layer by layer (recompute); without recompute the chunk is
    one graph and its loss head_loss's checkpointed slices."""
    model, _ = mlx_lm.load(str(tiny.path("tiny-mistral-4bit")))
    model = prepare(model)
    ids = np.random.default_rng(2).integers(0, 256, 161)
    args = (model, ids[:-1], ids[1:], np.ones(160))
    _, one = window_gradient(*args, chunk=160, walk="one-graph")
    with products.vocab_slice(96):
        _, walked = window_gradient(*args, chunk=48, head_products="sliced")
    assert compare(walked, one)[1] <= 2e-5


def test_the_sliced_head_row_of_test_walk_exact_runs_on_an_untied_quantized_model():
    from mlxwalk import exactness
    from mlxwalk.commands.walk_exact import Table

    model, _ = mlx_lm.load(str(tiny.path("tiny-mistral-4bit")))
    assert type(model.lm_head) is nn.QuantizedLinear  # untied, quantized
    (spec,) = [s for s in exactness.ROWS if s.row == "(1d)"]
    row = Table(prepare(model), "tiny-mistral-4bit").compared(spec)
    print(row)
    assert row.ok and row.rel_l2 is not None and row.rel_l2 <= 2e-5, row
    tied, _ = mlx_lm.load(str(tiny.path("tiny-qwen2-4bit")))
    row = Table(prepare(tied), "tiny-qwen2-4bit").compared(spec)
    assert row.detail == "not offered: a tied or unquantized head", row
