"""The blocked kernel's gradient for several tangent block sizes, against the floor; JSON.

    python benchmarks/tangent_blocks.py                       # sizes 8 16 32 64, N 4096 16384
    python benchmarks/tangent_blocks.py --sizes 16 --lengths 1024 --rounds 3

The blocked kernel's tangent (its JVP, which JAX transposes into the backward pass) takes
dense ``S x S`` weights inside blocks of ``S = aaren_jax.scan.TANGENT_BLOCK`` tokens. For
each size this sets that constant while the gradient is traced, and times ``jax.grad`` of
``sum(outputs * g)`` with respect to scores and values against the forward+backward floor
(``_common.floor_forward_backward``), interleaved round by round. The forward pass does not
depend on the size. Writes ``results/tangent_blocks_<backend>.json``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import jax
from _common import REPO, add_shape_args, interleaved, machine_info, write_json
from scan import variants_of

import aaren_jax as aj
from aaren_jax import scan as scan_core


def variants(length, batch, heads, dim, sizes) -> dict:
    """``_common.interleaved``'s table: the floors, then the blocked kernel at each size."""

    def forward_of(size):
        def forward(s, v):
            # read when the JVP rule is traced, which is during this call under jax.grad
            scan_core.TANGENT_BLOCK = size
            return aj.prefix_attention(s, v, method="blocked")[0]

        return forward

    forwards = {f"blocked_tangent_{size}": forward_of(size) for size in sizes}
    return variants_of(forwards, length, batch, heads, dim)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[8, 16, 32, 64])
    parser.add_argument("--lengths", type=int, nargs="+", default=[4096, 16384])
    add_shape_args(parser, blocks=False)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    default = scan_core.TANGENT_BLOCK
    try:
        rows = [
            {
                "N": n,
                **interleaved(
                    variants(n, args.batch, args.heads, args.dim, args.sizes), args.rounds
                ),
            }
            for n in args.lengths
        ]
    finally:
        scan_core.TANGENT_BLOCK = default
    report = {
        "benchmark": "tangent_blocks",
        "default_tangent_block": default,
        "shape": {"B": args.batch, "H": args.heads, "D": args.dim, "dtype": "float32"},
        "machine": machine_info(),
        "command": " ".join(["python", "benchmarks/tangent_blocks.py", *(argv or sys.argv[1:])]),
        "results": rows,
    }
    write_json(
        args.out or REPO / "results" / f"tangent_blocks_{jax.default_backend()}.json", report
    )
    return report


if __name__ == "__main__":
    main()
