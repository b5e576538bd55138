"""Training and evaluation of one classification run (one dataset, backbone, seed)."""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from examples.classification.configs import Config
from examples.classification.data import ClassificationData, load_dataset
from examples.classification.model import Classifier
from examples.common import fit


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
    config: Config, workdir: str | None, data: ClassificationData | None = None
) -> dict:
    """Trains with early stopping on the validation hold-out, then tests the best parameters.

    Args:
      config: the run's configuration.
      workdir: checkpoints and ``result.json`` go here (resumes if a checkpoint exists);
        None keeps nothing on disk.
      data: preloaded splits (must match ``config.data``), to share between runs.

    Returns:
      A record: dataset, model, seed, test ``accuracy`` (in %), validation accuracy, steps,
      epochs, parameter count and ``wall_s``.
    """
    t0 = time.perf_counter()
    dc = config.data
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
        workdir=workdir,
        tokens_per_example=data.max_len,
        desc=f"{dc.dataset}-{config.model.backbone}",
    )
    test = result.evaluate(data.test)
    val = result.evaluate(data.val)
    record = {
        "dataset": dc.dataset,
        "model": config.model.backbone,
        "seed": config.loop.seed,
        "accuracy": 100.0 * test["accuracy"],
        "val_accuracy": 100.0 * val["accuracy"],
        "test_nll": test["nll"],
        "steps": result.step,
        "epochs": len(result.history),
        "params": int(n_params),
        "wall_s": time.perf_counter() - t0,
    }
    logging.info("result %s", record)
    if workdir is not None:
        out = Path(workdir)
        out.mkdir(parents=True, exist_ok=True)
        summary = {"record": record, "history": result.history}
        summary["config"] = dataclasses.asdict(config)
        (out / "result.json").write_text(json.dumps(summary, indent=1) + "\n")
    return record
