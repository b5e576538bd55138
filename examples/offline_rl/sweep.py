"""Resumable sweep: environment x dataset x model x seed, records appended as runs finish.

    python examples/offline_rl/sweep.py --results results/offline_rl.json
    python examples/offline_rl/sweep.py --envs hopper --datasets medium --seeds 0 --dry-run

Records ``{"env", "dataset", "model", "seed", "eval", "target", "score", "score_own",
"return", "eval_episodes", "ms_per_env_step", "wall_s", ...}`` (``eval``: ``window`` for both
models, and ``stream`` for Aaren; ``target``: ``corl`` or ``data_best``, ``train.targets``)
go to ``--results`` (default ``workdirs/offline_rl/results.json``; the committed table is
``results/offline_rl.json``). Runs already recorded are skipped; an interrupted run resumes
from its checkpoints in its run folder (keyed by its configuration).
Runs go seed-major and, within an environment and dataset, the Transformer then Aaren, so an
interrupted sweep leaves complete pairs behind. Environments whose datasets are not generated
yet are skipped with a message. ``--workers N`` runs N such sweeps side by side (on a machine
with many cores, or several jobs sharing one GPU); they share the runs through the claims.
"""

from __future__ import annotations

import argparse
import logging
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root

from examples.common import (  # noqa: E402
    append_record,
    claim_run,
    default_run_dir,
    load_records,
    record_key,
    results_path,
    setup_logging,
)
from examples.common.paths import ensure_importable  # noqa: E402
from examples.offline_rl import configs, train  # noqa: E402
from examples.offline_rl.data import dataset_id, default_root, set_data_root  # noqa: E402

KEY = ("env", "dataset", "model", "seed")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--envs", nargs="+", default=list(configs.ENV_IDS))
    p.add_argument("--datasets", nargs="+", default=list(configs.DATASETS))
    p.add_argument("--models", nargs="+", default=["transformer", "aaren"])
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    p.add_argument("--results", default=None, help="default: workdirs/offline_rl/results.json")
    p.add_argument("--data-root", default=None, help="Minari datasets (default: workdirs/...)")
    p.add_argument("--steps", type=int, default=None, help="training updates per run")
    p.add_argument(
        "--context", type=int, default=None, help="context K in steps (CORL: 20); own --results"
    )
    p.add_argument(
        "--fold-return",
        action="store_true",
        help="return-to-go token added to the state token (main.py's option); own --results",
    )
    p.add_argument("--rsa", action="store_true", help="RSA heads (main.py's option); own --results")
    p.add_argument("--eval-episodes", type=int, default=None)
    p.add_argument(
        "--keep-checkpoints",
        action="store_true",
        help="keep a finished run's checkpoints: evaluated again with other --eval-episodes "
        "(or another evaluation setting) without training",
    )
    p.add_argument("--max-runs", type=int, default=None, help="stop after this many new runs")
    p.add_argument(
        "--workers",
        type=int,
        default=1,
        help="sweep processes side by side, sharing the runs through their claims",
    )
    p.add_argument("--dry-run", action="store_true", help="list the pending runs and exit")
    p.add_argument("--no-progress", action="store_true", help="hide progress bars")
    return p.parse_args(argv)


def run_config(args, env: str, ds: str, model: str, seed: int) -> configs.Config:
    cfg = configs.get_config(env, ds, model, seed)
    cfg.data.data_root = args.data_root
    configs.set_run_length(cfg, args.steps, args.context)
    cfg.model.fold_return = args.fold_return
    cfg.model.rsa = args.rsa
    if args.eval_episodes is not None:
        cfg.eval.eval_episodes = args.eval_episodes
    cfg.loop.progress = not args.no_progress
    return cfg


def pending_runs(args: argparse.Namespace, done: set[tuple]) -> list[tuple]:
    """The (env, dataset, model, seed) runs not yet recorded, seed-major."""
    return [
        (env, ds, model, seed)
        for seed in args.seeds
        for env in args.envs
        for ds in args.datasets
        for model in args.models
        if (env, ds, model, seed) not in done
    ]


def check_same_data(results: Path, dataset: str, provenance: dict) -> None:
    """Refuses to add runs of ``dataset`` trained on other data than the runs ``results``
    holds of it (``train.data_provenance``: the generator draws other datasets on another
    CPU or MuJoCo, and a table that mixed them would compare unlike runs)."""
    records = [r for r in load_records(results) if r.get("dataset_id") == dataset]
    for key in ("data_digest", "data_manifest"):  # "mujoco" is recorded, not compared
        value = provenance[key]
        if value is None:
            continue
        held = {r.get(key) for r in records}
        held.discard(None)
        if held - {value}:
            raise SystemExit(
                f"error: {results} holds {dataset} runs on other data ({key} "
                f"{', '.join(sorted(h[:12] for h in held))}; this data root's: {value[:12]}). "
                "Carry the datasets they were trained on (pack.py), or give --results "
                "another file"
            )


def run_workers(argv: list[str], n: int) -> None:
    """``n`` copies of this sweep (``argv`` with one worker each), waited for. JAX does not
    take most of a GPU's memory up front in them, so that they can share one device."""
    env = {**os.environ, "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
    cmd = [sys.executable, str(Path(__file__).resolve()), *argv, "--workers", "1"]
    procs = [subprocess.Popen(cmd, env=env) for _ in range(n)]
    codes = [p.wait() for p in procs]
    if any(codes):
        raise SystemExit(f"error: sweep workers exited with {codes}")


def main(argv=None) -> None:
    setup_logging()
    ensure_importable()
    args = parse_args(argv)
    if args.workers < 1:
        raise SystemExit(f"error: --workers must be at least 1, got {args.workers}")
    results = results_path(args.results, "offline_rl")
    # one results file, one kind of run, so that its table compares like with like; records
    # from before the layout options were all trained at CORL's context of 20 with the
    # return-to-go as a token of its own, and those from before ``updates_asked`` asked for
    # the updates they ran
    cfg = run_config(args, args.envs[0], args.datasets[0], args.models[0], args.seeds[0])
    kind = (
        cfg.model.seq_len,
        cfg.model.fold_return,
        cfg.model.rsa,
        cfg.loop.max_epochs * cfg.loop.steps_per_epoch,
        cfg.eval.eval_episodes,
    )
    kinds = {
        (
            r.get("context_steps", configs.ModelConfig.seq_len),
            r.get("fold_return", False),
            r.get("rsa", False),
            r.get("updates_asked", r["train_steps"]),
            r["eval_episodes"],
        )
        for r in load_records(results)
    }
    if kinds - {kind}:
        raise SystemExit(
            f"error: {results} holds runs with (context, fold_return, rsa, updates_asked, "
            f"eval_episodes) {sorted(kinds)}; give --results another file for {kind}"
        )
    if args.workers > 1 and not args.dry_run:  # checked once here, not in every worker
        run_workers(sys.argv[1:] if argv is None else list(argv), args.workers)
        return
    done = {record_key(r, KEY) for r in load_records(results)}
    runs = pending_runs(args, done)
    logging.info("%d runs recorded, %d pending", len(done), len(runs))
    if args.dry_run:
        for run in runs:
            print(*run)  # the listing is the command's output
        return
    import minari

    root = Path(args.data_root) if args.data_root else default_root()
    set_data_root(root)
    local = set(minari.list_local_datasets())
    cache: dict[tuple, train.Trajectories] = {}
    new = 0
    for env, ds, model, seed in runs:
        if args.max_runs is not None and new >= args.max_runs:
            break
        if dataset_id(env, ds) not in local:
            logging.warning("%s not generated yet (generate.py --env %s): skipped", ds, env)
            continue
        cfg = run_config(args, env, ds, model, seed)
        workdir = default_run_dir("offline_rl", f"{env}-{ds}-{model}-{seed}", cfg)
        with claim_run(workdir.with_name(workdir.name + ".lock")) as claimed:
            # re-read under the claim: another sweep process may have recorded this run
            done = {record_key(r, KEY) for r in load_records(results)}
            if not claimed or (env, ds, model, seed) in done:
                logging.info("%s-%s-%s-%d: done or claimed by another sweep", env, ds, model, seed)
                continue
            if (env, ds) not in cache:
                cache.clear()
                cache[(env, ds)] = train.load_data(cfg)
                check_same_data(
                    results, cache[(env, ds)].name, train.data_provenance(cfg, cache[(env, ds)])
                )
            records = train.train_and_evaluate(
                cfg,
                str(workdir),
                traj=cache[(env, ds)],
                keep_checkpoints=args.keep_checkpoints,
            )
            for record in records:
                append_record(results, record)
        new += 1


if __name__ == "__main__":
    main()
