"""Training and evaluation of one forecasting run (one dataset, horizon, backbone, seed)."""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from pathlib import Path

import jax
import jax.numpy as jnp
from flax import nnx

from examples.common import fit
from examples.forecasting.configs import Config
from examples.forecasting.data import ForecastData, load_dataset
from examples.forecasting.model import Forecaster


def loss_fn(model: Forecaster, batch) -> tuple[jax.Array, None]:
    """Mean squared error in the scaled space (the training objective)."""
    pred = model(batch["x"], batch["x_mark"])
    return jnp.mean(jnp.square(pred - batch["y"])), None


def eval_fn(model: Forecaster, batch) -> dict[str, jax.Array]:
    """Weighted sums of squared and absolute errors over a batch, and their count ``n``."""
    pred = model(batch["x"], batch["x_mark"])
    err = pred - batch["y"]
    w = batch["weight"][:, None, None]
    return {
        "mse": jnp.sum(w * jnp.square(err)),
        "mae": jnp.sum(w * jnp.abs(err)),
        "n": jnp.sum(batch["weight"]) * err.shape[1] * err.shape[2],
    }


def build_model(config: Config, data: ForecastData) -> Forecaster:
    """The forecaster for ``data``, initialised from the run's seed."""
    return Forecaster(
        config.model,
        data.num_channels,
        data.num_marks,
        config.data.seq_len,
        config.data.pred_len,
        rngs=nnx.Rngs(params=config.loop.seed, dropout=config.loop.seed + 1),
    )


def train_and_evaluate(
    config: Config, workdir: str | None, data: ForecastData | None = None
) -> dict:
    """Trains with early stopping on validation MSE, then tests the best parameters.

    Args:
      config: the run's configuration.
      workdir: checkpoints and ``result.json`` go here (resumes if a checkpoint exists);
        None keeps nothing on disk.
      data: preloaded splits (must match ``config.data``), to share between runs.

    Returns:
      A record: dataset, horizon, model, seed, test ``mse``/``mae`` (scaled space), best
      ``val_mse``, steps, epochs, parameter count and ``wall_s``.
    """
    t0 = time.perf_counter()
    dc = config.data
    if data is None:
        data = load_dataset(dc.dataset, dc.seq_len, dc.pred_len, dc.data_root)
    model = build_model(config, data)
    n_params = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    logging.info(
        "%s H=%d %s: %d params, %d/%d/%d windows",
        dc.dataset,
        dc.pred_len,
        config.model.backbone,
        n_params,
        len(data.train),
        len(data.val),
        len(data.test),
    )
    result = fit(
        model,
        loss_fn,
        eval_fn,
        data.train,
        data.val,
        monitor="mse",
        mode="min",
        loop=config.loop,
        optim=config.optim,
        workdir=workdir,
        tokens_per_example=dc.seq_len,
        desc=f"{dc.dataset}-{dc.pred_len}-{config.model.backbone}",
    )
    test = result.evaluate(data.test)
    record = {
        "dataset": dc.dataset,
        "horizon": dc.pred_len,
        "model": config.model.backbone,
        "seed": config.loop.seed,
        "mse": test["mse"],
        "mae": test["mae"],
        "val_mse": result.best_metric,
        "steps": result.step,
        "epochs": len(result.history),
        "params": int(n_params),
        "wall_s": time.perf_counter() - t0,
    }
    logging.info("result %s", record)
    if workdir is not None:
        out = Path(workdir)
        out.mkdir(parents=True, exist_ok=True)
        summary = {
            "record": record,
            "history": result.history,
            "config": dataclasses.asdict(config),
        }
        (out / "result.json").write_text(json.dumps(summary, indent=1) + "\n")
    return record
