"""Training and evaluation of one forecasting run (one dataset, horizon, backbone, seed)."""

from __future__ import annotations

import logging
import time

import jax
import jax.numpy as jnp
from flax import nnx

from examples.common import fit
from examples.common.runs import RunDir
from examples.forecasting.configs import Config
from examples.forecasting.data import ForecastData, load_csv, load_dataset
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


def load_data(config: Config) -> ForecastData:
    """The splits ``config.data`` names: its CSV if set, else a named TSLib dataset."""
    dc = config.data
    if dc.csv:
        return load_csv(dc.csv, dc.seq_len, dc.pred_len, dc.target, dc.freq, dc.split)
    return load_dataset(dc.dataset, dc.seq_len, dc.pred_len, dc.data_root, dc.target, dc.freq)


def train_and_evaluate(
    config: Config,
    workdir: str | None,
    data: ForecastData | None = None,
    *,
    overwrite: bool = False,
    keep_checkpoints: bool = False,
) -> dict:
    """Trains with early stopping on validation MSE, then tests the best parameters.

    Args:
      config: the run's configuration.
      workdir: the run folder (``examples.common.runs.RunDir``): its ``config.json`` must
        match ``config``; an unfinished run resumes from its checkpoints, a finished one
        returns its stored record without training. ``result.json`` and ``loss.png`` are
        written there. None keeps nothing on disk.
      data: preloaded splits (must match ``config.data``), to share between runs.
      overwrite: discard the run ``workdir`` holds and start fresh.
      keep_checkpoints: keep the checkpoints of a finished run (else they are deleted).

    Returns:
      A record: dataset, horizon, model, seed, test ``mse``/``mae`` (scaled space), best
      ``val_mse``, steps, epochs, parameter count and ``wall_s``.

    Raises:
      examples.common.runs.ConfigMismatchError: ``workdir`` holds a run of another
        configuration and not ``overwrite``.
    """
    t0 = time.perf_counter()
    dc = config.data
    run = RunDir(workdir, config, overwrite=overwrite) if workdir is not None else None
    if run is not None and (stored := run.finished_result()) is not None:
        logging.info(
            "%s: this configuration already finished there; its stored result is returned "
            "(pass --overwrite to train again)",
            run.path,
        )
        logging.info("result %s", stored["record"])
        return stored["record"]
    if data is None:
        data = load_data(config)
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
        workdir=None if run is None else str(run.path),
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
        "wall_s": result.prior_wall_s + time.perf_counter() - t0,  # resumed runs: all calls
    }
    if dc.csv:
        record["csv"] = dc.csv
    if config.model.rem_config() is not None:
        record["rsa_counts"] = list(config.model.rsa_counts)
        record["rsa_dilations"] = list(config.model.rsa_dilations)
        record["mu_init"] = config.model.mu_init
        # the learned gate sigmoid(mu) of each layer: the share of the REMs (RSA's Figure 10)
        record["gates"] = [
            float(jax.nn.sigmoid(b.attention.rsa.mu[...])) for b in result.model.backbone.blocks
        ]
    logging.info("result %s", record)
    if run is not None:
        run.write_result(
            record,
            result.history,
            finished=result.done,
            keep_checkpoints=keep_checkpoints,
            plot_keys=("train_loss", "val_mse"),
        )
    return record
