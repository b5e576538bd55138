"""Resumable sweep: dataset x horizon x model x seed, one JSON record per finished run.

    python examples/forecasting/sweep.py                      # the paper's datasets, 3 seeds
    python examples/forecasting/sweep.py --datasets ETTh1 --horizons 96 --seeds 0 --dry-run
    python examples/forecasting/sweep.py --csv mine.csv --target OT --horizons 24 48 --seeds 0 1

Records ``{"dataset", "horizon", "model", "seed", "mse", "mae", "wall_s", ...}`` are appended
to ``--results`` (default ``workdirs/forecasting/results.json``, outside git; the committed
table is ``--results results/forecasting.json``); runs already there are skipped, and an
interrupted run resumes from its checkpoint in ``--workdir-root`` (a folder per run and
configuration). Every run uses the same default configuration.
"""

from __future__ import annotations

import argparse
import logging
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root

from examples.common import append_record, load_records, record_key, setup_logging  # noqa: E402
from examples.common.paths import ensure_importable, runs_root  # noqa: E402
from examples.common.results import results_path  # noqa: E402
from examples.common.runs import config_hash  # noqa: E402
from examples.forecasting import configs, data, train  # noqa: E402

KEY = ("dataset", "horizon", "model", "seed")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--datasets", nargs="+", default=None, help="default: the paper's (none with --csv)"
    )
    p.add_argument(
        "--csv", nargs="+", default=[], help="TSLib-format CSVs, each a dataset named by its stem"
    )
    p.add_argument("--target", default="OT", help="target column of the CSVs")
    p.add_argument("--freq", default=None, help="time features of the CSVs; default: inferred")
    p.add_argument("--split", default="auto", choices=data.SPLITS, help="split of the CSVs")
    p.add_argument("--seq-len", type=int, default=None, help="input length; default: protocol")
    p.add_argument(
        "--horizons", nargs="+", type=int, default=None, help="default: the dataset's protocol"
    )
    p.add_argument("--models", nargs="+", default=["aaren", "transformer"])
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    p.add_argument(
        "--results",
        default=None,
        help="records file; default workdirs/forecasting/results.json (the committed tables "
        "change only with --results results/forecasting.json)",
    )
    p.add_argument(
        "--workdir-root",
        default=str(runs_root() / "forecasting"),
        help="per-run checkpoints (deleted once the run's record is written)",
    )
    p.add_argument("--data-root", default=None, help="default: ../shared/data beside the repo")
    p.add_argument("--max-runs", type=int, default=None, help="stop after this many new runs")
    p.add_argument("--dry-run", action="store_true", help="list the pending runs and exit")
    p.add_argument("--no-progress", action="store_true", help="hide progress bars")
    return p.parse_args(argv)


def csv_datasets(args: argparse.Namespace) -> dict[str, Path]:
    """The ``--csv`` files by dataset name (their stems)."""
    by_name = {Path(p).stem: Path(p).resolve() for p in args.csv}
    if len(by_name) != len(args.csv):
        raise SystemExit("error: two --csv files share a name")
    clash = set(by_name) & set(args.datasets or ())
    if clash or set(by_name) & set(data.DATASETS):
        raise SystemExit(f"error: --csv names clash with named datasets: {sorted(by_name)}")
    missing = [str(p) for p in by_name.values() if not p.is_file()]
    if missing:
        raise SystemExit(f"error: --csv: no such file: {missing}")
    return by_name


def pending_runs(args: argparse.Namespace, done: set[tuple]) -> list[tuple]:
    """The (dataset, horizon, model, seed) runs not yet recorded, in sweep order."""
    runs = []
    if args.datasets is None:
        named = [] if getattr(args, "csv", None) else list(configs.PAPER_DATASETS)
    else:
        named = list(args.datasets)
    for ds in named + [Path(p).stem for p in getattr(args, "csv", [])]:
        for h in args.horizons or configs.horizons_for(ds):
            for model in args.models:
                for seed in args.seeds:
                    if (ds, h, model, seed) not in done:
                        runs.append((ds, h, model, seed))
    return runs


def main(argv=None) -> None:
    setup_logging()
    ensure_importable()
    args = parse_args(argv)
    args.results = str(results_path(args.results, "forecasting"))
    logging.info("records go to %s", args.results)
    csvs = csv_datasets(args)
    done = {record_key(r, KEY) for r in load_records(args.results)}
    runs = pending_runs(args, done)
    logging.info("%d runs done, %d pending", len(done), len(runs))
    if args.dry_run:
        for run in runs:
            print(*run)  # the listing is the command's output
        return
    cache: dict[tuple, data.ForecastData] = {}
    for n, (ds, h, model, seed) in enumerate(runs):
        if args.max_runs is not None and n >= args.max_runs:
            break
        cfg = configs.get_config(ds, h, model, seed)
        cfg.data.data_root = args.data_root
        cfg.loop.progress = not args.no_progress
        if args.seq_len is not None:
            cfg.data.seq_len = args.seq_len
        if ds in csvs:
            cfg.data.csv = str(csvs[ds])
            cfg.data.csv_sha256 = data.sha256_file(csvs[ds])
            cfg.data.target, cfg.data.freq, cfg.data.split = args.target, args.freq, args.split
        key = (ds, cfg.data.seq_len, h)
        if key not in cache:
            cache.clear()  # keep one dataset in memory
            cache[key] = train.load_data(cfg)
        # one folder per configuration: a changed default never meets an old run
        workdir = Path(args.workdir_root) / f"{ds}_{h}_{model}_{seed}-{config_hash(cfg)}"
        record = train.train_and_evaluate(cfg, str(workdir), data=cache[key])
        append_record(args.results, record)
        shutil.rmtree(workdir / "checkpoints", ignore_errors=True)


if __name__ == "__main__":
    main()
