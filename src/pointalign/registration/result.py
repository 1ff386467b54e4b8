"""RegistrationResult: the only result type of every registration algorithm."""

from __future__ import annotations

import dataclasses
import enum
import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch


@dataclass(frozen=True)
class RegistrationResult:
    """Outcome of a registration.

    Attributes:
        transformation: ``(4, 4)`` float64 NumPy array ``T_target_source`` mapping source
            points into the target frame (``x_t = R x_s + t``); ``(B, 4, 4)`` for a batch.
        fitness: fraction of source points whose nearest target point, after moving the
            source by ``transformation``, lies within the method's correspondence distance
            (Open3D's ``fitness``); ``(B,)`` array for a batch. See *Meaning of fitness and
            rmse* below for the distance each method uses.
        rmse: root mean square of those inlier distances, in the units of the data
            (Open3D's ``inlier_rmse``; ``inf`` when there is no inlier); ``(B,)`` for a batch.
        iterations: iterations run (``(B,)`` for a batch), the ones ``history`` records:
            for ``register`` its final ICP's; for ``ransac`` the hypotheses drawn.
        converged: whether a convergence criterion (not the iteration cap) stopped it and
            the result is determined; for ``register``, its verdict (the result can be
            trusted).
        stop_reason: why, one vocabulary for every algorithm
            (:class:`~pointalign.registration._edge.StopReason` values: "small_update",
            "max_iterations", …; ``register``'s verdict: "trusted", "small_overlap", …).
        history: per-iteration records (dicts of floats), oldest first.
        timings: seconds per stage, e.g. ``{"index": …, "iterate": …, "total": …}``. On a
            GPU the stages are timed by CUDA events (the device's seconds between a
            stage's boundaries: its kernels and any wait for the host's launches), the
            iteration loop (``iterate``) and ``total`` by the host's clock.
        info: algorithm-specific extras (e.g. the final 6x6 information matrix ``H``,
            RANSAC stage counts). Values may be tensors.
        transformation_tensor: the same transformation as a float64 tensor on the
            compute device, for users who stay in PyTorch.

    Meaning of fitness and rmse:
        One meaning everywhere: nearest-neighbour inliers within a distance ``d``,
        ``fitness = inliers / source points`` and ``rmse = sqrt(mean(inlier distance²))``,
        exactly what :func:`pointalign.metrics.evaluate_registration` computes. Only ``d``,
        and for two methods the distance itself, depend on the method:

        * ``icp``, ``ransac``, ``register``: ``d`` is ``max_correspondence_distance``
          (for ``register``, that of its final ICP stage).
        * ``emicp``, ``softassign``: ``d = 3 σ_min`` (the end of the annealing schedule);
          hard nearest neighbours, not the soft weights.
        * ``surface_newton``, ``approximate_icp``: *approximate* distances to the k-d tree
          cells' surface approximants, truncated at ``max_correspondence_distance``;
          without a truncation every term counts and ``fitness`` is 1.0 whatever the pose.
          Their ``rmse`` is the RMS approximate point-to-surface distance. Compare methods
          with :meth:`evaluate` (or ``evaluate_registration``) at one common distance.

    Saving: :meth:`to_dict` / :meth:`to_json` / :meth:`save` write strict JSON (NumPy
    arrays and tensors tagged so that :meth:`load` restores them; non-finite floats as
    ``"inf"``/``"nan"`` strings); :meth:`load` / :meth:`from_dict` read it back.

    """

    transformation: np.ndarray
    fitness: Any = 0.0
    rmse: Any = float("inf")
    iterations: Any = 0
    converged: Any = False
    stop_reason: Any = ""
    history: list[dict[str, float]] = field(default_factory=list)
    timings: dict[str, float] = field(default_factory=dict)
    info: dict[str, Any] = field(default_factory=dict)
    transformation_tensor: torch.Tensor | None = None

    @property
    def inlier_rmse(self) -> Any:
        """:attr:`rmse` under Open3D's name (the RMS distance of the inlier correspondences)."""
        return self.rmse

    @property
    def batched(self) -> bool:
        """True when this result holds B transformations."""
        return self.transformation.ndim == 3

    def __len__(self) -> int:
        return self.transformation.shape[0] if self.batched else 1

    def __getitem__(self, b: int) -> RegistrationResult:
        """Return the b-th result of a batched run, as an unbatched result."""
        if not self.batched:
            raise TypeError("this RegistrationResult is not batched")

        n = len(self)

        def pick(v: Any) -> Any:
            if type(v) is np.ndarray and v.ndim == 1 and len(v) == n:
                return v.item(b)  # (the common case, as a Python scalar)
            if isinstance(v, (np.ndarray, torch.Tensor)) and v.ndim >= 1 and len(v) == n:
                x = v[b]
                return x.item() if x.ndim == 0 else x
            if isinstance(v, list) and len(v) == n:
                return v[b]
            return v

        return RegistrationResult(
            transformation=self.transformation[b],
            fitness=pick(self.fitness),
            rmse=pick(self.rmse),
            iterations=pick(self.iterations),
            converged=pick(self.converged),
            stop_reason=pick(self.stop_reason),
            history=[{k: (pick(v) if isinstance(v, (np.ndarray, list)) else v)
                      for k, v in h.items()} for h in self.history],
            timings=dict(self.timings),
            info={k: pick(v) for k, v in self.info.items()},
            transformation_tensor=None if self.transformation_tensor is None
            else self.transformation_tensor[b],
        )

    def summary(self) -> str:
        """One line for logs and the CLI."""
        if self.batched:
            return f"RegistrationResult(batch of {len(self)})"
        total = self.timings.get("total")
        tt = f", {total * 1e3:.1f} ms" if total is not None else ""
        return (
            f"fitness {float(self.fitness):.4f}, rmse {float(self.rmse):.6g}, "
            f"{int(self.iterations)} iterations, converged={bool(self.converged)}"
            f" ({self.stop_reason}){tt}"
        )

    # ------------------------------------------------------------------ saving and loading

    #: the ``format`` tag written by :meth:`to_dict`
    FORMAT = "pointalign.RegistrationResult"

    def to_dict(self) -> dict[str, Any]:
        """Return a JSON-safe dict of every field (``transformation_tensor`` excepted).

        ``transformation`` becomes a nested list of floats (``4×4`` or ``B×4×4``); scalars
        stay numbers, booleans and strings; NumPy arrays and tensors anywhere else become
        ``{"__ndarray__": nested list, "dtype": ..., "shape": [...]}`` (``"__tensor__": true``
        for tensors) so that :meth:`from_dict` restores them; non-finite floats inside
        arrays become the strings ``"inf"``, ``"-inf"``, ``"nan"``, and as scalars
        ``{"__float__": "inf"}`` (strict JSON, readable by any parser). Enums become
        their value.
        """
        out: dict[str, Any] = {"format": self.FORMAT}
        for f in dataclasses.fields(self):
            if f.name == "transformation_tensor":
                continue
            v = getattr(self, f.name)
            if f.name == "transformation":
                out[f.name] = _plain(np.asarray(v, dtype=np.float64))
            else:
                out[f.name] = _jsonable(v)
        return out

    def to_json(self, indent: int | None = 2) -> str:
        """Strict JSON text of :meth:`to_dict` (no ``NaN``/``Infinity`` tokens)."""
        return json.dumps(self.to_dict(), indent=indent, allow_nan=False)

    def save(self, path: str | os.PathLike) -> Path:
        """Write :meth:`to_json` to ``path`` (UTF-8); returns the path.

        Raises:
            ValueError: the folder of ``path`` does not exist.

        """
        p = Path(path)
        if not p.parent.is_dir():
            raise ValueError(f"path: folder {str(p.parent)!r} does not exist")
        p.write_text(self.to_json() + "\n", encoding="utf-8")
        return p

    @classmethod
    def from_dict(cls, doc: dict[str, Any]) -> RegistrationResult:
        """Rebuild a result from :meth:`to_dict`'s output (unknown keys are ignored).

        ``transformation_tensor`` is restored as a CPU float64 tensor of the transformation.

        Raises:
            ValueError: ``doc`` has no ``transformation`` or it is not ``(4, 4)``/``(B, 4, 4)``.

        """
        if not isinstance(doc, dict) or "transformation" not in doc:
            raise ValueError("doc: expected a dict with a 'transformation' entry "
                             "(the output of RegistrationResult.to_dict)")
        try:
            T = np.asarray(doc["transformation"], dtype=np.float64)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"doc['transformation']: not a numeric array ({exc})") from None
        if T.shape[-2:] != (4, 4) or T.ndim not in (2, 3):
            raise ValueError(f"doc['transformation']: expected (4, 4) or (B, 4, 4), "
                             f"got shape {T.shape}")
        kwargs: dict[str, Any] = {"transformation": T}
        names = {f.name for f in dataclasses.fields(cls)}
        for k, v in doc.items():
            if k in names and k not in ("transformation", "transformation_tensor"):
                kwargs[k] = _restore(v)
        kwargs["transformation_tensor"] = torch.from_numpy(T.copy())
        return cls(**kwargs)

    @classmethod
    def load(cls, path: str | os.PathLike) -> RegistrationResult:
        """Read a result written by :meth:`save` (or the CLI's ``--json``).

        Raises:
            ValueError: the file is missing, not JSON, or holds no result.

        """
        p = Path(path)
        try:
            doc = json.loads(p.read_text(encoding="utf-8"))
        except OSError as exc:
            raise ValueError(f"path: cannot read {str(p)!r}: {exc.strerror or exc}") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ValueError(f"path: {str(p)!r} is not JSON ({exc})") from None
        if isinstance(doc, dict) and isinstance(doc.get("result"), dict) \
                and "transformation" in doc["result"]:
            doc = doc["result"]  # the CLI's --json document wraps the result
        try:
            return cls.from_dict(doc)
        except ValueError as exc:
            raise ValueError(f"path: {str(p)!r}: {exc}") from None

    def evaluate(self, source: Any, target: Any, max_correspondence_distance: float) -> Any:
        """Fitness, inlier RMSE and the correspondence set of this result's transformation.

        The same measure for every method (see the class docstring); computed on demand by
        :func:`pointalign.metrics.evaluate_registration`.

        Args:
            source: ``(N, 3)`` cloud that was registered.
            target: ``(M, 3)`` cloud it was registered onto.
            max_correspondence_distance: inlier distance, in the units of the data.

        Returns:
            :class:`pointalign.metrics.RegistrationEvaluation`.

        """
        if self.batched:
            raise TypeError("evaluate: this result is batched; call result[b].evaluate(...)")
        from pointalign import metrics

        return metrics.evaluate_registration(source, target, self.transformation,
                                             max_correspondence_distance)


def _float_token(x: float) -> Any:
    if math.isfinite(x):
        return x
    return "nan" if math.isnan(x) else ("inf" if x > 0 else "-inf")


def _plain(a: np.ndarray) -> Any:
    """Nested lists of a NumPy array; non-finite floats as strings."""
    if a.dtype.kind == "f":
        if np.isfinite(a).all():
            return a.tolist()
        obj = a.astype(object)
        flat = obj.reshape(-1)
        for i, x in enumerate(flat):
            flat[i] = _float_token(float(x))
        return obj.tolist()
    if a.dtype.kind in "biu":
        return a.tolist()
    return [str(x) for x in a.reshape(-1)] if a.ndim == 1 else a.astype(str).tolist()


def _jsonable(v: Any) -> Any:
    if v is None or isinstance(v, (bool, str)):
        return v
    if isinstance(v, enum.Enum):
        return _jsonable(v.value)
    if isinstance(v, RegistrationResult):  # e.g. register()'s info["global"]
        return {"__result__": v.to_dict()}
    if isinstance(v, (np.bool_,)):
        return bool(v)
    if isinstance(v, (int, np.integer)):
        return int(v)
    if isinstance(v, (float, np.floating)):
        x = float(v)
        return x if math.isfinite(x) else {"__float__": _float_token(x)}
    if isinstance(v, torch.Tensor):
        a = v.detach().cpu()
        if a.dtype == torch.bfloat16:
            a = a.float()
        d = _jsonable(a.numpy())
        d["__tensor__"] = True
        return d
    if isinstance(v, np.ndarray):
        if v.dtype.kind not in "biuf":
            return [_jsonable(x) for x in v.tolist()]
        return {"__ndarray__": _plain(v), "dtype": str(v.dtype), "shape": list(v.shape)}
    if isinstance(v, dict):
        return {str(k): _jsonable(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_jsonable(x) for x in v]
    if isinstance(v, (os.PathLike,)):
        return os.fspath(v)
    return {"__repr__": repr(v)}


def _restore(v: Any) -> Any:
    if isinstance(v, list):
        return [_restore(x) for x in v]
    if not isinstance(v, dict):
        return v
    if "__result__" in v and len(v) == 1:
        return RegistrationResult.from_dict(v["__result__"])
    if "__float__" in v and len(v) == 1:
        return float(v["__float__"])
    if "__ndarray__" in v:
        dtype = np.dtype(v.get("dtype", "float64"))
        a = np.array(v["__ndarray__"], dtype=object if dtype.kind == "f" else dtype)
        a = a.astype(dtype).reshape(v.get("shape", a.shape))
        return torch.from_numpy(a) if v.get("__tensor__") else a
    if "__repr__" in v and len(v) == 1:
        return v["__repr__"]
    return {k: _restore(x) for k, x in v.items()}
