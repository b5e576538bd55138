"""The blocked kernel's forward and gradient at two revisions, interleaved in one process.

    python benchmarks/blocked_gradient.py --before e6717bc       # that revision's kernel vs this
    python benchmarks/blocked_gradient.py --before e6717bc --lengths 1024 --rounds 3

Loads ``src/aaren_jax/scan.py`` of ``--before`` (from git) and of this tree as two modules
and times, for each N, ``prefix_attention(..., method="blocked")`` forward and
``jax.grad`` of ``sum(outputs * g)`` with respect to scores and values, alternating the two
revisions round by round, so that both see the same machine noise (this machine is shared);
each timed call follows an untimed one of the same function (``_common.interleaved``).
Reports per-round times, medians and the ratio this / before, and the largest difference of
the two gradients. Writes ``results/blocked_gradient_<backend>.json``.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import jax
import numpy as np
from _common import REPO, machine_info, timed, write_json


def load_scan(source: str, name: str):
    """``scan.py``'s text as a module (it imports only jax and numpy)."""
    path = Path(tempfile.mkdtemp()) / f"{name}.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def functions(scan, scores, values, cotangent, method="blocked"):
    """Compiled forward and gradient, each taking its inputs as arguments: a cotangent
    closed over would be a compile-time constant, and XLA would fold work on it (its
    transposes into another layout) into the executable instead of timing it."""

    def forward(s, v):
        return scan.prefix_attention(s, v, method=method)[0]

    def gradient(s, v, g):
        loss = lambda s, v: (forward(s, v) * g).sum()  # noqa: E731
        return jax.grad(loss, argnums=(0, 1))(s, v)

    return {
        "forward": (jax.jit(forward).lower(scores, values).compile(), (scores, values)),
        "gradient": (
            jax.jit(gradient).lower(scores, values, cotangent).compile(),
            (scores, values, cotangent),
        ),
    }


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--before", required=True, help="a git revision")
    p.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096, 16384])
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument(
        "--before-method",
        default="blocked",
        help="the method at --before: 'auto' for revisions before 'blocked' was named (d76ce44)",
    )
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)

    old_source = subprocess.run(
        ["git", "show", f"{args.before}:src/aaren_jax/scan.py"],
        cwd=REPO,
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    revisions = {
        "before": load_scan(old_source, "scan_before"),
        "after": load_scan((REPO / "src/aaren_jax/scan.py").read_text(), "scan_after"),
    }
    record = {
        "benchmark": "blocked_gradient",
        "command": "python benchmarks/blocked_gradient.py " + " ".join(argv or sys.argv[1:]),
        "before": args.before,
        "before_method": args.before_method,
        "machine": machine_info(),
        "shape": {"batch": args.batch, "heads": args.heads, "dim": args.dim},
        "lengths": {},
    }
    for length in args.lengths:
        keys = jax.random.split(jax.random.key(length), 3)
        shape = (args.batch, args.heads, length)
        scores = jax.random.normal(keys[0], shape) * 2
        values = jax.random.normal(keys[1], (*shape, args.dim))
        cotangent = jax.random.normal(keys[2], (*shape, args.dim))
        methods = {"before": args.before_method, "after": "blocked"}
        compiled = {
            name: functions(scan, scores, values, cotangent, methods[name])
            for name, scan in revisions.items()
        }
        grads = {name: fns["gradient"][0](*fns["gradient"][1]) for name, fns in compiled.items()}
        difference = max(
            float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
            for a, b in zip(grads["before"], grads["after"], strict=True)
        )
        times = {(rev, kind): [] for rev in compiled for kind in ("forward", "gradient")}
        for _ in range(args.rounds + 1):  # the first round is a warm-up
            for kind in ("forward", "gradient"):
                for rev, fns in compiled.items():
                    fn, fn_args = fns[kind]
                    jax.block_until_ready(fn(*fn_args))  # settle, as _common.interleaved
                    times[rev, kind].append(timed(fn, *fn_args)[0] * 1e3)
        entry = {"max_gradient_difference": difference}
        for kind in ("forward", "gradient"):
            before, after = times["before", kind][1:], times["after", kind][1:]
            entry[kind] = {
                "before_ms": [round(t, 2) for t in before],
                "after_ms": [round(t, 2) for t in after],
                "before_median_ms": round(statistics.median(before), 2),
                "after_median_ms": round(statistics.median(after), 2),
                "after_over_before_median": round(
                    statistics.median(after) / statistics.median(before), 3
                ),
                "after_over_before_per_round": [
                    round(a / b, 3) for a, b in zip(after, before, strict=True)
                ],
            }
        record["lengths"][str(length)] = entry
        print(length, {k: entry[k]["after_over_before_median"] for k in ("forward", "gradient")})
    out = args.out or REPO / "results" / f"blocked_gradient_{jax.default_backend()}.json"
    write_json(out, record)
    return record


if __name__ == "__main__":
    main()
