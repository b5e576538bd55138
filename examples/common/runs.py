"""Run folders keyed by their configuration: safe resumption, ``result.json`` and a loss plot.

A run folder holds ``config.json`` (the configuration it was made with), Orbax checkpoints in
``checkpoints/`` while the run is unfinished (or always with ``keep_checkpoints``),
``result.json`` once it has a result, and ``loss.png``. Opening a folder with a different
configuration is refused (``ConfigMismatchError``) unless ``overwrite`` discards the old run;
opening it with the same configuration resumes it, or returns its stored result if finished.

Settings that do not change what is trained (``IGNORED``: progress display, logging and
checkpoint cadence, the ``max_steps`` stopping point used to train a run in slices, and the
``eval`` section of a task whose finished run can be evaluated again: offline RL's online
evaluation) are left out of the comparison and of the folder's hash.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import shutil
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from examples.common.paths import runs_root

# Dotted config keys that may differ between a run and its resumption; a key ending in "."
# stands for every key under it.
IGNORED = (
    "loop.progress",
    "loop.log_every",
    "loop.max_steps",
    "loop.checkpoint",
    "loop.checkpoint_every",
    "loop.eval_batch_size",
    "loop.data_parallel",
    "data.data_root",
    "eval.",  # how a trained model is evaluated: its task re-evaluates a kept run instead
)
RUN_FILES = (
    "config.json",
    "result.json",
    "loss.png",
)  # what ``overwrite`` removes, with checkpoints/


class ConfigMismatchError(ValueError):
    """A run folder was made with another configuration; the message lists the differences."""


# Field metadata of an option added after runs were made: while the option is at its
# default it is left out of the configuration (dict, hash, saved config.json), so the runs
# made before it keep their folders and resume.
OMIT_DEFAULT = {"omit_default": True}


def _asdict(obj: Any) -> Any:
    """``dataclasses.asdict`` without the ``OMIT_DEFAULT`` fields that hold their default."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {
            f.name: _asdict(getattr(obj, f.name))
            for f in dataclasses.fields(obj)
            if not (f.metadata.get("omit_default") and getattr(obj, f.name) == f.default)
        }
    if isinstance(obj, Mapping):
        return {k: _asdict(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_asdict(v) for v in obj]
    return obj


def config_dict(config: Any) -> dict:
    """A JSON-ready dict of a dataclass (nested ones included) or a mapping."""
    return json.loads(json.dumps(dict(_asdict(config)), default=list))


def _flatten(d: Mapping, prefix: str = "") -> dict[str, Any]:
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, Mapping):
            out.update(_flatten(v, key + "."))
        else:
            out[key] = v
    return out


def _ignored(key: str, ignore: Sequence[str]) -> bool:
    return any(key == k or (k.endswith(".") and key.startswith(k)) for k in ignore)


def config_hash(config: Any, ignore: Sequence[str] = IGNORED) -> str:
    """A short hex digest of the configuration, without the ``ignore`` keys."""
    flat = {k: v for k, v in _flatten(config_dict(config)).items() if not _ignored(k, ignore)}
    return hashlib.sha256(json.dumps(flat, sort_keys=True).encode()).hexdigest()[:10]


def config_diff(saved: Any, current: Any, ignore: Sequence[str] = IGNORED) -> list[str]:
    """Lines ``key: saved -> current`` for every key whose value differs."""
    a, b = _flatten(config_dict(saved)), _flatten(config_dict(current))
    missing = object()
    return [
        f"{k}: {a.get(k, missing)!r} (saved) -> {b.get(k, missing)!r} (now)".replace(
            repr(missing), "absent"
        )
        for k in sorted(set(a) | set(b))
        if not _ignored(k, ignore) and a.get(k, missing) != b.get(k, missing)
    ]


def default_run_dir(task: str, name: str, config: Any) -> Path:
    """``<runs root>/<task>/runs/<name>-<config hash>``: one folder per configuration.

    The runs root is ``$AAREN_RUNS_ROOT`` or ``<repo>/workdirs`` (ignored by git).
    """
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in name)
    return runs_root() / task / "runs" / f"{safe}-{config_hash(config)}"


def _is_writer() -> bool:
    """Whether this process writes run files: always, unless it is not process 0 of several."""
    import jax

    return jax.process_index() == 0


def _write_json(path: Path, obj: Any) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(obj, indent=1) + "\n")
    os.replace(tmp, path)


class RunDir:
    """One run's folder, checked against the configuration it was made with.

    Attributes:
      path: the folder.
      config: the run's configuration as a dict.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        config: Any,
        *,
        overwrite: bool = False,
        ignore: Sequence[str] = IGNORED,
    ):
        """Opens (creating) ``path`` for ``config``.

        Args:
          path: the run folder.
          config: the run's configuration (a dataclass or a mapping).
          overwrite: discard whatever run the folder holds and start fresh.
          ignore: dotted keys that may differ between a run and its resumption.

        Raises:
          ConfigMismatchError: the folder holds a run of another configuration (or of an
            unknown one: checkpoints or a result without ``config.json``) and not ``overwrite``.
        """
        self.path = Path(path)
        self.config = config_dict(config)
        saved_file = self.path / "config.json"
        if overwrite:
            self.clear()
        elif saved_file.exists():
            diff = config_diff(json.loads(saved_file.read_text()), self.config, ignore)
            if diff:
                raise ConfigMismatchError(
                    f"{self.path} holds a run made with another configuration:\n  "
                    + "\n  ".join(diff)
                    + "\nResuming it would mix the two runs. Pass --overwrite to discard it and "
                    "start fresh, or use another --workdir (without --workdir, every "
                    "configuration gets a folder of its own)."
                )
        elif (self.path / "checkpoints").exists() or (self.path / "result.json").exists():
            raise ConfigMismatchError(
                f"{self.path} holds a run without config.json (made by an older version), so "
                "whether it matches this configuration is unknown. Pass --overwrite to "
                "discard it and start fresh, or use another --workdir."
            )
        self.path.mkdir(parents=True, exist_ok=True)
        if not saved_file.exists() and _is_writer():
            _write_json(saved_file, self.config)

    def clear(self) -> None:
        """Removes the run's files (config, result, plot, checkpoints); keeps anything else."""
        if not _is_writer():
            return
        shutil.rmtree(self.path / "checkpoints", ignore_errors=True)
        for name in RUN_FILES:
            (self.path / name).unlink(missing_ok=True)

    @property
    def checkpoint_dir(self) -> Path:
        return self.path / "checkpoints"

    def finished_result(self) -> dict | None:
        """The stored ``result.json`` of a finished run (then nothing needs to run), or None."""
        path = self.path / "result.json"
        if not path.exists():
            return None
        summary = json.loads(path.read_text())
        return summary if summary.get("finished") else None

    def write_result(
        self,
        record: Mapping,
        history: list[dict],
        *,
        finished: bool,
        keep_checkpoints: bool = False,
        plot_keys: Sequence[str] = ("train_loss",),
        extra: Mapping | None = None,
    ) -> Path:
        """Writes ``result.json`` and ``loss.png``; drops checkpoints of a finished run.

        Args:
          record: the run's record (metrics, steps, ``wall_s``).
          history: one dict per epoch (``fit``'s history).
          finished: whether training is complete; an unfinished run (stopped by
            ``max_steps``) keeps its checkpoints so that it can resume.
          keep_checkpoints: keep the checkpoints of a finished run too.
          plot_keys: history keys to plot against the epoch.
          extra: more fields for ``result.json``.

        Returns:
          The path of ``result.json``.
        """
        out = self.path / "result.json"
        if not _is_writer():  # several processes: process 0 writes
            return out
        summary = {
            "record": dict(record),
            "finished": finished,
            "history": history,
            "config": self.config,
            **(extra or {}),
        }
        _write_json(out, summary)
        try:
            plot_history(history, self.path / "loss.png", plot_keys, title=self.path.name)
        except ImportError:
            logging.warning("matplotlib is not installed: no loss plot")
        if finished and not keep_checkpoints:
            shutil.rmtree(self.checkpoint_dir, ignore_errors=True)
        logging.info("wrote %s", out)
        return out


def plot_history(
    history: list[dict], path: str | os.PathLike, keys: Sequence[str], title: str = ""
) -> Path | None:
    """A PNG of ``keys`` of ``history`` (one dict per epoch) against the epoch; None if empty.

    Uses matplotlib's Agg backend (no display needed).
    """
    if not history:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    fig, ax = plt.subplots(figsize=(5, 3.2), dpi=100)
    epochs = [h.get("epoch", i + 1) for i, h in enumerate(history)]
    for key in keys:
        values = [h.get(key) for h in history]
        if any(v is not None for v in values):
            ax.plot(epochs, values, marker="o", markersize=3, label=key)
    ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
    ax.set_xlabel("epoch")
    ax.set_ylabel("loss")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return Path(path)
