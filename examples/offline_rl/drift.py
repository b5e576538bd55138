"""How far Decision Aaren's stream drifts from its windowed actions over whole episodes.

    python examples/offline_rl/drift.py --env hopper --dataset medium-expert --seed 0 \
        --steps 2000 --data-root <cache>

Trains one Decision Aaren as ``main.py`` does (every ``main.py`` option applies; the run
folder, default ``workdirs/offline_rl/drift/`` and ``main.study_name``, keeps its
checkpoints, so a rerun resumes or reuses the trained parameters), then plays
``--episodes`` episodes in closed loop with the windowed policy (what training matches) and,
at every step, asks the stream for its action on the very same history (teacher forcing:
the stream sees what the window saw, so the difference is the model's alone, not a
compounding of its own actions). Until step ``K - 1`` both see the whole episode and must
agree to float32 round-off; after it the window drops the oldest steps and the stream
keeps them. The RMS difference of the two actions, and that difference relative to the
RMS of the windowed action, are reported per range of the timestep ``t`` (``[0, K)``,
then up to 50, 100, 200, 500, 1000). ``--context`` trains and plays with another ``K``.

One record per run goes to ``--out`` (default ``results/offline_rl_drift.json``):
``{"env", "dataset", "seed", "train_steps", "context_steps", "episodes", "return",
"episode_len", "score", "stream_return", "stream_episode_len", "stream_score", "buckets":
[{"t_from", "t_to", "steps", "rms_diff", "relative"}, ...], "data_digest", "data_manifest",
"mujoco", "cpu_model", "cpu_count", "jax", ...}``: ``return`` and ``score``
(D4RL-normalised) are the windowed policy's, ``stream_*`` the same model streaming in closed
loop over the same episode seeds (its own actions, so its own drift compounds).

Shape notation: ``B`` episodes, ``A`` action size.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
from pathlib import Path

import jax
import numpy as np
from flax import nnx

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root

from aaren_jax.native import cpu_kind, cpu_model  # noqa: E402
from examples.common import append_record, setup_logging  # noqa: E402
from examples.common.paths import REPO_ROOT, ensure_importable  # noqa: E402
from examples.offline_rl import configs, train  # noqa: E402
from examples.offline_rl import evaluate as ev  # noqa: E402
from examples.offline_rl import main as cli  # noqa: E402

EDGES = (50, 100, 200, 500, 1000)  # timestep ranges reported after the first K steps
DEFAULT_OUT = REPO_ROOT / "results" / "offline_rl_drift.json"


class TeacherForcedStream:
    """Acts with the window; records the stream's action on the same inputs at every step."""

    def __init__(self, model, batch: int, obs_dim: int, act_dim: int):
        self.window = ev.WindowPolicy(model, batch, obs_dim, act_dim)
        self.stream = ev.StreamPolicy(model)
        self.window_actions: list[np.ndarray] = []  # per step, [B, A]
        self.stream_actions: list[np.ndarray] = []

    def __call__(self, t: int, states, returns, prev_actions) -> np.ndarray:
        acted = self.window(t, states, returns, prev_actions)
        self.window_actions.append(acted)
        self.stream_actions.append(self.stream(t, states, returns, prev_actions))
        return acted


def drift_by_timestep(
    window: np.ndarray, stream: np.ndarray, lengths: np.ndarray, context: int
) -> list[dict]:
    """Per range of ``t`` (``[0, K)``, then up to each of ``EDGES``): the RMS of
    ``stream - window`` over the steps inside the episodes, and its ratio to the RMS of
    ``window``.

    Args:
      window, stream: [T, B, A] actions per step.
      lengths: [B] episode lengths (steps at ``t >= length`` are after the episode's end).
      context: ``K``, the window's length in steps.
    """
    inside = np.arange(window.shape[0])[:, None] < lengths[None, :]  # [T, B]
    edges = [0, context, *(e for e in EDGES if e > context)]
    out = []
    for lo, hi in zip(edges[:-1], edges[1:], strict=True):
        sel = inside[lo:hi]
        if not sel.any():
            break
        diff = (stream[lo:hi] - window[lo:hi])[sel]
        rms_diff = float(np.sqrt(np.mean(np.square(diff, dtype=np.float64))))
        rms = float(np.sqrt(np.mean(np.square(window[lo:hi][sel], dtype=np.float64))))
        out.append(
            {
                "t_from": lo,
                "t_to": min(hi, int(lengths.max())),
                "steps": int(sel.sum()),
                "rms_diff": rms_diff,
                "relative": rms_diff / rms if rms > 0 else None,
            }
        )
    return out


def main(argv=None) -> dict:
    setup_logging()
    ensure_importable()
    p = argparse.ArgumentParser(description=__doc__, add_help=False)
    p.add_argument("--episodes", type=int, default=5)
    p.add_argument("--out", default=str(DEFAULT_OUT))
    own, rest = p.parse_known_args(argv)
    args = cli.parse_args([*rest, "--model", "aaren"])
    cfg = cli.config_from_args(args)
    name = cli.study_name(cfg)
    workdir = args.workdir or str(REPO_ROOT / "workdirs" / "offline_rl" / "drift" / name)
    traj = train.load_data(cfg)
    result = train.fit_model(cfg, traj, workdir)  # a plain folder: its checkpoints stay
    model = result.model
    nnx.update(model, result.params)
    target = train.targets(cfg, traj)[0][1]
    play = functools.partial(
        ev.rollout,
        make_env=train.make_env_fn(args.env),
        episodes=own.episodes,
        target_return=target,
        state_mean=traj.state_mean,
        state_std=traj.state_std,
        reward_scale=cfg.data.reward_scale,
        seed=cfg.eval.seed,
    )
    policy = TeacherForcedStream(model, own.episodes, traj.obs_dim, traj.act_dim)
    out = play(policy)
    window, stream = np.stack(policy.window_actions), np.stack(policy.stream_actions)
    # the same model streaming in closed loop, on the same episode seeds: what its own
    # actions, not the window's, make of the drift
    streamed = play(ev.StreamPolicy(model))
    ref = configs.D4RL_REF[args.env]
    record = {
        "env": args.env,
        "dataset": args.dataset,
        "seed": args.seed,
        "train_steps": int(result.step),
        "context_steps": cfg.model.seq_len,
        "episodes": own.episodes,
        "target_return": float(target),
        "return": float(np.mean(out.returns)),
        "episode_len": float(np.mean(out.lengths)),
        "score": float(np.mean(ev.normalised(out.returns, ref))),
        "stream_return": float(np.mean(streamed.returns)),
        "stream_episode_len": float(np.mean(streamed.lengths)),
        "stream_score": float(np.mean(ev.normalised(streamed.returns, ref))),
        "buckets": drift_by_timestep(window, stream, out.lengths, cfg.model.seq_len),
        # which draw of the data (the generator draws other datasets on another CPU) and
        # which machine
        **train.data_provenance(cfg, traj),
        "cpu_model": cpu_model(),
        "cpu_kind": cpu_kind(),
        "cpu_count": os.cpu_count(),
        "jax": jax.__version__,
        "command": "python examples/offline_rl/drift.py " + " ".join(argv or sys.argv[1:]),
    }
    append_record(own.out, record)
    for b in record["buckets"]:
        print(
            f"t {b['t_from']:4d}-{b['t_to']:4d}: {b['steps']:5d} steps, rms diff "
            f"{b['rms_diff']:.2e}, relative {b['relative']:.3f}"
        )
    return record


if __name__ == "__main__":
    main()
