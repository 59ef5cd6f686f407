"""Where data is read from and decoded data is cached: the one module that image datasets
(`hfl.data.datasets`) and token datasets (`hfl.data.tokens`) share.

It imports torch only where tensors are read or written, so that the config, which names these
folders in its defaults, stays free of torch.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hfl.storage import atomic_write

logger = logging.getLogger(__name__)

CACHE_FORMAT = 1
"""Version of a cached blob's layout: a blob of another version is built again."""


def default_data_root() -> str:
    """Where datasets are looked for when the config gives no root: $HFL_DATA or ~/.cache/hfl."""
    return os.environ.get("HFL_DATA") or os.path.expanduser("~/.cache/hfl")


def default_cache_dir() -> str:
    """Where decoded datasets are cached when the config gives no cache dir: $HFL_CACHE or ~/.cache/hfl."""
    return os.environ.get("HFL_CACHE") or os.path.expanduser("~/.cache/hfl")


def decoded_path(cache_dir: str, name: str) -> Path:
    """The cache file of decoded dataset `name` (a dataset with variants names each, e.g. shakespeare_seq80)."""
    return Path(cache_dir) / "decoded" / f"{name}.pt"


def cached_blob(path: Path, name: str, build: Callable[[], dict[str, Any]], is_current: Callable[[dict[str, Any]], bool] = lambda blob: True) -> dict[str, Any]:
    """Dataset `name`'s tensors as cached at `path` when readable, of this format and `is_current`;
    otherwise `build()`'s, cached first (a read-only or full cache costs speed next time, not this run)."""
    import torch

    if path.is_file():
        try:
            blob = torch.load(path, weights_only=True)
        except Exception as err:  # noqa: BLE001 - a corrupt cache must not block loading: build again instead
            logger.warning("ignoring unreadable cache %s (%s); building %s again", path, err, name)
        else:
            if isinstance(blob, dict) and blob.get("format") == CACHE_FORMAT and blob.get("name") == name and is_current(blob):
                logger.debug("loaded %s from cache %s", name, path)
                return blob
            logger.info("cache %s has an old format or other sources; building %s again", path, name)
    start = time.perf_counter()
    blob = {"format": CACHE_FORMAT, "name": name, **build()}
    try:
        atomic_write(path, lambda f: torch.save(blob, f))
    except OSError as err:
        logger.warning("built %s but could not cache it at %s: %s", name, path, err)
    else:
        logger.info("built %s in %.1f s; cached at %s", name, time.perf_counter() - start, path)
    return blob
