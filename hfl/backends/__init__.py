"""Backends run client tasks: LocalBackend in-process (Ray lives in hfl/backends/ray.py only)."""

from hfl.backends import local  # noqa: F401  (registers the backend)
from hfl.backends.base import Backend, ClientEnvironment
from hfl.backends.local import LocalBackend

__all__ = ["Backend", "ClientEnvironment", "LocalBackend"]
