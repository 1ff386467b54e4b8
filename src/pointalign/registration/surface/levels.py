"""The coarse-to-fine tree levels of the surface methods (:class:`LevelSchedule`)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch

from pointalign import _validate
from pointalign.kernels import surface as _ks
from pointalign.search.kdtree import KDTreeIndex


def _resolve_depth(tree: KDTreeIndex, depth: int | None) -> int:
    """Check ``depth`` and clamp it to the tree (None: the deepest level of >= 8-point cells)."""
    if depth is None:
        min_cell_points = 8
        m = tree.points.shape[0]
        return max((lv for lv in range(tree.depth + 1) if (m >> lv) >= min_cell_points),
                   default=0)
    return min(_validate.integer(depth, "tree_depth", minimum=0), tree.depth)


def _level_radii(tree: KDTreeIndex, levels: list[int]) -> list[float]:
    """Median RMS radius of the cells of each level in ``levels`` (cached per node)."""
    key = "surface:radius"
    if not tree.has_payload(key):
        tree.attach(key, _ks.node_radii(tree.arrays).float())
    r = tree.payload(key)
    return torch.stack([r[tree.level_nodes(lv)].median() for lv in levels]).tolist()


@dataclass
class LevelSchedule:
    """The coarse-to-fine tree levels of :func:`surface_newton` and :func:`approximate_icp`.

    Cells of deep levels are small; a source point moved off the surface by more than a cell
    falls in a cell whose approximant describes another piece of surface (the lookup does
    not backtrack). So the iteration starts on a coarse level and, after each step on a
    coarse level (:meth:`after_step`), moves to the deepest level whose median cell radius
    is at least ``margin`` times the motion still expected, or one level deeper when the
    objective stopped changing. The stop rules apply on the finest level only.

    Attributes:
        levels: the tree levels, coarse to fine (``[depth]`` for a fixed ``tree_depth``).
        radii: the median cell radius of each level.
        margin: cell radius over expected motion required to go deeper.
        index: the current position in ``levels``.
        prev_disp: the last step's RMS displacement on this level (NaN: none yet).

    """

    levels: list[int]
    radii: list[float]
    margin: float
    index: int = 0
    prev_disp: float = math.nan

    #: a coarse level is left when the objective changes by less than this, relatively
    LEVEL_RELATIVE_CHANGE: ClassVar[float] = 1e-3

    @classmethod
    def for_tree(cls, tree: KDTreeIndex, tree_depth: int | None, *,
                 cell_means: bool) -> LevelSchedule:
        """Build the schedule on ``tree`` down to ``tree_depth`` (None: the default depth).

        With ``tree_depth`` given that one level is used throughout. Otherwise the start is
        6 levels above the finest (never above level 3, 8 cells); for the cell-mean
        methods (``cell_means``: approximate ICP and the point approximant) 7 levels above
        and no deeper than the deepest level whose median cell radius is at least 0.3 of
        the whole target's: a lookup's capture range is a length, not a point count (on
        150k-1M-point bunnies a start 7 levels up put the first cells at 2.7-3.8 mm against
        a 10°/10 mm motion, ~15 mm RMS; cell-mean ICP there has spurious fixed points and
        crept 0.2 mm per step, still ~9° off after 50 steps; issue 5). Their margin is 8
        (linear convergence: a step underestimates the motion still to come), else 2.
        """
        depth = _resolve_depth(tree, tree_depth)
        margin = 8.0 if cell_means else 2.0
        if tree_depth is not None:
            return cls([depth], _level_radii(tree, [depth]), margin)
        start = depth - (7 if cell_means else 6)
        if cell_means:
            radii = _level_radii(tree, list(range(depth + 1)))
            start = min(start, max((lv for lv in range(depth + 1) if radii[lv] >= 0.3 * radii[0]),
                                   default=0))
        levels = list(range(min(depth, max(3, start)), depth + 1))
        return cls(levels, _level_radii(tree, levels), margin)

    @property
    def level(self) -> int:
        """The current tree level."""
        return self.levels[self.index]

    @property
    def finest(self) -> bool:
        """Whether the current level is the last one."""
        return self.index == len(self.levels) - 1

    def descend(self) -> None:
        """Go one level finer (the current level gives no more descent)."""
        self.index = min(self.index + 1, len(self.levels) - 1)
        self.prev_disp = math.nan

    def after_step(self, disp: float, rel_change: float) -> bool:
        """Pick the level after a step on a coarse level; True when it changed.

        ``disp``: the step's RMS displacement of the source; ``rel_change``: the relative
        change of the objective. The motion still expected is ``disp``, stretched by the
        observed linear rate ρ (remaining ≈ disp ρ / (1 − ρ)) when convergence is slow.
        """
        rho = min(disp / self.prev_disp if self.prev_disp > 0 else 0.0, 0.9)
        remaining = disp * max(1.0, rho / (1.0 - rho))
        new = self.index
        while new + 1 < len(self.levels) and self.radii[new + 1] >= self.margin * remaining:
            new += 1
        if new == self.index and rel_change < self.LEVEL_RELATIVE_CHANGE:
            new += 1
        if new == self.index:
            self.prev_disp = disp
            return False
        self.index, self.prev_disp = new, math.nan
        return True
