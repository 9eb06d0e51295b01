"""Decode lanes: the decoding rows' keys and values kept contiguous, appended to in place.

Without a paged-attention kernel, attention wants each row's past as one contiguous run;
gathering it out of the blocks every step costs O(past) copies per row per step. A
decoding row instead owns a *lane* of a workspace ``[layers, lanes, kv heads, columns, d]``
(per TP rank, its own heads). All decoding rows grow by one token a step, so with every
row's context right-aligned to a shared column ``c`` (its newest key at ``c``, the one
before at ``c − 1``, …) a step only writes column ``c`` of each lane and attends to the
view ``[c + 1 − W, c + 1)``, W the longest context: the same left-padded layout the
gather gave, with no copy. The next step uses column ``c + 1``.

A row's past is copied into its lane once, when it starts decoding (from the paged blocks,
where its prompt was written); a finished row's lane is taken by the last lane (one row
copied) so the lanes in use stay ``0 … b − 1`` and the view stays a view. When a new row
is longer than the free columns left of ``c``, or ``c`` reaches the last column, every lane
is reloaded from the blocks into a re-laid-out workspace (a *rebase*: the old per-step cost,
once in a while). The blocks still get every token, so a reload always finds it.

Memory: the workspace holds the running rows' contexts a second time, with headroom (about
3× the longest row per lane), on top of the block pool.

The scheduling rank decides every operation (:class:`LaneOps`, part of a step's plan);
every TP rank applies the same ones to its own workspace, so all stay in step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

MIN_GROWTH = 64  # columns right of c after a rebase, at least: steps before the next


@dataclass(frozen=True)
class LaneOps:
    """What to do to the lanes before one decode forward, and where it writes.

    ``columns``: a rebase's new workspace width (None: keep it and the lanes' contents);
    ``moves``: ``(source lane, target lane, length)`` copies of the last ``length`` columns
    before ``column``; ``fills``: ``(lane, block slots)`` loads of a row's cached past;
    ``column``: where this step's new keys go, every lane's context ending there."""

    column: int
    columns: int | None = None
    lanes: int = 0  # with ``columns``: the lanes a rebased workspace has
    moves: tuple[tuple[int, int, int], ...] = ()
    fills: tuple[tuple[int, torch.Tensor], ...] = ()


class DecodeLanes:
    """One rank's workspace (made on first use, sized by the rebase ops)."""

    def __init__(self, cache) -> None:
        self.cache = cache  # the PagedKVCache whose blocks fill the lanes
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None

    def apply(self, ops: LaneOps) -> None:
        """Carry out ``ops`` (before the step's forward)."""
        pool = self.cache.keys  # [layers, blocks + 1, block, heads, d]
        shape = (pool.shape[0], ops.lanes, pool.shape[3], ops.columns, pool.shape[4])
        if ops.columns is not None and (self.keys is None or self.keys.shape != shape):
            # Zeros: a padding column still enters q·kᵀ (masked), and must not be NaN.
            self.keys = torch.zeros(shape, dtype=pool.dtype, device=pool.device)
            self.values = torch.zeros_like(self.keys)
        c = ops.column
        for source, target, length in ops.moves:
            for store in (self.keys, self.values):
                store[:, target, :, c - length : c] = store[:, source, :, c - length : c]
        for lane, slots in ops.fills:
            n = len(slots)
            for store, pool in ((self.keys, self.cache.keys), (self.values, self.cache.values)):
                flat = pool.view(pool.shape[0], -1, *pool.shape[3:])  # [layers, slots, h, d]
                store[:, lane, :, c - n : c] = flat[:, slots.to(flat.device)].transpose(1, 2)

    def layer(self, layer: int, write: torch.Tensor, column: int, width: int) -> _LaneLayer:
        """Layer ``layer``'s cache for a step writing block slots ``write`` ``[b, 1]``."""
        return _LaneLayer(self, layer, write, column, width)


class _LaneLayer:
    """A layer's KV cache for one decode step (``length`` and ``append``, as
    ``layers.attention.KVCache``): the new keys go to column ``column`` of each lane (and
    to the blocks); the context is the ``width`` columns ending there, a view."""

    def __init__(self, lanes: DecodeLanes, layer: int, write, column: int, width: int) -> None:
        self.lanes, self.layer, self.write, self.column = lanes, layer, write, column
        self.width = width
        self.length = width - 1  # the left-padded past every row's keys are aligned to

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store the step's ``[b, heads, 1, d]``; return each row's whole context."""
        b, c = k.shape[0], self.column
        self.lanes.cache.write(self.layer, self.write, k, v)
        keys = self.lanes.keys[self.layer, :b]
        values = self.lanes.values[self.layer, :b]
        keys[:, :, c] = k[:, :, 0]
        values[:, :, c] = v[:, :, 0]
        return keys[:, :, c + 1 - self.width : c + 1], values[:, :, c + 1 - self.width : c + 1]


@dataclass
class LanePlanner:
    """The scheduling rank's side: which sequence is in which lane, and the column."""

    lanes: int  # the most rows a decode step has (the engine's max_running)
    rows: list = field(default_factory=list)  # sequences, by lane
    column: int = 0
    columns: int = 0  # the workspace width the ranks hold

    def plan(self, decoding: list, cache) -> LaneOps:
        """Put ``decoding`` (sequences with ``cached`` positions and a ``table``) in lanes;
        returns the ops. ``self.rows`` is then the batch's row order."""
        live = {id(s) for s in decoding}
        moves = []
        for lane in range(len(self.rows) - 1, -1, -1):  # highest first: the last moves in
            if id(self.rows[lane]) not in live:
                last = self.rows.pop()
                if lane < len(self.rows):
                    moves.append((len(self.rows), lane, last.cached))
                    self.rows[lane] = last
        have = {id(s) for s in self.rows}
        joining = [s for s in decoding if id(s) not in have]
        self.rows += joining
        longest = max(s.cached for s in self.rows)
        c = self.column
        if self.columns == 0 or c >= self.columns or any(s.cached > c for s in joining):
            c = 2 * longest  # room left of c for rows up to twice the longest to join
            self.columns = c + max(longest, MIN_GROWTH) + 1
            fills = [(i, cache.slots(s.table, 0, s.cached)) for i, s in enumerate(self.rows)]
            ops = LaneOps(c, self.columns, self.lanes, (), tuple(fills))
        else:
            start = len(self.rows) - len(joining)
            fills = [(start + i, cache.slots(s.table, 0, s.cached)) for i, s in enumerate(joining)]
            ops = LaneOps(c, None, 0, tuple(moves), tuple(fills))
        self.column = c + 1
        return ops
