"""Which row of the sinks side buffer holds each request's sinks (packed.py; docs/serving.md, the packed cache).

TALE keeps the first `alpha` tokens of a sequence at 16 bits (its sinks). Under vLLM the packed backend keeps them, per
layer, in a side buffer of `rows` rows of alpha tokens, besides their packed slots in the pages. vLLM's attention
metadata names no request (the CPU's model runner condenses its batch rows as requests finish), so a row is keyed by
the request's **first page** (block_table[b, 0]), which vLLM keeps for the request's whole life and which holds its
positions [0, page_size): a request's block table only grows until the request is freed (finished, aborted or
preempted); after preemption it is prefilled again from position 0, into pages it gets then.

What keeps a row right: whenever a step writes a position below alpha into a first page, it writes the row keyed by
that page too, and a row is taken for a page only by a step that writes its position 0. A prefix-cache hit reuses a
first page whose tokens, hence sinks, are those of the request that wrote it (same tokens at the same positions), and
the row keyed by it; a page reused by another request is written from its position 0 again (a first page) or never
read as a first page (its cache hash is dropped when it is reallocated). Rows go least recently used first when a new
first page needs one. A request whose row is gone (taken while it was not scheduled for longer than the other rows'
requests, or alpha tokens that a prefix hit skipped) reads its sinks from their packed slots: -1, never another
request's row.
"""

from __future__ import annotations

import numpy as np


class SinkRows:
    """Rows of the sinks buffer, keyed by first page. `assign` maps each request of a step to its row."""

    def __init__(self, rows: int, alpha: int):
        self.rows, self.alpha = rows, alpha
        self.row_of: dict[int, int] = {}  # first page -> row
        self.page_of = np.full(rows, -1, dtype=np.int64)  # row -> first page (-1: free)
        self.used = np.zeros(rows, dtype=np.int64)  # the step that last used each row
        self.step = 0

    def assign(self, first_pages: np.ndarray, ctx: np.ndarray) -> np.ndarray:
        """Row of each request [B] (-1: none; its sinks are read from the pages), given its first page and its
        cached tokens before this step. Calling it again with the same batch gives the same rows."""
        self.step += 1
        out = np.full(len(first_pages), -1, dtype=np.int64)
        current = set(int(p) for p in first_pages)
        for b, (page, c) in enumerate(zip(first_pages.tolist(), ctx.tolist())):
            row = self.row_of.get(page)
            if row is None and c == 0:  # a new request (or one prefilled again): its sinks are written now
                row = self._take(current)
                if row is not None:
                    self.page_of[row], self.row_of[page] = page, row
            if row is not None:
                self.used[row] = self.step
                out[b] = row
        return out

    def _take(self, current: set[int]) -> int | None:
        """A free row, else the least recently used one whose page is not in this step's batch."""
        free = np.flatnonzero(self.page_of < 0)
        if len(free):
            row = int(free[0])
        else:
            busy = np.array([p in current for p in self.page_of.tolist()])
            if busy.all():
                return None
            row = int(np.argmin(np.where(busy, np.iinfo(np.int64).max, self.used)))
            del self.row_of[int(self.page_of[row])]
        return row
