"""Softmax attention of one query as an RNN: the associative operator and its scans.

Implements "Attention as an RNN" (Feng et al., 2024), eqs. (1)-(3) and Appendix A, as
restated in SPEC 1.1-1.3. For one query, the attention output over the first ``t`` tokens
is ``o_t = w_t / u_t`` where the state ``(m, u, w)`` is

    m_t = max_{i<=t} s_i                      running max of the scores
    u_t = sum_{i<=t} exp(s_i - m_t)           denominator
    w_t = sum_{i<=t} exp(s_i - m_t) v_i       numerator

Two states merge with an associative operator (``combine``), so every prefix comes from
one parallel prefix scan. This module knows no Flax: pure functions over arrays.

Numerics (binding, SPEC 1.2):
  * the state is float32 (float64 for float64 inputs) whatever the input dtype; outputs are
    cast back to the dtype of ``values``;
  * a masked token is the identity ``(-inf, 0, 0)``; ``exp(-inf - (-inf))`` is never
    evaluated: the exponent's reference is 0 where the running max is still ``-inf``;
  * an output with no unmasked token at or before it is exactly 0, with zero gradient;
  * the running max carries no gradient (``stop_gradient``): ``w / u`` does not depend on
    it, so this is exact, and it makes the backward pass cheaper.

Shape notation: ``...`` leading axes, ``T`` time, ``D`` value size.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

Array = jax.Array

METHODS = ("auto", "associative", "sequential", "chunked")
DEFAULT_CHUNK_SIZE = 64


class AttentionState(NamedTuple):
    """The RNN state of prefix softmax attention for one query.

    Attributes:
      m: running max of the scores seen; ``-inf`` before any token. [...]
      u: sum of ``exp(s_i - m)`` over the tokens seen. [...]
      w: sum of ``exp(s_i - m) * v_i`` over the tokens seen. [..., D]
    """

    m: Array
    u: Array
    w: Array


def init_state(batch_shape, dim: int, dtype=jnp.float32) -> AttentionState:
    """The identity state ``(-inf, 0, 0)``: attention over no token.

    Args:
      batch_shape: leading axes of the state, e.g. ``(B, H)``. [...]
      dim: value size ``D``.
      dtype: state dtype; float32 unless the inputs are float64.

    Returns:
      An ``AttentionState`` with ``m`` [...], ``u`` [...], ``w`` [..., D].

    Example:
      >>> s = init_state((2, 4), 8)
      >>> s.w.shape
      (2, 4, 8)
    """
    batch_shape = (int(batch_shape),) if np.ndim(batch_shape) == 0 else tuple(map(int, batch_shape))
    if not jnp.issubdtype(dtype, jnp.floating):
        raise TypeError(f"init_state: dtype must be floating, got {jnp.dtype(dtype)}")
    return AttentionState(
        m=jnp.full(batch_shape, -jnp.inf, dtype),
        u=jnp.zeros(batch_shape, dtype),
        w=jnp.zeros((*batch_shape, int(dim)), dtype),
    )


def _reference(m: Array) -> Array:
    """The exponent's reference point: ``m`` itself, or 0 where nothing was seen yet.

    Using 0 where ``m == -inf`` keeps ``exp(m_part - ref)`` at ``exp(-inf) = 0`` instead of
    ``exp(nan)`` (MEASUREMENTS pitfall 1). No gradient flows through it.
    """
    return jax.lax.stop_gradient(jnp.where(jnp.isneginf(m), jnp.zeros_like(m), m))


def combine(a: AttentionState, b: AttentionState) -> AttentionState:
    """The associative operator: the state of tokens ``A`` followed by tokens ``B``.

    Paper eq. (3) / SPEC 1.2. Broadcasts like ``jnp`` arithmetic; ``init_state`` is its
    identity element, on either side.

    Args:
      a: state of the earlier tokens; ``m`` [...], ``u`` [...], ``w`` [..., D].
      b: state of the later tokens; same layout, broadcastable against ``a``.

    Returns:
      The merged state. Its ``m`` carries no gradient.

    Example:
      >>> a = attention_step(init_state((), 2), jnp.float32(1.0), jnp.ones(2))[0]
      >>> combine(init_state((), 2), a).u
      Array(1., dtype=float32)
    """
    m = jax.lax.stop_gradient(jnp.maximum(a.m, b.m))
    ref = _reference(m)
    scale_a = jnp.exp(a.m - ref)
    scale_b = jnp.exp(b.m - ref)
    u = a.u * scale_a + b.u * scale_b
    w = a.w * scale_a[..., None] + b.w * scale_b[..., None]
    return AttentionState(m, u, w)


def _readout(u: Array, w: Array) -> Array:
    """``w / u``, and exactly 0 (with zero gradient) where no token was seen (``u == 0``)."""
    seen = u > 0
    safe_u = jnp.where(seen, u, jnp.ones_like(u))
    return jnp.where(seen[..., None], w / safe_u[..., None], jnp.zeros_like(w))


def _accumulation_dtype(*dtypes) -> jnp.dtype:
    return (
        jnp.dtype(jnp.float64)
        if jnp.dtype(jnp.float64) in map(jnp.dtype, dtypes)
        else (jnp.dtype(jnp.float32))
    )


# ----------------------------------------------------------------------------------------
# Validation


def _check_floating(name: str, x) -> None:
    if not jnp.issubdtype(jnp.result_type(x), jnp.floating):
        raise TypeError(f"{name} must have a floating dtype, got {jnp.result_type(x)}")


def _check_mask(mask, target_shape: tuple, target_name: str):
    if mask is None:
        return None
    mask = jnp.asarray(mask)
    if mask.dtype != jnp.bool_:
        raise TypeError(
            f"mask must be boolean (True = attend), got dtype {mask.dtype}; use mask.astype(bool)"
        )
    try:
        broadcast = np.broadcast_shapes(mask.shape, target_shape)
    except ValueError:
        broadcast = None
    if broadcast != tuple(target_shape):
        raise ValueError(
            f"mask of shape {mask.shape} does not broadcast to {target_name} of shape "
            f"{tuple(target_shape)}"
        )
    return jnp.broadcast_to(mask, target_shape)


def _check_state(state: AttentionState, batch_shape: tuple, dim: int, name: str) -> None:
    if not isinstance(state, AttentionState):
        raise TypeError(f"{name} must be an AttentionState, got {type(state).__name__}")
    for field, want in (("m", batch_shape), ("u", batch_shape), ("w", (*batch_shape, dim))):
        got = tuple(jnp.shape(getattr(state, field)))
        if got != tuple(want):
            raise ValueError(
                f"{name}.{field} has shape {got}, but the scores and values need {tuple(want)}"
            )
        _check_floating(f"{name}.{field}", getattr(state, field))


# ----------------------------------------------------------------------------------------
# One token


def attention_step(
    state: AttentionState, score: Array, value: Array, mask: Array | None = None
) -> tuple[AttentionState, Array]:
    """Advances the RNN by one token: the body of a ``lax.scan``, carry first.

    Paper eq. (2) / SPEC 1.1. A masked token leaves the state unchanged.

    Args:
      state: the state before this token. m [...], u [...], w [..., D]
      score: this token's score ``<q, k_t> / sqrt(D)``. [...]
      value: this token's value. [..., D]
      mask: True where the token is attended (default: all). [...]

    Returns:
      ``(new_state, output)``; ``output`` is the attention over all tokens so far,
      in ``value``'s dtype, exactly 0 while no token was attended. [..., D]

    Raises:
      TypeError: non-floating inputs or a non-boolean mask.
      ValueError: shapes of score, value, mask and state that do not match.

    Example:
      >>> state = init_state((3,), 4)
      >>> state, out = attention_step(state, jnp.zeros(3), jnp.ones((3, 4)))
      >>> out.shape
      (3, 4)
    """
    _check_floating("score", score)
    _check_floating("value", value)
    score, value = jnp.asarray(score), jnp.asarray(value)
    if value.ndim < 1 or score.shape != value.shape[:-1]:
        raise ValueError(
            f"score of shape {score.shape} must equal value's shape {value.shape} without its "
            "last axis"
        )
    _check_state(state, score.shape, value.shape[-1], "state")
    mask = _check_mask(mask, score.shape, "score")
    acc = _accumulation_dtype(score.dtype, value.dtype, state.u.dtype)
    leaf = _leaves(score.astype(acc), value.astype(acc), mask)
    state = AttentionState(*(x.astype(acc) for x in state))
    new_state = combine(state, leaf)
    return new_state, _readout(new_state.u, new_state.w).astype(value.dtype)


def _leaves(scores: Array, values: Array, mask: Array | None) -> AttentionState:
    """Per-token states ``(s_i, 1, v_i)``; a masked token is the identity ``(-inf, 0, 0)``.

    The mask is applied before any ``exp`` (MEASUREMENTS pitfall 3), so masked tokens get
    exactly zero gradient.
    """
    if mask is None:
        return AttentionState(scores, jnp.ones_like(scores), values)
    return AttentionState(
        m=jnp.where(mask, scores, -jnp.inf),
        u=mask.astype(scores.dtype),
        w=jnp.where(mask[..., None], values, jnp.zeros_like(values)),
    )


# ----------------------------------------------------------------------------------------
# Prefix states of a whole sequence: three methods. Each maps leaves [..., T] / [..., T, D]
# and an initial state [...] to the state after every prefix, [..., T] / [..., T, D].


def _prefix_states_associative(leaves: AttentionState, init: AttentionState) -> AttentionState:
    time_axis = leaves.m.ndim - 1  # T sits at the same axis in m, u [..., T] and w [..., T, D]
    states = jax.lax.associative_scan(combine, leaves, axis=time_axis)
    return combine(_expand_time(init), states)


def _prefix_states_sequential(leaves: AttentionState, init: AttentionState) -> AttentionState:
    def body(state, leaf):
        state = combine(state, leaf)
        return state, state

    time_major = AttentionState(
        jnp.moveaxis(leaves.m, -1, 0), jnp.moveaxis(leaves.u, -1, 0), jnp.moveaxis(leaves.w, -2, 0)
    )
    _, states = jax.lax.scan(body, init, time_major)
    return AttentionState(
        jnp.moveaxis(states.m, 0, -1), jnp.moveaxis(states.u, 0, -1), jnp.moveaxis(states.w, 0, -2)
    )


def _prefix_states_chunked(
    leaves: AttentionState, init: AttentionState, chunk_size: int
) -> AttentionState:
    """Block-by-block (paper Appendix A): dense prefixes inside blocks, a scan across them."""
    num_tokens = leaves.m.shape[-1]
    num_chunks = -(-num_tokens // chunk_size)
    batch_shape = leaves.m.shape[:-1]
    dim = leaves.w.shape[-1]
    blocked = functools.partial(
        _to_blocks, batch_ndim=len(batch_shape), num_blocks=num_chunks, chunk_size=chunk_size
    )
    # padding tokens are identities (-inf, 0, 0); their states are dropped below
    blocks = AttentionState(blocked(leaves.m, fill=-jnp.inf), blocked(leaves.u), blocked(leaves.w))
    local = _dense_block_prefixes(blocks)

    # Exclusive prefix over the block totals: the state before each block.
    totals = AttentionState(local.m[..., -1], local.u[..., -1], local.w[..., -1, :])

    def body(state, total):
        return combine(state, total), state

    time_major = AttentionState(
        jnp.moveaxis(totals.m, -1, 0), jnp.moveaxis(totals.u, -1, 0), jnp.moveaxis(totals.w, -2, 0)
    )
    _, before = jax.lax.scan(body, init, time_major)
    before = AttentionState(
        jnp.moveaxis(before.m, 0, -1), jnp.moveaxis(before.u, 0, -1), jnp.moveaxis(before.w, 0, -2)
    )
    states = combine(_expand_time(before), local)
    states = AttentionState(
        states.m.reshape(*batch_shape, -1),
        states.u.reshape(*batch_shape, -1),
        states.w.reshape(*batch_shape, -1, dim),
    )
    return AttentionState(
        states.m[..., :num_tokens], states.u[..., :num_tokens], states.w[..., :num_tokens, :]
    )


def _dense_block_prefixes(blocks: AttentionState) -> AttentionState:
    """All prefix states inside each block as one masked matrix product.

    Args:
      blocks: leaves grouped in blocks. m, u [..., N, C]; w [..., N, C, D]

    Returns:
      The state after each position of each block, counting that block only.
    """
    chunk_size = blocks.m.shape[-1]
    causal = np.tril(np.ones((chunk_size, chunk_size), dtype=bool))
    running_max = jax.lax.stop_gradient(jax.lax.cummax(blocks.m, axis=blocks.m.ndim - 1))
    ref = _reference(running_max)
    # weights[t, i] = exp(s_i - m_t) for i <= t; the exponent is masked before exp, so
    # entries above the diagonal neither overflow nor leak gradient.
    exponent = jnp.where(causal, blocks.m[..., None, :] - ref[..., :, None], -jnp.inf)
    weights = jnp.exp(exponent)
    u = jnp.einsum("...ti,...i->...t", weights, blocks.u)
    w = jnp.einsum("...ti,...id->...td", weights, blocks.w)
    return AttentionState(running_max, u, w)


def _expand_time(state: AttentionState) -> AttentionState:
    """Adds a length-1 time axis so a state [...] broadcasts against states [..., T]."""
    return AttentionState(state.m[..., None], state.u[..., None], state.w[..., None, :])


# ----------------------------------------------------------------------------------------
# Public entry point


def prefix_attention(
    scores: Array,
    values: Array,
    mask: Array | None = None,
    *,
    initial_state: AttentionState | None = None,
    method: str = "auto",
    chunk_size: int | None = None,
) -> tuple[Array, AttentionState]:
    """Softmax attention of one query over every prefix of a sequence.

    ``outputs[..., t, :] = sum_{i<=t} softmax(scores[..., :t+1])_i values[..., i, :]``,
    counting only unmasked tokens (and the tokens summarised by ``initial_state``, which
    come before all of them). SPEC 1.3 / paper Sec. 3.2 and Appendix A.

    Args:
      scores: per-token scores ``<q, k_i> / sqrt(D)``. [..., T]
      values: per-token values. [..., T, D]
      mask: True where a token is attended; default all. [..., T] (broadcastable)
      initial_state: state of tokens before these, e.g. a prefill; default the identity.
        m [...], u [...], w [..., D]
      method: ``"associative"`` (``lax.associative_scan``, O(log T) depth),
        ``"sequential"`` (``lax.scan`` of the one-token update), ``"chunked"`` (dense
        ``C x C`` blocks, state carried across blocks), or ``"auto"`` (the fastest for the
        backend and shape, chosen by ``benchmarks/scan.py``; it has a custom gradient that
        runs one reverse scan).
      chunk_size: block size ``C`` of the chunked method (default 64); need not divide T.

    Returns:
      ``(outputs, final_state)``: outputs [..., T, D] in ``values``' dtype, exactly 0 where
      no token was attended yet; ``final_state`` covers ``initial_state`` and all T tokens,
      in float32 (float64 for float64 inputs).

    Raises:
      TypeError: non-floating scores, values or state; a non-boolean mask.
      ValueError: shapes that do not match, naming both; an unknown method.

    Example:
      >>> scores = jnp.array([0.0, 1.0, 2.0])
      >>> values = jnp.eye(3)
      >>> out, state = prefix_attention(scores, values)
      >>> out[0]
      Array([1., 0., 0.], dtype=float32)
    """
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    _check_floating("scores", scores)
    _check_floating("values", values)
    scores, values = jnp.asarray(scores), jnp.asarray(values)
    if scores.ndim < 1:
        raise ValueError(f"scores must have a time axis: shape [..., T], got {scores.shape}")
    if values.shape[:-1] != scores.shape:
        raise ValueError(
            f"values of shape {values.shape} must be scores' shape {scores.shape} plus a "
            "value axis D: [..., T, D]"
        )
    mask = _check_mask(mask, scores.shape, "scores")
    batch_shape, dim = scores.shape[:-1], values.shape[-1]
    if chunk_size is None:
        chunk_size = DEFAULT_CHUNK_SIZE
    elif not isinstance(chunk_size, (int, np.integer)) or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive integer, got {chunk_size!r}")

    acc = _accumulation_dtype(scores.dtype, values.dtype)
    if initial_state is None:
        initial_state = init_state(batch_shape, dim, acc)
    else:
        _check_state(initial_state, batch_shape, dim, "initial_state")
        acc = _accumulation_dtype(acc, *(x.dtype for x in initial_state))
        initial_state = AttentionState(*(jnp.asarray(x, acc) for x in initial_state))

    scores_acc, values_acc = scores.astype(acc), values.astype(acc)
    if scores.shape[-1] == 0:
        return jnp.zeros(values.shape, values.dtype), initial_state
    if method == "auto":
        # The two-pass kernel was the fastest method at every length benchmarks/scan.py
        # measured on CPU, forward and backward (README, results/scan_cpu.json).
        valid = jnp.ones(scores.shape, bool) if mask is None else mask
        block = _pick_chunk(scores.shape[-1], int(chunk_size))
        outputs, final = _blocked_attention(scores_acc, values_acc, valid, initial_state, block)
        return outputs.astype(values.dtype), final

    leaves = _leaves(scores_acc, values_acc, mask)
    if method == "associative":
        states = _prefix_states_associative(leaves, initial_state)
    elif method == "sequential":
        states = _prefix_states_sequential(leaves, initial_state)
    else:
        states = _prefix_states_chunked(leaves, initial_state, int(chunk_size))
    outputs = _readout(states.u, states.w).astype(values.dtype)
    final = AttentionState(states.m[..., -1], states.u[..., -1], states.w[..., -1, :])
    return outputs, final


# ----------------------------------------------------------------------------------------
# The "auto" path: a two-pass blocked kernel with a custom gradient.
#
# Pass 1 reduces each block of C tokens to its total state (one read of the values); a
# short scan across blocks gives the state before each block; pass 2 walks the C positions
# of all blocks at once, from those states, and writes each output in place. The values are
# read twice and the outputs written once, with no C x C matrix and no transpose.
#
# Gradient (one reverse pass of the same kernel). With lse_t = m_t + log u_t and
# p_ti = exp(s_i - lse_t) for i <= t, o_t = sum_i p_ti v_i. For cotangents g_t of o_t and
# delta_t = <g_t, o_t>:
#     dv_i = sum_{t>=i} exp(s_i - lse_t) g_t
#     ds_i = <v_i, dv_i> - sum_{t>=i} exp(s_i - lse_t) delta_t
# Both are suffix sums with "scores" -lse_t over the channels (g_t, delta_t); their running
# max M_i = max_{t>=i} -lse_t keeps every factor exp(s_i + M_i) <= 1. The final state's
# cotangents enter as one more term after the last token, with score -m_T; the initial
# state's gradient is that of one more token before the first.


def _pick_chunk(num_tokens: int, target: int) -> int:
    """A block size near ``target`` that divides T when one exists (no padding copy)."""
    target = max(1, min(target, num_tokens))
    for size in range(target, max(target // 2, 1) - 1, -1):
        if num_tokens % size == 0:
            return size
    return target


def _to_blocks(x: Array, batch_ndim: int, num_blocks: int, chunk_size: int, fill=0) -> Array:
    """[..., T, *rest] -> [..., N, C, *rest], padding the end of time with ``fill``."""
    pad = num_blocks * chunk_size - x.shape[batch_ndim]
    if pad:
        widths = [(0, 0)] * x.ndim
        widths[batch_ndim] = (0, pad)
        x = jnp.pad(x, widths, constant_values=fill)
    shape = x.shape
    return x.reshape(*shape[:batch_ndim], num_blocks, chunk_size, *shape[batch_ndim + 1 :])


def _scale_channel(channel: Array, scale: Array) -> Array:
    return channel * (scale if channel.ndim == scale.ndim else scale[..., None])


def _two_pass_scan(scores, channels, init_m, init_channels, extras, readout, chunk_size, reverse):
    """Blocked prefix (or suffix, with ``reverse``) sums ``sum_i exp(s_i - m) c_i``.

    Args:
      scores: per-token scores, ``-inf`` where masked. [..., T]
      channels: per-token quantities to accumulate. tuple of [..., T] or [..., T, K]
      init_m: running max of the state before the first (or after the last) token. [...]
      init_channels: that state's channel sums, relative to ``init_m``. tuple of [...(, K)]
      extras: per-token arrays handed to ``readout``. tuple of [..., T(, *)]
      readout: ``f(m, channel_sums, extras) -> tuple of outputs`` for one position of every
        block; arrays there are [..., N(, *)].
      chunk_size: block size C.
      reverse: accumulate suffixes (t >= i) instead of prefixes.

    Returns:
      ``(outputs, (final_m, final_channels))``: readout at every position, [..., T(, *)],
      and the state after all tokens (before all tokens, with ``reverse``).
    """
    batch_ndim = scores.ndim - 1
    num_tokens = scores.shape[-1]
    num_blocks = -(-num_tokens // chunk_size)
    blocked = functools.partial(
        _to_blocks, batch_ndim=batch_ndim, num_blocks=num_blocks, chunk_size=chunk_size
    )
    # Padding tokens are identities: score -inf, zero channels; their outputs are dropped.
    score_blocks = blocked(scores, fill=-jnp.inf)
    channel_blocks = tuple(blocked(c) for c in channels)
    extra_blocks = tuple(blocked(x) for x in extras)

    # Pass 1: each block's total, relative to the block's max.
    block_max = jax.lax.stop_gradient(jnp.max(score_blocks, axis=-1))
    weights = jnp.exp(score_blocks - _reference(block_max)[..., None])
    totals = tuple(jnp.sum(_scale_channel(c, weights), axis=batch_ndim + 1) for c in channel_blocks)

    # Across blocks: the state before each block (after it, with reverse).
    def across(state, total):
        m, sums = state
        t_m, t_sums = total
        new_m = jax.lax.stop_gradient(jnp.maximum(m, t_m))
        ref = _reference(new_m)
        a, b = jnp.exp(m - ref), jnp.exp(t_m - ref)
        new_sums = tuple(
            _scale_channel(x, a) + _scale_channel(y, b) for x, y in zip(sums, t_sums, strict=True)
        )
        return (new_m, new_sums), (m, sums)

    block_axis = batch_ndim
    time_major = (
        jnp.moveaxis(block_max, block_axis, 0),
        tuple(jnp.moveaxis(t, block_axis, 0) for t in totals),
    )
    (final_m, final_sums), (start_m, start_sums) = jax.lax.scan(
        across, (init_m, tuple(init_channels)), time_major, reverse=reverse
    )
    start_m = jnp.moveaxis(start_m, 0, block_axis)
    start_sums = tuple(jnp.moveaxis(x, 0, block_axis) for x in start_sums)

    # Pass 2: every block's C positions in lockstep, writing outputs in place.
    position_axis = batch_ndim + 1
    take = functools.partial(jax.lax.dynamic_index_in_dim, axis=position_axis, keepdims=False)
    example = jax.eval_shape(readout, start_m, start_sums, tuple(take(x, 0) for x in extra_blocks))
    outputs = tuple(
        jnp.zeros((*o.shape[:position_axis], chunk_size, *o.shape[position_axis:]), o.dtype)
        for o in example
    )

    def position(step, carry):
        m, sums, outs = carry
        c = chunk_size - 1 - step if reverse else step
        s = take(score_blocks, c)
        new_m = jax.lax.stop_gradient(jnp.maximum(m, s))
        ref = _reference(new_m)
        a, b = jnp.exp(m - ref), jnp.exp(s - ref)
        sums = tuple(
            _scale_channel(x, a) + _scale_channel(take(ch, c), b)
            for x, ch in zip(sums, channel_blocks, strict=True)
        )
        # the readout sees the sums' reference point, which carries no gradient
        values = readout(ref, sums, tuple(take(x, c) for x in extra_blocks))
        outs = tuple(
            jax.lax.dynamic_update_index_in_dim(o, v, c, position_axis)
            for o, v in zip(outs, values, strict=True)
        )
        return new_m, sums, outs

    _, _, outputs = jax.lax.fori_loop(0, chunk_size, position, (start_m, start_sums, outputs))
    outputs = tuple(
        o.reshape(*o.shape[:batch_ndim], num_blocks * chunk_size, *o.shape[batch_ndim + 2 :])[
            (slice(None),) * batch_ndim + (slice(0, num_tokens),)
        ]
        for o in outputs
    )
    return outputs, (final_m, final_sums)


def _forward_readout(ref, sums, extras):
    del extras
    u, w = sums
    seen = u > 0
    log_norm = jnp.where(seen, ref + jnp.log(jnp.where(seen, u, 1.0)), -jnp.inf)
    return _readout(u, w), log_norm


def _blocked_forward(scores, values, valid, init, chunk_size):
    masked_scores = jnp.where(valid, scores, -jnp.inf)
    (outputs, log_norm), (m, (u, w)) = _two_pass_scan(
        masked_scores,
        (valid.astype(scores.dtype), values),
        init.m,
        (init.u, init.w),
        (),
        _forward_readout,
        chunk_size,
        reverse=False,
    )
    return outputs, AttentionState(m, u, w), log_norm


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _blocked_attention(scores, values, valid, init, chunk_size):
    outputs, final, _ = _blocked_forward(scores, values, valid, init, chunk_size)
    return outputs, final


def _blocked_fwd(scores, values, valid, init, chunk_size):
    outputs, final, log_norm = _blocked_forward(scores, values, valid, init, chunk_size)
    return (outputs, final), (scores, values, valid, init, outputs, log_norm, final.m)


def _blocked_bwd(chunk_size, residuals, cotangents):
    scores, values, valid, init, outputs, log_norm, final_m = residuals
    d_outputs, d_final = cotangents
    delta = jnp.sum(d_outputs * outputs, axis=-1)
    # Positions where nothing was attended have constant outputs: they drop out.
    reverse_scores = jnp.where(jnp.isneginf(log_norm), -jnp.inf, -log_norm)

    def readout(suffix_ref, sums, extras):
        d_out_sum, delta_sum = sums
        score, value, is_valid = extras
        factor = jnp.exp(jnp.where(is_valid, score + suffix_ref, -jnp.inf))
        d_value = factor[..., None] * d_out_sum
        d_score = jnp.sum(value * d_value, axis=-1) - factor * delta_sum
        return d_value, d_score

    final_score = jnp.where(jnp.isneginf(final_m), -jnp.inf, -final_m)
    (d_values, d_scores), (total_m, (total_g, total_delta)) = _two_pass_scan(
        reverse_scores,
        (d_outputs, delta),
        final_score,
        (d_final.w, -d_final.u),
        (scores, values, valid),
        readout,
        chunk_size,
        reverse=True,
    )
    # The initial state acts as one more token before the first.
    init_factor = jnp.exp(jnp.where(jnp.isneginf(init.m), -jnp.inf, init.m + total_m))
    d_init = AttentionState(
        m=jnp.zeros_like(init.m),
        u=-init_factor * total_delta,
        w=init_factor[..., None] * total_g,
    )
    return d_scores, d_values, np.zeros(valid.shape, jax.dtypes.float0), d_init


_blocked_attention.defvjp(_blocked_fwd, _blocked_bwd)
