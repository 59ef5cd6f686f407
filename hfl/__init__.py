"""hfl: federated learning with heterogeneous, resource-constrained clients."""

# Explicit imports fill the registries (no package scanning).
from hfl import backends, data, methods, models  # noqa: F401

__version__ = "0.1.0"
