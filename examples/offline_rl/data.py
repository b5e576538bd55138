"""Offline-RL data: any Minari dataset as Decision-Transformer windows.

The reader takes a Minari dataset id (looked up under the data root, ``MINARI_DATASETS_PATH``)
or the path of a dataset folder, and reads per episode the observations, actions, rewards,
terminations and truncations. As CORL's ``dt.py``:

* returns-to-go ``R_t = sum_{t' >= t} r_t'`` per episode (undiscounted), times ``reward_scale``;
* states normalised by the dataset's mean and standard deviation (+ 1e-6) over all steps;
* a training example is the window of ``K`` steps starting at a transition chosen uniformly
  among all transitions (CORL: an episode with probability proportional to its length, then
  a start uniformly inside it), cut at the episode's end and padded after it with zeros and
  ``mask = 0``; timesteps are absolute (``start .. start + K - 1``).

The generated datasets have ids ``aaren/<env>/<dataset>-v0`` (real Minari ones, e.g.
``mujoco/hopper/medium-v0``, load the same way).

Shape notation: ``B`` batch, ``K`` context steps, ``S`` observation size, ``A`` action size.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from pathlib import Path

import numpy as np

from examples.common.paths import runs_root

NAMESPACE = "aaren"


def default_root() -> Path:
    """``$MINARI_DATASETS_PATH`` if set, else ``<repo>/workdirs/offline_rl_data`` (git-ignored)."""
    env = os.environ.get("MINARI_DATASETS_PATH")
    return Path(env) if env else runs_root() / "offline_rl_data"


def set_data_root(root: str | os.PathLike | None) -> Path:
    """Points Minari at ``root`` (default ``default_root()``) and returns it."""
    path = Path(root) if root is not None else default_root()
    path.mkdir(parents=True, exist_ok=True)
    os.environ["MINARI_DATASETS_PATH"] = str(path.absolute())
    return path


def dataset_id(env: str, dataset: str) -> str:
    """The Minari id of a generated dataset, e.g. ``aaren/hopper/medium-v0``."""
    return f"{NAMESPACE}/{env}/{dataset}-v0"


def returns_to_go(rewards: np.ndarray) -> np.ndarray:
    """``R_t = sum_{t' >= t} r_t'``, accumulated in float64. [T] -> [T]"""
    return np.cumsum(np.asarray(rewards, np.float64)[::-1])[::-1]


def open_dataset(spec: str | os.PathLike, data_root: str | os.PathLike | None = None):
    """A ``minari.MinariDataset`` from an id (under ``data_root``) or a dataset folder.

    A folder is the one holding ``data/`` (as ``<root>/<id>``), or that ``data/`` folder.
    """
    import minari

    path = Path(spec)
    if path.is_dir():
        data = path / "data" if (path / "data").is_dir() else path
        return minari.MinariDataset(data)
    set_data_root(data_root)
    return minari.load_dataset(str(spec))


@dataclasses.dataclass
class Trajectories:
    """Episodes of one dataset, with returns-to-go and the state statistics.

    Attributes:
      observations: per episode [T, S] (the final next-observation dropped).
      actions: per episode [T, A].
      rewards: per episode [T].
      returns: per episode [T] returns-to-go (not scaled).
      terminations: per episode [T] bool.
      truncations: per episode [T] bool.
      state_mean: [S] mean of all observations.
      state_std: [S] their standard deviation + 1e-6.
      name: the dataset's id or path.
      ref_scores: (random, expert) reference returns from the dataset's metadata, or None.
    """

    observations: list[np.ndarray]
    actions: list[np.ndarray]
    rewards: list[np.ndarray]
    returns: list[np.ndarray]
    terminations: list[np.ndarray]
    truncations: list[np.ndarray]
    state_mean: np.ndarray
    state_std: np.ndarray
    name: str
    ref_scores: tuple[float, float] | None = None

    @property
    def num_transitions(self) -> int:
        return int(sum(len(a) for a in self.actions))

    @property
    def obs_dim(self) -> int:
        return self.observations[0].shape[-1]

    @property
    def act_dim(self) -> int:
        return self.actions[0].shape[-1]

    def episode_returns(self) -> np.ndarray:
        return np.array([float(np.sum(r)) for r in self.rewards])


def load_trajectories(
    spec: str | os.PathLike, data_root: str | os.PathLike | None = None
) -> Trajectories:
    """Reads a Minari dataset (id or folder) into ``Trajectories``."""
    ds = open_dataset(spec, data_root)
    obs, act, rew, ret, term, trunc = [], [], [], [], [], []
    for ep in ds.iterate_episodes():
        o = np.asarray(ep.observations, np.float32)
        if o.ndim != 2:
            raise ValueError(f"{spec}: observations must be flat vectors, got {o.shape[1:]}")
        n = len(ep.actions)
        obs.append(o[:n])
        act.append(np.asarray(ep.actions, np.float32).reshape(n, -1))
        rew.append(np.asarray(ep.rewards, np.float32))
        ret.append(returns_to_go(ep.rewards).astype(np.float32))
        term.append(np.asarray(ep.terminations, bool))
        trunc.append(np.asarray(ep.truncations, bool))
    if not obs:
        raise ValueError(f"{spec} has no episodes")
    allobs = np.concatenate(obs)
    meta = ds.storage.metadata
    lo, hi = meta.get("ref_min_score"), meta.get("ref_max_score")
    return Trajectories(
        obs,
        act,
        rew,
        ret,
        term,
        trunc,
        allobs.mean(0),
        allobs.std(0) + 1e-6,
        str(spec),
        None if lo is None or hi is None else (float(lo), float(hi)),
    )


def trajectory_digest(traj: Trajectories) -> str:
    """SHA-256 of everything the reader returns (arrays in episode order, statistics and
    reference scores): equal digests, equal training data."""
    h = hashlib.sha256()
    for episodes in (
        traj.observations,
        traj.actions,
        traj.rewards,
        traj.returns,
        traj.terminations,
        traj.truncations,
    ):
        for a in episodes:
            h.update(np.ascontiguousarray(a).tobytes())
    h.update(traj.state_mean.tobytes())
    h.update(traj.state_std.tobytes())
    h.update(repr(traj.ref_scores).encode())
    return h.hexdigest()


def manifest_entry(env: str, data_root: str | os.PathLike | None = None) -> dict | None:
    """``env``'s entry in the generator's ``<data root>/manifest.json``, or None."""
    path = (Path(data_root) if data_root is not None else default_root()) / "manifest.json"
    if not path.exists():
        return None
    return json.loads(path.read_text()).get(env)


def drawing_config(config: dict) -> dict:
    """A generator configuration (``GenConfig`` as a dict) without what does not decide the
    data: the checkpoint cadence."""
    return {k: v for k, v in config.items() if k != "save_every_s"}


def manifest_fingerprint(entry: dict) -> str:
    """SHA-256 of a generator manifest entry without what does not decide the data (the SAC
    wall time, the checkpoint cadence, the machine it names): the policies' evaluated returns
    and the datasets' sizes and mean returns, to the last bit. Datasets generated on another
    CPU or with another MuJoCo differ in it."""
    kept = {k: v for k, v in entry.items() if k not in ("sac_wall_s", "machine")}
    kept["config"] = drawing_config(entry["config"])
    return hashlib.sha256(json.dumps(kept, sort_keys=True).encode()).hexdigest()


class SequenceData:
    """Decision-Transformer windows over ``Trajectories``: a ``BatchSource`` for ``fit``.

    Example ``i`` is the window starting at the ``i``-th transition of the concatenated
    episodes (``starts`` restricts them, e.g. to a fixed validation subset).
    """

    def __init__(
        self,
        traj: Trajectories,
        seq_len: int,
        reward_scale: float,
        starts: np.ndarray | None = None,
    ):
        self.traj, self.seq_len, self.reward_scale = traj, seq_len, reward_scale
        lengths = np.array([len(a) for a in traj.actions])
        self._ep = np.repeat(np.arange(len(lengths)), lengths)
        self._t = np.concatenate([np.arange(n) for n in lengths])
        self._starts = np.arange(len(self._ep)) if starts is None else np.asarray(starts)

    def __len__(self) -> int:
        return len(self._starts)

    def batch(self, indices: np.ndarray) -> dict[str, np.ndarray]:
        """Windows: states [B, K, S] (normalised), actions [B, K, A], returns [B, K]
        (scaled), timesteps [B, K] int32, mask [B, K] (1 inside the episode)."""
        tr, k = self.traj, self.seq_len
        b = len(indices)
        out = {
            "states": np.zeros((b, k, tr.obs_dim), np.float32),
            "actions": np.zeros((b, k, tr.act_dim), np.float32),
            "returns": np.zeros((b, k), np.float32),
            "timesteps": np.zeros((b, k), np.int32),
            "mask": np.zeros((b, k), np.float32),
        }
        for row, i in enumerate(self._starts[np.asarray(indices)]):
            e, t = self._ep[i], self._t[i]
            n = min(k, len(tr.actions[e]) - t)
            out["states"][row, :n] = (tr.observations[e][t : t + n] - tr.state_mean) / tr.state_std
            out["actions"][row, :n] = tr.actions[e][t : t + n]
            out["returns"][row, :n] = tr.returns[e][t : t + n] * self.reward_scale
            out["timesteps"][row] = np.arange(t, t + k)
            out["mask"][row, :n] = 1.0
        return out


def validation_subset(n: int, size: int, seed: int) -> np.ndarray:
    """A fixed random subset of ``size`` window starts among ``n`` (for the logged fit MSE)."""
    return np.random.default_rng([seed, 7]).choice(n, size=min(size, n), replace=False)
