"""Backends run client tasks: LocalBackend in-process, RayBackend on actors. Ray lives in
hfl/backends/ray.py only; the backend is declared only where Ray is installed, and imported on use."""

import importlib.util

from hfl.registry import BACKENDS

BACKENDS.declare("local", "hfl.backends.local")
if importlib.util.find_spec("ray") is not None:
    BACKENDS.declare("ray", "hfl.backends.ray")
