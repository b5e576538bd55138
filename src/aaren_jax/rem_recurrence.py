"""REMs in recurrent form (SPEC 1.6, "Beyond the paper"): each causal REM applied to values
is a linear recurrence, run in parallel (``rem_apply``) or one token at a time
(``rem_step``), with no truncation at ``K`` and padding tokens absent from the lags. See
``aaren_jax.rem`` for the definitions and the difference from the matrix form.

Shape notation: ``...`` leading axes, ``H`` heads, ``T`` time, ``D`` value size.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from aaren_jax.rem_config import REMConfig, config_params
from aaren_jax.scan import accumulation_dtype

Array = jax.Array

METHODS = ("associative", "sequential")


# --------------------------------------------------------------------------------------
# Recurrent form (SPEC 1.6, "Beyond the paper")
# --------------------------------------------------------------------------------------


class REMState(NamedTuple):
    """Streaming state of the causal REMs of one layer.

    Per head, a ring of ``p`` recurrence states ``s = r + v`` (the REM output so far plus
    the last value, which is all the recurrence needs), one per residue class of the
    token index modulo the head's dilation ``p``; slots at and above ``p`` are unused.
    Complex states of cyclical heads are stored as (real, imaginary) pairs; regular heads
    keep a zero imaginary part.

    Attributes:
      ring: recurrence states. [..., H, P, 2, D] with ``P = config.ring_size``
      phase: present tokens seen, modulo ``config.phase_modulus`` (int32); the slot of the
        next token of a head with dilation ``p`` is ``phase % p``. [...]
    """

    ring: Array
    phase: Array


def init_rem_state(config: REMConfig, batch_shape, dim: int, dtype=jnp.float32) -> REMState:
    """The empty state: no token seen (all REM outputs 0).

    Args:
      config: head assignment.
      batch_shape: leading axes, e.g. ``(B,)``. [...]
      dim: value size ``D``.
      dtype: state dtype; float32 unless the values are float64.

    Returns:
      ``REMState`` with ``ring`` [..., H, P, 2, D] zeros and ``phase`` [...] zeros.

    Example:
      >>> init_rem_state(REMConfig((1, 0, 0, 1, 0, 0), dilations=3), (2,), 8).ring.shape
      (2, 2, 3, 2, 8)
    """
    if not isinstance(config, REMConfig):
        raise TypeError(f"init_rem_state: config must be a REMConfig, got {type(config)}")
    if not jnp.issubdtype(dtype, jnp.floating):
        raise TypeError(f"init_rem_state: dtype must be floating, got {jnp.dtype(dtype)}")
    batch_shape = (int(batch_shape),) if np.ndim(batch_shape) == 0 else tuple(map(int, batch_shape))
    ring_shape = (*batch_shape, config.num_heads, config.ring_size, 2, int(dim))
    return REMState(jnp.zeros(ring_shape, dtype), jnp.zeros(batch_shape, jnp.int32))


def _head_coefficients(config: REMConfig, params: Mapping, acc, name: str):
    """Per-head recurrence coefficient ``a = lambda`` or ``gamma e^{i theta}``: (re, im). [H]"""
    eta, nu, theta = config_params(name, config, params, acc)
    gamma = jnp.exp(jax.nn.log_sigmoid(nu))
    re = jnp.concatenate([jnp.tanh(eta), gamma * jnp.cos(theta)])
    im = jnp.concatenate([jnp.zeros_like(eta), gamma * jnp.sin(theta)])
    offset = {"regular": 0, "cyclic_cos": config.num_regular, "cyclic_sin": config.num_regular}
    row = [offset[k] + i for k, i in zip(config.head_kinds, config.head_param_index, strict=True)]
    row = jnp.asarray(row, jnp.int32)
    return jnp.take(re, row), jnp.take(im, row)


def _check_values(name: str, config: REMConfig, values, time_axis: bool):
    values = jnp.asarray(values)
    rank = 3 if time_axis else 2
    layout = "[..., H, T, D]" if time_axis else "[..., H, D]"
    if values.ndim < rank:
        raise ValueError(f"{name}: values must be {layout}, got shape {list(values.shape)}")
    if not jnp.issubdtype(values.dtype, jnp.floating):
        raise TypeError(f"{name}: values must be floating, got {values.dtype}")
    if values.shape[-rank] != config.num_heads:
        raise ValueError(
            f"{name}: values {layout} has H = {values.shape[-rank]} heads, config has "
            f"{config.num_heads} (counts {config.counts})"
        )
    return values


def _check_mask(name: str, mask, shape: tuple, layout: str):
    if mask is None:
        return None
    mask = jnp.asarray(mask)
    if mask.dtype != jnp.bool_:
        raise TypeError(f"{name}: mask must be boolean (True = token present), got {mask.dtype}")
    if mask.shape != shape:
        raise ValueError(
            f"{name}: mask must have shape {layout} = {list(shape)}, got {list(mask.shape)}"
        )
    return mask


def _check_state(name: str, config: REMConfig, state, batch_shape: tuple, dim: int):
    if not isinstance(state, REMState):
        raise TypeError(f"{name}: state must be a REMState, got {type(state).__name__}")
    ring_shape = (*batch_shape, config.num_heads, config.ring_size, 2, dim)
    if state.ring.shape != ring_shape or state.phase.shape != batch_shape:
        raise ValueError(
            f"{name}: state has ring {list(state.ring.shape)} and phase "
            f"{list(state.phase.shape)}, expected {list(ring_shape)} and {list(batch_shape)}"
        )
    if not jnp.issubdtype(state.phase.dtype, jnp.integer):
        raise TypeError(f"{name}: state.phase must be an integer array, got {state.phase.dtype}")


def rem_step(
    config: REMConfig,
    params: Mapping[str, Array],
    state: REMState,
    value: Array,
    mask: Array | None = None,
) -> tuple[REMState, Array]:
    """One token through every causal REM of a layer: the ``lax.scan`` body, carry first.

    For a head with coefficient ``a`` and dilation ``p``, slot ``k = phase % p`` holds
    ``s_{t-p}``; the output is ``a s_{t-p} = sum_{m>=1} f(m) v_{t-mp}`` and the slot becomes
    ``a s_{t-p} + v_t``. Regular and cos heads read the real part, sin heads the imaginary
    part (``Im z^m = gamma^m sin(m theta)``). No truncation at ``K`` (see module docstring).

    Args:
      config: head assignment.
      params: ``{"eta", "nu", "theta"}`` as made by ``init_rem_params``.
      state: state before this token.
      value: the token's values per head. [..., H, D]
      mask: True where the token is present; an absent token leaves the state (and phase)
        unchanged and outputs 0. [...]

    Returns:
      ``(state, out)``: the new state and the REM outputs ``(P V)_t`` per head, in
      ``value``'s dtype. [..., H, D]

    Example:
      >>> cfg = REMConfig((1, 0, 0, 0, 0, 0))
      >>> prm = {"eta": jnp.array([jnp.arctanh(0.5)]), "nu": jnp.zeros(0), "theta": jnp.zeros(0)}
      >>> s = init_rem_state(cfg, (), 1)
      >>> s, y = rem_step(cfg, prm, s, jnp.ones((1, 1)))
      >>> s, y = rem_step(cfg, prm, s, jnp.ones((1, 1)))
      >>> float(y[0, 0])
      0.5
    """
    name = "rem_step"
    value = _check_values(name, config, value, time_axis=False)
    batch_shape, dim = value.shape[:-2], value.shape[-1]
    mask = _check_mask(name, mask, batch_shape, "[...]")
    _check_state(name, config, state, batch_shape, dim)
    acc = accumulation_dtype(value.dtype, state.ring.dtype)
    a_re, a_im = _head_coefficients(config, params, acc, name)
    nb, h, ring_size = len(batch_shape), config.num_heads, config.ring_size

    dil = jnp.asarray(config.head_dilations, jnp.int32).reshape((1,) * nb + (h,))
    slot = state.phase.astype(jnp.int32)[..., None] % dil  # [..., H]
    onehot = slot[..., None] == jnp.arange(ring_size, dtype=jnp.int32).reshape(
        (1,) * (nb + 1) + (-1,)
    )
    ring = state.ring.astype(acc)
    prev = jnp.sum(jnp.where(onehot[..., None, None], ring, 0), axis=-3)  # [..., H, 2, D]
    p_re, p_im = prev[..., 0, :], prev[..., 1, :]
    a_re = a_re.reshape((1,) * nb + (h, 1))
    a_im = a_im.reshape((1,) * nb + (h, 1))
    o_re, o_im = a_re * p_re - a_im * p_im, a_re * p_im + a_im * p_re
    is_sin = np.array([k == "cyclic_sin" for k in config.head_kinds]).reshape((1,) * nb + (h, 1))
    out = jnp.where(is_sin, o_im, o_re)
    updated = jnp.stack([o_re + value.astype(acc), o_im], axis=-2)  # [..., H, 2, D]
    write = onehot
    if mask is not None:
        write = write & mask.reshape(batch_shape + (1, 1))
        out = jnp.where(mask.reshape(batch_shape + (1, 1)), out, 0)
    ring = jnp.where(write[..., None, None], updated[..., None, :, :], ring)
    step = 1 if mask is None else mask.astype(jnp.int32)
    phase = (state.phase + step) % config.phase_modulus
    return REMState(ring, phase.astype(state.phase.dtype)), out.astype(value.dtype)


def _linear_scan(a: Array, b: Array, axis: int) -> Array:
    """All prefixes of ``h_t = a_t h_{t-1} + b_t`` (``h_{-1} = 0``) by associative scan."""

    def combine(x, y):
        return x[0] * y[0], y[0] * x[1] + y[1]

    return jax.lax.associative_scan(combine, (a, b), axis=axis)[1]


def _cell_layout(mask: Array | None, phase: Array, p: int, num_tokens: int):
    """Place the present tokens of each row on a grid of ``R`` rows and ``p`` columns.

    Present token number ``j`` (counted over the whole stream, ``phase + j``) goes to
    cell ``e = phase % p + j``: column ``e % p`` is its residue class, i.e. its ring slot,
    and each column is one chain of the dilated recurrence. Cells holding no token are
    identities of the scan.

    With ``p = 1`` there is one chain and no phase: the tokens stay in place (an absent
    one is an identity where it stands), so no layout is needed.

    Returns:
      ``(src, cell_valid, token_cell, num_cells)``: token index of each cell [..., C],
      whether the cell holds a token [..., C], the cell of each token [..., T] (present
      tokens only), and ``C = R p``; ``None`` for the first three when ``p = 1``.
    """
    if p == 1:
        return None, None, None, num_tokens
    batch_shape = phase.shape
    t = jnp.arange(num_tokens, dtype=jnp.int32).reshape((1,) * len(batch_shape) + (-1,))
    r0 = (phase.astype(jnp.int32) % p)[..., None]  # [..., 1]
    num_cells = -(-(num_tokens + p - 1) // p) * p
    if mask is None:
        order = jnp.broadcast_to(t, batch_shape + (num_tokens,))
        count = jnp.full(batch_shape + (1,), num_tokens, jnp.int32)
        rank = t
    else:
        # Positions of the present tokens in order, absent ones after them.
        order = jnp.argsort(jnp.where(mask, t, t + num_tokens), axis=-1).astype(jnp.int32)
        count = jnp.sum(mask, axis=-1, dtype=jnp.int32)[..., None]
        rank = jnp.cumsum(mask, axis=-1, dtype=jnp.int32) - 1
    cell = jnp.arange(num_cells, dtype=jnp.int32).reshape((1,) * len(batch_shape) + (-1,))
    cell_rank = cell - r0
    cell_valid = (cell_rank >= 0) & (cell_rank < count)
    src = jnp.take_along_axis(order, jnp.clip(cell_rank, 0, num_tokens - 1), axis=-1)
    token_cell = jnp.clip(r0 + rank, 0, num_cells - 1)
    return src, cell_valid, token_cell, num_cells


def _apply_group(values, ring0, a, layout, p: int, mask):
    """Dilated linear recurrence for one group of heads sharing the dilation ``p``.

    Args:
      values: [..., G, T, D] (real, or complex for cyclical heads).
      ring0: initial states. [..., G, p, D]
      a: coefficient per head. [G]
      layout: ``_cell_layout`` for ``p``.
      mask: [..., T] or None.

    Returns:
      ``(out [..., G, T, D], ring [..., G, p, D])``.
    """
    src, cell_valid, token_cell, num_cells = layout
    nb = values.ndim - 3
    g, _, d = values.shape[-3:]
    rows = num_cells // p
    if src is None:  # p = 1: cells are the tokens
        cells, cell_valid = values, mask
    else:
        cells = jnp.take_along_axis(values, src[..., None, :, None], axis=-2)  # [..., G, C, D]
    cells = cells.reshape(values.shape[:-2] + (rows, p, d))
    if cell_valid is None:
        cell_valid = jnp.ones(values.shape[:-3] + (num_cells,), bool)
    valid = cell_valid.reshape(cell_valid.shape[:-1] + (1, rows, p, 1))
    a_b = a.reshape((1,) * nb + (g, 1, 1, 1))
    coef = jnp.where(valid, a_b, jnp.ones((), a.dtype))  # [..., G, R, p, 1]
    b = jnp.where(valid, cells, jnp.zeros((), cells.dtype))
    b = b.at[..., 0, :, :].add(coef[..., 0, :, :] * ring0)  # fold the initial state in
    states = _linear_scan(coef, b, axis=-3)  # [..., G, R, p, D]
    before = jnp.concatenate([ring0[..., None, :, :], states[..., :-1, :, :]], axis=-3)
    out = (a_b * before).reshape(values.shape[:-2] + (num_cells, d))
    if token_cell is not None:
        out = jnp.take_along_axis(out, token_cell[..., None, :, None], axis=-2)
    if mask is not None:
        out = jnp.where(mask[..., None, :, None], out, jnp.zeros((), out.dtype))
    return out, states[..., -1, :, :]


def rem_apply(
    config: REMConfig,
    params: Mapping[str, Array],
    values: Array,
    mask: Array | None = None,
    *,
    initial_state: REMState | None = None,
    method: str = "associative",
) -> tuple[Array, REMState]:
    """Every causal REM of a layer applied to its head's values, as a linear recurrence.

    ``out[..., h, t] = sum_{m >= 1} f_h(m) v[..., h, t - m p_h]``: the masked REM times
    ``V`` (eq. (4) without softmax and gate) with no truncation at ``K``, in O(T D) work
    per head (no ``T x T`` matrix). ``rem_apply(v2, initial_state=rem_apply(v1)[1])``
    equals the second half of ``rem_apply(concat(v1, v2))``: prefill, then continue.

    Args:
      config: head assignment.
      params: ``{"eta", "nu", "theta"}`` as made by ``init_rem_params``.
      values: values per head. [..., H, T, D]
      mask: True where the token is present; absent tokens are skipped exactly (the
        recurrence does not advance; their output is 0). [..., T]
      initial_state: state before the first token; default ``init_rem_state``.
      method: ``"associative"`` (parallel ``jax.lax.associative_scan``, O(log T) depth) or
        ``"sequential"`` (``jax.lax.scan`` of ``rem_step``).

    Returns:
      ``(out, final_state)``: ``out`` [..., H, T, D] in ``values``' dtype, ``final_state``
      after all ``T`` tokens.

    Raises:
      ValueError / TypeError: shapes or dtypes of ``values``, ``mask``, ``params`` or
        ``initial_state`` that do not match ``config``, or an unknown ``method``.

    Example:
      >>> cfg = REMConfig((1, 1, 1, 0, 1, 0), dilations=2)
      >>> v = jnp.ones((2, 4, 5, 8))
      >>> out, state = rem_apply(cfg, init_rem_params(cfg), v)
      >>> out.shape, state.ring.shape
      ((2, 4, 5, 8), (2, 4, 2, 2, 8))
    """
    name = "rem_apply"
    if method not in METHODS:
        raise ValueError(f"{name}: method must be one of {METHODS}, got {method!r}")
    values = _check_values(name, config, values, time_axis=True)
    batch_shape, num_tokens, dim = values.shape[:-3], values.shape[-2], values.shape[-1]
    mask = _check_mask(name, mask, batch_shape + (num_tokens,), "[..., T]")
    if initial_state is None:
        initial_state = init_rem_state(config, batch_shape, dim, accumulation_dtype(values.dtype))
    _check_state(name, config, initial_state, batch_shape, dim)
    acc = accumulation_dtype(values.dtype, initial_state.ring.dtype)
    params = dict(
        zip(("eta", "nu", "theta"), config_params(name, config, params, acc), strict=True)
    )
    if num_tokens == 0:
        return jnp.zeros(values.shape, values.dtype), initial_state
    if num_tokens == 1:  # a streaming step: one update of the ring, no scan
        final, out = rem_step(
            config, params, initial_state, values[..., 0, :], None if mask is None else mask[..., 0]
        )
        return out[..., None, :], final
    return _rem_scan(config, params, values, mask, initial_state, method)


# Jitted: op by op, an eager call (a notebook) compiles each of its dozens of small ops (the
# associative scan's slices most), seconds; compiled once, milliseconds. Under an outer jit
# it is traced into the caller's program as before.
@functools.partial(jax.jit, static_argnames=("config", "method"))
def _rem_scan(config, params, values, mask, initial_state, method):
    """``rem_apply`` on validated inputs of ``T >= 2`` tokens."""
    num_tokens = values.shape[-2]
    acc = accumulation_dtype(values.dtype, initial_state.ring.dtype)
    a_re, a_im = _head_coefficients(config, params, acc, "rem_apply")
    if method == "sequential":
        xs = (jnp.moveaxis(values, -2, 0), None if mask is None else jnp.moveaxis(mask, -1, 0))

        def body(state, x):
            return rem_step(config, params, state, x[0], x[1])

        final, out = jax.lax.scan(body, initial_state, xs)
        return jnp.moveaxis(out, 0, -2), final

    ring = initial_state.ring.astype(acc)
    phase = initial_state.phase
    v = values.astype(acc)
    complex_dtype = jnp.complex128 if acc == jnp.float64 else jnp.complex64
    outs, rings = [None] * config.num_heads, [None] * config.num_heads
    kinds, dils = config.head_kinds, config.head_dilations
    # One scan per distinct dilation (few scans keep compile time down); a group with a
    # cyclical head runs in complex arithmetic, where a regular head's imaginary part
    # stays exactly 0.
    for p in sorted(set(dils)):
        heads = [h for h in range(config.num_heads) if dils[h] == p]
        cyclic = any(kinds[h] != "regular" for h in heads)
        idx = np.asarray(heads)
        v_g, ring_g = v[..., idx, :, :], ring[..., idx, :p, :, :]
        if cyclic:
            a = jax.lax.complex(a_re[idx], a_im[idx])
            ring0 = jax.lax.complex(ring_g[..., 0, :], ring_g[..., 1, :])
            v_g = v_g.astype(complex_dtype)
        else:
            a, ring0 = a_re[idx], ring_g[..., 0, :]
        layout = _cell_layout(mask, phase, p, num_tokens)
        out_g, ring_g = _apply_group(v_g, ring0, a, layout, p, mask)
        if cyclic:
            is_sin = np.array([kinds[h] == "cyclic_sin" for h in heads])
            is_sin = is_sin.reshape((1,) * (out_g.ndim - 3) + (-1, 1, 1))
            out_g = jnp.where(is_sin, jnp.imag(out_g), jnp.real(out_g))
            ring_g = jnp.stack([jnp.real(ring_g), jnp.imag(ring_g)], axis=-2)
        else:
            ring_g = jnp.stack([ring_g, jnp.zeros_like(ring_g)], axis=-2)
        for i, h in enumerate(heads):
            outs[h] = out_g[..., i, :, :]
            rings[h] = jnp.concatenate([ring_g[..., i, :, :, :], ring[..., h, p:, :, :]], axis=-3)
    out = jnp.stack(outs, axis=-3).astype(values.dtype)
    seen = num_tokens if mask is None else jnp.sum(mask, axis=-1, dtype=jnp.int32)
    new_phase = ((phase + seen) % config.phase_modulus).astype(phase.dtype)
    final = REMState(jnp.stack(rings, axis=-4).astype(initial_state.ring.dtype), new_phase)
    return out, final


def rem_apply_bidirectional(
    config: REMConfig,
    params: Mapping[str, Array],
    values: Array,
    mask: Array | None = None,
) -> Array:
    """The unmasked REMs ``(P + P^T) V`` (Section 3) as two recurrences, O(T D) per head.

    A forward pass gives ``P V``, a pass over the reversed sequence gives ``P^T V``. No
    truncation at ``K``; no streaming (the backward pass needs the whole sequence).

    Args:
      config: head assignment.
      params: ``{"eta", "nu", "theta"}``.
      values: values per head. [..., H, T, D]
      mask: True where the token is present; absent tokens are skipped. [..., T]

    Returns:
      ``(P + P^T) V`` per head, in ``values``' dtype. [..., H, T, D]
    """
    forward, _ = rem_apply(config, params, values, mask)
    flipped_mask = None if mask is None else jnp.flip(jnp.asarray(mask), axis=-1)
    backward, _ = rem_apply(config, params, jnp.flip(values, axis=-2), flipped_mask)
    return forward + jnp.flip(backward, axis=-2)
