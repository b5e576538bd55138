"""Times every method of ``prefix_attention`` against memory-bound floors; prints JSON.

    python benchmarks/scan.py                    # B=8, H=4, D=64, N in {1024, 4096, 16384}
    python benchmarks/scan.py --lengths 1024     # a quicker look

For each N: the forward pass and forward+backward (the gradient of ``sum(outputs * g)`` with
respect to scores and values) of every method and of the floors, interleaved round by round
(``--rounds``; each timed call after an untimed one of the same variant), with compile
times, medians, per-round times and the ratio to the floor (of the medians, and its
per-round minimum, median and maximum). The forward floor is one jitted ``a * b + a`` over
two value-shaped arrays, the forward+backward floor ``jax.grad`` of ``sum((a * b + a) * c)``
with respect to ``a`` and ``b``. The machine is shared and noisy: compare ratios within one
run. Writes ``results/scan_<backend>.json``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
from _common import (
    add_shape_args,
    floor_forward,
    floor_forward_backward,
    interleaved,
    machine_info,
)

import aaren_jax as aj

METHODS = ("auto", "native", "blocked", "associative", "sequential", "chunked")


def variants(length, batch, heads, dim, methods) -> dict:
    """``_common.interleaved``'s table: the floors, then each method's forward and gradient."""

    def forward_of(method):
        return lambda s, v: aj.prefix_attention(s, v, method=method)[0]

    return variants_of({m: forward_of(m) for m in methods}, length, batch, heads, dim)


def variants_of(forwards: dict, length, batch, heads, dim) -> dict:
    """The floors, then for each ``name: forward(scores, values) -> outputs`` its forward and
    the gradient of ``sum(outputs * g)`` with respect to scores and values: scores [B, H, N]
    (normal x 2), values and the cotangent g [B, H, N, D]."""
    keys = jax.random.split(jax.random.key(length), 3)
    scores = jax.random.normal(keys[0], (batch, heads, length)) * 2
    values = jax.random.normal(keys[1], (batch, heads, length, dim))
    cotangent = jax.random.normal(keys[2], (batch, heads, length, dim))

    table = {"floor": (floor_forward, floor_forward_backward, (values, cotangent), values)}
    for name, forward in forwards.items():

        def gradient(s, v, g, forward=forward):
            loss = lambda s, v: jnp.sum(forward(s, v) * g)  # noqa: E731
            return jax.grad(loss, argnums=(0, 1))(s, v)

        table[name] = (forward, gradient, (scores, values), cotangent)
    return table


def bench_length(length, batch, heads, dim, rounds, methods):
    """The floors and every method at one N, interleaved round by round."""
    return {"N": length, **interleaved(variants(length, batch, heads, dim, methods), rounds)}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096, 16384])
    add_shape_args(parser, blocks=False)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    parser.add_argument("--out", type=Path, help="default: results/scan_<backend>.json")
    args = parser.parse_args()

    rows = [
        bench_length(n, args.batch, args.heads, args.dim, args.rounds, args.methods)
        for n in args.lengths
    ]
    report = {
        "benchmark": "prefix_attention",
        "shape": {"B": args.batch, "H": args.heads, "D": args.dim, "dtype": "float32"},
        "machine": machine_info(),
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
