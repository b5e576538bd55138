"""Online evaluation of a Decision Transformer / Decision Aaren in the MuJoCo environment.

Two modes, both in eval mode (no dropout):

* ``"window"`` (CORL's ``eval_rollout``, what training matches): at step ``t`` the model runs
  on the last ``K`` steps ``max(0, t - K + 1) .. t`` of (return-to-go, state, action), padded
  at the end to a fixed ``K`` (padding after the read position cannot change a causal
  output), and acts from the state token of step ``t``: ``3K`` tokens per environment step,
  for either backbone.
* ``"stream"`` (Decision Aaren): the whole episode through the stack's ``step``, three tokens
  per environment step into an O(1) carry; no window, so from step ``K`` on the model sees
  more history than in training.

Episodes run in lockstep (one batched model call per step); the returns-to-go start at the
target return and drop by each reward (scaled), as in CORL. ``ms_per_env_step`` is timed
separately with one environment (batch 1), model call and environment step together, after
compilation.

Shape notation: ``B`` episodes, ``K`` context steps, ``S`` observation size, ``A`` action size.
"""

from __future__ import annotations

import functools
import time
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from examples.offline_rl.model import DecisionModel, stream_next, stream_start


class Rollouts(NamedTuple):
    """Evaluation episodes.

    Attributes:
      returns: [B] undiscounted episode returns.
      lengths: [B] episode lengths.
      wall_s: seconds of the rollouts' loop (environments built and reset before).
    """

    returns: np.ndarray
    lengths: np.ndarray
    wall_s: float


@functools.partial(jax.jit, static_argnames="graphdef")
def _window_act(graphdef, params, states, actions, returns, timesteps, mask, pos):
    model = nnx.merge(graphdef, params)
    pred = model(states, actions, returns, timesteps, mask)  # [B, K, A]
    return jnp.take(pred, pos, axis=1)


@functools.partial(jax.jit, static_argnames=("graphdef", "max_len"))
def _stream_start(graphdef, params, returns, states, max_len):
    return stream_start(nnx.merge(graphdef, params), returns, states, max_len)


@functools.partial(jax.jit, static_argnames="graphdef", donate_argnames="carry")
def _stream_next(graphdef, params, carry, prev_actions, returns, states, t):
    t = jnp.full(returns.shape, t, jnp.int32)
    return stream_next(nnx.merge(graphdef, params), carry, prev_actions, returns, states, t)


class WindowPolicy:
    """CORL's windowed policy over the histories of ``B`` lockstep episodes."""

    def __init__(self, model: DecisionModel, batch: int, obs_dim: int, act_dim: int):
        model.eval()
        self.graphdef, self.params = nnx.split(model)
        c = model.config
        self.k, n = c.seq_len, c.episode_len + c.seq_len + 1
        self.states = np.zeros((batch, n, obs_dim), np.float32)
        self.actions = np.zeros((batch, n, act_dim), np.float32)
        self.returns = np.zeros((batch, n), np.float32)

    def __call__(self, t: int, states, returns, prev_actions) -> np.ndarray:
        self.states[:, t], self.returns[:, t] = states, returns
        if t > 0:
            self.actions[:, t - 1] = prev_actions
        start = max(0, t + 1 - self.k)
        sl = slice(start, start + self.k)
        b = self.states.shape[0]
        timesteps = np.broadcast_to(np.arange(start, start + self.k, dtype=np.int32), (b, self.k))
        mask = np.broadcast_to((np.arange(self.k) <= t - start).astype(np.float32), (b, self.k))
        out = _window_act(
            self.graphdef,
            self.params,
            self.states[:, sl],
            self.actions[:, sl],
            self.returns[:, sl],
            timesteps,
            mask,
            np.int32(t - start),
        )
        return np.asarray(out)


class StreamPolicy:
    """The whole episode through ``step``: one carry for ``B`` lockstep episodes."""

    def __init__(self, model: DecisionModel, max_len: int | None = None):
        model.eval()
        self.graphdef, self.params = nnx.split(model)
        self.max_len = max_len
        self.carry = None

    def __call__(self, t: int, states, returns, prev_actions) -> np.ndarray:
        # host arrays straight into the jitted calls: one dispatch per environment step
        if t == 0:
            self.carry, a = _stream_start(self.graphdef, self.params, returns, states, self.max_len)
        else:
            self.carry, a = _stream_next(
                self.graphdef, self.params, self.carry, prev_actions, returns, states, np.int32(t)
            )
        return np.asarray(a)


def make_policy(mode: str, model: DecisionModel, batch: int, obs_dim: int, act_dim: int):
    """``"window"`` or ``"stream"`` policy for ``batch`` lockstep episodes."""
    if mode == "window":
        return WindowPolicy(model, batch, obs_dim, act_dim)
    if mode == "stream":
        per_episode = len(model.config.token_kinds) * model.config.episode_len
        max_len = per_episode if model.config.backbone == "transformer" else None
        return StreamPolicy(model, max_len)
    raise ValueError(f"unknown evaluation mode {mode!r}; expected 'window' or 'stream'")


def rollout(
    policy,
    make_env,
    episodes: int,
    target_return: float,
    state_mean: np.ndarray,
    state_std: np.ndarray,
    reward_scale: float,
    seed: int,
    max_steps: int | None = None,
) -> Rollouts:
    """Runs ``episodes`` episodes in lockstep with ``policy(t, states, returns, prev_actions)``.

    Args:
      policy: a ``WindowPolicy`` or ``StreamPolicy`` for ``episodes`` episodes.
      make_env: builds one environment.
      episodes: number of episodes B.
      target_return: the unscaled return to condition on at the first step.
      state_mean, state_std: [S] the dataset's state statistics.
      reward_scale: the returns-to-go scale of training.
      seed: episode ``i`` resets with seed ``seed + i``.
      max_steps: stop every episode after this many steps (None: the environment's limit).

    Returns:
      The episodes' returns and lengths, and the wall time.
    """
    envs = [make_env() for _ in range(episodes)]
    obs = np.stack([e.reset(seed=seed + i)[0] for i, e in enumerate(envs)]).astype(np.float32)
    t0 = time.perf_counter()  # environments built and reset: the loop alone is timed
    limit = envs[0].spec.max_episode_steps if envs[0].spec is not None else None
    max_steps = max_steps or limit or 1000
    active = np.ones(episodes, bool)
    totals, lengths = np.zeros(episodes), np.zeros(episodes, np.int64)
    rtg = np.full(episodes, target_return * reward_scale, np.float32)
    actions = np.zeros((episodes, envs[0].action_space.shape[0]), np.float32)
    for t in range(max_steps):
        actions = policy(t, (obs - state_mean) / state_std, rtg.copy(), actions)
        for i in np.flatnonzero(active):
            o, r, term, trunc, _ = envs[i].step(actions[i])
            obs[i], totals[i], lengths[i] = o, totals[i] + r, lengths[i] + 1
            rtg[i] -= r * reward_scale
            active[i] = not (term or trunc)
        if not active.any():
            break
    wall = time.perf_counter() - t0
    for e in envs:
        e.close()
    return Rollouts(totals, lengths, wall)


def ms_per_env_step(
    mode: str, model: DecisionModel, make_env, obs_dim: int, act_dim: int, steps: int, **kw
) -> float:
    """Milliseconds per environment step (model call and step) of one episode, batch 1.

    The first run compiles; the second, timed, runs ``steps`` steps (or to the episode's end).
    """
    for timed in (False, True):
        policy = make_policy(mode, model, 1, obs_dim, act_dim)
        out = rollout(policy, make_env, 1, max_steps=steps if timed else 3, **kw)
    return 1e3 * out.wall_s / max(int(out.lengths[0]), 1)


def normalised(returns: np.ndarray, ref: tuple[float, float]) -> np.ndarray:
    """D4RL's normalised score: ``100 (R - random) / (expert - random)``."""
    lo, hi = ref
    return 100.0 * (np.asarray(returns) - lo) / (hi - lo)
