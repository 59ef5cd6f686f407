"""`hfl tune`: Ray Tune sweeps over config paths whose trials are ordinary hfl runs."""

from hfl.tune.runner import TuneOutcome, format_results, run_tune
from hfl.tune.space import Domain, Sweep, load_sweep

__all__ = ["Domain", "Sweep", "TuneOutcome", "format_results", "load_sweep", "run_tune", "show_progress"]


def show_progress() -> None:
    """Print a running sweep's progress lines on stderr (the CLI's choice; see hfl.tune.progress)."""
    from hfl.tune.progress import show_progress as show  # imports Ray: only when a sweep is about to run

    show()
