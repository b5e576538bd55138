"""Seconds of a first eager call (no ``jax.jit`` around it), as in a notebook cell.

    python benchmarks/eager_first_call.py               # 3 rounds
    python benchmarks/eager_first_call.py --rounds 1    # a quicker look

Op by op, ``lax.associative_scan`` dispatches dozens of small slices, each compiled on its
first use; the library jits its scans (``scan._prefix_states_associative``,
``scan._prefix_states_chunked``, ``rem_recurrence._rem_scan``) so that an eager call
compiles one program instead. Each case runs in a fresh process (a first call is what is
measured) as shipped, ``jitted``, and with those three helpers swapped for their unjitted
functions, ``op_by_op``; the two alternate round by round. Cases:

- ``prefix_attention`` with ``method="associative"`` and ``"chunked"``, B = 2, T = 70, D = 3;
- the first forward of a 2-layer ``Aaren`` (d = 12, H = 6, d_ff = 16, batch 2, T = 7),
  plain and with RSA heads (``REMConfig((3, 0, 0, 3, 0, 0), dilations=2)``).

Writes ``results/eager_first_call_<backend>.json`` (``--out``) and prints it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys

import jax
from _common import REPO, machine_info, write_json

CASES = ("associative", "chunked", "aaren", "rsa_aaren")
VARIANTS = ("jitted", "op_by_op")


def run_case(case: str, variant: str) -> float:
    """Seconds of the case's first call, in this (fresh) process."""
    import time

    import jax.numpy as jnp
    from flax import nnx

    import aaren_jax as aj
    from aaren_jax import rem_recurrence, scan

    if variant == "op_by_op":
        for module, name in (
            (scan, "_prefix_states_associative"),
            (scan, "_prefix_states_chunked"),
            (rem_recurrence, "_rem_scan"),
        ):
            setattr(module, name, getattr(module, name).__wrapped__)
    key = jax.random.key(0)
    if case in ("associative", "chunked"):
        scores = jax.random.normal(key, (2, 70))
        values = jax.random.normal(key, (2, 70, 3))
        call = lambda: aj.prefix_attention(scores, values, method=case)  # noqa: E731
    else:
        rsa = aj.REMConfig((3, 0, 0, 3, 0, 0), dilations=2) if case == "rsa_aaren" else None
        model = aj.Aaren(2, 12, 6, 16, rsa=rsa, rngs=nnx.Rngs(0))
        x = jax.random.normal(key, (2, 7, 12))
        call = lambda: model(x)  # noqa: E731
    jax.block_until_ready(jnp.zeros(()) + 1)  # backend started before the clock
    start = time.perf_counter()
    jax.block_until_ready(call())
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--cases", nargs="+", choices=CASES, default=list(CASES))
    parser.add_argument("--out", default=None)
    parser.add_argument("--child", nargs=2, metavar=("CASE", "VARIANT"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps({"seconds": run_case(*args.child)}))
        return {}
    seconds = {case: {v: [] for v in VARIANTS} for case in args.cases}
    for _ in range(args.rounds):
        for case in args.cases:
            for variant in VARIANTS:
                proc = subprocess.run(
                    [sys.executable, __file__, "--child", case, variant],
                    capture_output=True,
                    text=True,
                    check=True,
                    cwd=REPO,
                )
                seconds[case][variant].append(json.loads(proc.stdout.splitlines()[-1])["seconds"])
    results = {}
    for case, by_variant in seconds.items():
        row = {v: [round(s, 3) for s in ts] for v, ts in by_variant.items()}
        jitted, op_by_op = (statistics.median(by_variant[v]) for v in VARIANTS)
        row["median_s"] = {"jitted": round(jitted, 3), "op_by_op": round(op_by_op, 3)}
        row["op_by_op_over_jitted"] = round(op_by_op / jitted, 2)
        results[case] = row
    out = {"machine": machine_info(), "rounds": args.rounds, "results": results}
    write_json(args.out or REPO / "results" / f"eager_first_call_{jax.default_backend()}.json", out)
    return out


if __name__ == "__main__":
    main()
