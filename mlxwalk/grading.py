"""How a walk's gradient is graded against its reference, in any framework: the bars, a row of
`mlxwalk test-walk-exact`'s table, the comparison. Plain Python and NumPy."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass

import numpy as np

# The exact bar is float32's (on CUDA with TF32 off): the walks read 1e-6 to 5e-6 against their
# references, on the CPU and the H200, so 2e-5 leaves a factor of 4 and still fails a gradient
# scaled by 0.9999 or a float16 K/V store on the hybrid (5e-5). Rows where half precision is in
# play have their own bars, named by it, a few times what they read (tiny-qwen2 the worst, float32
# products: float16 store 2.3e-3, bfloat16 store 2.0e-2, q8 5.3e-2, bfloat16 accumulators 2.0e-3).
EXACT = "cosine >= 0.99999, relative L2 error <= 2e-5 (float32)"
FLOAT16_STORE = "float16 store: relative L2 error <= 1e-2"
BFLOAT16_STORE = "bfloat16 store: relative L2 error <= 5e-2"
Q8_STORE = "8-bit store: relative L2 error <= 1e-1"
BFLOAT16_ACCUMULATORS = "bfloat16 accumulators: relative L2 error <= 1e-2"
TELLS_APART = "cosine < 0.95 (tells the walks apart)"
BARS: dict[str, Callable[[float, float], bool]] = {  # (cosine, relative L2 error)
    EXACT: lambda c, e: c >= 0.99999 and e <= 2e-5,
    FLOAT16_STORE: lambda c, e: e <= 1e-2,
    BFLOAT16_STORE: lambda c, e: e <= 5e-2,
    Q8_STORE: lambda c, e: e <= 1e-1,
    BFLOAT16_ACCUMULATORS: lambda c, e: e <= 1e-2,
    TELLS_APART: lambda c, e: c < 0.95,
}


@dataclass
class Row:
    model: str
    row: str
    what: str
    bar: str
    ok: bool
    cosine: float | None = None
    rel_l2: float | None = None  # |walk - reference| / |reference|
    detail: str = ""

    def line(self) -> str:
        if self.cosine is not None:
            got = f"cosine {self.cosine:.6f}, rel. L2 error {self.rel_l2:.1e}"
        else:
            got = self.detail
        verdict = "OK" if self.ok else "FAILED"
        return f"  {self.row:<5}{self.what:<58}{got:<44}{verdict:<7}[{self.bar}]"


def flat(tree) -> np.ndarray:
    """Every leaf of a gradient tree (dicts and lists of arrays of any framework), in float64."""
    if isinstance(tree, dict):
        parts = [flat(tree[k]) for k in sorted(tree)]
    elif isinstance(tree, (list, tuple)):
        parts = [flat(v) for v in tree]
    else:
        return np.asarray(tree, np.float64).ravel()
    return np.concatenate(parts) if parts else np.zeros(0)


def compare(grads, reference) -> tuple[float, float]:
    """(cosine, relative L2 error |a - b| / |b|) of two gradient trees, in float64."""
    a, b = flat(grads), flat(reference)
    na, nb = np.linalg.norm(a), np.linalg.norm(b)
    return float(a @ b / (na * nb)), float(np.linalg.norm(a - b) / nb)


def compared_row(model: str, row: str, what: str, bar: str, walk, reference) -> Row:
    """A row comparing `walk()` with `reference()` (gradients, any framework); an error is the
    row's FAILED detail, so one row's failure never hides the others."""
    try:
        c, e = compare(walk(), reference())
    except (ValueError, RuntimeError, MemoryError) as err:
        detail = "error: " + (str(err).splitlines() or [type(err).__name__])[0][:120]
        return Row(model, row, what, bar, False, detail=detail)
    return Row(model, row, what, bar, BARS[bar](c, e), c, e)


def refusal_row(model: str, message: str, untouched: bool) -> Row:
    """Row (3): a host budget of 1 byte is refused, naming host memory, the adapter untouched."""
    detail = ("refused" if message else "not refused") + (
        ", adapter untouched" if untouched else ", adapter changed"
    )
    ok = "host memory" in message and untouched
    return Row(
        model, "(3)", "host budget of 1 byte", "refused, adapter untouched", ok, detail=detail
    )


def print_tables(
    tables: Iterable[tuple[str, Iterable[Row]]],
    title: str,
    as_json: bool = False,
    echo=print,
    footer: Callable[[], str] | None = None,
) -> bool:
    """test-walk-exact's output for either framework: each model's header and rows as they come
    (`tables` yields them lazily: a model loads when its turn comes), or one JSON object; then
    `footer` and the verdict. True when every row is OK."""
    rows: list[Row] = []
    for header, table_rows in tables:
        if not as_json:
            echo(header)
        for row in table_rows:
            rows.append(row)
            if not as_json:
                echo(row.line())
    ok = all(r.ok for r in rows)
    if as_json:
        echo(json.dumps({"ok": ok, "rows": [asdict(r) for r in rows]}, indent=2))
        return ok
    if footer is not None:
        echo(footer())
    echo(f"{title}: " + ("every row OK" if ok else "FAILED"))
    return ok
