"""Training costs shared by the processes of one session through a folder: `HFL_COST_STORE`.

Measuring what training one model shape costs runs three training steps, two under a dispatch mode
(`hfl.accounting.cost`): 0.06-0.3 s of a CPU core. A process measures each shape once
(`hfl.accounting.accountant`), but every process measures again what the others did: each Ray actor
what its driver planned with, each run of a comparison started in parallel, each worker of a test
suite (a quarter of hfl's own suite's CPU time was measuring, a third of it repeated). With the
environment variable `HFL_COST_STORE` naming a folder, a process looks a measurement up there
before making it and files the ones it makes.

A measurement is filed under what the process caches it by (the models' and the method's settings,
the model shape, batch size, optimiser, precision, default dtype) with the torch version and a
digest of hfl's own source, so that another torch or an edited hfl measures afresh. Only keys made of
plain values (strings, numbers, None, dtypes, tuples and frozensets of them) are filed; any other
key is measured in the process, as without the store. A model or objective defined outside hfl (a
plug-in) is not in the digest: empty the folder after changing one.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
from collections.abc import Callable, Hashable
from pathlib import Path

import torch

from hfl.accounting.cost import TrainingCost

STORE_VARIABLE = "HFL_COST_STORE"


def plain_text(value: Hashable) -> str | None:
    """The same text for equal keys in every process (sets sorted), or None for a key that holds
    anything but plain values (whose repr need not say what it is)."""
    if value is None or isinstance(value, (bool, int, float, str, torch.dtype)):
        return repr(value)
    if isinstance(value, (tuple, frozenset)):
        parts = [plain_text(v) for v in value]
        if None in parts:
            return None
        return f"({','.join(parts)})" if isinstance(value, tuple) else f"{{{','.join(sorted(parts))}}}"  # type: ignore[arg-type]
    return None


@functools.cache
def code_digest() -> str:
    """The torch version and every source file of hfl: what a measurement was made with."""
    digest = hashlib.sha256(torch.__version__.encode())
    package = Path(__file__).resolve().parents[1]
    for path in sorted(package.rglob("*.py")):
        digest.update(str(path.relative_to(package)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


def stored_cost(key: Hashable, measure: Callable[[], TrainingCost]) -> TrainingCost:
    """The cost filed under `key` in `HFL_COST_STORE`; else `measure()`, filed there. Without the
    variable, or for a key that is not plain, `measure()`."""
    folder = os.environ.get(STORE_VARIABLE)
    text = plain_text(key) if folder else None
    if text is None:
        return measure()
    path = Path(folder) / f"{hashlib.sha256((code_digest() + text).encode()).hexdigest()}.json"  # type: ignore[arg-type]
    try:
        return TrainingCost(**json.loads(path.read_text()))
    except (OSError, ValueError, TypeError):  # not filed yet (or unreadable): measure it
        pass
    cost = measure()
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f"{path.name}.{os.getpid()}.part")
    partial.write_text(json.dumps(dataclasses.asdict(cost)))
    os.replace(partial, path)  # whole or absent for a process reading it at the same time
    return cost
