"""hfl: federated learning with heterogeneous, resource-constrained clients.

Importing the package imports nothing else, so that `hfl --help` and `hfl methods` answer at once;
each module imports what it uses (the config fills the registries it checks names against)."""

__version__ = "0.1.0"
