"""Where the default scan kernel's forward time goes on this CPU; prints JSON.

    python benchmarks/scan_profile.py                  # B=8, H=4, D=64, N in {4096, 16384}
    python benchmarks/scan_profile.py --quick          # N = 1024, 3 rounds

The blocked kernel (``method="blocked"``, what ``"auto"`` ran on CPU before the compiled scan,
``"native"``) moves, per forward pass, these value-sized
arrays: pass 1 reads the values (block totals), the output buffer is zero-filled before the
in-place loop, pass 2 reads the values again and writes the outputs. The floor
(``a * b + a``) moves 3; a kernel that reads the values once and writes the outputs once
moves 2 (about 0.67x the floor).

Timed here, interleaved round by round (``_common.interleaved``, forward only):

* ``floor``: ``a * b + a`` over two value-sized arrays (3 arrays moved);
* ``read_one``: a sum over D of one value-sized array (1 array read: the bandwidth cost
  of one pass);
* ``write_one``: one value-sized array written from a score-sized one (1 array written);
* ``pass1``: the kernel's pass 1 and its scan across blocks, alone (``_block_starts``);
* ``kernel``: the whole forward, ``prefix_attention(method="blocked")``;
* ``kernel_batch1``: the same number of tokens as one ``[1, H * B, N]`` batch (the shape a
  batch of one long sequence gives);
* ``minimal_loop_strided`` and ``minimal_loop_contiguous``: the least a pass-2 loop can do
  (each value read once, one multiply-add, each output written in place), in the kernel's
  layout (each position a strided slice) and in a time-major one (each position
  contiguous): what XLA's in-place loop costs by itself, the bound on any kernel built on it;
* ``native``: the compiled scan (``method="native"``, the default on CPU since 2026-11-25),
  which reads the values once and writes the outputs once, outside XLA's loops;
* ``scores_from_keys`` and ``scores_folded``: the Aaren layer's scores from its input
  ``x`` [B, N, H * D], by forming the keys ``x W_k`` and reducing them against the query
  (the layer until 2026-11-24), and with the query folded into the key projection
  (``x (W_k q)``, the layer now).

Each time is given in "arrays" (its median over the median of ``read_one``) with the minor
page faults per call: a value-sized array is ``pages_per_array`` 4 KiB pages, and a call that
faults that many per output maps its outputs afresh each time, which is what writing costs
without huge pages (run once more with ``GLIBC_TUNABLES=glibc.malloc.hugetlb=1`` where
``transparent_hugepages`` is ``madvise`` to see the kernel without that cost).

Then ``paired``: the default kernel against its floors (those of ``benchmarks/scan.py``),
forward and forward+backward, interleaved round by round, with the ratio of the medians and
its per-round minimum, median and maximum. Last, facts from the compiled forward: how many
fusions write in place (``dynamic-update-slice``) and how many of those XLA's CPU backend
splits across threads (``outer_dimension_partitions``; XLA never splits an in-place update,
so pass 2's output writes run on one core), and whether the output buffer is zero-filled
first. Writes ``results/scan_profile_<backend>.json``.
"""

from __future__ import annotations

import argparse
import functools
import re
import sys

import jax
import jax.numpy as jnp
from _common import (
    REPO,
    add_shape_args,
    floor_forward,
    floor_forward_backward,
    interleaved,
    machine_info,
    write_json,
)

import aaren_jax as aj
from aaren_jax.scan import _block_starts, _pick_chunk, resolve_method


def _forward_only(fn):
    """``interleaved`` times a forward and a forward+backward: here both are the forward."""
    return fn, lambda *args: fn(*args[:-1])


def pass1(scores, values):
    """The blocked kernel's pass 1 and scan across blocks, as the kernel runs them."""
    batch, num_tokens, dim = scores.shape[0], scores.shape[-1], values.shape[-1]
    chunk = _pick_chunk(num_tokens, aj.scan.DEFAULT_CHUNK_SIZE)
    blocks = num_tokens // chunk
    score_blocks = scores.reshape(batch, blocks, chunk)
    value_blocks = values.reshape(batch, blocks, chunk, dim)
    return _block_starts(
        score_blocks,
        (jnp.ones_like(score_blocks), value_blocks),
        jnp.full((batch,), -jnp.inf),
        (jnp.zeros((batch,)), jnp.zeros((batch, dim))),
    )


def minimal_loop(score_blocks, value_blocks, axis: int):
    """The least a pass-2 loop can do: each value read once, one multiply-add into a carry,
    each output written once in place, over the positions on ``axis``.

    ``axis=2``: the kernel's layout, scores [B', N, C] and values [B', N, C, D], each
    position a strided slice; ``axis=0``: [C, B', N(, D)], each position contiguous. No scan
    arithmetic: what XLA's in-place loop costs by itself on this machine.
    """
    take = functools.partial(jax.lax.dynamic_index_in_dim, axis=axis, keepdims=False)

    def position(c, carry):
        acc, out = carry
        acc = acc * 0.5 + jnp.exp(take(score_blocks, c))[..., None] * take(value_blocks, c)
        return acc, jax.lax.dynamic_update_index_in_dim(out, acc, c, axis)

    carry = (jnp.zeros_like(take(value_blocks, 0)), jnp.zeros_like(value_blocks))
    return jax.lax.fori_loop(0, score_blocks.shape[axis], position, carry)[1]


def variants(batch: int, heads: int, length: int, dim: int) -> dict:
    keys = jax.random.split(jax.random.key(length), 3)
    scores = jax.random.normal(keys[0], (batch, heads, length)) * 2
    values = jax.random.normal(keys[1], (batch, heads, length, dim))
    other = jax.random.normal(keys[2], (batch, heads, length, dim))
    flat_scores = scores.reshape(batch * heads, length)
    flat_values = values.reshape(batch * heads, length, dim)
    chunk = _pick_chunk(length, aj.scan.DEFAULT_CHUNK_SIZE)
    score_blocks = flat_scores.reshape(-1, length // chunk, chunk)
    value_blocks = flat_values.reshape(-1, length // chunk, chunk, dim)

    def kernel(s, v):
        return aj.prefix_attention(s, v, method="blocked")[0]

    def native(s, v):
        return aj.prefix_attention(s, v, method="native")[0]

    d_model = heads * dim
    x = jax.random.normal(keys[2], (batch, length, d_model))
    key_kernel = jax.random.normal(keys[0], (d_model, d_model)) / d_model**0.5
    query = jax.random.normal(keys[1], (heads, dim))

    def scores_from_keys(x, w):
        k = jnp.matmul(x, w).reshape(batch, length, heads, dim)
        return jnp.sum(k * query[None, None], axis=-1)

    def scores_folded(x, w):
        return jnp.matmul(x, jnp.einsum("ihd,hd->ih", w.reshape(d_model, heads, dim), query))

    table = {
        "floor": (floor_forward, (values, other)),
        "read_one": (lambda v: jnp.sum(v, axis=-1), (values,)),
        "write_one": (lambda s: jnp.broadcast_to(s[..., None], values.shape) * 2.0, (scores,)),
        "pass1": (pass1, (flat_scores, flat_values)),
        "kernel": (kernel, (scores, values)),
        "kernel_batch1": (kernel, (flat_scores[None], flat_values[None])),
        "native": (native, (scores, values)),
        "minimal_loop_strided": (
            functools.partial(minimal_loop, axis=2),
            (score_blocks, value_blocks),
        ),
        "minimal_loop_contiguous": (
            functools.partial(minimal_loop, axis=0),
            (jnp.moveaxis(score_blocks, -1, 0), jnp.moveaxis(value_blocks, -2, 0)),
        ),
        "scores_from_keys": (scores_from_keys, (x, key_kernel)),
        "scores_folded": (scores_folded, (x, key_kernel)),
    }
    return {name: (*_forward_only(fn), args, args[0]) for name, (fn, args) in table.items()}


def paired(batch: int, heads: int, length: int, dim: int, rounds: int) -> dict:
    """The default kernel against its floors, forward and forward+backward, interleaved.

    Floors: ``_common.floor_forward`` and ``floor_forward_backward`` (as in
    ``benchmarks/scan.py``). The kernel's
    forward+backward is the gradient of ``sum(outputs * g)`` with respect to scores and values.
    """
    keys = jax.random.split(jax.random.key(length + 1), 4)
    scores = jax.random.normal(keys[0], (batch, heads, length)) * 2
    values = jax.random.normal(keys[1], (batch, heads, length, dim))
    other = jax.random.normal(keys[2], (batch, heads, length, dim))
    cotangent = jax.random.normal(keys[3], (batch, heads, length, dim))

    def kernel(s, v):
        return aj.prefix_attention(s, v)[0]

    def kernel_grad(s, v, g):
        return jax.grad(lambda s, v: jnp.sum(kernel(s, v) * g), argnums=(0, 1))(s, v)

    timings = interleaved(
        {
            "floor": (floor_forward, floor_forward_backward, (values, other), cotangent),
            "kernel": (kernel, kernel_grad, (scores, values), cotangent),
        },
        rounds,
    )
    return {
        kind: {
            "floor_ms": timings["floor"][kind]["ms"],
            "kernel_ms": timings["kernel"][kind]["ms"],
            "kernel_over_floor": timings["kernel"][kind]["ratio_to_floor"],
            "page_faults_per_call": {
                name: timings[name][kind]["page_faults_per_call"] for name in timings
            },
        }
        for kind in ("forward", "forward_backward")
    }


def compiled_facts(batch: int, heads: int, length: int, dim: int) -> dict:
    """In-place fusions of the compiled forward, and which of them XLA splits across threads."""
    scores = jax.ShapeDtypeStruct((batch, heads, length), jnp.float32)
    values = jax.ShapeDtypeStruct((batch, heads, length, dim), jnp.float32)
    text = jax.jit(lambda s, v: aj.prefix_attention(s, v, method="blocked")[0])
    text = text.lower(scores, values)
    text = text.compile().as_text()
    fusion_lines = [line for line in text.splitlines() if re.search(r"= \S+ fusion\(", line)]
    in_place = [line for line in fusion_lines if "dynamic-update-slice" in line.split("=")[0]]
    split = [line for line in in_place if re.search(r'outer_dimension_partitions":\["', line)]
    value_size = batch * heads * length * dim
    zero_fills = [
        line
        for line in fusion_lines
        if "broadcast" in line.split("=")[0] and _elements(line) == value_size
    ]
    return {
        "fusions": len(fusion_lines),
        "in_place_update_fusions": len(in_place),
        "in_place_update_fusions_split_across_threads": len(split),
        "value_sized_zero_fills": len(zero_fills),
        "method": resolve_method("blocked", length),
    }


def _elements(line: str) -> int:
    """The number of elements of the array an HLO instruction line defines (0 if none)."""
    match = re.search(r"= \w+\[([\d,]*)\]", line)
    if match is None:
        return 0
    size = 1
    for extent in filter(None, match.group(1).split(",")):
        size *= int(extent)
    return size


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[4096, 16384])
    add_shape_args(parser, blocks=False)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--quick", action="store_true", help="N = 1024, 3 rounds")
    parser.add_argument("--out", default=None, help="default: results/scan_profile_<backend>.json")
    args = parser.parse_args()
    lengths, rounds = ([1024], 3) if args.quick else (args.lengths, args.rounds)

    rows = []
    for length in lengths:
        timings = interleaved(variants(args.batch, args.heads, length, args.dim), rounds)
        forward = {name: t["forward"] for name, t in timings.items()}
        one_array = forward["read_one"]["ms"]["median"]
        row = {"N": length}
        for name, t in forward.items():
            row[name] = {
                "ms": t["ms"],
                "ms_per_round": t["ms_per_round"],
                "arrays": round(t["ms"]["median"] / one_array, 2),
                "x_floor": round(t["ms"]["median"] / forward["floor"]["ms"]["median"], 2),
                "page_faults_per_call": t["page_faults_per_call"],
            }
        # 4 KiB pages in one value-sized array: a call faulting this many maps each output
        # afresh (the cost of "writing" on a machine without huge pages)
        row["pages_per_array"] = args.batch * args.heads * length * args.dim * 4 // 4096
        row["pass2_and_zero_fill_ms"] = round(
            forward["kernel"]["ms"]["median"] - forward["pass1"]["ms"]["median"], 2
        )
        row["paired"] = paired(args.batch, args.heads, length, args.dim, rounds)
        row["compiled"] = compiled_facts(args.batch, args.heads, length, args.dim)
        rows.append(row)
        summary_line = ", ".join(f"{k} {row[k]['x_floor']}x" for k in forward)
        summary_line += "; paired kernel / floor " + ", ".join(
            f"{kind} {t['kernel_over_floor']['of_medians']}x" for kind, t in row["paired"].items()
        )
        print(f"N={length}: {summary_line}", file=sys.stderr)

    result = {
        "benchmark": "scan_profile",
        "shape": {"B": args.batch, "H": args.heads, "D": args.dim, "dtype": "float32"},
        "rounds": rounds,
        "machine": machine_info(),
        "command": " ".join(["python", "benchmarks/scan_profile.py", *sys.argv[1:]]),
        "results": rows,
    }
    out = args.out or REPO / "results" / f"scan_profile_{jax.default_backend()}.json"
    write_json(out, result)


if __name__ == "__main__":
    main()
