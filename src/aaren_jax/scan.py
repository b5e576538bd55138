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
  * a NaN score or value at an attended token makes every output from that token on NaN (as
    ``jax.nn.softmax`` does); a ``+inf`` score gives NaN from that token on (``inf - inf``),
    a ``-inf`` score gives its token weight 0;
  * a masked token is ignored whatever it holds (NaN, inf): masked scores and values are
    replaced before any arithmetic, so outputs and gradients are bitwise those of the same
    input with zeros there;
  * a state made with ``init_state(..., compensated=True)`` carries the rounding errors of
    ``u`` and ``w`` (Kahan summation), so that a stream of 10^6 tokens stays within float32
    round-off of a float64 computation; the parallel methods need no compensation (their
    sums are blocked or tree-shaped) and the compiled scan (``"native"``) compensates its
    sequential sums itself;
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
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

from aaren_jax import native as native_scan

Array = jax.Array

METHODS = ("auto", "native", "blocked", "associative", "sequential", "chunked", "single")
DEFAULT_CHUNK_SIZE = 64
# Where the compiled scan cannot be built, "auto" takes the blocked kernel on CPU from this
# length on. benchmarks/short_sequences.py (results/short_sequences_cpu.json): from T = 16
# the associative scan was never the fastest, forward or forward+backward (up to 4x slower
# than the fastest, and 2-4x slower to compile than the blocked kernel); below, every method
# takes under 0.2 ms and the associative scan's forward was the fastest.
BLOCKED_MIN_TOKENS = 16
# Block size of the blocked kernel's tangent (dense TANGENT_BLOCK x TANGENT_BLOCK weights):
# benchmarks/tangent_blocks.py timed 8, 16, 32 and 64 (results/tangent_blocks_cpu.json).
TANGENT_BLOCK = 16


class AttentionState(NamedTuple):
    """The RNN state of prefix softmax attention for one query.

    Attributes:
      m: running max of the scores seen; ``-inf`` before any token. [...]
      u: sum of ``exp(s_i - m)`` over the tokens seen. [...]
      w: sum of ``exp(s_i - m) * v_i`` over the tokens seen. [..., D]
      u_err: rounding error of ``u`` (Kahan compensation), or None for a plain state;
        the sum is ``u + u_err``. [...]
      w_err: rounding error of ``w``, or None. [..., D]
    """

    m: Array
    u: Array
    w: Array
    u_err: Array | None = None
    w_err: Array | None = None

    @property
    def compensated(self) -> bool:
        """Whether the state carries Kahan compensation terms."""
        return self.u_err is not None


def init_state(
    batch_shape, dim: int, dtype=jnp.float32, *, compensated: bool = False
) -> AttentionState:
    """The identity state ``(-inf, 0, 0)``: attention over no token.

    Args:
      batch_shape: leading axes of the state, e.g. ``(B, H)``. [...]
      dim: value size ``D``.
      dtype: state dtype; float32 unless the inputs are float64.
      compensated: carry Kahan compensation terms ``u_err``, ``w_err`` (zeros), for long
        token-by-token streams: every state that continues it stays compensated.

    Returns:
      An ``AttentionState`` with ``m`` [...], ``u`` [...], ``w`` [..., D] (and ``u_err``
      [...], ``w_err`` [..., D] when compensated).

    Raises:
      TypeError: a non-floating dtype.
      ValueError: a negative axis or ``dim``.

    Example:
      >>> s = init_state((2, 4), 8)
      >>> s.w.shape
      (2, 4, 8)
    """
    batch_shape = as_shape("init_state: batch_shape", batch_shape)
    dim = as_shape("init_state: dim", dim)[0]
    if not jnp.issubdtype(dtype, jnp.floating):
        raise TypeError(f"init_state: dtype must be floating, got {jnp.dtype(dtype)}")
    state = AttentionState(
        m=jnp.full(batch_shape, -jnp.inf, dtype),
        u=jnp.zeros(batch_shape, dtype),
        w=jnp.zeros((*batch_shape, dim), dtype),
    )
    if compensated:
        state = state._replace(u_err=jnp.zeros_like(state.u), w_err=jnp.zeros_like(state.w))
    return state


def as_shape(name: str, value) -> tuple[int, ...]:
    """A shape (an int or ints, each >= 0) as a tuple; a clear error otherwise.

    Raises:
      TypeError: a non-integer entry (2.5, a bool, an array under a trace).
      ValueError: a negative entry.
    """
    entries = (value,) if np.ndim(value) == 0 else tuple(value)
    for entry in entries:
        if isinstance(entry, bool) or not isinstance(entry, int | np.integer):
            raise TypeError(f"{name} must be an int or ints, got {value!r}")
        if entry < 0:
            raise ValueError(f"{name} must be >= 0, got {value!r}")
    return tuple(int(e) for e in entries)


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
    u_a, u_b = a.u * scale_a, b.u * scale_b
    w_a, w_b = a.w * scale_a[..., None], b.w * scale_b[..., None]
    if not (a.compensated or b.compensated):
        return AttentionState(m, u_a + u_b, w_a + w_b)
    # Kahan: keep what the addition rounds away, so that a long stream of small terms added
    # to a large sum does not drift (one rounding per token otherwise; MEASUREMENTS).
    u, u_lost = _two_sum(u_a, u_b)
    w, w_lost = _two_sum(w_a, w_b)
    u_err = u_lost + _scaled(a.u_err, scale_a) + _scaled(b.u_err, scale_b)
    w_err = w_lost + _scaled(a.w_err, scale_a[..., None]) + _scaled(b.w_err, scale_b[..., None])
    return AttentionState(m, u, w, u_err, w_err)


def _two_sum(x: Array, y: Array) -> tuple[Array, Array]:
    """``(x + y, e)`` with ``x + y + e`` exact (Knuth's TwoSum; XLA does not reassociate)."""
    total = x + y
    y_part = total - x
    return total, (x - (total - y_part)) + (y - y_part)


def _scaled(err: Array | None, scale: Array):
    return 0.0 if err is None else err * scale


def readout(state: AttentionState) -> Array:
    """The attention output of a state, ``w / u``. [..., D]

    Exactly 0 (with zero gradient) where no token was attended (``u == 0``); NaN where the
    state holds a NaN (a NaN is never read as "nothing seen").
    """
    u, w = state.u, state.w
    if state.compensated:
        u, w = u + state.u_err, w + state.w_err
    seen = u != 0
    safe_u = jnp.where(seen, u, jnp.ones_like(u))
    return jnp.where(seen[..., None], w / safe_u[..., None], jnp.zeros_like(w))


def accumulation_dtype(*dtypes) -> jnp.dtype:
    """float64 if any of ``dtypes`` is float64, else float32: the dtype sums are kept in."""
    f64 = jnp.dtype(jnp.float64)
    return f64 if any(jnp.dtype(d) == f64 for d in dtypes) else jnp.dtype(jnp.float32)


# ----------------------------------------------------------------------------------------
# Validation (once, at the public entry points)


def check_floating(name: str, x) -> None:
    """Raises TypeError unless ``x`` has a floating dtype."""
    if not jnp.issubdtype(jnp.result_type(x), jnp.floating):
        raise TypeError(f"{name} must have a floating dtype, got {jnp.result_type(x)}")


def check_mask(mask, target_shape: tuple, target_name: str, name: str = "mask"):
    """A boolean mask broadcast to ``target_shape``, or None; clear errors otherwise."""
    if mask is None:
        return None
    mask = jnp.asarray(mask)
    if mask.dtype != jnp.bool_:
        raise TypeError(
            f"{name} must be boolean (True = attend), got dtype {mask.dtype}; use "
            f"{name}.astype(bool)"
        )
    try:
        broadcast = np.broadcast_shapes(mask.shape, target_shape)
    except ValueError:
        broadcast = None
    if broadcast != tuple(target_shape):
        raise ValueError(
            f"{name} of shape {mask.shape} does not broadcast to {target_name} of shape "
            f"{tuple(target_shape)}"
        )
    return jnp.broadcast_to(mask, target_shape)


def check_state(state: AttentionState, batch_shape: tuple, dim: int, name: str) -> None:
    """Raises unless ``state`` is an ``AttentionState`` laid out for ``batch_shape``, ``dim``."""
    if not isinstance(state, AttentionState):
        raise TypeError(f"{name} must be an AttentionState, got {type(state).__name__}")
    if (state.u_err is None) != (state.w_err is None):
        raise ValueError(f"{name} must have both u_err and w_err, or neither")
    want = {"m": batch_shape, "u": batch_shape, "w": (*batch_shape, dim)}
    want.update(u_err=batch_shape, w_err=(*batch_shape, dim))
    for field, shape in want.items():
        value = getattr(state, field)
        if value is None:
            continue
        got = tuple(jnp.shape(value))
        if got != tuple(shape):
            raise ValueError(
                f"{name}.{field} has shape {got}, but the scores and values need {tuple(shape)}"
            )
        check_floating(f"{name}.{field}", value)


# ----------------------------------------------------------------------------------------
# One token


def attention_step(
    state: AttentionState, score: Array, value: Array, mask: Array | None = None
) -> tuple[AttentionState, Array]:
    """Advances the RNN by one token: the body of a ``lax.scan``, carry first.

    Paper eq. (2) / SPEC 1.1. This is ``prefix_attention`` on a sequence of one token
    (one code path): a masked token leaves the state unchanged.

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
    check_floating("score", score)
    check_floating("value", value)
    score, value = jnp.asarray(score), jnp.asarray(value)
    if value.ndim < 1 or score.shape != value.shape[:-1]:
        raise ValueError(
            f"score of shape {score.shape} must equal value's shape {value.shape} without its "
            "last axis"
        )
    check_state(state, score.shape, value.shape[-1], "state")
    mask = check_mask(mask, score.shape, "score")
    outputs, state = prefix_attention(
        score[..., None],
        value[..., None, :],
        None if mask is None else mask[..., None],
        initial_state=state,
    )
    return state, outputs[..., 0, :]


def _leaves(scores: Array, values: Array, mask: Array | None) -> AttentionState:
    """Per-token states ``(s_i, 1, v_i)``; a masked token is the identity ``(-inf, 0, 0)``.

    The mask is applied before any arithmetic (MEASUREMENTS pitfall 3), so whatever a masked
    token holds (NaN, inf) reaches no output, and it gets exactly zero gradient.
    """
    if mask is None:
        return AttentionState(scores, jnp.ones_like(scores), values)
    return AttentionState(
        m=jnp.where(mask, scores, -jnp.inf),
        u=mask.astype(scores.dtype),
        w=jnp.where(mask[..., None], values, jnp.zeros_like(values)),
    )


def _map_state(state: AttentionState, per_token, per_value) -> AttentionState:
    """Applies ``per_token`` to m, u, u_err [..., X] and ``per_value`` to w, w_err [..., X, D]."""
    return AttentionState(
        per_token(state.m),
        per_token(state.u),
        per_value(state.w),
        None if state.u_err is None else per_token(state.u_err),
        None if state.w_err is None else per_value(state.w_err),
    )


def _time_major(state: AttentionState) -> AttentionState:
    return _map_state(state, lambda x: jnp.moveaxis(x, -1, 0), lambda x: jnp.moveaxis(x, -2, 0))


def _time_minor(state: AttentionState) -> AttentionState:
    return _map_state(state, lambda x: jnp.moveaxis(x, 0, -1), lambda x: jnp.moveaxis(x, 0, -2))


def _expand_time(state: AttentionState) -> AttentionState:
    """Adds a length-1 time axis so a state [...] broadcasts against states [..., T]."""
    return _map_state(state, lambda x: x[..., None], lambda x: x[..., None, :])


def _last(states: AttentionState) -> AttentionState:
    """The state after the last token of states [..., T]."""
    return _map_state(states, lambda x: x[..., -1], lambda x: x[..., -1, :])


# ----------------------------------------------------------------------------------------
# Prefix states of a whole sequence. Each method maps leaves [..., T] / [..., T, D] and an
# initial state [...] to the state after every prefix, [..., T] / [..., T, D].


# Jitted: op by op, lax.associative_scan dispatches (and compiles) dozens of small slices,
# seconds for one eager call; compiled once, milliseconds. Under an outer jit it is inlined.
@jax.jit
def _prefix_states_associative(leaves: AttentionState, init: AttentionState) -> AttentionState:
    time_axis = leaves.m.ndim - 1  # T sits at the same axis in m, u [..., T] and w [..., T, D]
    states = jax.lax.associative_scan(combine, leaves, axis=time_axis)
    return combine(_expand_time(init), states)


def _prefix_states_sequential(leaves: AttentionState, init: AttentionState) -> AttentionState:
    def body(state, leaf):
        state = combine(state, leaf)
        return state, state

    _, states = jax.lax.scan(body, init, _time_major(leaves))
    return _time_minor(states)


@functools.partial(jax.jit, static_argnames="chunk_size")  # as _prefix_states_associative
def _prefix_states_chunked(
    leaves: AttentionState, init: AttentionState, chunk_size: int
) -> AttentionState:
    """Block-by-block (paper Appendix A): dense prefixes inside blocks, a scan across them."""
    num_tokens = leaves.m.shape[-1]
    num_chunks = -(-num_tokens // chunk_size)
    batch_shape = leaves.m.shape[:-1]
    blocked = functools.partial(
        _to_blocks, batch_ndim=len(batch_shape), num_blocks=num_chunks, chunk_size=chunk_size
    )
    # padding tokens are identities (-inf, 0, 0); their states are dropped below
    blocks = AttentionState(blocked(leaves.m, fill=-jnp.inf), blocked(leaves.u), blocked(leaves.w))
    local = _dense_block_prefixes(blocks)

    # Exclusive prefix over the block totals: the state before each block.
    def body(state, total):
        return combine(state, total), state

    _, before = jax.lax.scan(body, init, _time_major(_last(local)))
    states = combine(_expand_time(_time_minor(before)), local)
    states = _map_state(
        states,
        lambda x: x.reshape(*batch_shape, -1)[..., :num_tokens],
        lambda x: x.reshape(*batch_shape, -1, x.shape[-1])[..., :num_tokens, :],
    )
    return states


def _dense_block_prefixes(blocks: AttentionState) -> AttentionState:
    """All prefix states inside each block as one masked matrix product.

    Args:
      blocks: leaves grouped in blocks. m, u [..., N, C]; w [..., N, C, D]

    Returns:
      The state after each position of each block, counting that block only.
    """
    running_max = jax.lax.stop_gradient(jax.lax.cummax(blocks.m, axis=blocks.m.ndim - 1))
    weights = _causal_weights(blocks.m, _reference(running_max))
    u = jnp.einsum("...ti,...i->...t", weights, blocks.u)
    # A non-finite value would reach earlier positions of its block as 0 * nan through the
    # product: leave it out there, and make every position from it on NaN instead.
    finite = jnp.isfinite(blocks.w)
    w = jnp.einsum("...ti,...id->...td", weights, jnp.where(finite, blocks.w, 0.0))
    seen_bad = jax.lax.cummax((~finite).astype(jnp.int8), axis=finite.ndim - 2) > 0
    w = jnp.where(seen_bad, jnp.nan, w)
    return AttentionState(running_max, u, w)


def _causal_weights(scores: Array, ref: Array, by_source: bool = False) -> Array:
    """``weights[..., t, i] = exp(s_i - ref_t)`` for ``i <= t``, else 0. [..., C, C]

    ``by_source`` stores the same matrix as ``[..., i, t]``. The exponent is masked before
    ``exp``, so entries above the diagonal neither overflow nor leak gradient.
    scores, ref: [..., C]
    """
    size = scores.shape[-1]
    causal = np.tril(np.ones((size, size), dtype=bool))
    if by_source:
        return jnp.exp(jnp.where(causal.T, scores[..., :, None] - ref[..., None, :], -jnp.inf))
    return jnp.exp(jnp.where(causal, scores[..., None, :] - ref[..., :, None], -jnp.inf))


def _prefix_states_single(leaves: AttentionState, init: AttentionState) -> AttentionState:
    """One token: a single ``combine`` (the streaming step's static fast path)."""
    return _expand_time(combine(init, _last(leaves)))


# ----------------------------------------------------------------------------------------
# Method selection


def resolve_method(method: str, num_tokens: int, backend: str | None = None) -> str:
    """The named method ``prefix_attention`` runs for ``method`` at this length and backend.

    One token takes ``"single"`` (one ``combine``) whatever the method: a layer's ``step``
    is that, and a compensated carry keeps its error terms. ``"auto"`` resolves by backend
    and shape: on CPU, ``"native"``, the scan compiled as XLA custom calls
    (``aaren_jax.native``; built with the machine's C++ compiler on first use), fastest at
    every length measured from T = 2 to 16,384, forward and backward
    (``benchmarks/short_sequences.py``, ``benchmarks/scan.py``). Where it cannot be built
    (with a warning), sequences of ``BLOCKED_MIN_TOKENS`` (16) or more take ``"blocked"``,
    shorter ones ``"associative"``, as on other backends (not measured here).
    ``"native"`` and ``"blocked"`` differentiate in both modes, to any order (one custom
    JVP, which JAX transposes for the backward pass). ``jax.export`` cannot serialise the
    custom calls: export with ``method="blocked"``.
    Other names are returned as they are.

    Args:
      method: one of ``METHODS``.
      num_tokens: ``T``.
      backend: ``jax.default_backend()`` when None.

    Raises:
      ValueError: an unknown method.
    """
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    if num_tokens == 1:
        # Every method computes the same one combine; "single" also keeps a compensated
        # state's error terms (the blocked kernel folds them in), so streaming does not drift.
        return "single"
    if method != "auto":
        return method
    on_cpu = (backend or jax.default_backend()) == "cpu"
    if on_cpu and native_scan.available(warn=True):
        return "native"
    return "blocked" if on_cpu and num_tokens >= BLOCKED_MIN_TOKENS else "associative"


def check_chunk_size(chunk_size) -> int:
    """``chunk_size`` (None: ``DEFAULT_CHUNK_SIZE``) as a positive int; ValueError otherwise."""
    if chunk_size is None:
        return DEFAULT_CHUNK_SIZE
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int | np.integer):
        raise ValueError(f"chunk_size must be a positive integer, got {chunk_size!r}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive integer, got {chunk_size!r}")
    return int(chunk_size)


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
      mask: True where a token is attended; default all. Masked tokens may hold anything
        (NaN, inf): they reach no output and get zero gradient. [..., T] (broadcastable)
      initial_state: state of tokens before these, e.g. a prefill; default the identity.
        A compensated state (``init_state(..., compensated=True)``) gives a compensated
        final state. m [...], u [...], w [..., D]
      method: a named method, or ``"auto"`` (``resolve_method``: by backend and length):
        ``"blocked"`` (a two-pass blocked kernel with a custom JVP: forward and reverse
        mode, any order), ``"associative"`` (``lax.associative_scan``,
        O(log T) depth), ``"sequential"`` (``lax.scan`` of the one-token update),
        ``"chunked"`` (dense ``C x C`` blocks, state carried across blocks; paper App. A),
        ``"single"`` (one token: one ``combine``).
      chunk_size: block size ``C`` of ``"chunked"`` (default 64) and the target block size
        of ``"blocked"`` (a nearby divisor of T is taken when one exists); ignored by the
        other methods. Need not divide T.

    Returns:
      ``(outputs, final_state)``: outputs [..., T, D] in ``values``' dtype, exactly 0 where
      no token was attended yet; ``final_state`` covers ``initial_state`` and all T tokens,
      in float32 (float64 for float64 inputs).

    Raises:
      TypeError: non-floating scores, values or state; a non-boolean mask.
      ValueError: shapes that do not match, naming both; an unknown method; ``"single"``
        for more than one token.

    Example:
      >>> scores = jnp.array([0.0, 1.0, 2.0])
      >>> values = jnp.eye(3)
      >>> out, state = prefix_attention(scores, values)
      >>> out[0]
      Array([1., 0., 0.], dtype=float32)
    """
    check_floating("scores", scores)
    check_floating("values", values)
    scores, values = jnp.asarray(scores), jnp.asarray(values)
    if scores.ndim < 1:
        raise ValueError(f"scores must have a time axis: shape [..., T], got {scores.shape}")
    if values.shape[:-1] != scores.shape:
        raise ValueError(
            f"values of shape {values.shape} must be scores' shape {scores.shape} plus a "
            "value axis D: [..., T, D]"
        )
    mask = check_mask(mask, scores.shape, "scores")
    chunk_size = check_chunk_size(chunk_size)
    if resolve_method(method, scores.shape[-1]) == "single" and scores.shape[-1] != 1:
        raise ValueError(f'method "single" takes one token, got T = {scores.shape[-1]}')
    if initial_state is not None:
        check_state(initial_state, scores.shape[:-1], values.shape[-1], "initial_state")
    return checked_prefix_attention(scores, values, mask, initial_state, method, chunk_size)


def checked_prefix_attention(
    scores: Array,
    values: Array,
    mask: Array | None,
    initial_state: AttentionState | None,
    method: str,
    chunk_size: int,
) -> tuple[Array, AttentionState]:
    """``prefix_attention`` on arguments its caller has validated (the layers' path: their
    inputs are checked once, at their public boundary)."""
    batch_shape, num_tokens, dim = scores.shape[:-1], scores.shape[-1], values.shape[-1]
    method = resolve_method(method, num_tokens)
    acc = accumulation_dtype(scores.dtype, values.dtype)
    if initial_state is None:
        initial_state = init_state(batch_shape, dim, acc)
    else:
        acc = accumulation_dtype(acc, initial_state.u.dtype)
        initial_state = jax.tree.map(lambda x: jnp.asarray(x, acc), initial_state)
    if num_tokens == 0:
        return jnp.zeros(values.shape, values.dtype), initial_state

    if method in ("native", "blocked"):
        outputs, final = _blocked(
            scores.astype(acc),
            values.astype(acc),
            mask,
            initial_state,
            chunk_size,
            native=method == "native",
        )
        return outputs.astype(values.dtype), final

    leaves = _leaves(scores.astype(acc), values.astype(acc), mask)
    prefix_states = {
        "single": _prefix_states_single,
        "associative": _prefix_states_associative,
        "sequential": _prefix_states_sequential,
        "chunked": functools.partial(_prefix_states_chunked, chunk_size=chunk_size),
    }[method]
    states = prefix_states(leaves, initial_state)
    return readout(states).astype(values.dtype), _last(states)


# ----------------------------------------------------------------------------------------
# The "blocked" method: a two-pass blocked kernel with a custom JVP.
#
# Pass 1 reduces each block of C tokens to its total state (one read of the values); a
# short scan across blocks gives the state before each block; pass 2 walks the C positions
# of all blocks at once, from those states, and writes each output in place. The values are
# read twice and the outputs written once, with no C x C matrix and no transpose.
#
# Derivatives. With p_ti = exp(s_i - m_t) / u_t for i <= t, o_t = sum_i p_ti v_i and
#     d o_t = sum_i p_ti (dv_i + ds_i v_i) - o_t sum_i p_ti ds_i,
# attention again, with the primal weights, over the tangent channels (ds_i, dv_i + ds_i v_i).
# That is the JVP rule (forward mode); it is linear in the tangents, and JAX transposes it
# into the backward pass. The tangent is computed in blocks of TANGENT_BLOCK tokens: inside
# a block, p_ti is a dense matrix (a batched matmul, from the primal's running max and sum at
# every position); across blocks, pass 1 and the scan over block totals carry the tangent
# sums. Matmuls, elementwise ops and one short scan transpose into the same again, so the
# backward pass reads and writes each array in its own layout; the tangent as a
# position-by-position scan transposed into copies to and from position-major layout, and
# the gradient took twice the time (results/blocked_gradient_tangent_blocks_cpu_amd.json).
# The weights come from the running max and sum, exp(s_i - m_t) / u_t, not from a rounded
# log-normaliser exp(s_i - log_norm_t): at scores near 1e4 that one is 1e-3 off.


def _blocked(scores, values, mask, init: AttentionState, chunk_size: int, native: bool):
    """The blocked kernel: validity as an array, masked values zeroed, compensation folded.

    The kernel multiplies masked values by a weight of 0, so they are zeroed first: a NaN
    there would otherwise give ``0 * nan = nan``. A compensated initial state enters as its
    rounded sum (one rounding per call, not per token) and the final state keeps the
    compensated layout with zero error terms.
    """
    valid = jnp.ones(scores.shape, bool) if mask is None else mask
    if mask is not None:
        values = jnp.where(mask[..., None], values, jnp.zeros((), values.dtype))
    plain = AttentionState(init.m, init.u, init.w)
    if init.compensated:
        plain = AttentionState(init.m, init.u + init.u_err, init.w + init.w_err)
    block = _pick_chunk(scores.shape[-1], chunk_size)
    # The kernel runs on one flat batch axis: XLA's CPU code for the same loops over a
    # leading axis of size 1 (B = 1, [1, H, T]) was 4-5x slower than over [H, T]
    # (results/blocked_gradient_batch1_cpu.json); the reshapes are free (row-major bitcasts).
    batch_shape, (num_tokens, dim) = scores.shape[:-1], values.shape[-2:]
    flat_plain = _map_state(plain, lambda x: x.reshape(-1), lambda x: x.reshape(-1, dim))
    outputs, final = _blocked_attention(
        scores.reshape(-1, num_tokens),
        values.reshape(-1, num_tokens, dim),
        valid.reshape(-1, num_tokens),
        flat_plain,
        block,
        native,
    )
    outputs = outputs.reshape(*batch_shape, num_tokens, dim)
    final = _map_state(
        final, lambda x: x.reshape(batch_shape), lambda x: x.reshape(*batch_shape, dim)
    )
    if init.compensated:
        final = final._replace(u_err=jnp.zeros_like(final.u), w_err=jnp.zeros_like(final.w))
    return outputs, final


def _pick_chunk(num_tokens: int, target: int) -> int:
    """A block size near ``target`` that divides T when one exists (no padding copy); else
    the smallest size that keeps the number of blocks ``ceil(T / target)``, so that fewer
    padding tokens than blocks are computed (T = 257, target 64: 5 blocks of 52, not 64)."""
    target = max(1, min(target, num_tokens))
    for size in range(target, max(target // 2, 1) - 1, -1):
        if num_tokens % size == 0:
            return size
    return -(-num_tokens // -(-num_tokens // target))


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


def _two_pass_scan(scores, channels, init_m, init_channels, readout, chunk_size):
    """Blocked prefix sums ``sum_{i<=t} exp(s_i - m_t) c_i``, read out at every position.

    Args:
      scores: per-token scores, ``-inf`` where masked. [..., T]
      channels: per-token quantities to accumulate. tuple of [..., T] or [..., T, K]
      init_m: running max of the state before the first token. [...]
      init_channels: that state's channel sums, relative to ``init_m``. tuple of [...(, K)]
      readout: ``f(ref, channel_sums) -> tuple of outputs`` for one position of every
        block, the sums relative to ``ref``; arrays there are [..., N(, *)].
      chunk_size: block size C.

    Returns:
      ``(outputs, (final_m, final_channels))``: readout at every position, [..., T(, *)],
      and the state after all tokens.
    """
    batch_ndim = scores.ndim - 1
    num_tokens = scores.shape[-1]
    num_blocks = -(-num_tokens // chunk_size)
    blocked = functools.partial(
        _to_blocks, batch_ndim=batch_ndim, num_blocks=num_blocks, chunk_size=chunk_size
    )
    # Padding tokens are identities (score -inf, zero channels); their outputs are dropped.
    score_blocks = blocked(scores, fill=-jnp.inf)
    channel_blocks = tuple(blocked(c) for c in channels)

    start_m, start_sums, final_m, final_sums = _block_starts(
        score_blocks, channel_blocks, init_m, tuple(init_channels)
    )
    # Pass 2: every block's C positions in lockstep.
    outputs = _positions_in_place(readout, start_m, start_sums, score_blocks, channel_blocks)
    outputs = tuple(_from_blocks(o, batch_ndim, num_tokens) for o in outputs)
    return outputs, (final_m, final_sums)


def _from_blocks(x: Array, batch_ndim: int, num_tokens: int) -> Array:
    """[..., N, C, *rest] -> [..., T, *rest], dropping the padding at the end of time."""
    shape = x.shape
    x = x.reshape(
        *shape[:batch_ndim], shape[batch_ndim] * shape[batch_ndim + 1], *shape[batch_ndim + 2 :]
    )
    return x[(slice(None),) * batch_ndim + (slice(0, num_tokens),)]


def _merge_sums(m, sums, new_max, new_sums):
    """Channel sums relative to ``m`` merged with ones relative to ``new_max``: ``combine``
    over any channels. Returns the merged max, the exponent's reference, the merged sums."""
    next_m = jax.lax.stop_gradient(jnp.maximum(m, new_max))
    ref = _reference(next_m)
    a, b = jnp.exp(m - ref), jnp.exp(new_max - ref)
    merged = tuple(
        _scale_channel(x, a) + _scale_channel(y, b) for x, y in zip(sums, new_sums, strict=True)
    )
    return next_m, ref, merged


def _block_starts(score_blocks, channel_blocks, init_m, init_channels):
    """Pass 1 and the scan across blocks: the state before each block, and after the last.

    Returns ``(start_m [..., N], start_sums, final_m [...], final_sums)``.
    """
    batch_ndim = score_blocks.ndim - 2
    # each block's total, relative to the block's max
    block_max = jax.lax.stop_gradient(jnp.max(score_blocks, axis=-1))
    weights = jnp.exp(score_blocks - _reference(block_max)[..., None])
    totals = tuple(jnp.sum(_scale_channel(c, weights), axis=batch_ndim + 1) for c in channel_blocks)

    def across(state, total):
        next_m, _, next_sums = _merge_sums(*state, *total)
        return (next_m, next_sums), state

    time_major = (
        jnp.moveaxis(block_max, batch_ndim, 0),
        tuple(jnp.moveaxis(t, batch_ndim, 0) for t in totals),
    )
    (final_m, final_sums), (start_m, start_sums) = jax.lax.scan(
        across, (init_m, init_channels), time_major
    )
    start_m = jnp.moveaxis(start_m, 0, batch_ndim)
    start_sums = tuple(jnp.moveaxis(x, 0, batch_ndim) for x in start_sums)
    return start_m, start_sums, final_m, final_sums


def _positions_in_place(readout, start_m, start_sums, scores, channels):
    """Pass 2 as a ``fori_loop`` over the C positions, writing [..., N, C, *] in place."""
    position_axis = scores.ndim - 1
    chunk_size = scores.shape[-1]
    take = functools.partial(jax.lax.dynamic_index_in_dim, axis=position_axis, keepdims=False)
    example = jax.eval_shape(readout, start_m, start_sums)
    outputs = tuple(
        jnp.zeros((*o.shape[:position_axis], chunk_size, *o.shape[position_axis:]), o.dtype)
        for o in example
    )

    def position(c, carry):
        m, sums, outs = carry
        next_m, ref, sums = _merge_sums(
            m, sums, take(scores, c), tuple(take(x, c) for x in channels)
        )
        values = readout(ref, sums)
        outs = tuple(
            jax.lax.dynamic_update_index_in_dim(o, v, c, position_axis)
            for o, v in zip(outs, values, strict=True)
        )
        return next_m, sums, outs

    return jax.lax.fori_loop(0, chunk_size, position, (start_m, start_sums, outputs))[2]


def _output_readout(ref, sums):
    """The output at a position: ``(o [..., D],)``."""
    u, w = sums
    return (readout(AttentionState(ref, u, w)),)


def _weights_readout(ref, sums):
    """The output at a position, and the running max and sum it came from (the tangent's
    weights): ``(o [..., D], ref [...], u [...])``, u relative to ref."""
    return (*_output_readout(ref, sums), ref, sums[0])


def _forward(scores, values, valid, init, chunk_size, native, with_weights):
    """The outputs at every position (and with ``with_weights`` the running max and sum
    they came from), [B, T, *] each, and the final state: compiled or blocked."""
    if native:
        outputs, ref, u, m, final_u, final_w = native_scan.prefix_scan(
            jnp.where(valid, scores, -jnp.inf),
            valid.astype(scores.dtype),
            values,
            init.m,
            init.u,
            init.w,
        )
        return ((outputs, ref, u) if with_weights else (outputs,)), AttentionState(
            m, final_u, final_w
        )
    readout_fn = _weights_readout if with_weights else _output_readout
    outputs, (m, (final_u, final_w)) = _two_pass_scan(
        jnp.where(valid, scores, -jnp.inf),
        (valid.astype(scores.dtype), values),
        init.m,
        (init.u, init.w),
        readout_fn,
        chunk_size,
    )
    return outputs, AttentionState(m, final_u, final_w)


@functools.partial(jax.custom_jvp, nondiff_argnums=(4, 5))
def _blocked_attention(scores, values, valid, init, chunk_size, native):
    # without derivatives, the outputs alone
    (outputs,), final = _forward(scores, values, valid, init, chunk_size, native, False)
    return outputs, final


@_blocked_attention.defjvp
def _blocked_jvp(chunk_size, native, primals, tangents):
    """The tangent is attention itself, with the primal weights, over tangent channels.

    With ``p_ti = exp(s_i - m_t) / u_t``: ``d o_t = sum_i p_ti (dv_i + ds_i v_i) - o_t
    sum_i p_ti ds_i``, the initial state entering as one more token. It is linear in the
    tangents with primal weights, so JAX transposes it into the backward pass and forward
    mode (``jax.jvp``, ``jax.hessian``) works too. The running max carries no tangent, as
    everywhere in this module.
    """
    outputs, ref, u, final = _attention_weights(*primals, chunk_size, native)
    d_outputs, _, d_final = _tangent_of(native, primals, tangents, outputs, ref, u)
    return (outputs, final), (d_outputs, d_final)


@functools.partial(jax.custom_jvp, nondiff_argnums=(4, 5))
def _attention_weights(scores, values, valid, init, chunk_size, native):
    """The outputs, the running max and sum at every position (the tangent's weights), and
    the final state. Its own JVP rule (the same tangent) keeps second derivatives working
    when the primal is the compiled scan, which JAX cannot differentiate."""
    (outputs, ref, u), final = _forward(scores, values, valid, init, chunk_size, native, True)
    return outputs, ref, u, final


@_attention_weights.defjvp
def _attention_weights_jvp(chunk_size, native, primals, tangents):
    # the running max carries no tangent; u (relative to it) moves as u * sum_i p_ti ds_i
    outputs, ref, u, final = _attention_weights(*primals, chunk_size, native)
    d_outputs, d_u_norm, d_final = _tangent_of(native, primals, tangents, outputs, ref, u)
    return (outputs, ref, u, final), (d_outputs, jnp.zeros_like(ref), u * d_u_norm, d_final)


def _tangent_of(native, primals, tangents, outputs, ref, u):
    """``(d_outputs, d_u_norm, d_final)``: ``_tangent`` of the rules' arguments; for the
    compiled method a primitive whose transpose is the compiled backward pass."""
    scores, values, valid, init = primals
    d_scores, d_values, _, d_init = tangents
    args = (scores, values, valid.astype(scores.dtype), init.m, outputs, ref, u)
    args += (d_scores, d_values, d_init.u, d_init.w)
    d_outputs, d_u_norm, d_u, d_w = (_native_tangent_p.bind if native else _tangent)(*args)
    return d_outputs, d_u_norm, AttentionState(jnp.zeros_like(init.m), d_u, d_w)


def _tangent(
    scores, values, counts, init_m, outputs, ref, u, d_scores, d_values, d_init_u, d_init_w
):
    """The tangent of the outputs [B, T, D], of ``u`` relative to itself [B, T] (``du / u``,
    0 where nothing was attended) and of the final ``u`` [B] and ``w`` [B, D], from the
    primal weights (``counts``: 1 where attended, 0 where masked)."""
    valid = counts != 0
    scores = jnp.where(valid, scores, -jnp.inf)
    d_scores = jnp.where(valid, d_scores, jnp.zeros((), d_scores.dtype))
    channels = (d_scores, d_values + d_scores[..., None] * values)

    num_tokens = scores.shape[-1]
    num_blocks = -(-num_tokens // TANGENT_BLOCK)
    blocked = functools.partial(
        _to_blocks, batch_ndim=1, num_blocks=num_blocks, chunk_size=TANGENT_BLOCK
    )
    # Padding tokens: score -inf, zero channels; as positions, a reference of +inf and
    # nothing attended (u = 0), so that their weights are exactly 0. Dropped below.
    score_blocks = blocked(scores, fill=-jnp.inf)
    channel_blocks = tuple(blocked(c) for c in channels)
    start_m, (start_du, start_dw), _, (final_du, final_dw) = _block_starts(
        score_blocks, channel_blocks, init_m, (d_init_u, d_init_w)
    )
    ref, u = blocked(ref, fill=jnp.inf), blocked(u)
    seen = u != 0  # as readout: a NaN sum is never read as "nothing attended"
    inverse_u = jnp.where(seen, 1.0 / jnp.where(seen, u, 1.0), 0.0)
    # p_ti inside each block, stored source-major [B, N, C(i), C(t)] so that the backward
    # pass's dv = P^T g is a plain matmul (stored [t, i], XLA's CPU backend ran that
    # transposed-operand batched dot as an unfused `dot`, a third of the gradient, which
    # took 1.2x the time: results/blocked_gradient_source_major_cpu_amd.json; computed
    # [t, i] and swapped, it was as slow); and the weight of the state before the block
    # [B, N, C]
    weights = _causal_weights(score_blocks, ref, by_source=True) * inverse_u[..., None, :]
    start_weight = jnp.exp(start_m[..., None] - ref) * inverse_u
    d_u_norm = jnp.einsum("...it,...i->...t", weights, channel_blocks[0])
    d_u_norm = d_u_norm + start_weight * start_du[..., None]
    d_w_norm = jnp.einsum("...it,...id->...td", weights, channel_blocks[1])
    d_w_norm = d_w_norm + start_weight[..., None] * start_dw[..., None, :]
    d_outputs = _from_blocks(d_w_norm - blocked(outputs) * d_u_norm[..., None], 1, num_tokens)
    return d_outputs, _from_blocks(d_u_norm, 1, num_tokens), final_du, final_dw


# ----------------------------------------------------------------------------------------
# The compiled method's backward pass.
#
# JAX transposes the tangent into the backward pass. For "native", the tangent is a
# primitive: computed by ``_tangent`` (XLA), transposed into the compiled backward pass
# (``native.prefix_scan_backward``: one reverse walk over the tokens, which reads the
# cotangents, values and outputs once and writes the gradients once), whose own derivatives
# (second order) are those of ``_tangent``'s transpose in XLA. Both work on rows [R, ...]
# (``_blocked``'s flat batch), so a batched call is one call over more rows.


def _row_outputs(scores, values):
    """Avals [R, T, D], [R, T], [R], [R, D] of values' dtype, from scores [R, T] and values."""
    shapes = (values.shape, scores.shape, scores.shape[:-1], (*values.shape[:-2], values.shape[-1]))
    return [jax.core.ShapedArray(shape, values.dtype) for shape in shapes]


def _backward_reference(scores, counts, values, outputs, ref, u, init_m, g, g_unorm, g_u, g_w):
    """``native.prefix_scan_backward`` in XLA: the transpose of ``_tangent``."""
    zeros = tuple(jnp.zeros_like(x) for x in (scores, values, init_m, g_w))
    residuals = (scores, values, counts, init_m, outputs, ref, u)
    _, pullback = jax.vjp(lambda *t: _tangent(*residuals, *t), *zeros)
    return pullback((g, g_unorm, g_u, g_w))


def _rows_batcher(primitive):
    """vmap of a row-wise primitive: the mapped axis joins the rows."""

    def batched(args, dims):
        size = next(x.shape[d] for x, d in zip(args, dims, strict=True) if d is not None)
        args = [batching.bdim_at_front(x, d, size) for x, d in zip(args, dims, strict=True)]
        outs = primitive.bind(*(x.reshape(-1, *x.shape[2:]) for x in args))
        return [o.reshape(size, -1, *o.shape[1:]) for o in outs], [0] * len(outs)

    return batched


def _jvp_of(fn):
    def jvp(primals, tangents):
        tangents = [ad.instantiate_zeros(t) for t in tangents]
        out, out_tangents = jax.jvp(fn, tuple(primals), tuple(tangents))
        return list(out), list(out_tangents)

    return jvp


def _native_tangent_transpose(cts, *args):
    scores, values, counts, init_m, outputs, ref, u = args[:7]
    g, g_unorm, g_u, g_w = (ad.instantiate_zeros(ct) for ct in cts)
    grads = _native_backward_p.bind(
        jnp.where(counts != 0, scores, -jnp.inf),
        counts,
        values,
        outputs,
        ref,
        u,
        init_m,
        g,
        g_unorm,
        g_u,
        g_w,
    )
    linear = args[7:]
    return [None] * 7 + [
        ct if ad.is_undefined_primal(x) else None for ct, x in zip(grads, linear, strict=True)
    ]


_native_tangent_p = Primitive("aaren_native_tangent")
_native_tangent_p.multiple_results = True
_native_tangent_p.def_impl(_tangent)
_native_tangent_p.def_abstract_eval(lambda scores, values, *rest: _row_outputs(scores, values))
mlir.register_lowering(_native_tangent_p, mlir.lower_fun(_tangent, multiple_results=True))
ad.primitive_jvps[_native_tangent_p] = _jvp_of(_tangent)
ad.primitive_transposes[_native_tangent_p] = _native_tangent_transpose
batching.primitive_batchers[_native_tangent_p] = _rows_batcher(_native_tangent_p)

_native_backward_p = Primitive("aaren_native_backward")
_native_backward_p.multiple_results = True
_native_backward_p.def_impl(native_scan.prefix_scan_backward)
_native_backward_p.def_abstract_eval(
    lambda scores, counts, values, *rest: [_row_outputs(scores, values)[i] for i in (1, 0, 2, 3)]
)
mlir.register_lowering(
    _native_backward_p,
    mlir.lower_fun(native_scan.prefix_scan_backward, multiple_results=True),
    platform="cpu",
)
ad.primitive_jvps[_native_backward_p] = _jvp_of(_backward_reference)
batching.primitive_batchers[_native_backward_p] = _rows_batcher(_native_backward_p)
