"""How Decision Transformer and Decision Aaren respond to the return they are conditioned on.

    python examples/offline_rl/conditioning.py --env hopper --dataset medium-replay --seed 0 \
        --steps 5000 --data-root <cache>
    python examples/offline_rl/conditioning.py --report   # the tables of the records

Trains one Decision Transformer and one Decision Aaren as ``main.py`` does (every
``main.py`` option applies but ``--model``; the run folders,
``<env>-<dataset>-<model>-<seed>-<steps>[-k<K>][-h<heads>]`` under ``--workdir-root``, default
``workdirs/offline_rl/conditioning``, keep their checkpoints, so a rerun reuses the trained
parameters), then, for each target return (``--fractions`` of the dataset's best
episode return, and CORL's target):

* **closed loop**: the D4RL-normalised score over ``--episodes`` episodes, windowed (and, for
  Aaren, streamed), as ``train.evaluate_online`` scores a run;
* **open loop**: on ``train.VAL_WINDOWS`` fixed windows of the dataset, every return-to-go
  raised by ``target - best`` (what conditioning on ``target`` instead of the best return
  does to the tokens), the MSE of the predicted against the dataset's actions, and the share
  of the attention that the state token of each window's last step gives to return-to-go,
  state and action tokens, per layer (mean over windows and heads). For Aaren the query is
  the layer's learned one; for the Transformer, the state token's own.

One record per (model, target) goes to ``--out`` (default
``results/offline_rl_conditioning.json``): ``{"env", "dataset", "model", "seed",
"train_steps", "context_steps", "num_heads", "target", "target_return", "fraction_of_best",
"eval_episodes", "score", "score_std", "episode_len", "stream_score", "stream_episode_len",
"open_loop_mse", "attention_share": [{"layer", "return", "state", "action"}, ...],
"command"}`` (folded returns, ``--fold-return``: no ``"return"`` share, and
``"fold_return": true``).

Shape notation: ``B`` windows, ``K`` steps, ``T = nK`` tokens (``n`` per step:
``ModelConfig.token_kinds``), ``H`` heads, ``D`` head size.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root

from examples.common import append_record, load_records, setup_logging  # noqa: E402
from examples.common.paths import REPO_ROOT, ensure_importable  # noqa: E402
from examples.offline_rl import configs, train  # noqa: E402
from examples.offline_rl import main as cli  # noqa: E402
from examples.offline_rl.data import SequenceData, validation_subset  # noqa: E402

DEFAULT_OUT = REPO_ROOT / "results" / "offline_rl_conditioning.json"
DEFAULT_WORKDIRS = REPO_ROOT / "workdirs" / "offline_rl" / "conditioning"


def last_state_weights(attention, x: jax.Array) -> jax.Array:
    """The attention weights of the last step's state token (token ``T - 2``) over its causal
    prefix, tokens ``0 .. T - 2``: [B, H, T - 1].

    ``x`` [B, T, d] is the layer's (normalised) input; the query is Aaren's learned one or,
    for the Transformer, the state token's own.
    """
    b, n, _ = x.shape
    h, dh = attention.num_heads, attention.head_dim
    keys = attention.k_proj(x[:, : n - 1]).reshape(b, n - 1, h, dh)
    if hasattr(attention, "q0"):
        q = jnp.broadcast_to(attention.q_proj(attention.q0[...]).reshape(1, h, dh), (b, h, dh))
    else:
        q = attention.q_proj(x[:, n - 2]).reshape(b, h, dh)
    return jax.nn.softmax(jnp.einsum("bhd,bthd->bht", q, keys) / math.sqrt(dh), axis=-1)


def attention_shares(model, batch: dict) -> list[dict]:
    """Per layer, the mean share of the last state token's attention on each kind of token.

    Windows are full (every step inside the episode), so the causal prefix of the last
    state token is every token but the last action.
    """
    k, kinds = batch["returns"].shape[1], model.config.token_kinds
    x = model.tokens(*(batch[key] for key in ("states", "actions", "returns", "timesteps")))
    kind = jnp.arange(len(kinds) * k - 1) % len(kinds)  # of each token of the prefix
    out = []
    for i, block in enumerate(model.backbone.blocks):
        w = last_state_weights(block.attention, block.norm1(x))
        share = {
            name: float(jnp.mean(jnp.sum(jnp.where(kind == j, w, 0.0), axis=-1)))
            for j, name in enumerate(kinds)
        }
        out.append({"layer": i, **share})
        x, _ = block.forward(x, None, None)
    return out


def open_loop(model, cfg: configs.Config, traj, shift: float) -> tuple[float, list[dict]]:
    """(action MSE, attention shares) on the fixed validation windows that lie wholly inside
    their episodes, every return-to-go raised by ``shift`` (unscaled)."""
    k, scale = cfg.model.seq_len, cfg.data.reward_scale
    windows = SequenceData(traj, k, scale)
    val = SequenceData(traj, k, scale, validation_subset(len(windows), train.VAL_WINDOWS, 0))
    batch = val.batch(np.arange(len(val)))
    full = batch["mask"].all(axis=1)
    batch = {key: v[full] for key, v in batch.items()}
    batch["returns"] = batch["returns"] + np.float32(shift * scale)
    pred = model(batch["states"], batch["actions"], batch["returns"], batch["timesteps"])
    mse = float(jnp.mean((pred - batch["actions"]) ** 2))
    return mse, attention_shares(model, batch)


def _mean_std(values: list, fmt: str) -> str:
    """``mean ± std`` of the values that are not None (one value: itself; none: ``-``)."""
    values = [v for v in values if v is not None]
    if not values:
        return "-"
    if len(values) == 1:
        return format(values[0], fmt)
    return f"{np.mean(values):{fmt}} ± {np.std(values):{fmt}}"


def summary(records: list[dict]) -> str:
    """Markdown tables of the records, one per study (environment, dataset, updates, context,
    heads, layout, evaluation episodes (10 in records without the key), model): per target,
    mean ± standard deviation over the seeds of the window and stream scores, the open-loop
    MSE and layer 0's share of attention on returns-to-go. A record repeated (a rerun) counts
    once, its last copy."""
    runs: dict[tuple, dict] = {}
    for r in records:
        study = (r["env"], r["dataset"], r["train_steps"], r["context_steps"], r["num_heads"],
                 r.get("fold_return", False), r.get("eval_episodes", 10), r["model"])  # fmt: skip
        runs[(study, r["seed"], r["target"])] = r
    lines = []
    for study in dict.fromkeys(key[0] for key in runs):
        env, dataset, steps, k, heads, fold, episodes, model_name = study
        rows = [(seed, target, r) for (s, seed, target), r in runs.items() if s == study]
        seeds = sorted({seed for seed, _, _ in rows})
        lines += [
            f"\n{model_name}, {env} {dataset}, {steps} updates, K = {k}, {heads} head(s)"
            + (", return folded into the state token" if fold else "")
            + f", {episodes} episodes, seeds {seeds}",
            "",
            "| target | score (window) | score (stream) | open-loop MSE | layer 0 on returns |",
            "|---|---|---|---|---|",
        ]
        for target in dict.fromkeys(target for _, target, _ in rows):
            at = [r for _, t, r in rows if t == target]
            cells = [
                _mean_std([r["score"] for r in at], ".1f"),
                _mean_std([r["stream_score"] for r in at], ".1f"),
                _mean_std([r["open_loop_mse"] for r in at], ".3f"),
                _mean_std([r["attention_share"][0].get("return") for r in at], ".2f"),
            ]
            lines.append(f"| {target} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> list[dict]:
    setup_logging()
    ensure_importable()
    p = argparse.ArgumentParser(description=__doc__, add_help=False)
    p.add_argument("--report", action="store_true", help="print --out's tables and exit")
    p.add_argument("--fractions", type=float, nargs="+", default=[0.5, 1.0, 1.5, 2.0, 3.0])
    p.add_argument("--models", nargs="+", default=["transformer", "aaren"])
    p.add_argument("--episodes", type=int, default=10)
    p.add_argument("--out", default=str(DEFAULT_OUT))
    p.add_argument("--workdir-root", default=str(DEFAULT_WORKDIRS), help="the run folders")
    own, rest = p.parse_known_args(argv)
    if own.report:
        print(summary(load_records(own.out)))  # the tables are the command's output
        return []
    records = []
    for model_name in own.models:
        args = cli.parse_args([*rest, "--model", model_name])
        cfg = cli.config_from_args(args)
        cfg.eval.eval_episodes = own.episodes
        workdir = Path(own.workdir_root) / cli.study_name(cfg)
        traj = train.load_data(cfg)
        result = train.fit_model(cfg, traj, str(workdir))  # a plain folder: checkpoints stay
        model = result.model
        nnx.update(model, result.params)
        model.eval()
        best = float(np.max(traj.episode_returns()))
        corl = configs.TARGET_RETURNS[args.env][0]
        targets = [(f"{f:g}x best", f * best) for f in own.fractions] + [("corl", corl)]
        for target_name, target in targets:
            window = train.evaluate_online(model, cfg, traj, "window", target, timed=False)
            stream = None
            if model_name == "aaren":
                stream = train.evaluate_online(model, cfg, traj, "stream", target, timed=False)
            mse, shares = open_loop(model, cfg, traj, target - best)
            record = {
                "env": args.env,
                "dataset": args.dataset,
                "model": model_name,
                "seed": args.seed,
                "train_steps": int(result.step),
                "context_steps": cfg.model.seq_len,
                "num_heads": cfg.model.num_heads,
                **({"fold_return": True} if cfg.model.fold_return else {}),
                "target": target_name,
                "target_return": float(target),
                "fraction_of_best": float(target / best),
                "eval_episodes": own.episodes,
                "score": window["score"],
                "score_std": window["score_std"],
                "episode_len": window["episode_len"],
                "stream_score": None if stream is None else stream["score"],
                "stream_episode_len": None if stream is None else stream["episode_len"],
                "open_loop_mse": mse,
                "attention_share": shares,
                "command": "python examples/offline_rl/conditioning.py "
                + " ".join(argv or sys.argv[1:]),
            }
            append_record(own.out, record)
            records.append(record)
            stream_txt = "" if stream is None else f" stream {stream['score']:.1f}"
            last = ", ".join(f"{kind}s {shares[-1][kind]:.2f}" for kind in cfg.model.token_kinds)
            print(
                f"{model_name:11s} {target_name:9s} ({target:7.1f}): score "
                f"{window['score']:.1f}{stream_txt}, open-loop mse {mse:.3f}, last layer's "
                f"attention on {last}",
                flush=True,
            )
    return records


if __name__ == "__main__":
    main()
