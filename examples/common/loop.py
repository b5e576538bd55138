"""A generic epoch loop: jitted pure train step, early stopping, exact resumption from Orbax.

An "epoch" is one pass over a seeded permutation of the training set, or its first
``steps_per_epoch`` batches when that cap is set (so large datasets cost the same as small ones).

Determinism (what makes resumption exact): the batch at global step ``s`` is fixed by the
seed (epoch ``s // steps_per_epoch`` uses the permutation ``default_rng([seed, epoch])``), the
dropout keys at step ``s`` are ``fold_in(key(seed), s)``, and a checkpoint stores parameters,
optimiser state (whose count drives the schedule), best parameters and the early-stopping
counters. Stopping after ``k`` steps and resuming therefore gives the same parameters as an
uninterrupted run.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import time
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple, Protocol

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from examples.common.checkpoint import CheckpointIO
from examples.common.optim import OptimConfig, make_optimizer
from examples.common.parallel import data_mesh, replicate, shard_batch
from examples.common.progress import Progress

Batch = Mapping[str, np.ndarray]


class BatchSource(Protocol):
    """A dataset that can gather a batch of examples by index."""

    def __len__(self) -> int: ...

    def batch(self, indices: np.ndarray) -> Batch: ...


@dataclasses.dataclass
class LoopConfig:
    """Training-loop settings shared by the examples."""

    batch_size: int = 32  # examples per training step
    eval_batch_size: int = 256  # examples per evaluation step
    max_epochs: int = 10  # upper bound on epochs
    steps_per_epoch: int | None = None  # cap on steps between validations; None: a full pass
    patience: int = 3  # early stopping: epochs without validation improvement before stopping
    seed: int = 0  # seeds parameters, data order and dropout
    max_steps: int | None = None  # stop (and checkpoint) after this many steps in total
    checkpoint: bool = True  # write Orbax checkpoints to <workdir>/checkpoints and resume
    checkpoint_every: int = 1  # epochs between checkpoints (the last epoch is always saved)
    log_every: int = 50  # steps between progress-bar updates (each one syncs the device)
    progress: bool = True  # show a tqdm progress bar
    data_parallel: bool = True  # shard each batch over all devices (a no-op on one device)


class TrainResult(NamedTuple):
    """What ``fit`` returns.

    Attributes:
      model: the model holding the best (by validation) parameters, in eval mode.
      best_metric: the best validation value of the monitored metric.
      step: global steps trained.
      history: one dict per evaluated epoch (epoch, step, train_loss, val metrics).
      evaluate: ``evaluate(source) -> metrics`` with the best parameters.
      wall_s: seconds spent in this call (training and validation).
      params: the parameters after the last step (not the best ones).
      done: whether training is complete (early stop or the epoch cap), as opposed to
        stopped by ``max_steps`` and resumable.
      prior_wall_s: seconds of the earlier calls this run resumed from (training and
        validation, up to the checkpoint it resumed from); 0 for a fresh run.
    """

    model: nnx.Module
    best_metric: float
    step: int
    history: list[dict]
    evaluate: Callable[[BatchSource], dict]
    wall_s: float
    params: Any
    done: bool = False
    prior_wall_s: float = 0.0


def _reseed(model: nnx.Module, key: jax.Array) -> None:
    """``nnx.reseed`` of every RNG stream of ``model`` from ``key`` (one key per stream).

    Dropout masks then depend only on (seed, step), so a resumed run repeats them exactly.
    """
    tags = {s.key.tag for _, s in nnx.iter_graph(model) if isinstance(s, nnx.RngStream)}
    nnx.reseed(model, policy="match_shape", **dict.fromkeys(tags, key))


def _padded_batches(n: int, batch_size: int):
    """Fixed-shape evaluation batches: indices padded by repetition, plus a 0/1 weight."""
    for start in range(0, n, batch_size):
        idx = np.arange(start, min(start + batch_size, n))
        weight = np.ones(batch_size, np.float32)
        if len(idx) < batch_size:
            weight[len(idx) :] = 0.0
            idx = np.concatenate([idx, np.full(batch_size - len(idx), idx[0])])
        yield idx, weight


# Module-level jitted steps with the graph definition, optimiser and loss as static arguments:
# runs with the same model, optimiser and batch shapes (a sweep, the tests) compile once.
@functools.partial(
    jax.jit,
    static_argnames=("graphdef", "tx", "loss_fn"),
    donate_argnames=("params", "opt_state"),
)
def _train_step(params, opt_state, rest, batch, step, *, graphdef, tx, loss_fn, base_key):
    model = nnx.merge(graphdef, params, rest)
    _reseed(model, jax.random.fold_in(base_key, step))
    grad_fn = nnx.value_and_grad(lambda m: loss_fn(m, batch), has_aux=True)
    (loss, _), grads = grad_fn(model)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss


@functools.partial(jax.jit, static_argnames=("graphdef", "eval_fn"))
def _eval_step(params, rest, batch, *, graphdef, eval_fn):
    return eval_fn(nnx.merge(graphdef, params, rest), batch)


class TrainStep(NamedTuple):
    """The jitted training step ``fit`` runs, with its initial state.

    Attributes:
      step: ``step(params, opt_state, rest, batch, global_step) -> (params, opt_state, loss)``;
        ``params`` and ``opt_state`` are donated.
      params: the model's parameters.
      opt_state: the optimiser's initial state.
      rest: the model's other state (RNG streams), reseeded from the global step inside.
    """

    step: Callable
    params: Any
    opt_state: Any
    rest: Any


def make_train_step(
    model: nnx.Module,
    loss_fn: Callable[[nnx.Module, Batch], tuple[jax.Array, Any]],
    optim: OptimConfig | optax.GradientTransformation,
    seed: int,
) -> TrainStep:
    """The training step of ``model`` in training mode (also used by the cost benchmark).

    ``optim``: the examples' AdamW settings, or any Optax optimiser.
    """
    model.train()
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    if isinstance(optim, OptimConfig):
        tx = make_optimizer(optim, params)
    else:
        tx = optim
    step = functools.partial(
        _train_step, graphdef=graphdef, tx=tx, loss_fn=loss_fn, base_key=jax.random.key(seed)
    )
    return TrainStep(step, params, tx.init(params), rest)


def epoch_permutation(n: int, seed: int, epoch: int) -> np.ndarray:
    """The data order of one epoch; a pure function of (seed, epoch)."""
    return np.random.default_rng([seed, epoch]).permutation(n)


def fit(
    model: nnx.Module,
    loss_fn: Callable[[nnx.Module, Batch], tuple[jax.Array, Any]],
    eval_fn: Callable[[nnx.Module, Batch], dict[str, jax.Array]],
    train_data: BatchSource,
    val_data: BatchSource,
    *,
    monitor: str,
    mode: str,
    loop: LoopConfig,
    optim: OptimConfig,
    workdir: str | None = None,
    tokens_per_example: int = 1,
    desc: str = "train",
) -> TrainResult:
    """Trains ``model`` with early stopping on ``monitor`` over ``val_data``; resumes from workdir.

    Args:
      model: the freshly initialised model (its parameters are the start, or the restore target).
      loss_fn: ``loss_fn(model, batch) -> (scalar loss, aux)``, called in train mode.
      eval_fn: ``eval_fn(model, batch) -> sums``: per-batch sums of metrics, weighted by
        ``batch["weight"]`` [B] (0 for padding rows), including ``"n"``, the weighted count by
        which every other sum is divided.
      train_data: the training examples.
      val_data: the validation examples.
      monitor: the validation metric (a key of ``eval_fn``'s sums) for early stopping.
      mode: "min" or "max": whether smaller or larger ``monitor`` is better.
      loop: loop settings.
      optim: optimiser settings; ``decay_steps=0`` spans the whole run.
      workdir: where checkpoints live (``<workdir>/checkpoints``); None disables them.
      tokens_per_example: tokens per example, for the throughput shown in the progress bar.
      desc: progress-bar label.

    Returns:
      A ``TrainResult`` with the best model and an evaluator.
    """
    t_start = time.perf_counter()
    if mode not in ("min", "max"):
        raise ValueError(f"mode must be 'min' or 'max', got {mode!r}")
    better = (lambda a, b: a < b) if mode == "min" else (lambda a, b: a > b)
    steps_per_epoch = len(train_data) // loop.batch_size
    if steps_per_epoch == 0:
        raise ValueError(f"{len(train_data)} training examples < batch size {loop.batch_size}")
    if loop.steps_per_epoch:  # an "epoch" is then a random subset of one permutation
        steps_per_epoch = min(steps_per_epoch, loop.steps_per_epoch)
    total_steps = loop.max_epochs * steps_per_epoch
    if not optim.decay_steps:
        optim = dataclasses.replace(optim, decay_steps=total_steps)

    model.eval()
    graphdef_eval, _, _ = nnx.split(model, nnx.Param, ...)
    train_step, params, opt_state, rest = make_train_step(model, loss_fn, optim, loop.seed)
    eval_step = functools.partial(_eval_step, graphdef=graphdef_eval, eval_fn=eval_fn)

    # Data parallel: replicated state, batches split over all devices (None: one device).
    mesh = data_mesh() if loop.data_parallel else None
    if mesh is not None and loop.batch_size % mesh.size:
        raise ValueError(
            f"batch size {loop.batch_size} is not a multiple of the {mesh.size} devices; "
            "change it or set LoopConfig.data_parallel=False"
        )
    eval_mesh = mesh if mesh is not None and loop.eval_batch_size % mesh.size == 0 else None
    if mesh is not None:
        logging.info("%s: data parallel over %d devices", desc, mesh.size)

    def evaluate_params(p, source: BatchSource) -> dict:
        sums: dict[str, float] = {}
        for idx, weight in _padded_batches(len(source), loop.eval_batch_size):
            batch = dict(source.batch(idx))
            batch["weight"] = weight
            out = eval_step(p, rest, shard_batch(batch, eval_mesh))
            for k, v in out.items():
                sums[k] = sums.get(k, 0.0) + float(v)
        n = sums.pop("n")
        return {k: v / n for k, v in sums.items()}

    # --- state and resumption -------------------------------------------------------------
    step, bad_epochs, done = 0, 0, False
    prior_wall_s = 0.0
    best_metric = math.inf if mode == "min" else -math.inf
    best_params = jax.tree.map(jnp.copy, params)
    history: list[dict] = []
    ckpt = CheckpointIO(f"{workdir}/checkpoints") if (workdir and loop.checkpoint) else None
    if ckpt is not None and ckpt.latest_step() is not None:
        # restored straight onto the devices of the mesh (several processes need that)
        sharding = None if mesh is None else NamedSharding(mesh, PartitionSpec())
        abstract = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding),
            {"params": params, "opt_state": opt_state, "best_params": best_params},
        )
        try:
            state, meta = ckpt.restore(abstract)
        except (ValueError, KeyError, TypeError) as e:  # Orbax's multi-kilobyte tree diff
            ckpt.close()
            raise ValueError(
                f"{workdir}/checkpoints holds a checkpoint of another model or optimiser (its "
                f"arrays do not fit this one: {type(e).__name__}). Use another workdir, or "
                "delete that one to start fresh."
            ) from e
        params, opt_state, best_params = state["params"], state["opt_state"], state["best_params"]
        step, bad_epochs, done = meta["step"], meta["bad_epochs"], meta["done"]
        best_metric = meta["best_metric"] if meta["best_metric"] is not None else best_metric
        history = meta["history"]
        prior_wall_s = meta.get("wall_s", 0.0)
        logging.info("%s: resumed from step %d (done=%s)", desc, step, done)

    def save():
        if ckpt is None:
            return
        meta = {
            "step": step,
            "bad_epochs": bad_epochs,
            "done": done,
            "best_metric": best_metric if math.isfinite(best_metric) else None,
            "history": history,
            "wall_s": prior_wall_s + time.perf_counter() - t_start,
        }
        ckpt.save(
            step, {"params": params, "opt_state": opt_state, "best_params": best_params}, meta
        )

    params, opt_state, best_params, rest = replicate((params, opt_state, best_params, rest), mesh)
    if mesh is None:
        # Orbax restores committed arrays and a fresh model's are not: commit both alike, so
        # a fresh and a resumed run in one process share one compiled train and eval step
        device = next(iter(jax.tree.leaves(params)[0].devices()))
        params, opt_state, best_params, rest = jax.device_put(
            (params, opt_state, best_params, rest), device
        )

    # --- training ---------------------------------------------------------------------------
    stop_at = total_steps if loop.max_steps is None else min(total_steps, loop.max_steps)
    # One bar per epoch: early stopping cannot make its total (and ETA) wrong.
    bar = None
    loss_acc, loss_n, epoch_loss, epoch_n = None, 0, 0.0, 0
    perm, perm_epoch = None, -1
    while not done and step < stop_at:
        epoch, i = divmod(step, steps_per_epoch)
        if perm_epoch != epoch:
            perm, perm_epoch = epoch_permutation(len(train_data), loop.seed, epoch), epoch
        if bar is None:
            bar = Progress(
                min(steps_per_epoch, stop_at - epoch * steps_per_epoch),
                i,
                f"{desc} epoch {epoch + 1}/{loop.max_epochs}",
                enabled=loop.progress,
            )
        idx = perm[i * loop.batch_size : (i + 1) * loop.batch_size]
        params, opt_state, loss = train_step(
            params,
            opt_state,
            rest,
            shard_batch(train_data.batch(idx), mesh),
            jnp.asarray(step, jnp.uint32),
        )
        step += 1
        loss_acc = loss if loss_acc is None else loss_acc + loss
        loss_n += 1
        if step % loop.log_every == 0 or step % steps_per_epoch == 0 or step == stop_at:
            mean_loss = float(loss_acc) / loss_n
            epoch_loss, epoch_n = epoch_loss + mean_loss * loss_n, epoch_n + loss_n
            bar.update(loss_n, mean_loss, loss_n * loop.batch_size * tokens_per_example)
            loss_acc, loss_n = None, 0
        if step % steps_per_epoch == 0:  # end of an epoch: validate, early-stop, checkpoint
            bar.close()
            bar = None
            val = evaluate_params(params, val_data)
            record = {
                "epoch": step // steps_per_epoch,
                "step": step,
                "train_loss": epoch_loss / max(epoch_n, 1),
                **{f"val_{k}": v for k, v in val.items()},
            }
            history.append(record)
            epoch_loss, epoch_n = 0.0, 0
            if better(val[monitor], best_metric):
                best_metric, bad_epochs = val[monitor], 0
                best_params = jax.tree.map(jnp.copy, params)
            else:
                bad_epochs += 1
            done = bad_epochs >= loop.patience or step >= total_steps
            logging.info(
                "%s epoch %d step %d train_loss %.4f val_%s %.4f (best %.4f)",
                desc,
                record["epoch"],
                step,
                record["train_loss"],
                monitor,
                val[monitor],
                best_metric,
            )
            if done or (step // steps_per_epoch) % loop.checkpoint_every == 0:
                save()
    if step == stop_at and step % steps_per_epoch != 0:
        save()  # stopped mid-epoch (max_steps): keep the exact state for resumption
    if bar is not None:
        bar.close()
    if ckpt is not None:
        ckpt.close()

    if not history:  # never validated (max_steps inside the first epoch): use the last params
        best_params = params
    best_model = nnx.merge(graphdef_eval, best_params, rest)
    return TrainResult(
        model=best_model,
        best_metric=best_metric,
        step=step,
        history=history,
        evaluate=functools.partial(evaluate_params, best_params),
        wall_s=time.perf_counter() - t_start,
        params=params,
        done=done,
        prior_wall_s=prior_wall_s,
    )
