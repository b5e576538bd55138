"""Timing helpers shared by the benchmark scripts (not part of the library).

Every timing blocks on its result (``jax.block_until_ready``) and is taken with
``time.perf_counter``. The machines we run on are shared and noisy, so scripts report the
minimum and the median of repeats, and compare variants timed in the same run (best:
interleaved, so that every variant sees the same noise).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp

from aaren_jax import native
from aaren_jax.native import cpu_kind, cpu_model

REPO = Path(__file__).resolve().parents[1]


def timed(fn: Callable, *args, **kwargs):
    """Runs ``fn`` once, waits for its result, returns ``(seconds, result)``."""
    start = time.perf_counter()
    out = jax.block_until_ready(fn(*args, **kwargs))
    return time.perf_counter() - start, out


def summary(seconds: list[float], scale: float = 1.0, digits: int = 3) -> dict:
    """``{"min", "median", "n"}`` of a list of timings, multiplied by ``scale``."""
    if not seconds:
        return {"min": None, "median": None, "n": 0}
    return {
        "min": round(min(seconds) * scale, digits),
        "median": round(statistics.median(seconds) * scale, digits),
        "n": len(seconds),
    }


def repeat(fn: Callable, repeats: int, warmup: int = 1) -> list[float]:
    """Seconds of ``repeats`` calls of ``fn()`` after ``warmup`` untimed calls."""
    for _ in range(warmup):
        jax.block_until_ready(fn())
    return [timed(fn)[0] for _ in range(repeats)]


def transparent_hugepages() -> str | None:
    """The kernel's transparent huge page mode (``always``, ``madvise`` or ``never``).

    It decides what writing a fresh large array costs on CPU: XLA's buffers above glibc's
    mmap threshold are new mappings each call, faulted in 4 KiB at a time unless huge pages
    back them (``always``, or ``madvise`` with ``GLIBC_TUNABLES=glibc.malloc.hugetlb=1``).
    """
    try:
        text = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return None
    chosen = [w.strip("[]") for w in text.split() if w.startswith("[")]
    return chosen[0] if chosen else text.strip()


def page_faults() -> int:
    """Minor page faults of this process so far (``getrusage``)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def machine_info() -> dict:
    """What the figures were measured on, including what decides the cost of fresh memory."""
    try:
        load = [round(x, 2) for x in os.getloadavg()]
    except OSError:
        load = None
    return {
        "platform_processor": platform.processor(),
        "cpu_model": cpu_model(),
        # the model name alone ("AMD EPYC") covers CPUs of other generations and widths
        "cpu_kind": cpu_kind(),
        "cpu_count": os.cpu_count(),
        "load_average_at_start": load,
        "python": sys.version.split()[0],
        "jax": jax.__version__,
        "backend": jax.default_backend(),
        "devices": [str(d) for d in jax.devices()],
        "platform": platform.platform(),
        "transparent_hugepages": transparent_hugepages(),
        "glibc_tunables": os.environ.get("GLIBC_TUNABLES"),
        # what "auto" runs on CPU: the compiled scan, or why not ("blocked" then)
        "native_scan": native.unavailable_reason() or "available",
    }


def floor_forward(a, b):
    """The scan's forward floor: elementwise work over two value-sized arrays (reads 2,
    writes 1), the least any kernel producing value-sized outputs from them must move."""
    return a * b + a


def floor_forward_backward(a, b, c):
    """The scan's forward+backward floor: the gradient of ``sum(floor_forward(a, b) * c)``
    with respect to ``a`` and ``b``."""
    return jax.grad(lambda a, b: jnp.sum(floor_forward(a, b) * c), argnums=(0, 1))(a, b)


def tree_bytes(tree) -> int:
    """Total bytes of the arrays in a pytree."""
    return int(sum(x.nbytes for x in jax.tree.leaves(tree)))


def write_json(path: Path, data: dict) -> None:
    """Writes ``data`` as indented JSON (creating the folder) and prints it to stdout."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(data, indent=2)
    path.write_text(text + "\n")
    print(text)


def add_shape_args(parser: argparse.ArgumentParser, blocks: bool = True) -> None:
    """The shape flags every scan and block benchmark shares, with the same defaults.

    Scan: ``--batch`` B, ``--heads`` H, ``--dim`` D (the value width); block (``blocks``):
    ``--d-model`` d and ``--d-ff``.
    """
    parser.add_argument("--batch", type=int, default=8, help="scan batch B")
    parser.add_argument("--heads", type=int, default=4, help="heads H")
    parser.add_argument("--dim", type=int, default=64, help="scan value width D")
    if blocks:
        parser.add_argument("--d-model", type=int, default=256, help="block width d")
        parser.add_argument("--d-ff", type=int, default=1024, help="block MLP width")


def interleaved(variants: dict, rounds: int) -> dict:
    """Compiles, warms up and times every variant's forward and forward+backward.

    ``variants`` maps a name to ``(forward_fn, forward_backward_fn, inputs, extra)``: the
    forward runs on ``inputs``, the forward+backward on ``(*inputs, extra)`` (a cotangent or
    a target). Each is compiled (time recorded) and warmed up once, then all are timed once
    per round, interleaved round by round so that every variant sees the same noise. Each
    timed call follows an untimed call of the same variant, so that it is not charged for
    the previous variant's freed buffers and evicted caches (on a 2-core AMD EPYC the
    forward floor timed straight after the kernel's forward+backward took about twice its
    own time in ``scan_profile.py``'s paired rounds). Returns
    ``{name: {kind: {"compile_s", "warmup_ms", "ms", "ms_per_round", "page_faults_per_call",
    "ratio_to_<first>"}}}`` with ``kind`` in ``forward``, ``forward_backward``; ratios are to
    the first variant. Page faults are the process's minor faults during the timed calls (a
    fresh 4 KiB page touched for the first time), a count of memory newly mapped per call.
    """
    compiled, out = {}, {}
    for name, (fwd, bwd, inputs, g) in variants.items():
        out[name] = {}
        for kind, fn, args in (("forward", fwd, inputs), ("forward_backward", bwd, (*inputs, g))):
            start = time.perf_counter()
            exe = jax.jit(fn).lower(*args).compile()
            compile_s = time.perf_counter() - start
            warm, _ = timed(exe, *args)
            compiled[name, kind] = (exe, args)
            out[name][kind] = {"compile_s": round(compile_s, 2), "warmup_ms": round(1e3 * warm, 1)}
    times = {key: [] for key in compiled}
    faults = dict.fromkeys(compiled, 0)
    for _ in range(rounds):
        for key, (exe, args) in compiled.items():
            jax.block_until_ready(exe(*args))  # settle: see the docstring
            before = page_faults()
            times[key].append(timed(exe, *args)[0])
            faults[key] += page_faults() - before
    first = next(iter(variants))
    for (name, kind), ts in times.items():
        row = out[name][kind]
        row["ms"] = summary(ts, 1e3, 2)
        row["ms_per_round"] = [round(1e3 * t, 2) for t in ts]
        row["page_faults_per_call"] = round(faults[name, kind] / rounds)
        if name != first:
            per_round = [t / f for t, f in zip(ts, times[first, kind], strict=True)]
            row[f"ratio_to_{first}"] = {
                "of_medians": round(
                    statistics.median(ts) / statistics.median(times[first, kind]), 2
                ),
                "per_round_min": round(min(per_round), 2),
                "per_round_median": round(statistics.median(per_round), 2),
                "per_round_max": round(max(per_round), 2),
            }
    return out
