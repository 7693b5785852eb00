"""Engines that place the workers. Each is one module behind the `Backend` protocol, imported on demand."""

from __future__ import annotations

import importlib

from clusterfit.backends.base import Backend, EngineRef, EngineStatus, Rendered, RunHandle

_REGISTRY = {
    "local": "clusterfit.backends.local:LocalBackend",
    "ray": "clusterfit.backends.ray:RayBackend",
    "slurm": "clusterfit.backends.slurm:SlurmBackend",
    "kubernetes": "clusterfit.backends.kubernetes:KubernetesBackend",
}


def get_backend(name: str) -> Backend:
    target = _REGISTRY.get(name)
    if target is None:
        raise ValueError(f"unknown backend {name!r}; available: {', '.join(sorted(_REGISTRY))}")
    module_name, _, class_name = target.partition(":")
    return getattr(importlib.import_module(module_name), class_name)()


__all__ = ["Backend", "EngineRef", "EngineStatus", "Rendered", "RunHandle", "get_backend"]
