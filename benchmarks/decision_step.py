"""What one environment step of acting costs the offline-RL models: model call and MuJoCo step.

    python benchmarks/decision_step.py                     # Hopper, 1,000 steps, 5 rounds
    python benchmarks/decision_step.py --env halfcheetah --context 60
    python benchmarks/decision_step.py --quick             # 50 steps, 2 rounds (a smoke run)

The models are ``examples/offline_rl``'s default configuration (embedding 128, 3 layers,
1 head, context K = 20 steps), batch 1, eval mode, randomly initialised: the cost does not
depend on training. Four ways to act, each the policy the evaluation runs
(``examples/offline_rl/evaluate.py``), on the same normalised observations:

* ``transformer_window``: the Decision Transformer re-running its window of the last K steps
  (3K tokens) every step, as CORL evaluates and as it was trained;
* ``transformer_cache``: the Decision Transformer through its ``step`` with a KV cache that
  holds the whole episode (3 x 1,000 tokens; a step reads the cache's capacity);
* ``aaren_window``: Decision Aaren re-running the same window;
* ``aaren_stream``: Decision Aaren through its ``step``, three tokens per environment step
  into a carry of constant size.

A policy call is what the evaluation loop pays: host arrays in, the jitted call, the action
back on the host (``np.asarray`` waits for it). The environment's own step
(``gymnasium`` MuJoCo ``<Env>-v5``, random actions, reset at episode ends) is timed as a fifth
variant, so a full step is ``model + env``. Variants are interleaved round by round in an
order rotated every round; each round runs every variant for ``--steps`` steps after one
untimed call (compiled before the rounds). Writes
``results/decision_step_<env>_k<K>_<backend>.json``
(also printed): per variant the mean milliseconds per step of each round, their median and
spread, the same by step range, and per round the ratio to ``transformer_window``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
from _common import REPO, machine_info, tree_bytes, write_json
from flax import nnx

sys.path.insert(0, str(REPO))  # the examples
from examples.offline_rl import configs  # noqa: E402
from examples.offline_rl.evaluate import make_policy  # noqa: E402
from examples.offline_rl.model import DecisionModel  # noqa: E402

POLICIES = {
    "transformer_window": ("transformer", "window"),
    "transformer_cache": ("transformer", "stream"),
    "aaren_window": ("aaren", "window"),
    "aaren_stream": ("aaren", "stream"),
}
ENVS = {"hopper": "Hopper-v5", "halfcheetah": "HalfCheetah-v5", "walker2d": "Walker2d-v5"}
RANGES = ((0, 20), (20, 100), (100, 500), (500, 1000))


def policy_times(model: DecisionModel, mode: str, obs: np.ndarray, act_dim: int) -> np.ndarray:
    """Seconds of each of ``len(obs)`` policy calls of one episode (after an untimed one)."""
    steps, obs_dim = obs.shape
    policy = make_policy(mode, model, 1, obs_dim, act_dim)
    returns = np.full(1, 3.6, np.float32)
    action = np.zeros((1, act_dim), np.float32)
    policy(0, obs[:1], returns, action)  # untimed: the first call of a fresh policy
    policy = make_policy(mode, model, 1, obs_dim, act_dim)
    out = np.empty(steps)
    for t in range(steps):
        start = time.perf_counter()
        action = policy(t, obs[t : t + 1], returns, action)
        out[t] = time.perf_counter() - start
        returns = returns - np.float32(1e-3)
    return out


def env_times(env, steps: int, seed: int) -> np.ndarray:
    """Seconds of each of ``steps`` MuJoCo steps with random actions (resets untimed)."""
    env.reset(seed=seed)
    env.action_space.seed(seed)
    out = np.empty(steps)
    for t in range(steps):
        action = env.action_space.sample()
        start = time.perf_counter()
        _, _, term, trunc, _ = env.step(action)
        out[t] = time.perf_counter() - start
        if term or trunc:
            env.reset()
    return out


def summarise(per_round: list[np.ndarray]) -> dict:
    """Milliseconds per step: each round's mean, their median and spread, and by step range."""
    means = [1e3 * float(ts.mean()) for ts in per_round]
    row = {
        "ms_per_step_median": round(statistics.median(means), 4),
        "ms_per_step_min": round(min(means), 4),
        "ms_per_step_max": round(max(means), 4),
        "ms_per_step_per_round": [round(m, 4) for m in means],
    }
    steps = len(per_round[0])
    row["ms_per_step_by_range"] = {
        f"{lo}-{min(hi, steps) - 1}": round(
            statistics.median(1e3 * float(ts[lo:hi].mean()) for ts in per_round), 4
        )
        for lo, hi in RANGES
        if lo < steps
    }
    return row


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--env", choices=sorted(ENVS), default="hopper")
    p.add_argument("--steps", type=int, default=1000, help="timed steps per variant and round")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--context", type=int, default=None, help="K in steps (default: the config's)")
    p.add_argument("--quick", action="store_true", help="50 steps, 2 rounds")
    p.add_argument(
        "--out", default=None, help="default: results/decision_step_<env>_k<K>_<backend>.json"
    )
    args = p.parse_args(argv)
    if args.quick:
        args.steps, args.rounds = 50, 2
    import gymnasium as gym

    info = machine_info()
    env = gym.make(ENVS[args.env])
    obs_dim, act_dim = env.observation_space.shape[0], env.action_space.shape[0]
    # observations as the model sees them (normalised): a fixed random walk, one per run
    rng = np.random.default_rng(0)
    obs = np.cumsum(rng.normal(0.0, 0.1, (args.steps, obs_dim)), axis=0).astype(np.float32)

    models, sizes = {}, {}
    for backbone in ("transformer", "aaren"):
        cfg = configs.set_run_length(
            configs.get_config(args.env, "medium", backbone), None, args.context
        )
        models[backbone] = DecisionModel(cfg.model, obs_dim, act_dim, rngs=nnx.Rngs(0))
        sizes[backbone] = tree_bytes(nnx.state(models[backbone], nnx.Param))
    model_cfg = models["aaren"].config

    compile_s = {}
    for name, (backbone, mode) in POLICIES.items():  # compile every call before the rounds
        start = time.perf_counter()
        policy_times(models[backbone], mode, obs[:2], act_dim)
        compile_s[name] = round(time.perf_counter() - start, 2)
    env_times(env, 2, seed=0)

    names = [*POLICIES, "env"]
    times = {name: [] for name in names}
    for r in range(args.rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            if name == "env":
                times[name].append(env_times(env, args.steps, seed=r))
            else:
                backbone, mode = POLICIES[name]
                times[name].append(policy_times(models[backbone], mode, obs, act_dim))
    env.close()

    results = {name: summarise(ts) for name, ts in times.items()}
    base, env_s = times["transformer_window"], [ts.mean() for ts in times["env"]]
    for name in POLICIES:
        row, model_s = results[name], [ts.mean() for ts in times[name]]
        row["compile_and_first_calls_s"] = compile_s[name]
        ratios = [m / b.mean() for m, b in zip(model_s, base, strict=True)]
        row["ratio_to_transformer_window_per_round"] = [round(float(x), 3) for x in ratios]
        row["ratio_to_transformer_window_median"] = round(float(statistics.median(ratios)), 3)
        totals = [1e3 * float(m + e) for m, e in zip(model_s, env_s, strict=True)]
        row["with_env_ms_per_step_median"] = round(statistics.median(totals), 4)
    out = {
        "benchmark": "decision_step",
        "command": "python benchmarks/decision_step.py " + " ".join(argv or sys.argv[1:]),
        "machine": info,
        "env": ENVS[args.env],
        "steps": args.steps,
        "rounds": args.rounds,
        "batch": 1,
        "model": {
            "embedding_dim": model_cfg.embedding_dim,
            "num_layers": model_cfg.num_layers,
            "num_heads": model_cfg.num_heads,
            "context_steps": model_cfg.seq_len,
            "cache_tokens": 3 * model_cfg.episode_len,
            "param_bytes": sizes,
        },
        "results": results,
    }
    name = f"decision_step_{args.env}_k{model_cfg.seq_len}_{info['backend']}.json"
    path = args.out or REPO / "results" / name
    write_json(Path(path), out)
    return out


if __name__ == "__main__":
    main()
