"""Deployment: compiled streaming steps, a ``lax.scan`` streamer, and ``jax.export``.

Per-token overhead is the product when streaming. ``nnx.jit`` around a lambda calling
``model.step`` cost about 7 ms per call on CI's CPU, against under 1 ms for ``jax.jit`` of
a pure function built with ``nnx.split`` / ``nnx.merge`` (MEASUREMENTS). So:

* ``make_step_fn(model)`` returns a pure, jitted ``step_fn(state, carry, x_t, mask_t=None)``
  with the carry donated, and the model's ``state`` (a flat list of arrays) to pass to it;
* ``stream(model, carry, xs)`` runs a known batch of tokens through one ``lax.scan``,
  with no Python and no dispatch between tokens;
* ``export_step(model, batch_size)`` serialises the step (weights included) with
  ``jax.export``; ``load_step(blob)`` runs it without the model's Python code.

All three run the model in **eval mode** (dropout off), whatever mode ``model`` is in, and
leave ``model`` itself in the mode it was: a compiled or exported step is a deterministic
function of its state, carry and token, with no random key to carry along. So while
``model`` is in train mode with dropout, ``stream(model, ...)`` differs from ``model(x)``
and ``model.step``; call ``model.eval()`` to compare them, or loop over ``model.step`` in
Python to stream with dropout.

They take any ``nnx.Module`` with ``step(carry, x_t, mask_t)`` and
``init_carry(batch_size[, max_len])``: the width ``d`` comes from ``model.d_model`` when the
model has one, else from the input (``export_step`` takes it as ``d_model=``).

KV caches overflow checks run on the host before each call (a traced position cannot
raise); for a ``Transformer`` this reads the position back, one scalar per call.

Shape notation: ``B`` batch, ``T`` time, ``d`` model width.
"""

from __future__ import annotations

import functools
import hashlib
import json
import operator
import os
import struct
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from aaren_jax.attention import KVCache, check_capacity, check_inputs

Array = jax.Array

_MAGIC = b"AARENJAX-STEP\x00"
# Version 2 adds a SHA-256 digest of the two exported functions to the header; version 1
# artifacts (no digest) still load.
_FORMAT_VERSION = 2
_READABLE_VERSIONS = (1, 2)
_PLATFORMS = ("cpu", "cuda", "rocm", "tpu")
_PART_NAMES = ("header", "step function", "init function")


def _eval_model(graphdef, state):
    """Rebuilds the model inside a trace, in eval mode (only this copy changes)."""
    model = nnx.merge(graphdef, state)
    model.eval()
    return model


def _check_has_step(model, caller: str) -> None:
    if not callable(getattr(model, "step", None)):
        raise TypeError(
            f"{caller} needs a module with step(carry, x_t, mask_t), got {type(model).__name__}"
        )


def _model_width(model) -> int | None:
    """``model.d_model`` when the model has one, else None (take it from the input)."""
    width = getattr(model, "d_model", None)
    return None if width is None else int(width)


def _check_tokens(width: int | None, x, mask, *, name: str, ndim: int):
    """``check_inputs`` against ``width``, or against the input's own width when None."""
    if width is None:
        # Any width will do: check_inputs tests the rank before the width.
        width = np.shape(x)[-1] if np.ndim(x) else 0
    return check_inputs(x, mask, width, name=name, ndim=ndim)


def _init_carry(model, batch_size: int, max_len: int | None):
    """``model.init_carry``, without ``max_len`` when None (a one-argument init_carry works)."""
    if max_len is None:
        return model.init_carry(batch_size)
    return model.init_carry(batch_size, max_len)


def _brief_shapes(shapes, limit: int = 6) -> str:
    """``[(2, 16), (16,), ...]``, cut after ``limit`` entries."""
    shown = ", ".join(str(tuple(s)) for s in shapes[:limit])
    more = f", ... ({len(shapes) - limit} more)" if len(shapes) > limit else ""
    return f"[{shown}{more}]"


def _mismatch(what: str, owner: str, expected, got) -> ValueError:
    """The error for a list of arrays that is not the one expected (count or shapes)."""
    expected_shapes = [tuple(a.shape) for a in expected]
    got_shapes = [tuple(np.shape(a)) for a in got]
    message = (
        f"{what} does not match {owner}: expected {len(expected_shapes)} arrays of shapes "
        f"{_brief_shapes(expected_shapes)}, got {len(got_shapes)} arrays of shapes "
        f"{_brief_shapes(got_shapes)}"
    )
    if len(expected_shapes) == len(got_shapes):
        index = next(
            i for i, (a, b) in enumerate(zip(expected_shapes, got_shapes, strict=True)) if a != b
        )
        message += (
            f" (first difference: {what}[{index}] has shape {got_shapes[index]}, "
            f"expected {expected_shapes[index]})"
        )
    return ValueError(message)


def make_step_fn(model: nnx.Module) -> tuple[Callable, list[Array]]:
    """A pure, jit-compiled one-token step of ``model``, and the state to call it with.

    The step runs the model in eval mode (dropout off) whatever mode ``model`` is in, and
    leaves ``model``'s own mode alone: ``step_fn`` equals ``model.step`` after
    ``model.eval()``, not in train mode with dropout.

    The graph definition is closed over rather than passed as a static argument: hashing
    an NNX ``GraphDef`` on every call cost more than the step itself on CPU. The state is
    passed as a flat list of arrays, which ``jax.jit`` flattens faster than an
    ``nnx.State`` (an ``nnx.State`` is accepted too, at that cost).

    Args:
      model: an ``Aaren``, a ``Transformer``, or any ``nnx.Module`` with
        ``step(carry, x_t, mask_t)``; the width ``d`` is ``model.d_model`` when the model
        has one, else the last axis of ``x_t``.

    Returns:
      ``(step_fn, state)``. ``step_fn(state, carry, x_t, mask_t=None) -> (carry, y_t)``
      with ``x_t`` [B, d], ``mask_t`` [B] bool, ``y_t`` [B, d]. The carry argument is
      donated: do not reuse it after the call. ``state`` is a snapshot of the model's
      variables, ``jax.tree.leaves(nnx.state(model))``; pass a fresh one after training
      further. Each call of ``make_step_fn`` compiles anew: build it once.

    Raises:
      TypeError: ``model`` has no ``step`` method.

    ``step_fn`` raises:
      ValueError: a ``state`` that is not this model's (another count or shapes of
        arrays), a KV cache that would overflow (checked on the host, before the call),
        or bad shapes of ``x_t`` or ``mask_t``.

    Example:
      >>> model = Aaren(1, 16, 2, 32, rngs=nnx.Rngs(0))
      >>> step_fn, state = make_step_fn(model)
      >>> carry, y_t = step_fn(state, model.init_carry(2), jnp.ones((2, 16)))
      >>> y_t.shape
      (2, 16)
    """
    _check_has_step(model, "make_step_fn")
    graphdef, state = nnx.split(model)
    leaves, treedef = jax.tree.flatten(state)
    shapes = [tuple(leaf.shape) for leaf in leaves]
    width = _model_width(model)

    @functools.partial(jax.jit, donate_argnums=1)
    def jitted(state, carry, x_t, mask_t):
        # Checked while tracing, so at no cost per call: jit retraces for any other count
        # or shapes of arrays, and a state of another model would otherwise fail deep
        # inside nnx.merge ("cannot reshape array") or run with the wrong weights.
        if len(state) != len(shapes) or [a.shape for a in state] != shapes:
            raise _mismatch("state", "the model this step_fn was made for", leaves, state)
        module = _eval_model(graphdef, jax.tree.unflatten(treedef, state))
        return module.step(carry, x_t, mask_t)

    def step_fn(state, carry, x_t, mask_t=None):
        if isinstance(state, nnx.State):
            state = jax.tree.leaves(state)
        x_t, mask_t = _check_tokens(width, x_t, mask_t, name="x_t", ndim=2)
        check_capacity(carry, 1)
        return jitted(state, carry, x_t, mask_t)

    return step_fn, leaves


@functools.partial(jax.jit, static_argnums=0)
def _jit_stream(graphdef, state, carry, xs, mask):
    model = _eval_model(graphdef, state)
    time_major = jnp.swapaxes(xs, 0, 1)  # [T, B, d]: lax.scan walks the leading axis
    if mask is None:
        carry, ys = jax.lax.scan(lambda c, x: model.step(c, x), carry, time_major)
    else:
        carry, ys = jax.lax.scan(
            lambda c, xm: model.step(c, xm[0], xm[1]), carry, (time_major, mask.T)
        )
    return carry, jnp.swapaxes(ys, 0, 1)


def stream(model: nnx.Module, carry, xs: Array, mask: Array | None = None):
    """Feeds ``T`` tokens one at a time through ``model.step`` inside one ``lax.scan``.

    Equal to ``T`` calls of ``model.step`` (and to a parallel pass from ``carry``) in eval
    mode, with no Python between tokens. The stream runs in eval mode (dropout off)
    whatever mode ``model`` is in, and leaves ``model``'s own mode alone: compare it with
    ``model(x)`` after ``model.eval()``. Compiled once per model structure and shapes.

    Args:
      model: an ``Aaren``, a ``Transformer``, or any ``nnx.Module`` with
        ``step(carry, x_t, mask_t)``; the width ``d`` is ``model.d_model`` when the model
        has one, else the last axis of ``xs``.
      carry: the carry to start from (``model.init_carry`` or a prefill's); not donated.
      xs: tokens. [B, T, d]
      mask: True = valid token. [B, T]

    Returns:
      ``(carry, ys)`` with ``ys`` [B, T, d].

    Raises:
      TypeError: ``model`` has no ``step`` method.
      ValueError: a KV cache cannot hold ``T`` more tokens, or bad shapes.

    Example:
      >>> model = Aaren(1, 16, 2, 32, rngs=nnx.Rngs(0))
      >>> carry, ys = stream(model, model.init_carry(2), jnp.ones((2, 100, 16)))
      >>> ys.shape
      (2, 100, 16)
    """
    _check_has_step(model, "stream")
    xs, mask = _check_tokens(_model_width(model), xs, mask, name="xs", ndim=3)
    check_capacity(carry, xs.shape[1])
    graphdef, state = nnx.split(model)
    return _jit_stream(graphdef, state, carry, xs, mask)


# ----------------------------------------------------------------------------------------
# jax.export


class LoadedStep(NamedTuple):
    """A deserialised step: plain callables over a flat carry, no model code needed.

    Attributes:
      step: ``step(carry, x_t, mask_t=None) -> (carry, y_t)``; ``carry`` is a tuple of
        arrays (the model carry's leaves in ``jax.tree.leaves`` order; the model's own
        carry pytree is accepted too), ``x_t`` [B, d], ``mask_t`` [B] bool, ``y_t``
        [B, d]. Raises ValueError past a KV cache's capacity, and for a carry, ``x_t`` or
        ``mask_t`` that does not fit the artifact (count, shapes or dtypes).
      init_carry: ``init_carry() -> carry``, the empty carry as a tuple of arrays.
    """

    step: Callable[..., tuple[tuple[Array, ...], Array]]
    init_carry: Callable[[], tuple[Array, ...]]


def _cache_positions(carry) -> list[tuple[int, int]]:
    """``(leaf index of KVCache.length, capacity)`` for every cache in ``carry``."""
    is_cache = lambda c: isinstance(c, KVCache)  # noqa: E731
    caches, _ = jax.tree_util.tree_flatten_with_path(carry, is_leaf=is_cache)
    capacity_at = {
        path + (jax.tree_util.GetAttrKey("length"),): cache.capacity
        for path, cache in caches
        if is_cache(cache)
    }
    leaves, _ = jax.tree_util.tree_flatten_with_path(carry)
    return [(i, capacity_at[path]) for i, (path, _) in enumerate(leaves) if path in capacity_at]


def _positive_int(value, name: str) -> int:
    """``value`` as an int, or TypeError (not an integer) / ValueError (not positive)."""
    if isinstance(value, bool):
        raise TypeError(f"{name} must be a positive int, got {value!r}")
    try:
        number = operator.index(value)
    except TypeError:
        raise TypeError(
            f"{name} must be a positive int, got {value!r} ({type(value).__name__})"
        ) from None
    if number <= 0:
        raise ValueError(f"{name} must be a positive int, got {number}")
    return number


def _check_platforms(platforms) -> tuple[str, ...] | None:
    """``platforms`` as a tuple of known names, or TypeError / ValueError naming the bad one."""
    if platforms is None:
        return None
    if isinstance(platforms, str):
        raise TypeError(
            f"platforms must be a tuple of platform names such as ({platforms!r},), "
            f"got the string {platforms!r}"
        )
    try:
        platforms = tuple(platforms)
    except TypeError:
        raise TypeError(
            f"platforms must be a tuple of platform names from {_PLATFORMS}, got {platforms!r}"
        ) from None
    if not platforms:
        raise ValueError(f"platforms must name at least one of {_PLATFORMS}, got ()")
    for platform in platforms:
        if platform not in _PLATFORMS:
            raise ValueError(
                f"platforms: unknown platform {platform!r}; known platforms are {_PLATFORMS}"
            )
    if len(set(platforms)) != len(platforms):
        raise ValueError(f"platforms must not repeat a platform, got {platforms}")
    return platforms


def export_step(
    model: nnx.Module,
    batch_size: int,
    *,
    max_len: int | None = None,
    dtype: Any = jnp.float32,
    platforms: tuple[str, ...] | None = None,
    d_model: int | None = None,
) -> bytes:
    """Serialises the model's one-token step, weights included, with ``jax.export``.

    The artifact holds two StableHLO functions, the step and the empty carry, and runs
    with ``load_step`` in any process with JAX, without this library's model code.
    Shapes are fixed: batch ``batch_size``, the model's width, ``dtype`` inputs. The step
    is exported in eval mode (dropout off) whatever mode ``model`` is in; ``model``'s own
    mode is left alone.

    Args:
      model: an ``Aaren``, a ``Transformer``, or any ``nnx.Module`` with
        ``step(carry, x_t, mask_t)`` and ``init_carry(batch_size[, max_len])``.
      batch_size: ``B``, a positive int.
      max_len: the KV cache capacity (Transformer); ignored by Aaren; not passed to
        ``init_carry`` when None.
      dtype: dtype of ``x_t``, a floating dtype.
      platforms: lowering platforms, a tuple of names (``"cpu"``,
        ``"cuda"``, ``"rocm"``, ``"tpu"``), e.g. ``("cpu", "cuda")``; default the current
        one.
      d_model: the width ``d`` of ``x_t``; default ``model.d_model``, required for a model
        without that attribute.

    Returns:
      The serialised artifact.

    Raises:
      TypeError: ``batch_size`` not an int, ``platforms`` not a tuple of names, a
        non-floating ``dtype``, a ``model`` with no ``step``.
      ValueError: ``batch_size`` not positive, an unknown or repeated platform, a missing
        or contradictory ``d_model``.

    Example:
      >>> model = Aaren(1, 16, 2, 32, rngs=nnx.Rngs(0))
      >>> loaded = load_step(export_step(model, 2))
      >>> carry, y_t = loaded.step(loaded.init_carry(), jnp.ones((2, 16)))
      >>> y_t.shape
      (2, 16)
    """
    _check_has_step(model, "export_step")
    batch_size = _positive_int(batch_size, "batch_size")
    platforms = _check_platforms(platforms)
    if not jnp.issubdtype(jnp.dtype(dtype), jnp.floating):
        raise TypeError(f"dtype must be a floating dtype, got {jnp.dtype(dtype)}")
    width = _model_width(model)
    if d_model is not None:
        d_model = _positive_int(d_model, "d_model")
        if width is not None and d_model != width:
            raise ValueError(f"d_model={d_model} contradicts model.d_model={width}")
        width = d_model
    if width is None:
        raise ValueError(
            f"export_step needs the width of x_t: {type(model).__name__} has no d_model "
            "attribute, pass d_model="
        )

    graphdef, state = nnx.split(model)
    carry0 = _init_carry(model, batch_size, max_len)
    leaves0, treedef = jax.tree.flatten(carry0)

    def step(carry_leaves, x_t, mask_t):
        # The weights are closed over: they become constants of the exported module.
        module = _eval_model(graphdef, state)
        carry, y_t = module.step(jax.tree.unflatten(treedef, carry_leaves), x_t, mask_t)
        return tuple(jax.tree.leaves(carry)), y_t

    def init():
        return tuple(jax.tree.leaves(_init_carry(model, batch_size, max_len)))

    carry_spec = tuple(jax.ShapeDtypeStruct(x.shape, x.dtype) for x in leaves0)
    x_spec = jax.ShapeDtypeStruct((batch_size, width), jnp.dtype(dtype))
    mask_spec = jax.ShapeDtypeStruct((batch_size,), jnp.bool_)
    exp_step = jax.export.export(jax.jit(step), platforms=platforms)(carry_spec, x_spec, mask_spec)
    exp_init = jax.export.export(jax.jit(init), platforms=platforms)()
    step_bytes, init_bytes = bytes(exp_step.serialize()), bytes(exp_init.serialize())
    header = json.dumps(
        {
            "version": _FORMAT_VERSION,
            "batch_size": batch_size,
            "d_model": width,
            "caches": _cache_positions(carry0),
            "sha256": [hashlib.sha256(p).hexdigest() for p in (step_bytes, init_bytes)],
        }
    ).encode()
    parts = [header, step_bytes, init_bytes]
    return _MAGIC + b"".join(struct.pack("<Q", len(p)) + p for p in parts)


def _read_artifact(source) -> tuple[bytes, str]:
    """The artifact's bytes, and where they came from for error messages."""
    if isinstance(source, bytes | bytearray | memoryview):
        return bytes(source), ""
    if isinstance(source, str | os.PathLike):
        path = os.fspath(source)
        try:
            with open(path, "rb") as f:
                return f.read(), f" (file {path!r})"
        except OSError as error:
            reason = error.strerror or type(error).__name__
            raise ValueError(
                f"cannot read aaren_jax step artifact from path {path!r}: {reason}"
            ) from error
    raise TypeError(
        "load_step takes the artifact's bytes or a path (str or os.PathLike), "
        f"got {type(source).__name__}"
    )


def _corrupt(reason: str, origin: str) -> ValueError:
    return ValueError(f"corrupt aaren_jax step artifact{origin}: {reason}")


def _split_parts(blob: bytes, origin: str = "") -> list[bytes]:
    """The three length-prefixed parts, each length checked against the bytes left."""
    if not blob.startswith(_MAGIC):
        hint = "" if origin else "; pass a path as str or os.PathLike, not bytes"
        raise ValueError(f"not an aaren_jax step artifact{origin} (bad magic bytes){hint}")
    parts, pos = [], len(_MAGIC)
    for name in _PART_NAMES:
        left = len(blob) - pos
        if left < 8:
            raise _corrupt(
                f"truncated: the {name}'s 8-byte length field at offset {pos} has {left} "
                "byte(s) left",
                origin,
            )
        (size,) = struct.unpack_from("<Q", blob, pos)
        pos += 8
        if size > len(blob) - pos:
            raise _corrupt(
                f"truncated: the {name} declares {size} bytes, {len(blob) - pos} left", origin
            )
        parts.append(blob[pos : pos + size])
        pos += size
    if pos != len(blob):
        raise _corrupt(f"{len(blob) - pos} unexpected byte(s) after the last part", origin)
    return parts


def _read_header(header: bytes, origin: str) -> dict:
    try:
        meta = json.loads(header)
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise _corrupt(f"unreadable header ({error})", origin) from None
    if not isinstance(meta, dict):
        raise _corrupt("the header is not a JSON object", origin)
    if meta.get("version") not in _READABLE_VERSIONS:
        raise ValueError(
            f"unsupported aaren_jax step artifact version {meta.get('version')!r}{origin}; "
            f"this library reads versions {_READABLE_VERSIONS}"
        )
    ints = ("batch_size", "d_model")
    if not all(type(meta.get(key)) is int and meta[key] > 0 for key in ints):
        raise _corrupt("the header's batch_size or d_model is not a positive int", origin)
    caches = meta.get("caches")
    if not isinstance(caches, list) or not all(
        isinstance(c, list) and len(c) == 2 and all(type(i) is int for i in c) for c in caches
    ):
        raise _corrupt("the header's caches are not [leaf index, capacity] pairs", origin)
    return meta


def load_step(source: bytes | str | os.PathLike) -> LoadedStep:
    """Deserialises an ``export_step`` artifact into plain callables.

    Args:
      source: the bytes from ``export_step``, or the path of a file holding them
        (``str`` or ``os.PathLike``).

    Returns:
      A ``LoadedStep`` (``step``, ``init_carry``).

    Raises:
      TypeError: ``source`` is neither bytes nor a path.
      ValueError: a path that cannot be read (named), not an artifact of this format,
        an unsupported version, or a truncated or corrupt artifact
        (``"corrupt aaren_jax step artifact: ..."``).
    """
    blob, origin = _read_artifact(source)
    header, step_bytes, init_bytes = _split_parts(blob, origin)
    meta = _read_header(header, origin)
    if "sha256" in meta or meta["version"] >= 2:
        digests = [hashlib.sha256(p).hexdigest() for p in (step_bytes, init_bytes)]
        if meta.get("sha256") != digests:
            raise _corrupt("the exported functions do not match their SHA-256 digest", origin)
    try:
        exp_step = jax.export.deserialize(bytearray(step_bytes))
        exp_init = jax.export.deserialize(bytearray(init_bytes))
    except Exception as error:  # flatbuffer and MLIR parsers raise many kinds
        raise _corrupt(f"cannot deserialise ({type(error).__name__}: {error})", origin) from None
    batch_size, d_model, caches = meta["batch_size"], meta["d_model"], meta["caches"]
    carry_avals = tuple(exp_init.out_avals)
    num_carry = len(carry_avals)
    if len(exp_step.in_avals) != num_carry + 2 or any(index >= num_carry for index, _ in caches):
        raise _corrupt("the step's inputs do not fit the init function's carry", origin)
    x_aval = exp_step.in_avals[num_carry]
    if x_aval.shape != (batch_size, d_model):
        raise _corrupt("the step's x_t does not fit the header's batch_size and d_model", origin)
    x_shape = (batch_size, d_model)

    @jax.jit
    def call_step(leaves, x_t, mask_t):
        # Checked while tracing (jit retraces for any other shapes or dtypes): no cost per
        # call, and errors that name the argument instead of the exported call's.
        if len(leaves) != num_carry or [a.shape for a in leaves] != [b.shape for b in carry_avals]:
            raise _mismatch("carry", f"this artifact{origin}", carry_avals, leaves)
        for i, (a, b) in enumerate(zip(leaves, carry_avals, strict=True)):
            if a.dtype != b.dtype:
                raise ValueError(f"carry[{i}] has dtype {a.dtype}, the artifact expects {b.dtype}")
        if x_t.shape != x_shape or x_t.dtype != x_aval.dtype:
            raise ValueError(
                f"x_t must have shape {x_shape} and dtype {x_aval.dtype} (exported), "
                f"got shape {x_t.shape} and dtype {x_t.dtype}"
            )
        if mask_t.shape != (batch_size,) or mask_t.dtype != jnp.bool_:
            raise ValueError(
                f"mask_t must be boolean of shape {(batch_size,)} (exported), got "
                f"{mask_t.dtype} of shape {mask_t.shape}"
            )
        return exp_step.call(leaves, x_t, mask_t)

    call_init = jax.jit(exp_init.call)

    def step(carry, x_t, mask_t=None):
        leaves = tuple(jax.tree.leaves(carry))
        x_t = x_t if isinstance(x_t, jax.Array) else jnp.asarray(x_t)
        if mask_t is None:
            mask_t = jnp.ones((batch_size,), jnp.bool_)
        elif not isinstance(mask_t, jax.Array):
            mask_t = jnp.asarray(mask_t)
        for index, capacity in caches:
            if index >= len(leaves) or np.shape(leaves[index]) != ():
                break  # not this artifact's carry: call_step says so
            position = int(np.asarray(leaves[index]))
            if position + 1 > capacity:
                raise ValueError(
                    f"KV cache overflow: capacity {capacity}, position {position}, "
                    "cannot write 1 more token(s); export with a larger max_len"
                )
        return call_step(leaves, x_t, mask_t)

    def init_carry():
        return call_init()

    return LoadedStep(step, init_carry)
