"""Prints the README's tables from ``results/event_forecasting.json`` (mean +- std over seeds).

python examples/event_forecasting/report.py
python examples/event_forecasting/report.py --results other.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root

from examples.common import load_records  # noqa: E402
from examples.common.paths import REPO_ROOT  # noqa: E402
from examples.event_forecasting.data import DATASETS  # noqa: E402

# The paper's Table 2 (Aaren, Transformer); None where the paper has no entry.
PAPER = {
    "wikipedia": {"nll": (8.98, 9.66), "rmse": (0.22, 0.28), "accuracy": (21.26, 23.60)},
    "stackoverflow": {"nll": (2.91, 2.92), "rmse": (1.27, 1.44), "accuracy": (46.34, 46.44)},
    "sin": {"nll": (0.78, 0.68), "rmse": (2.03, 1.75), "accuracy": (None, None)},
    "taxi": {"nll": (2.33, 2.01), "rmse": (10.01, 10.34), "accuracy": (None, None)},
    "hawkes": {"nll": (None, None), "rmse": (None, None), "accuracy": (None, None)},
}
METRICS = ("nll", "rmse", "accuracy")


def _stats(values: list[float]) -> tuple[float, float, int]:
    mean = statistics.fmean(values)
    std = statistics.stdev(values) if len(values) > 1 else float("nan")
    return mean, std, len(values)


def _fmt(values: list[float], digits: int) -> str:
    if not values:
        return "-"
    mean, std, n = _stats(values)
    spec = ".3g" if abs(mean) >= 1000 else f".{digits}f"  # RMSE in seconds (Wikipedia)
    if n == 1:
        return f"{mean:{spec}} (1 seed)"
    return f"{mean:{spec}} +- {std:{spec}} ({n})"


def table(records: list[dict]) -> str:
    """One row per (dataset, metric): ours for both models beside the paper's."""
    lines = [
        "| dataset | metric | Aaren (ours) | Transformer (ours) | Aaren (paper) "
        "| Transformer (paper) | Aaren within 1 std of ours or better |",
        "|---|---|---|---|---|---|---|",
    ]
    for ds in DATASETS:
        rows = {
            m: [r for r in records if r["dataset"] == ds and r["model"] == m]
            for m in ("aaren", "transformer")
        }
        if not rows["aaren"] and not rows["transformer"]:
            continue
        for metric in METRICS:
            vals = {
                m: [r[metric] for r in rs if r.get(metric) is not None] for m, rs in rows.items()
            }
            if not vals["aaren"] and not vals["transformer"]:
                continue
            digits = 2 if metric == "accuracy" else 4
            verdict = "-"
            if len(vals["aaren"]) > 1 and len(vals["transformer"]) > 1:
                a, _, _ = _stats(vals["aaren"])
                t, sd, _ = _stats(vals["transformer"])
                better = a >= t - sd if metric == "accuracy" else a <= t + sd
                verdict = "yes" if better else "no"
            paper = PAPER[ds][metric]
            show = lambda v: "-" if v is None else f"{v}"  # noqa: E731
            lines.append(
                f"| {ds} | {metric} | {_fmt(vals['aaren'], digits)} | "
                f"{_fmt(vals['transformer'], digits)} | {show(paper[0])} | {show(paper[1])} "
                f"| {verdict} |"
            )
    return "\n".join(lines)


def true_gap_table(records: list[dict]) -> str:
    """NLL above the generating process's own NLL on the same test events."""
    lines = [
        "| dataset | model | seeds | model NLL | process NLL | gap (nats/event) |",
        "|---|---|---|---|---|---|",
    ]
    for ds in DATASETS:
        for m in ("aaren", "transformer"):
            rs = [
                r
                for r in records
                if r["dataset"] == ds and r["model"] == m and r.get("true_nll") is not None
            ]
            if not rs:
                continue
            gaps = [r["nll"] - r["true_nll"] for r in rs]
            lines.append(
                f"| {ds} | {m} | {len(rs)} | {_fmt([r['nll'] for r in rs], 4)} | "
                f"{rs[0]['true_nll']:.4f} | {_fmt(gaps, 4)} |"
            )
    return "\n".join(lines)


def cost_table(records: list[dict]) -> str:
    """Mean wall time and epochs per run."""
    lines = ["| dataset | model | runs | wall s (mean) | epochs (mean) |", "|---|---|---|---|---|"]
    for ds in DATASETS:
        for m in ("aaren", "transformer"):
            rs = [r for r in records if r["dataset"] == ds and r["model"] == m]
            if rs:
                lines.append(
                    f"| {ds} | {m} | {len(rs)} | {statistics.fmean(r['wall_s'] for r in rs):.0f} "
                    f"| {statistics.fmean(r['epochs'] for r in rs):.1f} |"
                )
    return "\n".join(lines)


def streaming_table(path: Path) -> str:
    """Per-event latency (min and median, ms) and carry bytes from the streaming benchmark."""
    import json

    bench = json.loads(Path(path).read_text())
    m = bench["machine"]
    lines = [
        f"{bench['command']} on {m['cpu_model']} ({m['cpu_count']} cores, load average "
        f"{m['load_average_at_start']} at start), jax {m['jax']}, batch 1, float32, "
        f"{bench['steps_timed']} timed events per row.",
        "",
        "| events seen | model | cache | latency min (ms) | latency median (ms) | carry bytes |",
        "|---|---|---|---|---|---|",
    ]
    for name, rows in bench["results"].items():
        model = "Aaren" if name == "aaren" else "Transformer"
        cache = "-" if name == "aaren" else ("filled" if name == "transformer" else "empty")
        for r in rows:
            lines.append(
                f"| {r['events']} | {model} | {cache} | {r['latency_ms']['min']} | "
                f"{r['latency_ms']['median']} | {r['carry_bytes']:,} |"
            )
    return "\n".join(lines)


def baseline_table(data_root: str | None) -> str:
    """Trivial predictors on each dataset's test split, over the models' predicted events.

    Marks: ``repeat last`` (the previous event's mark), ``most frequent`` (the training split's
    most frequent mark), ``most frequent so far`` (the mark seen most often earlier in the
    window, ties to the most recent), and the shares of events whose mark occurs in the
    training split and earlier in the window. Times: the RMSE of predicting every gap by the
    training split's mean gap, the log-gap statistics that set the mixture's scale
    (``sigma_s``) and the range of log gaps in training, and the largest factor
    ``exp((sigma_s s_k)^2 / 2)`` by which a component's width can raise its mean, at the
    log-scale clamps 1, 0 and -0.5 (Wikipedia's).
    """
    import numpy as np

    from examples.event_forecasting.data import load_dataset

    marks = [
        "| dataset | repeat last mark (%) | most frequent training mark (%) "
        "| most frequent mark so far (%) | mark occurs in training (%) "
        "| mark occurred earlier in the window (%) |",
        "|---|---|---|---|---|---|",
    ]
    times = [
        "| dataset | RMSE of the mean training gap | sigma_s | log gap range (train) "
        "| width factor, clamp 1 | width factor, clamp 0 | width factor, clamp -0.5 |",
        "|---|---|---|---|---|---|---|",
    ]
    for ds in ("stackoverflow", "taxi", "wikipedia", "sin", "hawkes"):
        d = load_dataset(ds, data_root, max_train_events=None)
        train_gaps = np.concatenate([s.gaps()[s.predicted()] for s in d.train.seqs])
        train_marks = np.concatenate([s.marks[s.predicted()] for s in d.train.seqs])
        in_train = np.zeros(d.num_marks, bool)
        in_train[np.concatenate([s.marks for s in d.train.seqs])] = True
        top = np.bincount(train_marks, minlength=d.num_marks).argmax()
        rep = hit = so_far = known = seen = n = 0
        sq = 0.0
        for s in d.test.seqs:
            pred = s.predicted()
            sq += float(np.sum((s.gaps()[pred] - train_gaps.mean()) ** 2))
            prev = np.concatenate([[-1], s.marks[:-1]])[pred]  # no previous mark: a miss
            rep += int(np.sum(prev == s.marks[pred]))
            hit += int(np.sum(s.marks[pred] == top))
            known += int(np.sum(in_train[s.marks[pred]]))
            counts: dict[int, tuple[int, int]] = {}  # mark -> (count, last position)
            for i, k in enumerate(s.marks):
                if pred[i] and counts:
                    guess = max(counts, key=lambda m: counts[m])
                    so_far += int(guess == k)
                    seen += int(int(k) in counts)
                counts[int(k)] = (counts.get(int(k), (0, 0))[0] + 1, i)
            n += int(pred.sum())
        if d.has_marks:
            pct = [100 * x / n for x in (rep, hit, so_far, known, seen)]
            marks.append(f"| {ds} | " + " | ".join(f"{x:.2f}" for x in pct) + " |")
        logs = np.log(train_gaps)
        times.append(
            f"| {ds} | {np.sqrt(sq / n):.4g} | {d.train.log_std:.3f} "
            f"| [{logs.min():.2f}, {logs.max():.2f}] "
            + "".join(
                f"| {np.exp((d.train.log_std * np.exp(clamp)) ** 2 / 2):.3g} "
                for clamp in (1.0, 0.0, -0.5)
            )
            + "|"
        )
    return "\n".join(marks) + "\n\n" + "\n".join(times)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--results", default=str(REPO_ROOT / "results" / "event_forecasting.json"))
    p.add_argument("--streaming", default=str(REPO_ROOT / "results" / "event_streaming_cpu.json"))
    p.add_argument("--baselines", action="store_true", help="trivial mark predictors")
    p.add_argument("--data-root", default=None, help="default: ../shared/data beside the repo")
    args = p.parse_args(argv)
    records = load_records(args.results)
    print(table(records))
    print()
    print(true_gap_table(records))
    print()
    print(cost_table(records))
    if Path(args.streaming).exists():
        print()
        print(streaming_table(Path(args.streaming)))
    if args.baselines:
        print()
        print(baseline_table(args.data_root))


if __name__ == "__main__":
    main()
