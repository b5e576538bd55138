"""The prefix scan compiled for XLA's CPU backend: an XLA FFI custom call, built on first use.

XLA's CPU code for a loop over positions runs each step as separate fusions over strided
slices on one thread: the blocked kernel's in-place loop cost 2.5x the memory floor on its
own (README, issue 13). ``_native/prefix_scan.cc`` is the same recurrence, ``combine`` one
token at a time, written once per row: it reads each score and value once, writes each output
once, and spreads rows over XLA's intra-op threads. It computes only the forward pass; the
``"native"`` method of ``scan.py`` takes its derivatives from the blocked kernel's tangent.

The library is compiled with the C++ compiler of the machine (``$CXX``, else ``c++``) against
the headers jaxlib ships, on the first call that needs it, and cached under
``$AAREN_JAX_CACHE`` (default ``~/.cache/aaren_jax``), keyed by the source, the flags, the
jax version and the CPU model, so a cache shared between machines never loads a library built
for another CPU. ``AAREN_JAX_NATIVE=0`` disables it (``"auto"`` then runs ``"blocked"``).

Shape notation: ``R`` rows (any leading axes), ``T`` tokens, ``D`` value width.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
import warnings
from pathlib import Path

import jax

Array = jax.Array
TARGET = "aaren_prefix_scan"
BACKWARD_TARGET = "aaren_prefix_scan_backward"
SOURCE = Path(__file__).parent / "_native" / "prefix_scan.cc"
# IEEE arithmetic throughout: no -ffast-math (NaN must propagate, -inf stay -inf), and no
# fused multiply-adds, which would break the compensated sums' TwoSum
FLAGS = (
    "-O3",
    "-march=native",
    "-ffp-contract=off",
    "-fopenmp-simd",  # `omp simd` pragmas only (the dot products), no OpenMP runtime
    "-std=c++17",
    "-shared",
    "-fPIC",
)


def _cpuinfo() -> str:
    try:
        return Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``; ``platform.processor()`` is often empty)."""
    for line in _cpuinfo().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def cpu_kind(cpuinfo: str | None = None) -> str:
    """The CPU's family, model number and vector width, e.g. ``"family 25, model 17,
    AVX-512"``: a virtual machine's model name ("AMD EPYC") is the same for CPUs that differ
    in both. ``cpuinfo``: the text of ``/proc/cpuinfo`` (default: this machine's)."""
    fields, flags = {}, set()
    for line in (_cpuinfo() if cpuinfo is None else cpuinfo).splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key in ("cpu family", "model") and key not in fields:
            fields[key] = value.strip()
        elif key == "flags" and not flags:
            flags = set(value.split())
    if not fields:
        return "not known"
    vector = "AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags else "no AVX2"
    return f"family {fields.get('cpu family', '?')}, model {fields.get('model', '?')}, {vector}"


def _cache_dir() -> Path:
    default = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "aaren_jax"
    return Path(os.environ.get("AAREN_JAX_CACHE", default))


def _library_path(compiler: str) -> Path:
    # -march=native: a library built for one kind of CPU may not run on another with the
    # same model name (an AVX-512 build on an AVX2 machine), so the kind is in the key
    key = "\n".join(
        [SOURCE.read_text(), compiler, *FLAGS, jax.__version__, platform.machine()]
        + [cpu_model(), cpu_kind()]
    )
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    return _cache_dir() / f"prefix_scan-{digest}.so"


def _build(compiler: str, library: Path) -> None:
    """Compiles the library into ``library`` once, whatever the number of processes asking
    (a file lock; the result is moved into place whole)."""
    import fcntl  # POSIX; elsewhere the ImportError reads as "not available"

    library.parent.mkdir(parents=True, exist_ok=True)
    with open(library.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if library.exists():
            return
        with tempfile.TemporaryDirectory(dir=library.parent) as tmp:
            built = Path(tmp) / library.name
            command = [
                compiler,
                *FLAGS,
                f"-I{jax.ffi.include_dir()}",
                str(SOURCE),
                "-o",
                str(built),
            ]
            result = subprocess.run(command, capture_output=True, text=True)
            if result.returncode != 0:
                raise RuntimeError(f"{' '.join(command)} failed:\n{result.stderr[-2000:]}")
            os.replace(built, library)


_LOAD_LOCK = threading.Lock()  # one registration, whatever the number of threads tracing


def _load() -> str | None:
    """Builds (or finds) and registers the library once: None, or why it is not available."""
    with _LOAD_LOCK:
        return _load_once()


@functools.cache
def _load_once() -> str | None:
    if os.environ.get("AAREN_JAX_NATIVE", "1") == "0":
        return "disabled by AAREN_JAX_NATIVE=0"
    compiler = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if compiler is None:
        return "no C++ compiler found (set CXX)"
    try:
        library = _library_path(compiler)  # reads the source: an OSError if it is missing
        if not library.exists():
            _build(compiler, library)
        loaded = ctypes.cdll.LoadLibrary(str(library))
        for name, handler in [
            (TARGET, loaded.AarenPrefixScan),
            (BACKWARD_TARGET, loaded.AarenPrefixScanBackward),
        ]:
            jax.ffi.register_ffi_target(name, jax.ffi.pycapsule(handler), platform="cpu")
    except (ImportError, OSError, RuntimeError) as err:
        return str(err)
    return None


def unavailable_reason() -> str | None:
    """None when the compiled scan can run here, else why not (building it if needed)."""
    return _load()


def available(warn: bool = False) -> bool:
    """Whether the compiled scan can run here; ``warn``: say once why not, unless disabled."""
    reason = _load()
    if reason is not None and warn and not reason.startswith("disabled"):
        _warn_once(reason)
    return reason is None


def _require() -> None:
    """Raises RuntimeError, with the reason, unless the compiled scan can run here."""
    reason = _load()
    if reason is not None:
        raise RuntimeError(f'method "native" is not available: {reason}')


@functools.cache
def _warn_once(reason: str) -> None:
    warnings.warn(
        f'aaren_jax: the compiled CPU scan is not available, "auto" runs "blocked" ({reason})',
        RuntimeWarning,
        stacklevel=3,
    )


def prefix_scan(
    scores: Array, counts: Array, values: Array, init_m: Array, init_u: Array, init_w: Array
) -> tuple[Array, ...]:
    """Every prefix's state and output, one token at a time (``combine`` of ``scan.py``).

    All arrays share one float dtype (float32 or float64); masked tokens come in as
    ``scores = -inf``, ``counts = 0``, ``values = 0``.

    Args:
      scores: [R..., T]
      counts: 1 where attended, 0 where masked. [R..., T]
      values: [R..., T, D]
      init_m: the running max of the state before the first token. [R...]
      init_u: its sum. [R...]
      init_w: its weighted sum of values. [R..., D]

    Returns:
      ``(outputs [R..., T, D], refs [R..., T], sums [R..., T], m [R...], u [R...],
      w [R..., D])``: per position the output, the exponent's reference (the running max,
      0 before anything is attended) and the sum ``u`` relative to it; then the final state.
    """
    _require()
    shapes = [values, scores, scores, init_m, init_u, init_w]
    out_types = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in shapes]
    call = jax.ffi.ffi_call(TARGET, out_types, vmap_method="broadcast_all")
    return tuple(call(scores, counts, values, init_m, init_u, init_w))


def prefix_scan_backward(
    scores: Array,
    counts: Array,
    values: Array,
    outputs: Array,
    refs: Array,
    sums: Array,
    init_m: Array,
    g: Array,
    g_unorm: Array,
    g_final_u: Array,
    g_final_w: Array,
) -> tuple[Array, ...]:
    """The backward pass of ``prefix_scan``'s outputs, walked from the last token to the first.

    The transpose of the tangent of ``scan.py`` (``_tangent``): given the cotangents of the
    outputs, of ``u`` relative to itself (``du / u``) and of the final ``u`` and ``w``, the
    cotangents of the scores, values and initial ``u`` and ``w``. Same dtype rules and
    masking as ``prefix_scan``, whose outputs, refs and sums it takes.

    Args:
      scores, counts: [R..., T]; values, outputs: [R..., T, D]; refs, sums: [R..., T];
      init_m: [R...]; g: [R..., T, D]; g_unorm: [R..., T]; g_final_u: [R...];
      g_final_w: [R..., D].

    Returns:
      ``(d_scores [R..., T], d_values [R..., T, D], d_init_u [R...], d_init_w [R..., D])``.
    """
    _require()
    shapes = [scores, values, init_m, g_final_w]
    out_types = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in shapes]
    call = jax.ffi.ffi_call(BACKWARD_TARGET, out_types, vmap_method="broadcast_all")
    args = (scores, counts, values, outputs, refs, sums, init_m, g, g_unorm, g_final_u, g_final_w)
    return tuple(call(*args))
