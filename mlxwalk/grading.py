"""How a walk's gradient is graded against its reference, in any framework: the bars, a row of
`mlxwalk test-walk-exact`'s table, the comparison. Plain Python and NumPy."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass

import numpy as np

EXACT = "cosine >= 0.99999, relative L2 error <= 1e-4"
BARS: dict[str, Callable[[float, float], bool]] = {  # (cosine, relative L2 error)
    EXACT: lambda c, e: c >= 0.99999 and e <= 1e-4,
    "cosine >= 0.9999": lambda c, e: c >= 0.9999,
    "cosine >= 0.999": lambda c, e: c >= 0.999,
    "cosine >= 0.99": lambda c, e: c >= 0.99,
    "cosine < 0.95 (tells the walks apart)": lambda c, e: c < 0.95,
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
