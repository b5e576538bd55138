"""Renders the README's result tables from the JSON files in ``results/``.

    python benchmarks/report.py                 # every table whose results exist
    python benchmarks/report.py --only scan
    python benchmarks/report.py --only cost     # after benchmarks/examples_cost.py

Each figure in a table is read from ``results/``; the paper's numbers beside ours are
quoted from "Attention as an RNN" (Feng et al., 2024), Tables 3-5 and 4 (Appendix D).
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

import numpy as np

RESULTS = Path(__file__).resolve().parents[1] / "results"

# Paper, Table 5 (Appendix D): MSE and MAE, mean +- std, for (Aaren, Transformer).
PAPER_FORECASTING = {
    ("ETTh1", 96): ((0.53, 0.04, 0.52, 0.02), (0.54, 0.01, 0.50, 0.01)),
    ("ETTh1", 192): ((0.59, 0.03, 0.55, 0.01), (0.64, 0.05, 0.57, 0.02)),
    ("ETTh1", 336): ((0.65, 0.03, 0.55, 0.01), (0.65, 0.02, 0.55, 0.01)),
    ("ETTh1", 720): ((0.67, 0.05, 0.62, 0.02), (0.70, 0.05, 0.58, 0.02)),
    ("ETTh2", 96): ((0.38, 0.02, 0.44, 0.02), (0.41, 0.04, 0.40, 0.02)),
    ("ETTh2", 192): ((0.49, 0.03, 0.48, 0.02), (0.50, 0.03, 0.46, 0.01)),
    ("ETTh2", 336): ((0.57, 0.05, 0.47, 0.02), (0.59, 0.03, 0.50, 0.01)),
    ("ETTh2", 720): ((0.55, 0.03, 0.52, 0.01), (0.60, 0.03, 0.52, 0.01)),
    ("ETTm1", 96): ((0.48, 0.02, 0.44, 0.01), (0.44, 0.01, 0.41, 0.01)),
    ("ETTm1", 192): ((0.51, 0.03, 0.47, 0.01), (0.52, 0.05, 0.47, 0.01)),
    ("ETTm1", 336): ((0.54, 0.02, 0.49, 0.01), (0.57, 0.03, 0.51, 0.01)),
    ("ETTm1", 720): ((0.60, 0.03, 0.52, 0.01), (0.66, 0.06, 0.56, 0.02)),
    ("ETTm2", 96): ((0.24, 0.03, 0.30, 0.02), (0.25, 0.01, 0.30, 0.01)),
    ("ETTm2", 192): ((0.34, 0.04, 0.39, 0.02), (0.38, 0.02, 0.37, 0.01)),
    ("ETTm2", 336): ((0.41, 0.03, 0.42, 0.01), (0.49, 0.05, 0.43, 0.02)),
    ("ETTm2", 720): ((0.51, 0.03, 0.49, 0.02), (0.56, 0.02, 0.47, 0.01)),
    ("weather", 96): ((0.18, 0.00, 0.23, 0.00), (0.18, 0.00, 0.23, 0.00)),
    ("weather", 192): ((0.25, 0.01, 0.28, 0.00), (0.24, 0.01, 0.28, 0.00)),
    ("weather", 336): ((0.31, 0.00, 0.32, 0.00), (0.31, 0.02, 0.34, 0.01)),
    ("weather", 720): ((0.40, 0.00, 0.39, 0.00), (0.38, 0.02, 0.39, 0.01)),
}
# Paper, Table 4: accuracy (%), mean +- std, for (Aaren, Transformer).
PAPER_CLASSIFICATION = {
    "JapaneseVowels": ((96.65, 0.75), (96.38, 0.91)),
    "Handwriting": ((27.39, 1.46), (26.54, 2.25)),
}


def _load(name):
    path = RESULTS / name
    return json.loads(path.read_text()) if path.exists() else None


def _mean_std(values):
    values = np.asarray(values, float)
    return f"{values.mean():.3f} +- {values.std():.3f} (n={len(values)})"


def scan_table():
    report = _load("scan_cpu.json")
    if report is None:
        return None
    machine = report["machine"]
    lines = [
        f"Machine: {machine['cpu_model']}, {machine['cpu_count']} cores, jax {machine['jax']} "
        f"({machine['backend']}), load average {machine['load_average_at_start']} at the start. "
        f"Command: `{report['command']}`.",
        "",
        "| N | method | forward ms (median) | x floor (per round) | fwd+bwd ms (median) "
        "| x floor (per round) | compile fwd / fwd+bwd s |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in report["results"]:
        floor_f = row["floor"]["forward"]["ms"]["median"]
        floor_b = row["floor"]["forward_backward"]["ms"]["median"]
        lines.append(f"| {row['N']} | floor | {floor_f:.1f} | 1 | {floor_b:.1f} | 1 | |")
        for method in ("auto", "blocked", "associative", "sequential", "chunked"):
            if method not in row:
                continue
            f, b = row[method]["forward"], row[method]["forward_backward"]
            ratio = {
                kind: "{of_medians:.2f} ({per_round_min:.2f}-{per_round_max:.2f})".format(
                    **t["ratio_to_floor"]
                )
                for kind, t in (("f", f), ("b", b))
            }
            lines.append(
                f"| {row['N']} | {method} | {f['ms']['median']:.1f} | {ratio['f']} "
                f"| {b['ms']['median']:.1f} | {ratio['b']} "
                f"| {f['compile_s']:.1f} / {b['compile_s']:.1f} |"
            )
    return "\n".join(lines)


def classification_table():
    records = _load("classification.json")
    if not records:
        return None
    by_key = defaultdict(list)
    for r in records:  # records from before the option existed are causal runs
        by_key[(r["dataset"], r["model"], r.get("causal", True))].append(r)
    lines = [
        "| dataset | model | ours: accuracy % | paper | wall s per run |",
        "|---|---|---|---|---|",
    ]

    def row(dataset, model, causal, paper):
        rows = by_key.get((dataset, model, causal), [])
        if not rows and not causal:
            return
        ours = (
            f"{np.mean([r['accuracy'] for r in rows]):.2f} +- "
            f"{np.std([r['accuracy'] for r in rows]):.2f} (n={len(rows)})"
            if rows
            else "not run yet"
        )
        wall = f"{np.mean([r['wall_s'] for r in rows]):.0f}" if rows else ""
        name = model if causal else f"{model}, `causal=False`"
        lines.append(f"| {dataset} | {name} | {ours} | {paper} | {wall} |")

    for dataset, paper in PAPER_CLASSIFICATION.items():
        for model, (p_mean, p_std) in zip(("aaren", "transformer"), paper, strict=True):
            row(dataset, model, True, f"{p_mean} +- {p_std}")
        for model in ("aaren", "transformer"):
            row(dataset, model, False, "-")
    return "\n".join(lines)


def forecasting_table():
    records = _load("forecasting.json")
    if not records:
        return None
    by_key = defaultdict(list)
    for r in records:
        by_key[(r["dataset"], int(r["horizon"]), r["model"])].append(r)
    lines = [
        "| dataset | horizon | Aaren MSE (ours) | Aaren MSE (paper) | Transformer MSE (ours) "
        "| Transformer MSE (paper) | Aaren MAE (ours) | Transformer MAE (ours) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for (dataset, horizon), (paper_a, paper_t) in PAPER_FORECASTING.items():
        a = by_key.get((dataset, horizon, "aaren"), [])
        t = by_key.get((dataset, horizon, "transformer"), [])
        if not a and not t:
            continue

        def cell(rows, key):
            return _mean_std([r[key] for r in rows]) if rows else "not run yet"

        lines.append(
            f"| {dataset} | {horizon} | {cell(a, 'mse')} | {paper_a[0]} +- {paper_a[1]} "
            f"| {cell(t, 'mse')} | {paper_t[0]} +- {paper_t[1]} | {cell(a, 'mae')} "
            f"| {cell(t, 'mae')} |"
        )
    return "\n".join(lines + ["", forecasting_summary(by_key)])


def forecasting_summary(by_key) -> str:
    """The figures the README's reading quotes: cells at or below the paper, wins, means."""
    cells = [
        (by_key[(d, h, "aaren")], by_key[(d, h, "transformer")], paper_a[0])
        for (d, h), (paper_a, _) in PAPER_FORECASTING.items()
        if by_key.get((d, h, "aaren")) and by_key.get((d, h, "transformer"))
    ]
    if not cells:
        return "No horizon has runs of both models yet."

    def mean(rows):
        return float(np.mean([r["mse"] for r in rows]))

    at_or_below = [round(mean(a), 2) <= paper for a, _, paper in cells]
    misses = [
        f"{a[0]['dataset']}-{a[0]['horizon']} ({mean(a):.3f} against {paper})"
        for (a, _, paper), ok in zip(cells, at_or_below, strict=True)
        if not ok
    ]
    wins = sum(mean(a) < mean(t) for a, t, _ in cells)
    seeds = sorted({len(a) for a, _, _ in cells} | {len(t) for _, t, _ in cells})
    walls = [r["wall_s"] for a, t, _ in cells for r in a + t]
    return (
        f"Summary over {len(cells)} horizons ({'/'.join(map(str, seeds))} seeds per cell): "
        f"Aaren's mean MSE, rounded to the paper's 2 decimals, is at or below the paper's in "
        f"{sum(at_or_below)} of {len(cells)}"
        + (f" (above: {', '.join(misses)})" if misses else "")
        + f"; Aaren beats our Transformer in {wins} of {len(cells)}; mean MSE over the horizons "
        f"{np.mean([mean(a) for a, _, _ in cells]):.3f} (Aaren) against "
        f"{np.mean([mean(t) for _, t, _ in cells]):.3f} (Transformer); "
        f"wall time per run {min(walls):.0f}-{max(walls):.0f} s "
        f"(median {np.median(walls):.0f} s, {len(walls)} runs)."
    )


def rsa_forecasting_table():
    """RSA against its plain backbone per (dataset, horizon), on the seeds both have run.

    Counts the comparisons where RSA lowers the error, MSE and MAE apart, as the RSA paper's
    Table 1 counts them, and lists the learned gates ``sigmoid(mu)`` per layer.
    """
    records = _load("forecasting.json") or []
    by_key = defaultdict(dict)
    for r in records:
        by_key[(r["dataset"], int(r["horizon"]), r["model"])][r["seed"]] = r
    pairs = (("rsa_aaren", "aaren"), ("rsa_transformer", "transformer"))
    lines = [
        "| dataset | horizon | seeds | RSA-Aaren MSE | Aaren MSE | RSA-Transformer MSE "
        "| Transformer MSE | RSA-Aaren MAE | Aaren MAE | RSA-Transformer MAE | Transformer MAE "
        "| gates RSA-Aaren | gates RSA-Transformer |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    wins, total = defaultdict(int), defaultdict(int)
    for dataset, horizon in sorted({(d, h) for d, h, m in by_key if m.startswith("rsa_")}):
        cells, gates, seed_counts = {}, {}, []
        for rsa, plain in pairs:
            a = by_key.get((dataset, horizon, rsa), {})
            b = by_key.get((dataset, horizon, plain), {})
            seeds = sorted(set(a) & set(b))
            seed_counts.append(len(seeds))
            for metric in ("mse", "mae"):
                if not seeds:
                    cells[(rsa, metric)] = cells[(plain, metric)] = "-"
                    continue
                x = [a[s][metric] for s in seeds]
                y = [b[s][metric] for s in seeds]
                cells[(rsa, metric)], cells[(plain, metric)] = _mean_std(x), _mean_std(y)
                wins[(rsa, metric)] += float(np.mean(x)) < float(np.mean(y))
                total[(rsa, metric)] += 1
            layer_gates = np.mean([a[s]["gates"] for s in seeds], axis=0) if seeds else []
            gates[rsa] = " / ".join(f"{g:.2f}" for g in layer_gates) or "-"
        # RSA then its plain backbone, for each backbone, MSE then MAE
        order = [(m, k) for k in ("mse", "mae") for pair in pairs for m in pair]
        lines.append(
            f"| {dataset} | {horizon} | {'/'.join(map(str, seed_counts))} | "
            + " | ".join(cells[c] for c in order)
            + f" | {gates['rsa_aaren']} | {gates['rsa_transformer']} |"
        )
    if len(lines) == 2:
        return None
    counts = "; ".join(
        f"{rsa} lowers the {metric.upper()} of {plain} in {wins[(rsa, metric)]} of "
        f"{total[(rsa, metric)]}"
        for rsa, plain in pairs
        for metric in ("mse", "mae")
        if total[(rsa, metric)]
    )
    against_all = _rsa_against_all_seeds(by_key, pairs)
    all_gates = [g for r in records if r["model"].startswith("rsa_") for g in r.get("gates", [])]
    gate_line = (
        f"Learned gates sigmoid(mu): mean {np.mean(all_gates):.2f}, range "
        f"{min(all_gates):.2f}-{max(all_gates):.2f}, over {len(all_gates)} layer gates of "
        f"{sum(r['model'].startswith('rsa_') for r in records)} RSA runs."
        if all_gates
        else ""
    )
    return "\n".join(
        lines
        + ["", f"Comparisons (mean over the shared seeds): {counts}.", "", against_all, ""]
        + [gate_line]
    )


def _rsa_against_all_seeds(by_key, pairs) -> str:
    """RSA's mean over its seeds against the plain model's mean over all of its seeds: how
    many errors RSA lowers, and how many by more than the plain model's sample std over its
    seeds (none where it has one seed)."""
    lowered, beyond_std, total = 0, 0, 0
    for dataset, horizon, model in sorted(by_key):
        for rsa, plain in pairs:
            if model != rsa or not by_key.get((dataset, horizon, plain)):
                continue
            a = list(by_key[(dataset, horizon, rsa)].values())
            b = list(by_key[(dataset, horizon, plain)].values())
            for metric in ("mse", "mae"):
                x, y = [r[metric] for r in a], [r[metric] for r in b]
                gain = float(np.mean(y)) - float(np.mean(x))
                total += 1
                lowered += gain > 0
                spread = float(np.std(y, ddof=1)) if len(y) > 1 else float("inf")
                beyond_std += gain > spread
    return (
        f"Against the plain models' means over all their seeds: RSA lowers {lowered} of the "
        f"{total} errors, {beyond_std} of them by more than the plain model's std over seeds."
    )


def cost_table():
    """Steady-state training throughput (benchmark) beside the sweeps' wall time per run."""
    report = _load("examples_cost_cpu.json")
    if report is None:
        return None
    runs = {
        "forecasting": _load("forecasting.json") or [],
        "classification": _load("classification.json") or [],
    }
    machine = report["machine"]
    lines = [
        f"Machine: {machine['cpu_model']}, {machine['cpu_count']} cores, jax {machine['jax']} "
        f"({machine['backend']}). Command: `{report['command']}`; wall time per run from "
        "`results/forecasting.json` and `results/classification.json`.",
        "",
        "| example | dataset | horizon | model | batch x length | training tokens/s (median) "
        "| step ms (median) | compile s | wall s per run: median (min-max), n |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in report["results"]:
        for model in ("aaren", "transformer"):
            walls = [
                r["wall_s"]
                for r in runs[row["example"]]
                if r["dataset"] == row["dataset"]
                and r["model"] == model
                and (row["horizon"] is None or int(r["horizon"]) == row["horizon"])
            ]
            wall = (
                f"{np.median(walls):.0f} ({min(walls):.0f}-{max(walls):.0f}), n={len(walls)}"
                if walls
                else "no runs yet"
            )
            m = row[model]
            lines.append(
                f"| {row['example']} | {row['dataset']} | {row['horizon'] or '-'} | {model} "
                f"| {row['batch']} x {row['tokens_per_batch'] // row['batch']} "
                f"| {m['tokens_per_s_median']:,} | {m['step_ms']['median']:.1f} "
                f"| {m['compile_s']:.1f} | {wall} |"
            )
    return "\n".join(lines)


TABLES = {
    "cost": cost_table,
    "scan": scan_table,
    "classification": classification_table,
    "forecasting": forecasting_table,
    "rsa_forecasting": rsa_forecasting_table,
}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=sorted(TABLES), nargs="+", default=sorted(TABLES))
    args = parser.parse_args()
    for name in args.only:
        table = TABLES[name]()
        print(f"### {name}\n\n{table if table else '(no results yet)'}\n")


if __name__ == "__main__":
    main()
