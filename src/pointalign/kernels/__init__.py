"""Kernel layer: one entry point per operation family; each dispatches via ``_backend``."""

from pointalign.kernels._backend import SearchPlan, backend, search_plan, upload

__all__ = ["SearchPlan", "backend", "search_plan", "upload"]
