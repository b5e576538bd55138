"""Training and evaluation of one event-forecasting run (one dataset, backbone, seed)."""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import time
from pathlib import Path

import jax
import numpy as np
from flax import nnx

from examples.common import TrainResult, fit
from examples.event_forecasting.configs import Config
from examples.event_forecasting.data import EventData, EventSet, load_dataset
from examples.event_forecasting.model import EventModel, eval_fn, loss_fn


def build_model(config: Config, data: EventData) -> EventModel:
    """The model for ``data``, initialised from the run's seed."""
    return EventModel(
        config.model,
        data.num_marks,
        data.train.log_mean,
        data.train.log_std,
        rngs=nnx.Rngs(params=config.loop.seed, dropout=config.loop.seed + 1),
    )


def load_data(config: Config) -> EventData:
    """The run's dataset, from ``config.data``."""
    dc = config.data
    return load_dataset(
        dc.dataset,
        dc.data_root,
        cache_dir=dc.cache_dir,
        split_seed=dc.split_seed,
        num_generated=dc.num_generated,
        max_train_events=dc.max_train_events,
    )


def metrics(sums: dict, has_marks: bool) -> dict:
    """Per-event metrics from ``fit``'s per-event means: NLLs, RMSE, accuracy in %."""
    return {
        "nll": sums["nll"],
        "nll_time": sums["nll_time"],
        "nll_mark": sums["nll_mark"] if has_marks else 0.0,
        "rmse": math.sqrt(sums["sq_err"]),
        "accuracy": 100.0 * sums["correct"] if has_marks else None,
    }


def true_nll(data: EventData, test: EventSet) -> float | None:
    """The generating process's NLL per predicted test event, where it is known."""
    if data.test_loglik is None:
        return None
    return float(-np.sum(data.test_loglik) / test.num_events)


def train_and_evaluate(config: Config, workdir: str | None, data: EventData | None = None) -> dict:
    """Trains with early stopping on validation NLL, then tests the best parameters.

    Returns ``run(config, workdir, data)``'s record.
    """
    return run(config, workdir, data)[0]


def run(
    config: Config, workdir: str | None, data: EventData | None = None
) -> tuple[dict, TrainResult]:
    """Trains with early stopping on validation NLL, then tests the best parameters.

    Args:
      config: the run's configuration.
      workdir: checkpoints and ``result.json`` go here (resumes if a checkpoint exists);
        None keeps nothing on disk.
      data: preloaded splits (must match ``config.data``), to share between runs.

    Returns:
      ``(record, result)``: the record ``{"dataset", "model", "seed", "nll", "nll_time",
      "nll_mark", "rmse", "accuracy", "true_nll", "events", "wall_s", ...}`` on the test split
      (per event), and ``fit``'s ``TrainResult`` (best model, last parameters, history).
    """
    t0 = time.perf_counter()
    if data is None:
        data = load_data(config)
    model = build_model(config, data)
    n_params = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    logging.info(
        "%s %s: %d params, %d/%d/%d sequences (train windows), %d marks",
        data.name,
        config.model.backbone,
        n_params,
        len(data.train),
        len(data.val),
        len(data.test),
        data.num_marks,
    )
    avg_tokens = max(1, data.train.num_events // max(len(data.train), 1))
    result = fit(
        model,
        loss_fn,
        eval_fn,
        data.train,
        data.val,
        monitor="nll",
        mode="min",
        loop=config.loop,
        optim=config.optim,
        workdir=workdir,
        tokens_per_example=avg_tokens,
        desc=f"{data.name}-{config.model.backbone}",
    )
    test = metrics(result.evaluate(data.test), data.has_marks)
    val = metrics(result.evaluate(data.val), data.has_marks)
    record = {
        "dataset": data.name,
        "model": config.model.backbone,
        "seed": config.loop.seed,
        **test,
        "true_nll": true_nll(data, data.test),
        "events": data.test.num_events,
        "val_nll": val["nll"],
        "val_rmse": val["rmse"],
        "val_accuracy": val["accuracy"],
        "steps": result.step,
        "epochs": len(result.history),
        "params": int(n_params),
        # the settings that differ between datasets, so that stale records can be told apart
        "copy_marks": config.model.copy_marks,
        "copy_prior": config.model.copy_prior,
        "log_scale_max": config.model.log_scale_max,
        "max_epochs": config.loop.max_epochs,
        "warmup_steps": config.optim.warmup_steps,
        "wall_s": time.perf_counter() - t0,
    }
    logging.info("result %s", record)
    if workdir is not None:
        out = Path(workdir)
        out.mkdir(parents=True, exist_ok=True)
        summary = {"record": record, "history": result.history}
        summary["config"] = dataclasses.asdict(config)
        (out / "result.json").write_text(json.dumps(summary, indent=1) + "\n")
    return record, result
