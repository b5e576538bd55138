"""Times every method of ``prefix_attention`` against memory-bound floors; prints JSON.

    python benchmarks/scan.py                    # B=8, H=4, D=64, N in {1024, 4096, 16384}
    python benchmarks/scan.py --lengths 1024     # a quicker look

For each N: median and min of the forward pass and of forward+backward (the gradient of
``sum(outputs * g)`` with respect to scores and values), the compile time of each, and ratios
to floors measured in the same run: the forward floor is one jitted ``a * b + a`` over two
value-shaped arrays, the forward+backward floor ``jax.grad`` of ``sum((a * b + a) * c)`` with
respect to ``a`` and ``b``. The machine is shared and noisy: compare ratios within one run.
Writes ``results/scan_<backend>.json``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from _common import add_shape_args, floor_forward, floor_forward_backward, machine_info

import aaren_jax as aj

METHODS = ("auto", "blocked", "associative", "sequential", "chunked")


def _compile(fn, *args):
    start = time.perf_counter()
    compiled = jax.jit(fn).lower(*args).compile()
    return compiled, time.perf_counter() - start


def _time(compiled, *args, repeats):
    jax.block_until_ready(compiled(*args))  # warm-up, excluded
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(compiled(*args))
        times.append(time.perf_counter() - start)
    return {"median_ms": 1e3 * float(np.median(times)), "min_ms": 1e3 * float(np.min(times))}


def _measure(fn, *args, repeats):
    compiled, compile_s = _compile(fn, *args)
    return {**_time(compiled, *args, repeats=repeats), "compile_s": compile_s}


def bench_length(length, batch, heads, dim, repeats, methods):
    keys = jax.random.split(jax.random.key(length), 3)
    scores = jax.random.normal(keys[0], (batch, heads, length)) * 2
    values = jax.random.normal(keys[1], (batch, heads, length, dim))
    cotangent = jax.random.normal(keys[2], (batch, heads, length, dim))

    floor_fwd = _measure(floor_forward, values, cotangent, repeats=repeats)
    floor_bwd = _measure(floor_forward_backward, values, cotangent, values, repeats=repeats)
    row = {"N": length, "floor_forward": floor_fwd, "floor_forward_backward": floor_bwd}
    for method in methods:

        def forward(s, v, method=method):
            return aj.prefix_attention(s, v, method=method)[0]

        def loss(s, v, g, method=method):
            return jnp.sum(aj.prefix_attention(s, v, method=method)[0] * g)

        fwd = _measure(forward, scores, values, repeats=repeats)
        bwd = _measure(jax.grad(loss, argnums=(0, 1)), scores, values, cotangent, repeats=repeats)
        fwd["ratio_to_floor"] = fwd["median_ms"] / floor_fwd["median_ms"]
        bwd["ratio_to_floor"] = bwd["median_ms"] / floor_bwd["median_ms"]
        row[method] = {"forward": fwd, "forward_backward": bwd}
    return row


def machine():
    """CPU model, core count, jax version, load average (``_common.machine_info``)."""
    return machine_info()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096, 16384])
    add_shape_args(parser, blocks=False)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    parser.add_argument("--out", type=Path, help="default: results/scan_<backend>.json")
    args = parser.parse_args()

    rows = [
        bench_length(n, args.batch, args.heads, args.dim, args.repeats, args.methods)
        for n in args.lengths
    ]
    report = {
        "benchmark": "prefix_attention",
        "shape": {"B": args.batch, "H": args.heads, "D": args.dim, "dtype": "float32"},
        "machine": machine(),
        "command": " ".join(["python", "benchmarks/scan.py", *sys.argv[1:]]),
        "results": rows,
    }
    text = json.dumps(report, indent=2)
    print(text)
    results_dir = Path(__file__).resolve().parents[1] / "results"
    out = args.out or results_dir / f"scan_{jax.default_backend()}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text + "\n")


if __name__ == "__main__":
    main()
