"""Trains and evaluates one Decision Transformer / Decision Aaren: ``python
examples/offline_rl/main.py --env hopper --dataset medium --model aaren``.

The dataset is the generated one (``generate.py``) unless ``--dataset-id`` names any Minari
dataset (an id under ``--data-root``, or a dataset folder).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root

from examples.common import default_run_dir, setup_logging  # noqa: E402
from examples.common.paths import ensure_importable  # noqa: E402
from examples.offline_rl import configs, train  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--env", default="hopper", choices=list(configs.ENV_IDS))
    p.add_argument("--dataset", default="medium", choices=list(configs.DATASETS))
    p.add_argument("--dataset-id", default=None, help="any Minari dataset id or folder")
    p.add_argument("--model", default="aaren", choices=["aaren", "transformer"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--data-root", default=None, help="Minari datasets (default: workdirs/...)")
    p.add_argument("--workdir", default=None, help="run folder (default: keyed by the config)")
    p.add_argument("--overwrite", action="store_true", help="discard the run folder's run")
    p.add_argument(
        "--keep-checkpoints",
        action="store_true",
        help="keep a finished run's checkpoints: evaluated again with other --eval-episodes "
        "(or another evaluation setting) without training",
    )
    p.add_argument("--steps", type=int, default=None, help="training updates (a multiple of 500)")
    p.add_argument("--max-steps", type=int, default=None, help="stop (resumable) after these")
    p.add_argument("--context", type=int, default=None, help="context K in steps (CORL: 20)")
    p.add_argument("--heads", type=int, default=None, help="attention heads (CORL: 1)")
    p.add_argument(
        "--fold-return",
        action="store_true",
        help="add the return-to-go token to the state token (CORL: a token of its own)",
    )
    p.add_argument(
        "--rsa",
        action="store_true",
        help="RSA heads: a learned regular REM gated into every head (CORL: softmax only)",
    )
    p.add_argument("--eval-episodes", type=int, default=None)
    p.add_argument("--target-return", type=float, default=None)
    p.add_argument("--no-stream", action="store_true", help="skip Aaren's streamed evaluation")
    p.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    return p.parse_args(argv)


def config_from_args(args: argparse.Namespace) -> configs.Config:
    cfg = configs.get_config(args.env, args.dataset, args.model, args.seed)
    cfg.data.dataset_id = args.dataset_id
    cfg.data.data_root = args.data_root
    configs.set_run_length(cfg, args.steps, args.context)
    if args.heads is not None:
        cfg.model.num_heads = args.heads
    cfg.model.fold_return = args.fold_return
    cfg.model.rsa = args.rsa
    cfg.loop.max_steps = args.max_steps
    if args.eval_episodes is not None:
        cfg.eval.eval_episodes = args.eval_episodes
    cfg.eval.target_return = args.target_return
    cfg.eval.stream = not args.no_stream
    cfg.loop.progress = not args.no_progress
    return cfg


def study_name(cfg: configs.Config) -> str:
    """``<env>-<dataset>-<model>-<seed>-<updates>[-k<K>][-h<heads>][-fold][-rsa]``: the folder of a
    run that keeps its checkpoints for a study (``drift.py``, ``conditioning.py``); the
    suffixes name what differs from CORL's context, heads, tokens and attention."""
    steps = cfg.loop.max_epochs * cfg.loop.steps_per_epoch
    d, m = cfg.data, cfg.model
    name = f"{d.env}-{d.dataset}-{m.backbone}-{cfg.loop.seed}-{steps}"
    if m.seq_len != configs.ModelConfig.seq_len:
        name += f"-k{m.seq_len}"
    if m.num_heads != configs.ModelConfig.num_heads:
        name += f"-h{m.num_heads}"
    if m.fold_return:
        name += "-fold"
    if m.rsa:
        name += "-rsa"
    return name


def main(argv=None) -> None:
    setup_logging()
    ensure_importable()
    args = parse_args(argv)
    cfg = config_from_args(args)
    name = f"{args.env}-{args.dataset}-{args.model}-{args.seed}"
    workdir = args.workdir or default_run_dir("offline_rl", name, cfg)
    train.train_and_evaluate(
        cfg, str(workdir), overwrite=args.overwrite, keep_checkpoints=args.keep_checkpoints
    )


if __name__ == "__main__":
    main()
