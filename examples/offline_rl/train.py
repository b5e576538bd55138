"""Training and online evaluation of one offline-RL run (environment, dataset, model, seed)."""

from __future__ import annotations

import dataclasses
import importlib.metadata
import logging
import os
import time

import jax
import numpy as np
from flax import nnx

from aaren_jax.native import cpu_kind, cpu_model
from examples.common import CheckpointIO, fit
from examples.common.runs import RunDir
from examples.offline_rl import evaluate as ev
from examples.offline_rl.configs import D4RL_REF, ENV_IDS, TARGET_RETURNS, Config
from examples.offline_rl.data import (
    SequenceData,
    Trajectories,
    dataset_id,
    load_trajectories,
    manifest_entry,
    manifest_fingerprint,
    trajectory_digest,
    validation_subset,
)
from examples.offline_rl.model import DecisionModel, eval_fn, loss_fn

VAL_WINDOWS = 512  # fixed windows of the training data on which the fit MSE is logged


def load_data(config: Config) -> Trajectories:
    """The run's dataset: ``config.data.dataset_id`` if set, else the generated one."""
    dc = config.data
    return load_trajectories(dc.dataset_id or dataset_id(dc.env, dc.dataset), dc.data_root)


def build_model(config: Config, traj: Trajectories) -> DecisionModel:
    """The model for ``traj``'s observation and action sizes, from the run's seed."""
    seed = config.loop.seed
    return DecisionModel(
        config.model, traj.obs_dim, traj.act_dim, rngs=nnx.Rngs(params=seed, dropout=seed + 1)
    )


def own_reference(config: Config, traj: Trajectories) -> tuple[float, float] | None:
    """(random, expert) returns of our own behaviour policies: the dataset's metadata, else
    the generator's manifest (medium-expert, a combined dataset, has no metadata)."""
    if traj.ref_scores is not None:
        return traj.ref_scores
    entry = manifest_entry(config.data.env, config.data.data_root)
    if entry is None:
        return None
    return entry["random_policy_return"], entry["expert_policy_return"]


def data_provenance(config: Config, traj: Trajectories) -> dict:
    """What a run was trained on: ``data_digest`` (``trajectory_digest``, exact) and, for a
    generated dataset, ``data_manifest`` (``manifest_fingerprint`` of its generator entry;
    None for any other Minari dataset), with the simulator's version. Runs of one dataset
    id compare only where these agree: the generator draws other data on another CPU."""
    dc = config.data
    entry = None if dc.dataset_id else manifest_entry(dc.env, dc.data_root)
    return {
        "data_digest": trajectory_digest(traj),
        "data_manifest": None if entry is None else manifest_fingerprint(entry),
        "mujoco": _version("mujoco"),
    }


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def make_env_fn(env: str):
    import gymnasium as gym

    return lambda: gym.make(ENV_IDS[env])


def targets(config: Config, traj: Trajectories) -> list[tuple[str, float]]:
    """The (name, return) pairs to condition on: ``"corl"`` (CORL's first target of the
    environment, or ``config.eval.target_return``) and, if ``config.eval.data_target``,
    ``"data_best"`` (the best episode return in the dataset)."""
    ec, env = config.eval, config.data.env
    out = [("corl", ec.target_return if ec.target_return is not None else TARGET_RETURNS[env][0])]
    if ec.data_target:
        out.append(("data_best", float(np.max(traj.episode_returns()))))
    return out


def evaluate_online(
    model: DecisionModel,
    config: Config,
    traj: Trajectories,
    mode: str,
    target: float,
    timed: bool = True,
) -> dict:
    """Scores of ``model`` over ``config.eval.eval_episodes`` episodes in ``mode``, conditioned
    on the unscaled return ``target``; ``ms_per_env_step`` is None unless ``timed``."""
    ec, env = config.eval, config.data.env
    kw = dict(
        target_return=target,
        state_mean=traj.state_mean,
        state_std=traj.state_std,
        reward_scale=config.data.reward_scale,
        seed=ec.seed,
    )
    make_env = make_env_fn(env)
    policy = ev.make_policy(mode, model, ec.eval_episodes, traj.obs_dim, traj.act_dim)
    out = ev.rollout(policy, make_env, ec.eval_episodes, **kw)
    ms = None
    if timed:
        ms = ev.ms_per_env_step(
            mode, model, make_env, traj.obs_dim, traj.act_dim, ec.timing_steps, **kw
        )
    score = ev.normalised(out.returns, D4RL_REF[env])
    own = own_reference(config, traj)
    own_score = ev.normalised(out.returns, own) if own is not None else None
    return {
        "score": float(np.mean(score)),
        "score_std": float(np.std(score)),
        "score_own": None if own_score is None else float(np.mean(own_score)),
        "return": float(np.mean(out.returns)),
        "return_std": float(np.std(out.returns)),
        "episode_len": float(np.mean(out.lengths)),
        "eval_episodes": int(ec.eval_episodes),
        "target_return": float(target),
        "ms_per_env_step": ms,
        "eval_wall_s": out.wall_s,
    }


def modes(config: Config) -> list[str]:
    """The evaluation modes of a run: the window; and the stream for Aaren (if enabled)."""
    stream = config.eval.stream and config.model.backbone == "aaren"
    return ["window", "stream"] if stream else ["window"]


def whole_passes(config: Config, windows: int):
    """The loop's settings for ``windows`` training windows: as configured, unless one pass
    over them holds fewer batches than an epoch's ``steps_per_epoch``. ``fit`` caps an epoch
    at one pass, so such a dataset would train fewer updates than asked for (e.g. 624 of
    2,000); CORL trains a fixed number of updates whatever the data's size, so here the
    epochs become whole passes, as many as reach the updates asked for (at most one pass
    more: every record's ``train_steps`` says how many ran)."""
    loop = config.loop
    batches = windows // loop.batch_size
    if not loop.steps_per_epoch or batches >= loop.steps_per_epoch or batches == 0:
        return loop  # (no batch at all: fit names the sizes)
    asked = loop.max_epochs * loop.steps_per_epoch
    passes = -(-asked // batches)
    logging.warning(
        "%d training windows make %d batches of %d per pass, fewer than an epoch's %d: "
        "training %d whole passes, %d updates (asked for %d)",
        windows, batches, loop.batch_size, loop.steps_per_epoch, passes, passes * batches, asked,
    )  # fmt: skip
    return dataclasses.replace(loop, max_epochs=passes)


def fit_model(config: Config, traj: Trajectories, workdir: str | None):
    """``fit`` on the dataset's windows for ``max_epochs x steps_per_epoch`` updates, logging
    the action MSE on ``VAL_WINDOWS`` fixed windows; resumes from ``workdir``'s checkpoints.

    Returns ``fit``'s ``TrainResult`` (``params``: the last parameters).
    """
    k, scale = config.model.seq_len, config.data.reward_scale
    train = SequenceData(traj, k, scale)
    val = SequenceData(traj, k, scale, validation_subset(len(train), VAL_WINDOWS, 0))
    return fit(
        build_model(config, traj),
        loss_fn,
        eval_fn,
        train,
        val,
        monitor="mse",
        mode="min",
        loop=whole_passes(config, len(train)),
        optim=config.optim,
        workdir=workdir,
        tokens_per_example=len(config.model.token_kinds) * k,
        desc=f"{config.data.env}-{config.data.dataset}-{config.model.backbone}",
    )


def train_and_evaluate(
    config: Config,
    workdir: str | None,
    traj: Trajectories | None = None,
    *,
    overwrite: bool = False,
    keep_checkpoints: bool = False,
) -> list[dict]:
    """Trains for a fixed number of updates, then evaluates the last parameters online.

    Args:
      config: the run's configuration.
      workdir: the run folder (``examples.common.runs.RunDir``): its ``config.json`` must
        match ``config`` but for the evaluation settings (``config.eval``); an unfinished run
        resumes from its checkpoints, a finished one returns its stored records if they were
        evaluated with ``config.eval``, else it is evaluated again from its kept checkpoints
        (or, without them, trained again). None keeps nothing on disk.
      traj: the preloaded dataset (must match ``config.data``).
      overwrite: discard the run ``workdir`` holds and start fresh.
      keep_checkpoints: keep the finished run's checkpoints, so that it can be evaluated
        again under other evaluation settings without training (a run that kept them keeps
        them when evaluated again).

    Returns:
      One record per evaluation mode and target: ``{"env", "dataset", "model", "seed", "eval",
      "target" (``"corl"`` or ``"data_best"``, ``targets``), "score",
      "score_std", "score_own", "return", "return_std", "eval_episodes", "target_return",
      "ms_per_env_step", "train_steps", "train_wall_s", "wall_s", "cpu_model", "jax",
      "data_digest", "data_manifest", "mujoco", ...}`` (``data_provenance``); ``score`` is
      D4RL's normalised score, ``score_own`` the one with our own random and expert policies.
    """
    t0 = time.perf_counter()
    run = RunDir(workdir, config, overwrite=overwrite) if workdir is not None else None
    if run is not None and (stored := run.finished_result()) is not None:
        if stored["config"].get("eval") == run.config["eval"]:
            logging.info("%s: finished already; its stored records are returned", run.path)
            return stored["records"]
        # fit's own test: a second training stopped before its first checkpoint leaves the
        # folder without a complete one
        if (
            run.checkpoint_dir.exists()
            and CheckpointIO(run.checkpoint_dir).latest_step() is not None
        ):
            logging.info(
                "%s: finished; goes on from its checkpoints (evaluated again if they hold "
                "the finished training, else a second training resumes)",
                run.path,
            )
            keep_checkpoints = True  # kept once, kept for the next evaluation too
        else:
            logging.warning(
                "%s: finished under other evaluation settings without kept checkpoints "
                "(--keep-checkpoints): it is trained again",
                run.path,
            )
    if traj is None:
        traj = load_data(config)
    logging.info(
        "%s: %d transitions in %d episodes", traj.name, traj.num_transitions, len(traj.actions)
    )
    result = fit_model(config, traj, None if run is None else str(run.path))
    n_params = sum(x.size for x in jax.tree.leaves(result.params))
    train_wall = result.prior_wall_s + result.wall_s
    model = result.model
    nnx.update(model, result.params)  # CORL evaluates the last parameters, not a "best" one
    records = []
    provenance = data_provenance(config, traj)
    load = round(os.getloadavg()[0], 2)  # other jobs on the machine move the timings
    for mode in modes(config):
        ms = None  # timed once per mode: the target does not change the step's cost
        for target_name, target in targets(config, traj):
            scores = evaluate_online(model, config, traj, mode, target, timed=ms is None)
            if ms is None:
                ms = scores["ms_per_env_step"]
            scores["ms_per_env_step"] = ms
            records.append(
                {
                    "env": config.data.env,
                    "dataset": config.data.dataset,
                    "model": config.model.backbone,
                    "seed": config.loop.seed,
                    "eval": mode,
                    "target": target_name,
                    **scores,
                    "dataset_id": traj.name,
                    "transitions": traj.num_transitions,
                    **provenance,
                    "context_steps": config.model.seq_len,
                    **({"fold_return": True} if config.model.fold_return else {}),
                    **({"rsa": True} if config.model.rsa else {}),
                    "train_steps": result.step,
                    # what the run asked for; a small dataset trains whole passes around it
                    "updates_asked": config.loop.max_epochs * config.loop.steps_per_epoch,
                    "finished": bool(result.done),
                    "fit_mse": result.history[-1]["val_mse"] if result.history else None,
                    "params": int(n_params),
                    "train_wall_s": train_wall,
                    "wall_s": train_wall + time.perf_counter() - t0 - result.wall_s,
                    # the timings' machine; floating-point results also differ across CPUs
                    "cpu_model": cpu_model(),
                    "cpu_kind": cpu_kind(),
                    "cpu_count": os.cpu_count(),
                    "device": jax.devices()[0].device_kind,  # "cpu", or the accelerator
                    "jax": jax.__version__,
                    "load_average_at_eval": load,
                }
            )
            logging.info("result %s", records[-1])
    if run is not None:
        run.write_result(
            records[0],
            result.history,
            finished=result.done,
            keep_checkpoints=keep_checkpoints,
            plot_keys=("train_loss", "val_mse"),
            extra={"records": records, "config": dataclasses.asdict(config)},
        )
    return records
