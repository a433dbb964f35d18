"""Where each cached token lives: the schedule's placement rules (DESIGN.md 4), as integer arithmetic.

Both caches follow these rules, so the dynamic cache (cache.py) and the static one (static_cache.py)
hold the same tokens in the same levels at every step. Counts are per layer and the same for every
batch row and every layer (rows are in lockstep; padding is masked, not skipped).

    sinks | level 0 (middle) | level 1 | ... | level L (recent) | residual

Level stores hold whole key groups; the residual holds the newest tokens until `residual` of them
fill key groups (then they are flushed into level L); a level >= 1 that holds a key group more
than its share of the N non-sink tokens moves its oldest groups one level down.
"""

from __future__ import annotations

from .artifact import Schedule, ceil_share


def targets(s: Schedule, N: int) -> list[int]:
    """Tokens each level >= 1 should hold for N non-sink tokens (level 0 takes the rest)."""
    return [0] + [ceil_share(lv.share, N) for lv in s.levels[1:]]


def fill_counts(s: Schedule, N: int) -> tuple[list[int], int]:
    """A run of N exact non-sink tokens placed straight into their final levels (prefill), as if
    decoded one by one: (tokens per level, oldest level first; tokens left in the residual)."""
    L = len(s.levels) - 1
    n_res = N if N < s.residual else N % s.unit(L)
    tg = targets(s, N)
    counts = [0] * (L + 1)
    left = N - n_res
    for i in range(L, 0, -1):
        gk = max(s.unit(i), s.unit(i - 1))  # whole key groups of both levels
        need = tg[i] - (n_res if i == L else 0)
        counts[i] = min(left, max(0, -(-need // gk) * gk))
        left -= counts[i]
    counts[0] = left
    for i in range(L):  # per-channel levels below per-token ones: carry what does not fill their groups upward
        extra = counts[i] % s.unit(i)
        counts[i] -= extra
        counts[i + 1] += extra
    return counts, n_res


def flush_count(s: Schedule, n_res: int) -> int:
    """Residual tokens quantized into level L now: its whole key groups once it holds `residual` tokens."""
    gk = s.unit(len(s.levels) - 1)
    return n_res // gk * gk if n_res >= s.residual else 0


def demotions(s: Schedule, counts: list[int], n_res: int, N: int) -> list[tuple[int, int]]:
    """(level i, tokens) moved from level i to i - 1, in the order they happen (top level first, so a
    group may move down twice). `counts` (tokens per level) is updated in place."""
    L = len(s.levels) - 1
    tg = targets(s, N)
    moves = []
    for i in range(L, 0, -1):
        gk = max(s.unit(i), s.unit(i - 1))  # whole key groups of both levels
        excess = counts[i] + (n_res if i == L else 0) - tg[i]
        n = min(excess // gk, counts[i] // gk) * gk
        if n > 0:
            counts[i] -= n
            counts[i - 1] += n
            moves.append((i, n))
    return moves
