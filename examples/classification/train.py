"""Training and evaluation of one classification run (one dataset, backbone, seed)."""

from __future__ import annotations

import logging
import time

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from examples.classification.configs import Config
from examples.classification.data import ClassificationData, load_dataset
from examples.classification.model import Classifier
from examples.common import fit
from examples.common.runs import RunDir


def loss_fn(model: Classifier, batch) -> tuple[jax.Array, None]:
    """Mean cross-entropy (the training objective)."""
    logits = model(batch["x"], batch["mask"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean(), None


def eval_fn(model: Classifier, batch) -> dict[str, jax.Array]:
    """Weighted sums of correct predictions and cross-entropy, and the count ``n``."""
    logits = model(batch["x"], batch["mask"])
    w = batch["weight"]
    nll = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"])
    correct = (jnp.argmax(logits, axis=-1) == batch["y"]).astype(jnp.float32)
    return {"accuracy": jnp.sum(w * correct), "nll": jnp.sum(w * nll), "n": jnp.sum(w)}


def build_model(config: Config, data: ClassificationData) -> Classifier:
    """The classifier for ``data``, initialised from the run's seed."""
    return Classifier(
        config.model,
        data.num_dims,
        data.num_classes,
        rngs=nnx.Rngs(params=config.loop.seed, dropout=config.loop.seed + 1),
    )


def train_and_evaluate(
    config: Config,
    workdir: str | None,
    data: ClassificationData | None = None,
    *,
    overwrite: bool = False,
    keep_checkpoints: bool = False,
) -> dict:
    """Trains with early stopping on the validation hold-out, then tests the best parameters.

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
      A record: dataset, model, seed, test ``accuracy`` (in %), validation accuracy, steps,
      epochs, parameter count and ``wall_s``.

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
        data = load_dataset(dc.dataset, dc.data_root, dc.val_fraction, dc.split_seed)
    model = build_model(config, data)
    n_params = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    logging.info(
        "%s %s: %d params, %d/%d/%d cases, T=%d, %d classes",
        dc.dataset,
        config.model.backbone,
        n_params,
        len(data.train),
        len(data.val),
        len(data.test),
        data.max_len,
        data.num_classes,
    )
    result = fit(
        model,
        loss_fn,
        eval_fn,
        data.train,
        data.val,
        monitor=config.monitor,
        mode="min" if config.monitor == "nll" else "max",
        loop=config.loop,
        optim=config.optim,
        workdir=None if run is None else str(run.path),
        tokens_per_example=data.max_len,
        desc=f"{dc.dataset}-{config.model.backbone}",
    )
    test = result.evaluate(data.test)
    val = result.evaluate(data.val)
    record = {
        "dataset": dc.dataset,
        "model": config.model.backbone,
        "seed": config.loop.seed,
        "causal": config.model.causal,
        "accuracy": 100.0 * test["accuracy"],
        "val_accuracy": 100.0 * val["accuracy"],
        "test_nll": test["nll"],
        "steps": result.step,
        "epochs": len(result.history),
        "params": int(n_params),
        "wall_s": result.prior_wall_s + time.perf_counter() - t0,  # resumed runs: all calls
    }
    logging.info("result %s", record)
    if run is not None:
        run.write_result(
            record,
            result.history,
            finished=result.done,
            keep_checkpoints=keep_checkpoints,
            plot_keys=("train_loss", "val_nll"),
        )
    return record
