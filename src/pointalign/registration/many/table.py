"""register_many's table: :class:`ManyResult` (rows, CSV, Parquet, pandas) and its columns."""

from __future__ import annotations

import csv
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

#: the columns of :meth:`ManyResult.to_rows` (``T00`` … ``T33``: the transformation, row-major)
COLUMNS = ("index", "name", *(f"T{r}{c}" for r in range(4) for c in range(4)), "fitness",
           "rmse", "verdict", "trusted", "converged", "stop_reason", "iterations",
           "voxel_size", "overlap", "margin", "concentration", "stability", "error",
           "read_s", "global_s", "local_s", "total_s")


@dataclass(frozen=True)
class ManyResult:
    """The table of :func:`register_many`: one row per pair, in the order given.

    Attributes:
        rows: one dict per pair with the keys of :data:`COLUMNS` except the sixteen
            ``Tij`` (a row holds ``transformation``: ``(4, 4)`` float64 NumPy, mapping the
            source into the target frame) plus ``info``: ``H``, the final ICP's 6×6
            information matrix (twist about ``H_center``, the target's centroid, metres),
            ``correspondences``, ``icp_converged``, ``icp_stop_reason`` and
            ``coarse_iterations``. ``stop_reason`` and ``iterations`` mean what they mean
            in :func:`~pointalign.registration.pipeline.register`'s result: the verdict's
            reason, the final stage's iterations.
        timings: seconds for the whole call (``total``) and summed per stage.

    """

    rows: list[dict[str, Any]]
    timings: dict[str, float] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict[str, Any]:
        """Return row i (a dict)."""
        return self.rows[i]

    @property
    def transformations(self) -> np.ndarray:
        """``(K, 4, 4)`` float64: every pair's ``T_target_source``."""
        return np.stack([r["transformation"] for r in self.rows]) if self.rows \
            else np.zeros((0, 4, 4))

    def to_rows(self) -> list[dict[str, Any]]:
        """Flat rows (the keys of :data:`COLUMNS`; plain Python numbers and strings)."""
        out = []
        for r in self.rows:
            flat = {k: r.get(k) for k in COLUMNS if not (k.startswith("T") and len(k) == 3)}
            T = np.asarray(r["transformation"], dtype=np.float64).reshape(16)
            flat.update({f"T{i // 4}{i % 4}": float(T[i]) for i in range(16)})
            out.append({k: _plain(flat[k]) for k in COLUMNS})
        return out

    def to_csv(self, path: str | os.PathLike) -> Path:
        """Write :meth:`to_rows` as CSV (a header of :data:`COLUMNS`); returns the path."""
        p = Path(path)
        with p.open("w", newline="", encoding="utf-8") as f:
            w = csv.DictWriter(f, fieldnames=list(COLUMNS))
            w.writeheader()
            w.writerows(self.to_rows())
        return p

    def to_pandas(self) -> Any:
        """:meth:`to_rows` as a ``pandas.DataFrame`` (needs pandas)."""
        try:
            import pandas as pd
        except ImportError:
            raise ImportError("to_pandas needs pandas: pip install pandas") from None
        return pd.DataFrame(self.to_rows(), columns=list(COLUMNS))

    def to_parquet(self, path: str | os.PathLike) -> Path:
        """Write :meth:`to_rows` as Parquet (needs pyarrow); returns the path."""
        try:
            import pyarrow as pa
            import pyarrow.parquet as pq
        except ImportError:
            raise ImportError("to_parquet needs pyarrow: pip install pyarrow") from None
        rows = self.to_rows()
        table = pa.table({k: [r[k] for r in rows] for k in COLUMNS})
        pq.write_table(table, str(path))
        return Path(path)


def _plain(v: Any) -> Any:
    if isinstance(v, (np.bool_,)):
        return bool(v)
    if isinstance(v, np.integer):
        return int(v)
    if isinstance(v, (np.floating,)):
        return float(v)
    return v


def _empty_row(i: int, name: str) -> dict[str, Any]:
    return {"index": i, "name": name, "transformation": np.full((4, 4), np.nan),
            "fitness": 0.0, "rmse": math.inf, "verdict": "", "trusted": False,
            "converged": False, "stop_reason": "", "iterations": 0, "voxel_size": math.nan,
            "overlap": math.nan, "margin": math.nan, "concentration": math.nan,
            "stability": math.nan, "error": "", "read_s": 0.0, "global_s": 0.0,
            "local_s": 0.0, "total_s": 0.0, "info": {}}
