"""Backends run client tasks: LocalBackend in-process, RayBackend on actors (Ray lives in
hfl/backends/ray.py only, and is imported only when Ray is installed)."""

import importlib.util

from hfl.backends import local  # noqa: F401  (registers the backend)

if importlib.util.find_spec("ray") is not None:
    from hfl.backends import ray  # noqa: F401  (registers the backend)
from hfl.backends.base import Backend, ClientEnvironment
from hfl.backends.local import LocalBackend

__all__ = ["Backend", "ClientEnvironment", "LocalBackend"]
