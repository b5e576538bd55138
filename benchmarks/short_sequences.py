"""Which scan method is fastest for short sequences on this backend; prints JSON.

    python benchmarks/short_sequences.py            # T from 2 to 512, and the examples' shapes
    python benchmarks/short_sequences.py --quick    # T in {8, 64}, 2 rounds

``aj.resolve_method("auto", T)`` picks one method per (backend, T). The long-sequence
benchmark (``benchmarks/scan.py``) starts at T = 1,024; the examples train at T = 20 to 300
(classification 29 and 152 steps, forecasting 96, the Decision Transformer 60 tokens, event
forecasting up to 257 events). For each shape, every method's forward and forward+backward
(the gradient of ``sum(outputs * g)`` with respect to scores and values) is compiled (time
recorded), warmed up, then timed once per round, the methods interleaved round by round
(``_common.interleaved``); ratios are per round to ``"auto"``. Shapes ``[B, H, T]`` scores
and ``[B, H, T, D]`` values: a grid over T at ``--batch``, ``--heads``, ``--dim``, plus the
examples' own shapes. Writes ``results/short_sequences_<backend>.json``.
"""

from __future__ import annotations

import argparse
import sys
import time

import jax
import jax.numpy as jnp
from _common import REPO, add_shape_args, interleaved, machine_info, write_json

import aaren_jax as aj

METHODS = ("auto", "associative", "sequential", "blocked", "native")
# (name, B, H, T, D) of the examples' default training shapes
EXAMPLE_SHAPES = (
    ("decision_transformer", 64, 1, 60, 128),
    ("classification_japanese_vowels", 16, 4, 29, 16),
    ("forecasting", 32, 4, 96, 16),
    ("event_forecasting", 32, 4, 257, 8),
)


def variants(batch: int, heads: int, length: int, dim: int) -> dict:
    """``{method: (forward, forward_backward, (scores, values), g)}`` at one shape."""
    keys = jax.random.split(jax.random.key(length), 3)
    scores = jax.random.normal(keys[0], (batch, heads, length)) * 2
    values = jax.random.normal(keys[1], (batch, heads, length, dim))
    g = jax.random.normal(keys[2], values.shape)
    out = {}
    for method in METHODS:

        def forward(s, v, method=method):
            return aj.prefix_attention(s, v, method=method)[0]

        grad = jax.grad(lambda s, v, g, f=forward: jnp.sum(f(s, v) * g), argnums=(0, 1))
        out[method] = (forward, grad, (scores, values), g)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--lengths", type=int, nargs="+", default=[2, 4, 8, 16, 32, 48, 63, 64, 128, 256, 512]
    )
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--no-examples", action="store_true", help="the T grid only")
    add_shape_args(parser, blocks=False)
    parser.add_argument("--quick", action="store_true", help="T in {8, 64}, 2 rounds")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.quick:
        args.lengths, args.rounds, args.no_examples = [8, 64], 2, True
    shapes = [(f"grid_T{n}", args.batch, args.heads, n, args.dim) for n in args.lengths]
    if not args.no_examples:
        shapes += list(EXAMPLE_SHAPES)
    started = time.perf_counter()
    rows = []
    for name, b, h, n, d in shapes:
        row = {"shape": name, "B": b, "H": h, "T": n, "D": d,
               "auto_resolves_to": aj.resolve_method("auto", n)}  # fmt: skip
        row.update(interleaved(variants(b, h, n, d), args.rounds))
        rows.append(row)
        fastest = {
            kind: min(METHODS[1:], key=lambda m, k=kind: row[m][k]["ms"]["median"])
            for kind in ("forward", "forward_backward")
        }
        row["fastest_by_median"] = fastest
        print(f"{name} (T={n}): fastest {fastest}", file=sys.stderr, flush=True)
    result = {
        "benchmark": "short_sequences",
        "config": {"rounds": args.rounds, "dtype": "float32", "methods": list(METHODS)},
        "command": "python " + " ".join(sys.argv),
        "machine": machine_info(),
        "method": "jitted, compile and one warm-up excluded, methods interleaved round by "
        "round; forward_backward = grad of sum(outputs * g) w.r.t. scores and values; ratios "
        "per round to auto",
        "rows": rows,
        "wall_seconds": round(time.perf_counter() - started, 1),
    }
    out = args.out or REPO / "results" / f"short_sequences_{jax.default_backend()}.json"
    write_json(out, result)


if __name__ == "__main__":
    main()
