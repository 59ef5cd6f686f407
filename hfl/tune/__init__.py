"""`hfl tune`: Ray Tune sweeps over config paths whose trials are ordinary hfl runs."""

from hfl.tune.runner import TuneOutcome, format_results, run_tune
from hfl.tune.space import Domain, Sweep, load_sweep

__all__ = ["Domain", "Sweep", "TuneOutcome", "format_results", "load_sweep", "run_tune"]
