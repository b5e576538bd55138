"""Resumable sweep: dataset x model x seed, one JSON record per finished run.

    python examples/event_forecasting/sweep.py                   # 5 datasets, 2 models, 5 seeds
    python examples/event_forecasting/sweep.py --datasets sin --seeds 0 --dry-run

Records ``{"dataset", "model", "seed", "nll", "nll_time", "nll_mark", "rmse", "accuracy",
"true_nll", "events", "wall_s", ...}`` are appended to ``results/event_forecasting.json``;
runs already there are skipped, and an interrupted run resumes from its checkpoint in
``--workdir-root``. Runs go seed by seed (every dataset and model at seed 0 first), so an
interrupted sweep leaves complete comparisons behind. Every run uses the default
configuration of ``configs.py``.
"""

from __future__ import annotations

import argparse
import logging
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root

from examples.common import (  # noqa: E402
    append_record,
    claim_run,
    load_records,
    record_key,
    setup_logging,
)
from examples.common.paths import REPO_ROOT, ensure_importable  # noqa: E402
from examples.event_forecasting import configs, data, train  # noqa: E402

KEY = ("dataset", "model", "seed")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--datasets", nargs="+", default=list(data.DATASETS))
    p.add_argument("--models", nargs="+", default=["aaren", "transformer"])
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2, 3, 4])
    p.add_argument("--results", default=str(REPO_ROOT / "results" / "event_forecasting.json"))
    p.add_argument(
        "--workdir-root",
        default=str(REPO_ROOT / "workdirs" / "event_forecasting"),
        help="per-run checkpoints (deleted once the run's record is written)",
    )
    p.add_argument("--data-root", default=None, help="default: ../shared/data beside the repo")
    p.add_argument("--cache-dir", default=None, help="generated data (default: workdirs/...)")
    p.add_argument("--max-runs", type=int, default=None, help="stop after this many new runs")
    p.add_argument("--dry-run", action="store_true", help="list the pending runs and exit")
    p.add_argument("--no-progress", action="store_true", help="hide progress bars")
    return p.parse_args(argv)


def pending_runs(args: argparse.Namespace, done: set[tuple]) -> list[tuple]:
    """The (dataset, model, seed) runs not yet recorded: seed-major, then dataset, model."""
    return [
        (ds, model, seed)
        for seed in args.seeds
        for ds in args.datasets
        for model in args.models
        if (ds, model, seed) not in done
    ]


def main(argv=None) -> None:
    setup_logging()
    ensure_importable()
    args = parse_args(argv)
    done = {record_key(r, KEY) for r in load_records(args.results)}
    runs = pending_runs(args, done)
    logging.info("%d runs done, %d pending", len(done), len(runs))
    if args.dry_run:
        for run in runs:
            print(*run)  # the listing is the command's output
        return
    cache: dict[str, data.EventData] = {}
    for n, (ds, model, seed) in enumerate(runs):
        if args.max_runs is not None and n >= args.max_runs:
            break
        workdir = Path(args.workdir_root) / f"{ds}_{model}_{seed}"
        with claim_run(workdir.with_name(workdir.name + ".lock")) as claimed:
            # re-read under the claim: another sweep process may have recorded this run
            done = {record_key(r, KEY) for r in load_records(args.results)}
            if not claimed or (ds, model, seed) in done:
                logging.info("%s %s %d: done or claimed by another sweep", ds, model, seed)
                continue
            cfg = configs.get_config(ds, model, seed)
            cfg.data.data_root = args.data_root
            cfg.data.cache_dir = args.cache_dir
            cfg.loop.progress = not args.no_progress
            if ds not in cache:
                cache.clear()
                cache[ds] = train.load_data(cfg)
            record = train.train_and_evaluate(cfg, str(workdir), data=cache[ds])
            append_record(args.results, record)
            shutil.rmtree(workdir / "checkpoints", ignore_errors=True)


if __name__ == "__main__":
    main()
