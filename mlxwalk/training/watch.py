"""What a run warns of, once each where the user looks, and counts for its report: a window
whose horizon the memory budget narrowed (its gradient not exact), a window whose peak passed the
budget, a loss that climbed to a uniform guess's (training diverged)."""

from __future__ import annotations

import math

from ..plan import MIB

BUDGET_MARGIN = 0.10  # a window's peak may pass the memory budget by this much before a warning


class Watch:
    def __init__(self, cfg, vocab: int, echo):
        self.cfg, self.vocab, self.echo = cfg, vocab, echo
        self.horizon_used = cfg.horizon  # the smallest horizon any window used
        self.narrowed = self.over_budget = 0  # windows less than exact; windows past the budget
        self.first_loss: float | None = None
        self.collapsed: int | None = None  # the window whose loss reached ln(vocabulary)

    def window(self, number: int, where: str, loss: float, used: int, peak: int) -> None:
        """Window `number` (at `where`) ended at `loss`, with horizon `used`, peaking at `peak`."""
        if used != self.cfg.horizon:
            self.horizon_used = used if self.horizon_used == 0 else min(self.horizon_used, used)
            self.narrowed += 1
            if self.narrowed == 1:
                self.echo(
                    f"warning: window {number} ({where}): the memory budget narrowed the horizon "
                    f"to {used} positions for its late chunks, so its gradient is not exact "
                    "(each such window says so; counted in each epoch's line and report.json: "
                    "windows_narrowed; --strict-exact refuses instead)"
                )
        self.collapse(number, where, loss)
        budget_bytes = (self.cfg.memory_budget_mib or 0) * MIB
        if budget_bytes and peak > budget_bytes * (1 + BUDGET_MARGIN):
            self.over_budget += 1
            if self.over_budget == 1:
                self.echo(
                    f"warning: window {number} peaked at {peak / MIB:,.0f} MiB, past the "
                    f"memory budget of {budget_bytes / MIB:,.0f} MiB by more than "
                    f"{BUDGET_MARGIN:.0%} (counted in report.json: "
                    "windows_over_budget)"
                )

    def collapse(self, number: int, where: str, loss: float) -> None:
        """A loss that climbs to ln(vocabulary), what a uniform guess scores, from well below it:
        the adapter has wrecked the model (too high a learning rate, as a rule). Said once."""
        uniform = math.log(self.vocab)
        if self.first_loss is None:
            self.first_loss = loss
        elif self.collapsed is None and self.first_loss < 0.9 * uniform <= loss / 0.99:
            self.collapsed = number
            self.echo(
                f"warning: window {number} ({where}): loss {loss:.3f} is that of a uniform "
                f"guess over the {self.vocab}-token vocabulary (ln {self.vocab} = "
                f"{uniform:.3f}), from {self.first_loss:.3f} at the first window: training "
                f"has diverged; lower --lr (now {self.cfg.lr:g})"
            )
