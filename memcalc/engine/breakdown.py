"""What is alive at a simulated step's peak, by category and by kind, copied lazily.

:class:`memcalc.engine.sim.Sim` keeps the running totals (``by_cat``, ``by_kind``) and marks a new
peak (``_peak_open``) as it allocates; the breakdown is copied only when memory next goes down
(:meth:`Sim.unref` calls :meth:`PeakBreakdown._snap_peak`) or when it is read: every allocation
before that is a new peak itself, so a copy per new peak would be wasted
(``tests/unit/test_sim_bookkeeping.py`` compares it with an eager copy).
"""

from __future__ import annotations


class PeakBreakdown:
    """The peak's breakdown, over the simulator's running totals (a base of :class:`Sim`);
    ``by_cat`` is keyed by (kind, category): a category can hold bytes of two kinds (the head's
    logits are saved for backward and also live as temporaries)."""

    by_cat: dict[tuple[str, str], int]
    by_kind: dict[str, int]
    peak_cats: dict[tuple[str, str], int]
    peak_kinds: dict[str, int]
    _peak_open: bool

    def _snap_peak(self) -> None:
        """Copy what is alive, by category and kind, as the peak's breakdown. Called before the
        first free after a new peak: until then only allocations happened, and each one that
        adds bytes is a new peak itself (a category that first appears with no bytes has no
        entry in :meth:`peak_categories`), so this is what was alive at the peak."""
        self.peak_cats = self.by_cat.copy()
        self.peak_kinds = self.by_kind.copy()
        self._peak_open = False

    def peak_categories(self) -> dict[str, int]:
        """What was alive at the peak, by category (those with bytes), in the order the categories
        first appeared."""
        if self._peak_open:
            self._snap_peak()
        out: dict[str, int] = {}
        for (_, cat), v in self.peak_cats.items():
            out[cat] = out.get(cat, 0) + v
        return {k: v for k, v in out.items() if v}

    def peak_by_kind(self) -> dict[str, dict[str, int]]:
        """What was alive at the peak, by kind and, within it, by category (those with bytes)."""
        if self._peak_open:
            self._snap_peak()
        out: dict[str, dict[str, int]] = {}
        for (kind, cat), v in self.peak_cats.items():
            if v:
                out.setdefault(kind, {})[cat] = v
        return out

    def peak_kinds_alive(self) -> dict[str, int]:
        """What was alive at the peak, by kind (every kind)."""
        if self._peak_open:
            self._snap_peak()
        return dict(self.peak_kinds)
