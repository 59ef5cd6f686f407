"""`hfl tune`: Ray Tune sweeps over config paths whose trials are ordinary hfl runs.

`hfl.tune(...)`, this package called as a function, runs a sweep from Python (`hfl.tune.grid.tune`)."""

import sys
import types
from typing import Any

from hfl.tune.runner import TuneOutcome, format_results, run_tune
from hfl.tune.space import Domain, Sweep, load_sweep

__all__ = ["Domain", "Sweep", "TuneOutcome", "format_results", "load_sweep", "run_tune", "show_progress"]


def show_progress() -> None:
    """Print a running sweep's progress lines on stderr (the CLI's choice; see hfl.tune.progress)."""
    from hfl.tune.progress import show_progress as show  # imports Ray: only when a sweep is about to run

    show()


class _Callable(types.ModuleType):
    """`hfl.tune` is this package: calling it runs a sweep (`hfl.tune.grid.tune`), as `hfl.run` runs an experiment."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        from hfl.tune.grid import tune

        return tune(*args, **kwargs)


sys.modules[__name__].__class__ = _Callable
