"""D4RL-like datasets: a SAC behaviour agent per environment, then medium / medium-replay /
medium-expert written as local Minari datasets.

    python examples/offline_rl/generate.py --env hopper                  # default sizes
    python examples/offline_rl/generate.py --env hopper --sac-steps 60000 --size 30000

As D4RL made them (Fu et al. 2020, Section 5): a SAC agent is trained online; **medium** is
rollouts of the policy stopped early, at about one third of the expert's return (here: the
first snapshot whose evaluated return reaches ``medium_fraction`` of the best snapshot's);
**medium-replay** is that agent's replay buffer up to that point; **medium-expert** is the
medium rollouts plus as many rollouts of the "expert" policy (the best snapshot). Rollouts
sample from the stochastic policy. Sizes are arguments (D4RL: 1M transitions per dataset).

Deterministic from ``--seed`` (environment resets, exploration, update batches, rollouts) and
resumable: the agent, its replay buffer and its policy snapshots are Orbax checkpoints saved
at episode boundaries every ``--save-every-s`` seconds; a finished dataset is not rewritten.
``<data root>/manifest.json`` records, per environment, the snapshots' returns, the chosen
medium policy, the random and expert returns and the datasets' sizes.

Reproducing a draw: ``--reference <manifest.json>`` (e.g. ``results/offline_rl_manifest.json``)
checks every snapshot's evaluated return against that manifest's entry as it is made and
stops at the first that differs, then checks the finished entry. The draw is reproducible on
the kinds of CPU (and MuJoCo version) that drew it only: machines of six kinds here drew
three different Hopper agents from the same command (Intel Xeons of two kinds and AMD EPYCs
of two kinds, all with AVX-512, drew the same one).

Shape notation: ``N`` transitions, ``S`` observation size, ``A`` action size.
"""

from __future__ import annotations

import argparse
import dataclasses
import fcntl
import json
import logging
import os
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from aaren_jax.native import cpu_kind, cpu_model  # noqa: E402
from examples.common import CheckpointIO, setup_logging  # noqa: E402
from examples.offline_rl import data as rl_data  # noqa: E402
from examples.offline_rl import sac  # noqa: E402
from examples.offline_rl.configs import ENV_IDS, GenConfig  # noqa: E402


def _reset_seed(seed: int, stream: int, episode: int) -> int:
    """The environment seed of one episode of one stream (training, evaluation, rollouts)."""
    return int(np.random.SeedSequence([seed, stream, episode]).generate_state(1)[0])


STREAM_TRAIN, STREAM_EVAL, STREAM_RANDOM, STREAM_MEDIUM, STREAM_EXPERT = range(5)


class Buffer:
    """The replay buffer, in insertion order (so a prefix is the buffer at that time).

    Attributes:
      arrays: obs [N, S], action [N, A], reward [N], next_obs [N, S], terminal [N],
        truncated [N] (episode cut by the time limit or by the end of training); N = capacity.
      size: transitions stored.
    """

    def __init__(self, capacity: int, obs_dim: int, act_dim: int):
        self.arrays = {
            "obs": np.zeros((capacity, obs_dim), np.float32),
            "action": np.zeros((capacity, act_dim), np.float32),
            "reward": np.zeros(capacity, np.float32),
            "next_obs": np.zeros((capacity, obs_dim), np.float32),
            "terminal": np.zeros(capacity, np.float32),
            "truncated": np.zeros(capacity, np.float32),
        }
        self.size = 0

    def add(self, obs, action, reward, next_obs, terminal, truncated) -> None:
        i = self.size
        a = self.arrays
        a["obs"][i], a["action"][i], a["reward"][i] = obs, action, reward
        a["next_obs"][i], a["terminal"][i], a["truncated"][i] = next_obs, terminal, truncated
        self.size += 1

    def sample(self, rng: np.random.Generator, k: int, batch: int) -> dict:
        """``k`` batches of ``batch`` transitions, stacked: every leaf [k, batch, ...]."""
        idx = rng.integers(0, self.size, size=(k, batch))
        return {n: self.arrays[n][idx] for n in ("obs", "action", "reward", "next_obs", "terminal")}

    def episodes(self, n: int) -> list[dict]:
        """The first ``n`` transitions as Minari episode buffers (observations [T + 1, S])."""
        a = self.arrays
        ends = np.flatnonzero((a["terminal"][:n] + a["truncated"][:n]) > 0)
        if not len(ends) or ends[-1] != n - 1:
            ends = np.append(ends, n - 1)  # the episode running at step n: cut there
        from minari.data_collector import EpisodeBuffer

        out, start = [], 0
        for end in ends:
            sl = slice(start, end + 1)
            term = a["terminal"][sl].astype(bool)
            trunc = ~term & (np.arange(start, end + 1) == end)
            out.append(
                EpisodeBuffer(
                    id=len(out),
                    observations=np.concatenate([a["obs"][sl], a["next_obs"][end : end + 1]]),
                    actions=a["action"][sl],
                    rewards=a["reward"][sl].astype(np.float64),
                    terminations=term,
                    truncations=trunc,
                )
            )
            start = end + 1
        return out


# Metadata of every written dataset (Minari warns about each one left out).
DATASET_META = {
    "author": "aaren_jax",
    "author_email": "aaren_jax@users.noreply.github.com",
    "code_permalink": "https://github.com/aaren-jax/aaren_jax/tree/main/examples/offline_rl",
}


def make_env(env: str):
    import gymnasium as gym

    return gym.make(ENV_IDS[env])


def policy_return(policy, env_name: str, seed: int, stream: int, episodes: int) -> float:
    """Mean undiscounted return of ``policy(obs, t, key) -> action`` over seeded episodes."""
    env = make_env(env_name)
    returns = []
    for ep in range(episodes):
        obs, _ = env.reset(seed=_reset_seed(seed, stream, ep))
        total, done, t = 0.0, False, 0
        while not done:
            obs, r, term, trunc, _ = env.step(policy(obs, t, ep))
            total += float(r)
            done, t = term or trunc, t + 1
        returns.append(total)
    env.close()
    return float(np.mean(returns))


def sac_policy(nets, actor, seed: int, deterministic: bool):
    """``policy(obs, t, episode)``: the actor's action, its noise keyed by (episode, t)."""
    base = jax.random.key(seed)

    def policy(obs, t, ep):
        a = sac.act(nets, actor, np.asarray(obs, np.float32), base, ep, t, deterministic)
        return np.asarray(a)

    return policy


class OtherDraw(ValueError):
    """This machine draws other data than the reference manifest records."""


def _machine() -> dict:
    """What decides the draw besides the configuration: the CPU and the simulator."""
    import mujoco

    return {
        "cpu_model": cpu_model(),
        "cpu_kind": cpu_kind(),
        "mujoco": mujoco.__version__,
        "jax": jax.__version__,
    }


def check_snapshots(env_name: str, cfg: GenConfig, returns, reference_returns) -> None:
    """Raises ``OtherDraw`` at the first snapshot whose evaluated return is not, to the last
    bit, the reference's (equal machines draw equal agents; any difference grows)."""
    # while training, ``returns`` is a prefix of the reference's
    for i, (got, want) in enumerate(zip(returns, reference_returns, strict=False)):
        if got != want:
            raise OtherDraw(
                f"{env_name}: the SAC snapshot at {(i + 1) * cfg.snapshot_every} steps "
                f"evaluates {got!r}, the reference manifest {want!r}: this machine "
                f"({_machine()}) draws other datasets than the reference's"
            )


def _abstract(tree):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), tree)


def train_behaviour(
    env_name: str,
    cfg: GenConfig,
    workdir: Path,
    stop_after: int | None = None,
    reference_returns: list[float] | None = None,
) -> dict:
    """Trains (or resumes) the SAC agent; returns its buffer, snapshots and their returns.

    Args:
      env_name: hopper, halfcheetah or walker2d.
      cfg: the generator's configuration.
      workdir: where the agent's checkpoints live (resumes from them).
      stop_after: stop (checkpointed, resumable) at the first episode end after this many
        environment steps in total; None: train to ``cfg.sac_steps``.
      reference_returns: the snapshots' evaluated returns of a draw to reproduce; the first
        that differs raises ``OtherDraw`` (checkpointed snapshots are checked on resume).

    Returns:
      ``{"nets", "state", "buffer", "snapshots" (stacked actors [n, ...]), "snapshot_steps",
      "snapshot_returns", "env_steps", "done", "wall_s"}``.
    """
    env = make_env(env_name)
    obs_dim, act_dim = env.observation_space.shape[0], env.action_space.shape[0]
    if not (np.all(env.action_space.high == 1.0) and np.all(env.action_space.low == -1.0)):
        raise ValueError(f"{env_name}: SAC here assumes actions in [-1, 1]")
    sc = cfg.sac
    nets, state = sac.init_sac(obs_dim, act_dim, sc, cfg.seed)
    buf = Buffer(cfg.sac_steps, obs_dim, act_dim)
    n_snap = cfg.sac_steps // cfg.snapshot_every
    snapshots = jax.tree.map(lambda x: jnp.zeros((n_snap, *x.shape), x.dtype), state.actor)
    snap_returns: list[float] = []
    env_steps, episode, wall = 0, 0, 0.0
    ckpt = CheckpointIO(workdir / "sac_checkpoints", max_to_keep=1)
    tree = lambda: {"sac": state, "buffer": buf.arrays, "snapshots": snapshots}  # noqa: E731
    if ckpt.latest_step() is not None:
        restored, meta = ckpt.restore(_abstract(tree()))
        state, snapshots = restored["sac"], restored["snapshots"]
        buf.arrays = {k: np.asarray(v) for k, v in restored["buffer"].items()}
        buf.size, env_steps, episode = meta["size"], meta["env_steps"], meta["episode"]
        snap_returns, wall = meta["snapshot_returns"], meta["wall_s"]
        logging.info("%s SAC: resumed at %d environment steps", env_name, env_steps)
    if reference_returns is not None:
        check_snapshots(env_name, cfg, snap_returns, reference_returns)

    t0, last_save = time.perf_counter(), time.perf_counter()

    def save():
        meta = {
            "size": buf.size,
            "env_steps": env_steps,
            "episode": episode,
            "snapshot_returns": snap_returns,
            "wall_s": wall + time.perf_counter() - t0,
        }
        ckpt.save(env_steps, tree(), meta)

    key = jax.random.key(cfg.seed)
    recent: list[float] = []
    info = None
    stop = cfg.sac_steps if stop_after is None else min(stop_after, cfg.sac_steps)
    while env_steps < stop:
        obs, _ = env.reset(seed=_reset_seed(cfg.seed, STREAM_TRAIN, episode))
        done, ep_ret = False, 0.0
        while not done and env_steps < cfg.sac_steps:
            if env_steps < sc.start_steps:
                action = np.random.default_rng([cfg.seed, env_steps]).uniform(-1, 1, act_dim)
            else:
                o = np.asarray(obs, np.float32)
                action = np.asarray(sac.act(nets, state.actor, o, key, env_steps))
            next_obs, r, term, trunc, _ = env.step(action)
            env_steps += 1
            done = term or trunc
            cut = not done and env_steps == cfg.sac_steps
            buf.add(obs, action, r, next_obs, float(term), float(trunc or cut))
            obs, ep_ret = next_obs, ep_ret + float(r)
            if env_steps >= sc.start_steps and env_steps % sc.update_every == 0:
                rng = np.random.default_rng([cfg.seed, env_steps])
                batches = buf.sample(rng, sc.update_every, sc.batch_size)
                ukey = jax.random.fold_in(jax.random.key(cfg.seed + 1), env_steps)
                state, info = sac.update_many(nets, state, batches, ukey)
            if env_steps % cfg.snapshot_every == 0:
                i = env_steps // cfg.snapshot_every - 1
                snapshots = jax.tree.map(lambda s, a, i=i: s.at[i].set(a), snapshots, state.actor)
                ret = policy_return(
                    sac_policy(nets, state.actor, cfg.seed, True),
                    env_name,
                    cfg.seed,
                    STREAM_EVAL,
                    cfg.eval_episodes,
                )
                snap_returns.append(ret)
                if reference_returns is not None:
                    check_snapshots(env_name, cfg, snap_returns, reference_returns)
                logging.info(
                    "%s SAC step %d: eval return %.1f, training episodes %.1f, alpha %.3f",
                    env_name,
                    env_steps,
                    ret,
                    np.mean(recent[-10:]) if recent else float("nan"),
                    float(info["alpha"]) if info is not None else float("nan"),
                )
        episode += 1
        recent.append(ep_ret)
        if time.perf_counter() - last_save > cfg.save_every_s or env_steps >= stop:
            save()
            last_save = time.perf_counter()
    ckpt.close()
    env.close()
    steps = [(i + 1) * cfg.snapshot_every for i in range(n_snap)]
    return {
        "nets": nets,
        "state": state,
        "buffer": buf,
        "snapshots": snapshots,
        "snapshot_steps": steps,
        "snapshot_returns": snap_returns,
        "env_steps": env_steps,
        "done": env_steps >= cfg.sac_steps,
        "wall_s": wall + time.perf_counter() - t0,
    }


def collect(policy, env_name: str, dataset_id: str, n: int, seed: int, stream: int, **meta):
    """Rolls ``policy`` through minari's ``DataCollector`` for at least ``n`` transitions
    (whole episodes) and writes the dataset; returns (transitions, mean episode return)."""
    import minari

    env = minari.DataCollector(make_env(env_name), record_infos=False)
    steps, ep, returns = 0, 0, []
    while steps < n:
        obs, _ = env.reset(seed=_reset_seed(seed, stream, ep))
        done, total, t = False, 0.0, 0
        while not done:
            obs, r, term, trunc, _ = env.step(policy(obs, t, ep))
            done, total, t = term or trunc, total + float(r), t + 1
        steps, ep = steps + t, ep + 1
        returns.append(total)
    env.create_dataset(dataset_id, algorithm_name="SAC (aaren_jax examples/offline_rl)", **meta)
    env.close()
    return steps, float(np.mean(returns))


def update_manifest(root: Path, env_name: str, entry: dict) -> None:
    path = root / "manifest.json"
    root.mkdir(parents=True, exist_ok=True)
    with (root / "manifest.json.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        manifest = json.loads(path.read_text()) if path.exists() else {}
        manifest[env_name] = entry
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(manifest, indent=1) + "\n")
        os.replace(tmp, path)


def generate(
    env_name: str,
    cfg: GenConfig,
    data_root: str | os.PathLike | None = None,
    stop_after: int | None = None,
    reference: dict | None = None,
) -> dict | None:
    """Trains the behaviour agent (resuming) and writes the three datasets; returns the
    manifest entry of ``env_name`` (also written to ``<data root>/manifest.json``), or None
    when ``stop_after`` stopped the agent's training before its end (run again to resume).

    ``reference``: a manifest entry of ``env_name`` to reproduce. Its configuration must be
    ``cfg`` (``ValueError`` before any training); a snapshot return that differs from its
    own raises ``OtherDraw`` as soon as it is evaluated, and a finished entry whose
    fingerprint (``data.manifest_fingerprint``) differs raises it before it is written."""
    import minari

    reference_returns = None
    if reference is not None:
        ours = rl_data.drawing_config(dataclasses.asdict(cfg))
        theirs = rl_data.drawing_config(reference["config"])
        if ours != theirs:
            differ = sorted(k for k in ours.keys() | theirs.keys() if ours.get(k) != theirs.get(k))
            raise ValueError(
                f"reference: its {env_name} entry was generated with another configuration "
                f"({', '.join(f'{k}={theirs.get(k)!r}, here {ours.get(k)!r}' for k in differ)})"
            )
        reference_returns = reference["snapshot_returns"]
    root = rl_data.set_data_root(data_root)
    workdir = root / "behaviour" / f"{env_name}-seed{cfg.seed}-steps{cfg.sac_steps}"
    workdir.mkdir(parents=True, exist_ok=True)
    beh = train_behaviour(env_name, cfg, workdir, stop_after, reference_returns)
    if not beh["done"]:
        logging.info("%s: SAC stopped at %d steps; run again to resume", env_name, beh["env_steps"])
        return None
    nets, rets = beh["nets"], np.asarray(beh["snapshot_returns"])
    if len(rets) == 0:
        raise ValueError("no policy snapshot: --sac-steps must be at least --snapshot-every")
    # the expert: the best snapshot (a short SAC run's return swings between snapshots; D4RL's
    # expert is the final policy of an agent trained to convergence, roughly its best)
    expert_i = int(np.argmax(rets))
    expert_return = float(rets[expert_i])
    reached = np.flatnonzero(rets >= cfg.medium_fraction * expert_return)
    medium_i = int(reached[0]) if len(reached) else expert_i
    medium_step = beh["snapshot_steps"][medium_i]
    actor_at = lambda i: jax.tree.map(lambda s: s[i], beh["snapshots"])  # noqa: E731
    random_return = policy_return(
        lambda obs, t, ep: np.random.default_rng([cfg.seed, ep, t]).uniform(-1, 1, nets.act_dim),
        env_name,
        cfg.seed,
        STREAM_RANDOM,
        cfg.eval_episodes,
    )
    meta = {
        **DATASET_META,
        "ref_min_score": random_return,
        "ref_max_score": expert_return,
        "eval_env": ENV_IDS[env_name],
    }
    ids = {k: rl_data.dataset_id(env_name, k) for k in ("medium", "medium-replay", "expert")}
    ids["medium-expert"] = rl_data.dataset_id(env_name, "medium-expert")
    local = set(minari.list_local_datasets())
    sizes = {}

    def done_or_clear(dataset_id):
        if dataset_id in local:
            return True
        path = root / dataset_id  # a crashed write: start it again
        if path.exists():
            shutil.rmtree(path)
        return False

    if not done_or_clear(ids["medium"]):
        pol = sac_policy(nets, actor_at(medium_i), cfg.seed + 100, False)
        desc = f"D4RL-like {env_name} medium: SAC policy at {medium_step} steps (seed {cfg.seed})"
        collect(pol, env_name, ids["medium"], cfg.size, cfg.seed, STREAM_MEDIUM, description=desc,
                **meta)  # fmt: skip
    if not done_or_clear(ids["expert"]):
        pol = sac_policy(nets, actor_at(expert_i), cfg.seed + 200, False)
        desc = f"D4RL-like {env_name} expert: final SAC policy (seed {cfg.seed})"
        collect(pol, env_name, ids["expert"], cfg.size, cfg.seed, STREAM_EXPERT, description=desc,
                **meta)  # fmt: skip
    if not done_or_clear(ids["medium-replay"]):
        minari.create_dataset_from_buffers(
            ids["medium-replay"],
            beh["buffer"].episodes(medium_step),
            env=make_env(env_name),
            algorithm_name="SAC replay buffer (aaren_jax examples/offline_rl)",
            description=f"D4RL-like {env_name} medium-replay: SAC replay buffer to step "
            f"{medium_step} (seed {cfg.seed})",
            **meta,
        )
    if not done_or_clear(ids["medium-expert"]):
        minari.combine_datasets(
            [minari.load_dataset(ids["medium"]), minari.load_dataset(ids["expert"])],
            ids["medium-expert"],
        )
    for name, dataset_id in ids.items():
        ds = minari.load_dataset(dataset_id)
        ep_returns = [float(np.sum(e.rewards)) for e in ds.iterate_episodes()]
        sizes[name] = {
            "id": dataset_id,
            "transitions": int(ds.total_steps),
            "episodes": int(ds.total_episodes),
            "mean_return": float(np.mean(ep_returns)),
        }
    entry = {
        "env_id": ENV_IDS[env_name],
        "config": dataclasses.asdict(cfg),
        "sac_wall_s": beh["wall_s"],
        "snapshot_steps": beh["snapshot_steps"][: len(rets)],
        "snapshot_returns": [float(r) for r in rets],
        "medium_step": medium_step,
        "medium_policy_return": float(rets[medium_i]),
        "expert_step": beh["snapshot_steps"][expert_i],
        "expert_policy_return": expert_return,
        "random_policy_return": random_return,
        "datasets": sizes,
        "machine": _machine(),
    }
    if reference is not None and (
        rl_data.manifest_fingerprint(entry) != rl_data.manifest_fingerprint(reference)
    ):
        ignored = ("sac_wall_s", "machine", "config")  # the config was checked first
        differ = sorted(k for k in entry if k not in ignored and entry[k] != reference.get(k))
        raise OtherDraw(
            f"{env_name}: the finished draw differs from the reference manifest in "
            f"{', '.join(differ)} (this machine: {_machine()}); not written to the manifest"
        )
    update_manifest(root, env_name, entry)
    logging.info("%s: %s", env_name, json.dumps(entry["datasets"]))
    return entry


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    d = GenConfig()
    p.add_argument("--env", nargs="+", default=list(ENV_IDS), choices=list(ENV_IDS))
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--data-root", default=None, help=f"default: {rl_data.default_root()}")
    p.add_argument("--sac-steps", type=int, default=d.sac_steps, help="environment steps")
    p.add_argument("--snapshot-every", type=int, default=d.snapshot_every)
    p.add_argument("--size", type=int, default=d.size, help="transitions per rollout dataset")
    p.add_argument("--medium-fraction", type=float, default=d.medium_fraction)
    p.add_argument("--save-every-s", type=float, default=d.save_every_s)
    p.add_argument("--stop-after", type=int, default=None, help="SAC steps, then stop (resume)")
    p.add_argument(
        "--reference",
        default=None,
        help="a manifest.json to reproduce: stop at the first snapshot that differs",
    )
    return p.parse_args(argv)


def main(argv=None) -> None:
    setup_logging()
    args = parse_args(argv)
    cfg = GenConfig(
        seed=args.seed,
        sac_steps=args.sac_steps,
        snapshot_every=args.snapshot_every,
        size=args.size,
        medium_fraction=args.medium_fraction,
        save_every_s=args.save_every_s,
    )
    reference = None
    if args.reference is not None:
        reference = json.loads(Path(args.reference).read_text())
        missing = [e for e in args.env if e not in reference]
        if missing:
            raise ValueError(f"--reference {args.reference}: no entry for {missing}")
    for env_name in args.env:
        ref = None if reference is None else reference[env_name]
        generate(env_name, cfg, args.data_root, args.stop_after, ref)


if __name__ == "__main__":
    main()
