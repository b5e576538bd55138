"""The streaming and training benchmarks for two revisions of the library, alternated.

    python benchmarks/before_after.py --before 374f97d              # HEAD's tree vs 374f97d
    python benchmarks/before_after.py --before 374f97d --rounds 3 --out results/x.json

Checks the ``--before`` revision out into a temporary git worktree and runs, ``--rounds``
times, first that revision's then this tree's ``benchmarks/streaming.py --quick`` and
``benchmarks/training.py --quick`` (or at ``--training-lengths``), each in a fresh process
whose ``PYTHONPATH`` points at that revision's ``src``, so both see the same machine noise.
Reports, per revision and round, Aaren's per-token step over the bare matmul floor and the
Transformer's per-token step at the largest checkpoint (streaming), and tokens per second of
one block at each N (training), then the medians over rounds and after / before ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from _common import REPO, machine_info, write_json


def run_benchmark(tree: Path, script: str, out: Path, options: list[str] | None = None) -> dict:
    env = dict(os.environ, PYTHONPATH=str(tree / "src"))
    options = ["--quick"] if options is None else options
    command = [sys.executable, str(tree / "benchmarks" / script), *options, "--out", str(out)]
    if script == "streaming.py":
        command.append("--no-plot")
    subprocess.run(command, cwd=tree / "benchmarks", env=env, check=True, capture_output=True)
    return json.loads(out.read_text())


def key_figures(streaming: dict, training: dict) -> dict:
    last = streaming["checkpoints"][-1]
    figures = {
        "aaren_over_floor_median": last["aaren_over_floor_median"],
        "aaren_us_median": last["aaren_us"]["median"],
        "transformer_us_median": last["transformer_us"]["median"],
    }
    for block in training["blocks"]:
        for kind in ("aaren", "transformer"):
            if isinstance(block.get(kind), dict):
                figures[f"{kind}_tokens_per_s_N{block['N']}"] = block[kind]["tokens_per_s"][
                    "median"
                ]
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", required=True, help="git revision to compare against")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument(
        "--training-lengths",
        type=int,
        nargs="+",
        default=None,
        help="training.py at these N (3 repeats) instead of its --quick",
    )
    parser.add_argument("--out", type=Path, default=REPO / "results" / "before_after_cpu.json")
    args = parser.parse_args()
    info = machine_info()
    training_options = None
    if args.training_lengths:
        training_options = ["--lengths", *map(str, args.training_lengths), "--repeats", "3"]
    rounds: dict[str, list[dict]] = {"before": [], "after": []}
    with tempfile.TemporaryDirectory() as tmp:
        before_tree = Path(tmp) / "before"
        subprocess.run(
            ["git", "worktree", "add", "--detach", str(before_tree), args.before],
            cwd=REPO,
            check=True,
            capture_output=True,
        )
        try:
            for r in range(args.rounds):
                for name, tree in (("before", before_tree), ("after", REPO)):
                    streaming = run_benchmark(tree, "streaming.py", Path(tmp) / f"s_{name}.json")
                    training = run_benchmark(
                        tree, "training.py", Path(tmp) / f"t_{name}.json", training_options
                    )
                    rounds[name].append(key_figures(streaming, training))
                    print(f"round {r} {name}: {rounds[name][-1]}", flush=True)
        finally:
            subprocess.run(
                ["git", "worktree", "remove", "--force", str(before_tree)], cwd=REPO, check=False
            )
    medians = {
        name: {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        for name, runs in rounds.items()
    }
    ratio = {k: round(medians["after"][k] / medians["before"][k], 3) for k in medians["after"]}
    head = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True
    ).stdout.strip()
    write_json(
        args.out,
        {
            "benchmark": "before_after",
            "command": "python benchmarks/before_after.py " + " ".join(sys.argv[1:]),
            "before": args.before,
            "after": f"{head} (working tree)",
            "machine": info,
            "rounds": rounds,
            "medians": medians,
            "after_over_before": ratio,
        },
    )


if __name__ == "__main__":
    main()
