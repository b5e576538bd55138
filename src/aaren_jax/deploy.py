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

All three run the model in eval mode (dropout off), whatever mode ``model`` is in.
KV caches overflow checks run on the host before each call (a traced position cannot
raise); for a ``Transformer`` this reads the position back, one scalar per call.

Shape notation: ``B`` batch, ``T`` time, ``d`` model width.
"""

from __future__ import annotations

import functools
import json
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
_FORMAT_VERSION = 1


def _eval_model(graphdef, state):
    """Rebuilds the model inside a trace, in eval mode (only this copy changes)."""
    model = nnx.merge(graphdef, state)
    model.eval()
    return model


def make_step_fn(model: nnx.Module) -> tuple[Callable, list[Array]]:
    """A pure, jit-compiled one-token step of ``model``, and the state to call it with.

    The graph definition is closed over rather than passed as a static argument: hashing
    an NNX ``GraphDef`` on every call cost more than the step itself on CPU. The state is
    passed as a flat list of arrays, which ``jax.jit`` flattens faster than an
    ``nnx.State`` (an ``nnx.State`` is accepted too, at that cost).

    Args:
      model: an ``Aaren`` or ``Transformer`` (anything with ``step(carry, x_t, mask_t)``).

    Returns:
      ``(step_fn, state)``. ``step_fn(state, carry, x_t, mask_t=None) -> (carry, y_t)``
      with ``x_t`` [B, d], ``mask_t`` [B] bool, ``y_t`` [B, d]. The carry argument is
      donated: do not reuse it after the call. ``state`` is a snapshot of the model's
      variables, ``jax.tree.leaves(nnx.state(model))``; pass a fresh one after training
      further. Each call of ``make_step_fn`` compiles anew: build it once.

    Raises (from ``step_fn``):
      ValueError: a KV cache would overflow (checked on the host, before the call), or
        bad shapes.

    Example:
      >>> model = Aaren(1, 16, 2, 32, rngs=nnx.Rngs(0))
      >>> step_fn, state = make_step_fn(model)
      >>> carry, y_t = step_fn(state, model.init_carry(2), jnp.ones((2, 16)))
      >>> y_t.shape
      (2, 16)
    """
    graphdef, state = nnx.split(model)
    leaves, treedef = jax.tree.flatten(state)
    d_model = model.d_model

    @functools.partial(jax.jit, donate_argnums=1)
    def jitted(leaves, carry, x_t, mask_t):
        module = _eval_model(graphdef, jax.tree.unflatten(treedef, leaves))
        return module.step(carry, x_t, mask_t)

    def step_fn(state, carry, x_t, mask_t=None):
        if isinstance(state, nnx.State):
            state = jax.tree.leaves(state)
        x_t, mask_t = check_inputs(x_t, mask_t, d_model, name="x_t", ndim=2)
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

    Equal to ``T`` calls of ``model.step`` (and to a parallel pass from ``carry``), with no
    Python between tokens. Compiled once per model structure and shapes.

    Args:
      model: an ``Aaren`` or ``Transformer``.
      carry: the carry to start from (``model.init_carry`` or a prefill's); not donated.
      xs: tokens. [B, T, d]
      mask: True = valid token. [B, T]

    Returns:
      ``(carry, ys)`` with ``ys`` [B, T, d].

    Raises:
      ValueError: a KV cache cannot hold ``T`` more tokens, or bad shapes.

    Example:
      >>> model = Aaren(1, 16, 2, 32, rngs=nnx.Rngs(0))
      >>> carry, ys = stream(model, model.init_carry(2), jnp.ones((2, 100, 16)))
      >>> ys.shape
      (2, 100, 16)
    """
    xs, mask = check_inputs(xs, mask, model.d_model, name="xs")
    check_capacity(carry, xs.shape[1])
    graphdef, state = nnx.split(model)
    return _jit_stream(graphdef, state, carry, xs, mask)


# ----------------------------------------------------------------------------------------
# jax.export


class LoadedStep(NamedTuple):
    """A deserialised step: plain callables over a flat carry, no model code needed.

    Attributes:
      step: ``step(carry, x_t, mask_t=None) -> (carry, y_t)``; ``carry`` is a tuple of
        arrays (the model carry's leaves in ``jax.tree.leaves`` order), ``x_t`` [B, d],
        ``mask_t`` [B] bool, ``y_t`` [B, d]. Raises ValueError past a KV cache's capacity.
      init_carry: ``init_carry() -> carry``, the empty carry as a tuple of arrays.
    """

    step: Callable[..., tuple[tuple[Array, ...], Array]]
    init_carry: Callable[[], tuple[Array, ...]]


def _cache_positions(carry) -> list[tuple[int, int]]:
    """``(leaf index of KVCache.length, capacity)`` for every cache in ``carry``."""
    marked = jax.tree.map(
        lambda c: c._replace(length="length") if isinstance(c, KVCache) else c,
        carry,
        is_leaf=lambda c: isinstance(c, KVCache),
    )
    leaves = jax.tree.leaves(marked)
    capacities = [
        c.capacity
        for c in jax.tree.leaves(carry, is_leaf=lambda c: isinstance(c, KVCache))
        if isinstance(c, KVCache)
    ]
    indices = [i for i, leaf in enumerate(leaves) if isinstance(leaf, str)]
    return list(zip(indices, capacities, strict=True))


def export_step(
    model: nnx.Module,
    batch_size: int,
    *,
    max_len: int | None = None,
    dtype: Any = jnp.float32,
    platforms: tuple[str, ...] | None = None,
) -> bytes:
    """Serialises the model's one-token step, weights included, with ``jax.export``.

    The artifact holds two StableHLO functions, the step and the empty carry, and runs
    with ``load_step`` in any process with JAX, without this library's model code.
    Shapes are fixed: batch ``batch_size``, the model's width, ``dtype`` inputs.

    Args:
      model: an ``Aaren`` or ``Transformer`` (run in eval mode).
      batch_size: ``B``.
      max_len: the KV cache capacity (Transformer); ignored by Aaren.
      dtype: dtype of ``x_t``.
      platforms: lowering platforms, e.g. ``("cpu", "cuda")``; default the current one.

    Returns:
      The serialised artifact.

    Example:
      >>> model = Aaren(1, 16, 2, 32, rngs=nnx.Rngs(0))
      >>> loaded = load_step(export_step(model, 2))
      >>> carry, y_t = loaded.step(loaded.init_carry(), jnp.ones((2, 16)))
      >>> y_t.shape
      (2, 16)
    """
    graphdef, state = nnx.split(model)
    carry0 = model.init_carry(batch_size, max_len)
    leaves0, treedef = jax.tree.flatten(carry0)

    def step(carry_leaves, x_t, mask_t):
        # The weights are closed over: they become constants of the exported module.
        module = _eval_model(graphdef, state)
        carry, y_t = module.step(jax.tree.unflatten(treedef, carry_leaves), x_t, mask_t)
        return tuple(jax.tree.leaves(carry)), y_t

    def init():
        return tuple(jax.tree.leaves(model.init_carry(batch_size, max_len)))

    carry_spec = tuple(jax.ShapeDtypeStruct(x.shape, x.dtype) for x in leaves0)
    x_spec = jax.ShapeDtypeStruct((int(batch_size), model.d_model), jnp.dtype(dtype))
    mask_spec = jax.ShapeDtypeStruct((int(batch_size),), jnp.bool_)
    exp_step = jax.export.export(jax.jit(step), platforms=platforms)(carry_spec, x_spec, mask_spec)
    exp_init = jax.export.export(jax.jit(init), platforms=platforms)()
    header = json.dumps(
        {
            "version": _FORMAT_VERSION,
            "batch_size": int(batch_size),
            "d_model": int(model.d_model),
            "caches": _cache_positions(carry0),
        }
    ).encode()
    parts = [header, bytes(exp_step.serialize()), bytes(exp_init.serialize())]
    return _MAGIC + b"".join(struct.pack("<Q", len(p)) + p for p in parts)


def _split_parts(blob: bytes) -> list[bytes]:
    if not blob.startswith(_MAGIC):
        raise ValueError("not an aaren_jax step artifact (bad magic bytes)")
    parts, pos = [], len(_MAGIC)
    while pos < len(blob):
        (size,) = struct.unpack_from("<Q", blob, pos)
        parts.append(blob[pos + 8 : pos + 8 + size])
        pos += 8 + size
    if len(parts) != 3:
        raise ValueError(f"corrupt aaren_jax step artifact: {len(parts)} parts, expected 3")
    return parts


def load_step(blob: bytes) -> LoadedStep:
    """Deserialises an ``export_step`` artifact into plain callables.

    Args:
      blob: the bytes from ``export_step``.

    Returns:
      A ``LoadedStep`` (``step``, ``init_carry``).

    Raises:
      ValueError: not an artifact of this format.
    """
    header, step_bytes, init_bytes = _split_parts(blob)
    meta = json.loads(header)
    if meta.get("version") != _FORMAT_VERSION:
        raise ValueError(f"unsupported artifact version {meta.get('version')}")
    exp_step = jax.export.deserialize(bytearray(step_bytes))
    exp_init = jax.export.deserialize(bytearray(init_bytes))
    batch_size, d_model, caches = meta["batch_size"], meta["d_model"], meta["caches"]
    call_step = jax.jit(exp_step.call)
    call_init = jax.jit(exp_init.call)

    def step(carry, x_t, mask_t=None):
        x_t = jnp.asarray(x_t)
        if x_t.shape != (batch_size, d_model):
            raise ValueError(
                f"x_t must have shape {(batch_size, d_model)} (exported), got {x_t.shape}"
            )
        for index, capacity in caches:
            position = int(np.asarray(carry[index]))
            if position + 1 > capacity:
                raise ValueError(
                    f"KV cache overflow: capacity {capacity}, position {position}, "
                    "cannot write 1 more token(s); export with a larger max_len"
                )
        if mask_t is None:
            mask_t = jnp.ones((batch_size,), jnp.bool_)
        return call_step(tuple(carry), x_t, mask_t)

    def init_carry():
        return call_init()

    return LoadedStep(step, init_carry)
