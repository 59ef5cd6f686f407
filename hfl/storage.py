"""Where results live: a local folder, or a URI that `pyarrow.fs` understands (`s3://`, `gs://`,
`file://`, `hdfs://`), so that a run started by `ray job submit` leaves its results where every node
and the user can read them after the job is gone.

A run on a URI writes into a local staging folder that starts as a copy of what the URI holds (so a
run resumes from there) and is copied back after every round and when the run stops, by error or
interruption too: a crash loses at most the round in flight, as it does on a local folder. Each
staging folder is held by a lock on a file beside it; one whose lock nobody holds was left by a
process that died (SIGKILL, a lost node), and the next run or resume on that machine removes it.
"""

from __future__ import annotations

import logging
import fcntl
import os
import re
import shutil
import tempfile
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, BinaryIO

from hfl.errors import ConfigError

log = logging.getLogger(__name__)
URI = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")
STAGING_PREFIX = "hfl-staging-"
RAY_JOB_VARIABLE = "RAY_JOB_CONFIG_JSON_ENV_VAR"
"""Set by Ray in the environment of a job's entrypoint (`ray job submit -- ...`)."""


def atomic_write(path: Path, write: Callable[[BinaryIO], object]) -> None:
    """Write `path` through `write(file)` into a temporary file beside it, flushed to disk, then
    renamed over `path` (its folder made first): a crash, even SIGKILL, leaves the old file or the
    new one, never half of one. The temporary name is unique per writer (not mkstemp, whose 0600 mode
    would survive the rename), so that concurrent writers, e.g. several Ray workers caching the same
    dataset, never write into the same file; a failed write leaves no temporary file behind."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex}.tmp")
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def is_uri(location: str | Path) -> bool:
    return isinstance(location, str) and bool(URI.match(location))


def check_job_location(location: str | Path | None, field: str) -> None:
    """Under a Ray job, the working directory is a temporary copy on the head node that Ray deletes
    with the job: a results folder must be an absolute path on shared storage or a URI."""
    if RAY_JOB_VARIABLE not in os.environ or (location is not None and (is_uri(location) or Path(location).is_absolute())):
        return
    raise ConfigError(field, None if location is None else str(location),
                      "under `ray job submit`, an absolute path on storage every node and you can read (e.g. /mnt/shared/runs/x) "
                      "or a URI (s3://bucket/runs/x, gs://..., file:///...): a relative folder lands in the job's temporary "
                      "working directory, which Ray deletes with the job")


def filesystem(uri: str, field: str) -> tuple[Any, str]:
    """(pyarrow filesystem, path in it) of `uri`; a ConfigError naming `field` where pyarrow cannot open it.
    A query string is the filesystem's options (`s3://bucket/x?region=eu-west-1&endpoint_override=...`)
    and stays part of the URI; a file:// URI has none to take, so one with a query is refused rather
    than its query dropped."""
    from pyarrow import fs  # a dependency of ray[tune]; imported only for URIs

    if uri.lower().startswith("file://") and "?" in uri:
        raise ConfigError(field, uri, "a file:// URI without a query string (a local filesystem takes no options; "
                          "a '?' in a folder name is not supported)")
    try:
        return fs.FileSystem.from_uri(uri)
    except Exception as error:  # noqa: BLE001 - pyarrow raises ArrowInvalid, OSError or its own types by scheme
        raise ConfigError(field, uri, f"a local folder or a URI pyarrow.fs can open ({str(error).splitlines()[0]})") from None


# -- single files at a local path or a URI (a sweep's own files) ------------------------------
def join(location: str, *parts: str) -> str:
    """`location`/`parts`; a URI keeps its `//` and its query string (the filesystem's options), after the path."""
    if not is_uri(location):
        return str(Path(location, *parts))
    path, mark, query = location.partition("?")
    return "/".join([path.rstrip("/"), *parts]) + mark + query


def read_text(location: str) -> str | None:
    """The text of the file at a local path or URI; None where there is no such file."""
    from pyarrow import fs

    files, path = filesystem(location, "--out")
    if files.get_file_info(path).type != fs.FileType.File:
        return None
    with files.open_input_stream(path) as f:
        return f.read().decode()


def write_text(location: str, text: str) -> None:
    files, path = filesystem(location, "--out")
    files.create_dir(path.rsplit("/", 1)[0], recursive=True)
    with files.open_output_stream(path) as f:
        f.write(text.encode())


def is_dir(location: str) -> bool:
    from pyarrow import fs

    files, path = filesystem(location, "--out")
    return files.get_file_info(path).type == fs.FileType.Directory


class Mirror:
    """A local folder copied to a URI file by file, each file only when it changed since the last copy."""

    def __init__(self, local: Path, uri: str, field: str) -> None:
        self.local, self.uri = local, uri
        self.fs, self.root = filesystem(uri, field)
        self.sent: dict[str, tuple[int, int]] = {}

    def pull(self) -> None:
        from pyarrow import fs

        if self.fs.get_file_info(self.root).type != fs.FileType.Directory:
            return
        for info in self.fs.get_file_info(fs.FileSelector(self.root, recursive=True)):
            if info.type != fs.FileType.File:
                continue
            relative = info.path[len(self.root.rstrip("/")) + 1 :]
            target = self.local / relative
            target.parent.mkdir(parents=True, exist_ok=True)
            with self.fs.open_input_stream(info.path) as source, open(target, "wb") as sink:
                shutil.copyfileobj(source, sink)
            self.sent[relative] = self._stamp(target)

    def push(self) -> None:
        for path in sorted(p for p in self.local.rglob("*") if p.is_file() and not p.name.endswith(".tmp")):
            relative, stamp = path.relative_to(self.local).as_posix(), self._stamp(path)
            if self.sent.get(relative) == stamp:
                continue
            destination = f"{self.root.rstrip('/')}/{relative}"
            self.fs.create_dir(destination.rsplit("/", 1)[0], recursive=True)
            with open(path, "rb") as source, self.fs.open_output_stream(destination) as sink:
                shutil.copyfileobj(source, sink)
            self.sent[relative] = stamp

    @staticmethod
    def _stamp(path: Path) -> tuple[int, int]:
        stat = path.stat()
        return stat.st_size, stat.st_mtime_ns


def remove_dead_staging(root: Path | None = None) -> None:
    """Remove the staging folders in `root` (the temporary directory) whose process died: their lock
    file (`<folder>.lock`) is held by no one. A live run's is held until its folder is gone."""
    root = Path(root or tempfile.gettempdir())
    for lock in root.glob(f"{STAGING_PREFIX}*.lock"):
        try:
            with open(lock, "a") as f:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                folder = lock.with_suffix("")
                if folder.is_dir():
                    log.info("removing %s, the staging folder of a run that stopped without removing it", folder)
                    shutil.rmtree(folder, ignore_errors=True)
                lock.unlink(missing_ok=True)
        except OSError:  # held: a live run's (or not ours to open)
            continue


@contextmanager
def staged(location: str | Path, field: str = "--out") -> Iterator[tuple[Path, Callable[[], None]]]:
    """(a local folder for `location`, a function that copies it there). For a local folder, that
    folder and a no-op; for a URI, a staging folder pulled from it, copied back once more on exit.
    A URI that cannot be opened or read is a ConfigError naming `field`, and leaves no folder behind."""
    if not is_uri(location):
        yield Path(location), lambda: None
        return
    remove_dead_staging()
    mirror = Mirror(Path(), str(location), field)  # opened before any folder is made for it
    # The lock first, then the folder named after it: a lock held from before the folder exists
    # keeps another process's clean-up from taking a folder being made for a live run.
    handle, lock_name = tempfile.mkstemp(prefix=STAGING_PREFIX, suffix=".lock")
    lock = os.fdopen(handle, "w")
    fcntl.flock(lock, fcntl.LOCK_EX)
    mirror.local = staging = Path(lock_name).with_suffix("")
    staging.mkdir()
    unsent = False
    try:
        try:
            mirror.pull()
        except Exception as error:  # noqa: BLE001 - pyarrow raises OSError or its own types by scheme
            raise ConfigError(field, str(location), f"a URI whose storage can be read ({str(error).splitlines()[0]})") from None
        log.info("%s is staged in %s and copied there after every round", location, staging)
        try:
            yield staging, mirror.push
        finally:  # by error or Ctrl-C too
            try:
                mirror.push()
            except Exception:
                unsent = True
                log.error("could not copy the run to %s: its files stay in %s", location, staging)
                raise
    finally:
        if not unsent:  # kept where the copy failed: without its lock file, no clean-up takes it
            shutil.rmtree(staging, ignore_errors=True)
        Path(lock_name).unlink(missing_ok=True)
        lock.close()
