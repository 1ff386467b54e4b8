"""Kernel layer: one entry point per operation family; each dispatches via ``_backend``."""

from pointalign.kernels._backend import backend

__all__ = ["backend"]
