"""JSON result records: a list of dicts in one file, appended atomically, for resumable sweeps."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path

from examples.common.paths import runs_root


def load_records(path: str | os.PathLike) -> list[dict]:
    """Reads the records of a results file; an absent file has none."""
    path = Path(path)
    if not path.exists():
        return []
    with path.open() as f:
        records = json.load(f)
    if not isinstance(records, list):
        raise ValueError(f"{path} must hold a JSON list of records")
    return records


def record_key(record: Mapping, fields: Iterable[str]) -> tuple:
    """The identity of a record: its values for ``fields`` (e.g. dataset, horizon, model, seed)."""
    return tuple(record.get(f) for f in fields)


def append_record(path: str | os.PathLike, record: Mapping) -> None:
    """Appends one record, writing a temporary file first so that a crash cannot corrupt it.

    The read-append-write holds an exclusive lock (``path`` + ``.lock``), so that several
    sweeps writing one results file cannot drop each other's records.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.with_suffix(path.suffix + ".lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        records = load_records(path)
        records.append(dict(record))
        tmp = path.with_suffix(path.suffix + ".tmp")
        with tmp.open("w") as f:
            json.dump(records, f, indent=1)
            f.write("\n")
        os.replace(tmp, path)


@contextlib.contextmanager
def claim_run(path: str | os.PathLike) -> Iterator[bool]:
    """Claims one run for this process while the block runs: yields False if another process
    holds it (skip the run), True otherwise.

    Sweep processes side by side over one results file re-read it before each run, but a run
    is recorded only when it ends: without a claim, a second process reaching a run that the
    first is still training resumes the same checkpoints and records it twice. The claim is
    an exclusive non-blocking ``flock`` on ``path`` (e.g. ``<run folder>.lock``), which the
    system drops when its process ends, so a crashed sweep never leaves a stale claim.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            yield False
            return
        try:
            yield True
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def results_path(arg: str | os.PathLike | None, task: str) -> Path:
    """Where a sweep writes its records: ``--results`` if given, else a file outside git.

    The default is ``<runs root>/<task>/results.json`` (``$AAREN_RUNS_ROOT`` or
    ``<repo>/workdirs``), so that a sweep never mixes a user's runs into the committed
    ``results/`` tables; those change only when ``--results results/<task>.json`` is passed.
    """
    return Path(arg) if arg else runs_root() / task / "results.json"
