"""Carries datasets to another machine exactly as the reader sees them, in about half their
Minari size: ``export`` packs Minari datasets into one file, ``restore`` writes them back
as Minari datasets under another data root and checks that they read back bitwise equal.

    python examples/offline_rl/pack.py export --envs hopper --data-root <root> --out hopper.npz
    python examples/offline_rl/pack.py restore hopper.npz --data-root <other root>

Why: the generator is deterministic from its seed on one machine, but a run elsewhere (a
GPU machine, another CPU) would draw other datasets if it generated them again, and records
made on two sets of data are not compared. The reader (``data.load_trajectories``) reads
observations and actions as float32 and rewards as float64 (for the returns-to-go), so the
pack keeps exactly that: float32 observations (Minari stores rollouts as float64), float32
actions, float64 rewards, the flags, and each dataset's metadata. A combined dataset
(Minari's ``combined_datasets``, e.g. medium-expert) is not stored but combined again from
its parts, as ``generate.py`` made it. Each dataset's digest (``trajectory_digest`` of what
the reader returns) travels with it, and ``restore`` raises if a restored dataset differs.
Float arrays are stored byte-shuffled (the byte planes of all values one after another),
which deflate compresses far better than interleaved floats.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root

from examples.common import setup_logging  # noqa: E402
from examples.offline_rl import configs  # noqa: E402
from examples.offline_rl.data import (  # noqa: E402
    dataset_id,
    load_trajectories,
    open_dataset,
    set_data_root,
    trajectory_digest,
)

# Metadata passed back to ``minari.create_dataset_from_buffers`` as it was written.
_META_KEYS = (
    "algorithm_name",
    "author",
    "author_email",
    "code_permalink",
    "description",
    "ref_min_score",
    "ref_max_score",
    "num_episodes_average_score",
)


def _shuffle(a: np.ndarray) -> np.ndarray:
    """The byte planes of ``a``'s values one after another: uint8 [itemsize, a.size]."""
    a = np.ascontiguousarray(a)
    return a.view(np.uint8).reshape(a.size, a.itemsize).T.copy()


def _unshuffle(planes: np.ndarray, dtype: str, shape: list[int]) -> np.ndarray:
    return np.ascontiguousarray(planes.T).view(dtype).reshape(shape)


def _text(value) -> str | float | int | None:
    """A metadata value as written (Minari reads ``author`` back as a one-element set)."""
    if isinstance(value, set | frozenset | list | tuple):
        return ", ".join(sorted(str(v) for v in value))
    return value.item() if isinstance(value, np.generic) else value


def _episode_arrays(spec: str, data_root) -> tuple[dict[str, np.ndarray], dict]:
    """A dataset's episodes concatenated, as the reader casts them: observations
    [N + E, S] float32 (each episode's final one too), actions [N, A] float32, rewards [N]
    float64, terminations and truncations [N] bool, lengths [E]; and its metadata.
    ``N`` transitions, ``E`` episodes, ``S`` observation size, ``A`` action size."""
    ds = open_dataset(spec, data_root)
    md = ds.storage.metadata
    if not md.get("env_spec"):
        raise ValueError(
            f"{spec}: pack.py needs the dataset's environment (env_spec) to "
            "write it again, and its metadata has none"
        )
    obs, act, rew, term, trunc, lengths = [], [], [], [], [], []
    for ep in ds.iterate_episodes():
        obs.append(np.asarray(ep.observations, np.float32))
        act.append(np.asarray(ep.actions, np.float32).reshape(len(ep.actions), -1))
        rew.append(np.asarray(ep.rewards, np.float64))
        term.append(np.asarray(ep.terminations, bool))
        trunc.append(np.asarray(ep.truncations, bool))
        lengths.append(len(ep.actions))
    meta = {k: _text(md[k]) for k in _META_KEYS if md.get(k) is not None}
    meta["env_id"] = json.loads(md["env_spec"])["id"]
    if md.get("eval_env_spec"):
        meta["eval_env_id"] = json.loads(md["eval_env_spec"])["id"]
    arrays = {
        "observations": np.concatenate(obs),
        "actions": np.concatenate(act),
        "rewards": np.concatenate(rew),
        "terminations": np.concatenate(term),
        "truncations": np.concatenate(trunc),
        "lengths": np.asarray(lengths, np.int64),
    }
    return arrays, meta


def export(ids: list[str], data_root, out) -> dict:
    """Packs the Minari datasets ``ids`` (under ``data_root``; a combined one brings its
    parts) and the generator's manifest entries of their environments into ``out`` (.npz).

    Returns the pack's header: ``{"datasets": {id: {"meta", "digest", "arrays"}},
    "combined": {id: {"of": [ids], "digest"}}, "manifest": {env: entry}}``.
    """
    header: dict = {"datasets": {}, "combined": {}, "manifest": {}}
    stored: dict[str, np.ndarray] = {}
    pending = list(ids)
    while pending:
        spec = pending.pop(0)
        if spec in header["datasets"] or spec in header["combined"]:
            continue
        digest = trajectory_digest(load_trajectories(spec, data_root))
        parts = open_dataset(spec, data_root).storage.metadata.get("combined_datasets")
        if parts:
            header["combined"][spec] = {"of": list(parts), "digest": digest}
            pending.extend(parts)
            continue
        arrays, meta = _episode_arrays(spec, data_root)
        header["datasets"][spec] = {
            "meta": meta,
            "digest": digest,
            "arrays": {k: [str(a.dtype), list(a.shape)] for k, a in arrays.items()},
        }
        for k, a in arrays.items():
            stored[f"{spec}/{k}"] = _shuffle(a)
    manifest = Path(data_root) / "manifest.json" if data_root else None
    if manifest is not None and manifest.exists():
        entries = json.loads(manifest.read_text())
        names = {s.split("/")[1] for s in [*header["datasets"], *header["combined"]] if "/" in s}
        header["manifest"] = {k: v for k, v in entries.items() if k in names}
    np.savez_compressed(out, header=np.array(json.dumps(header)), **stored)
    return header


def _episodes(arrays: dict[str, np.ndarray]) -> list:
    from minari.data_collector import EpisodeBuffer

    ends = np.cumsum(arrays["lengths"])
    out = []
    for i, (end, n) in enumerate(zip(ends, arrays["lengths"], strict=True)):
        start = end - n
        out.append(
            EpisodeBuffer(
                id=i,
                # an episode has n + 1 observations: the earlier episodes' extra ones before it
                observations=arrays["observations"][start + i : end + i + 1],
                actions=arrays["actions"][start:end],
                rewards=arrays["rewards"][start:end],
                terminations=arrays["terminations"][start:end],
                truncations=arrays["truncations"][start:end],
            )
        )
    return out


def restore(pack, data_root) -> list[str]:
    """Writes the pack's datasets under ``data_root`` (a dataset already there is kept, and
    checked like the rest), merges its manifest entries into ``data_root/manifest.json``, and
    checks each dataset's digest. Returns the dataset ids.

    Raises:
      ValueError: a dataset read back differs from the one packed.
    """
    import gymnasium as gym
    import minari

    root = set_data_root(data_root)
    with np.load(pack) as z:
        header = json.loads(str(z["header"]))
        local = set(minari.list_local_datasets())
        for spec, entry in header["datasets"].items():
            if spec in local:
                continue
            arrays = {
                k: _unshuffle(z[f"{spec}/{k}"], dtype, shape)
                for k, (dtype, shape) in entry["arrays"].items()
            }
            meta = dict(entry["meta"])
            env = gym.make(meta.pop("env_id"))
            eval_env = meta.pop("eval_env_id", None)
            minari.create_dataset_from_buffers(
                spec, _episodes(arrays), env=env, eval_env=eval_env, **meta
            )
    for spec, entry in header["combined"].items():
        if spec not in set(minari.list_local_datasets()):
            minari.combine_datasets([minari.load_dataset(p) for p in entry["of"]], spec)
    if header["manifest"]:
        from examples.offline_rl.generate import update_manifest

        for env_name, entry in header["manifest"].items():
            update_manifest(root, env_name, entry)
    ids = [*header["datasets"], *header["combined"]]
    for spec in ids:
        expected = {**header["datasets"], **header["combined"]}[spec]["digest"]
        got = trajectory_digest(load_trajectories(spec, root))
        if got != expected:
            raise ValueError(
                f"{spec}: restored under {root} it reads back with digest {got}, packed {expected}"
            )
    return ids


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = p.add_subparsers(dest="command", required=True)
    e = sub.add_parser("export", help="pack datasets into one file")
    e.add_argument("--envs", nargs="+", default=[], choices=list(configs.ENV_IDS))
    e.add_argument("--datasets", nargs="+", default=list(configs.DATASETS))
    e.add_argument("--ids", nargs="+", default=[], help="any Minari dataset ids or folders")
    e.add_argument("--data-root", default=None, help="default: generate.py's")
    e.add_argument("--out", required=True, help="the pack (.npz)")
    r = sub.add_parser("restore", help="write a pack's datasets under a data root")
    r.add_argument("pack")
    r.add_argument("--data-root", default=None, help="default: generate.py's")
    return p.parse_args(argv)


def main(argv=None) -> None:
    setup_logging()
    args = parse_args(argv)
    root = set_data_root(args.data_root)
    if args.command == "export":
        ids = [dataset_id(env, ds) for env in args.envs for ds in args.datasets] + args.ids
        if not ids:
            raise SystemExit("error: name --envs or --ids")
        header = export(ids, root, args.out)
        logging.info(
            "%s: %d datasets, %d combined, %.1f MB",
            args.out,
            len(header["datasets"]),
            len(header["combined"]),
            Path(args.out).stat().st_size / 1e6,
        )
    else:
        for spec in restore(args.pack, root):
            logging.info("%s: restored, reads back equal", spec)


if __name__ == "__main__":
    main()
