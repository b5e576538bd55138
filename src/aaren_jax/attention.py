"""Attention layers: Aaren's learned-query attention and the causal baseline with a KV cache.

Both layers share one interface (SPEC 2.2), at the level of a single layer:

    y = layer(x, mask=None)                                  # x [B, T, d] -> y [B, T, d]
    carry = layer.init_carry(batch_size, max_len=None)
    y, carry = layer(x, mask=None, carry=carry, return_carry=True)
    carry, y_t = layer.step(carry, x_t, mask_t=None)        # x_t [B, d] -> y_t [B, d]

``AarenAttention``'s carry is an ``AttentionState`` of constant size (SPEC 1.1, 1.4);
``CausalSelfAttention``'s carry is a ``KVCache`` of fixed capacity that grows in use.

No positional encoding lives here: both layers are permutation-equivariant over the past,
so users add their own embedding. Masks are boolean, True = valid token.

Shape notation: ``B`` batch, ``T`` time, ``H`` heads, ``D`` head size, ``d`` model width,
``C`` KV cache capacity.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from aaren_jax.rem import (
    REMConfig,
    REMState,
    init_rem_params,
    init_rem_state,
    rem_apply,
    rem_matrices,
    rem_step,
)
from aaren_jax.scan import AttentionState, attention_step, init_state, prefix_attention

Array = jax.Array

_DEFAULT_KERNEL_INIT = nnx.initializers.lecun_normal()
# Unit normal, so that W_q q0 has unit-scale entries under a LeCun-normal W_q, like the
# queries a Transformer computes from unit-scale (normalised) tokens.
_DEFAULT_QUERY_INIT = nnx.initializers.normal(stddev=1.0)


# ----------------------------------------------------------------------------------------
# Validation shared by every module (blocks and models import these).


def _check_heads(d_model: int, num_heads: int) -> int:
    if d_model < 1 or num_heads < 1:
        raise ValueError(f"d_model and num_heads must be positive, got {d_model}, {num_heads}")
    if d_model % num_heads:
        raise ValueError(f"d_model={d_model} is not divisible by num_heads={num_heads}")
    return d_model // num_heads


def check_inputs(x, mask, d_model: int, *, name: str = "x", ndim: int = 3):
    """Validates a sequence ``x [B, T, d]`` (or a token ``x_t [B, d]``) and its mask.

    Args:
      x: inputs. [B, T, d] (``ndim=3``) or [B, d] (``ndim=2``)
      mask: True = valid, or None. [B, T] or [B]
      d_model: the expected width ``d``.
      name: the argument's name in error messages.
      ndim: 3 for sequences, 2 for single tokens.

    Returns:
      ``(x, mask)`` as arrays (mask stays None when None).

    Raises:
      TypeError: non-floating ``x`` or non-boolean mask.
      ValueError: wrong rank or width of ``x``, mask shape not ``x.shape[:-1]``.
    """
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"{name} must have a floating dtype, got {x.dtype}")
    layout = "[B, T, d]" if ndim == 3 else "[B, d]"
    if x.ndim != ndim:
        raise ValueError(f"{name} must have shape {layout}, got shape {x.shape}")
    if x.shape[-1] != d_model:
        raise ValueError(
            f"{name} must have width d_model={d_model} on its last axis, got shape {x.shape}"
        )
    if mask is not None:
        mask_name = "mask" if ndim == 3 else "mask_t"
        mask = jnp.asarray(mask)
        if mask.dtype != jnp.bool_:
            raise TypeError(f"{mask_name} must be boolean (True = valid), got dtype {mask.dtype}")
        if mask.shape != x.shape[:-1]:
            raise ValueError(
                f"{mask_name} must have shape {x.shape[:-1]} to match {name} of shape "
                f"{x.shape}, got {mask.shape}"
            )
    return x, mask


def _concrete_int(x) -> int | None:
    """``int(x)`` when ``x`` is a concrete value; None inside a trace (jit, scan)."""
    if isinstance(x, jax.core.Tracer):
        return None
    return int(x)


def _state_dtype(dtype, param_dtype) -> jnp.dtype:
    # SPEC 1.2: scan state in float32 whatever the compute dtype (float64 stays float64).
    return jnp.promote_types(dtype if dtype is not None else param_dtype, jnp.float32)


# ----------------------------------------------------------------------------------------
# RSA: recurrence encoding (Huang et al., ICLR 2023; SPEC 1.6)


class RSAState(NamedTuple):
    """The carry of an RSA-Aaren attention layer: Aaren's scan state and the REM state.

    Both have constant size (the REM ring has ``p`` slots per head for dilation ``p``).

    Attributes:
      attention: Aaren's prefix-attention state. m, u [B, H]; w [B, H, D]
      rem: the REM recurrences' state. ring [B, H, P, 2, D]; phase [B]
    """

    attention: AttentionState
    rem: REMState


class RecurrenceEncoding(nnx.Module):
    """The RSA parameters of one attention layer: a gate and one REM per head (eq. (4)).

    ``sigmoid(mu)`` weighs the REMs against the attention: per head
    ``[(1 - sigmoid(mu)) A + sigmoid(mu) P] V`` with ``A`` the layer's attention weights and
    ``P`` the head's masked REM. ``mu`` is one scalar per layer; ``eta`` (regular heads) and
    ``nu``, ``theta`` (cyclical heads) one per head, laid out by ``REMConfig`` (the paper's
    counts ``k1..k6`` and dilations). Initialisation as in the paper (Section 3): ``mu =
    config.mu_init``, ``eta`` spread over [-2, -1] U [1, 2], ``nu`` over [1, 2], ``theta =
    pi / 4`` (``aaren_jax.init_rem_params``). Overhead per layer: ``1 + (k1 + k4) +
    2 (k2 + k3 + k5 + k6)`` parameters.

    Attributes:
      config: the ``REMConfig`` (static).
      mu: the gate parameter. []
      eta: regular heads' ``lambda = tanh(eta)``. [k1 + k4]
      nu: cyclical heads' ``gamma = sigmoid(nu)``. [k2 + k3 + k5 + k6]
      theta: cyclical heads' angles. [k2 + k3 + k5 + k6]

    Example:
      >>> rsa = RecurrenceEncoding(REMConfig((3, 1, 1, 0, 0, 0)), 5)
      >>> rsa.matrices(4, 4).shape
      (5, 4, 4)
    """

    def __init__(self, config: REMConfig, num_heads: int, *, param_dtype=jnp.float32):
        """Builds the parameters.

        Args:
          config: head assignment; ``config.num_heads`` must equal ``num_heads``.
          num_heads: the layer's heads ``H``.
          param_dtype: dtype of ``mu``, ``eta``, ``nu``, ``theta``.

        Raises:
          TypeError: ``config`` is not a ``REMConfig``.
          ValueError: the counts do not sum to ``num_heads``.
        """
        if not isinstance(config, REMConfig):
            raise TypeError(f"rsa must be a REMConfig or None, got {type(config).__name__}")
        if config.num_heads != num_heads:
            raise ValueError(
                f"rsa: counts {config.counts} assign {config.num_heads} heads, the layer has "
                f"num_heads={num_heads}"
            )
        self.config = config
        params = init_rem_params(config, dtype=param_dtype)
        self.mu = nnx.Param(jnp.asarray(config.mu_init, param_dtype))
        self.eta = nnx.Param(params["eta"])
        self.nu = nnx.Param(params["nu"])
        self.theta = nnx.Param(params["theta"])

    def gate(self, dtype=None) -> Array:
        """``sigmoid(mu)`` in ``dtype`` (default: float32, or float64 for float64 ``mu``). []"""
        mu = self.mu[...]
        return jax.nn.sigmoid(mu.astype(dtype or jnp.promote_types(mu.dtype, jnp.float32)))

    def params(self) -> dict[str, Array]:
        """``{"eta", "nu", "theta"}`` for the functions of ``aaren_jax.rem``."""
        return {"eta": self.eta[...], "nu": self.nu[...], "theta": self.theta[...]}

    def matrices(self, q_len: int, k_len: int, q_offset=0, dtype=None) -> Array:
        """Masked REMs of queries at ``q_offset ..`` against keys ``0 .. k_len-1``. [H, Tq, Tk]"""
        return rem_matrices(
            self.config, self.params(), q_len, k_len, q_offset=q_offset, dtype=dtype
        )


def _rsa_attention(
    q: Array, k: Array, v: Array, mask: Array, key_valid: Array, rem: Array, gate: Array
) -> Array:
    """RSA heads, eq. (4): ``(1 - g) softmax(q k^T + mask) v + g P v``.

    The softmax runs in float32 (float64 for float64 inputs); masked keys are excluded from
    the softmax and padded keys' values are zeroed for the REM product, so padding never
    leaks and gets exactly zero gradient. A row with no valid key gives exactly 0 (its
    softmax part is zeroed, its REM row meets only zeroed values).

    Args:
      q: queries, pre-scaled. [B, H, Tq, D]
      k: keys. [B, H, S, D]
      v: values. [B, H, S, D]
      mask: True where query t may attend key s. [B, 1, Tq, S]
      key_valid: True for keys that hold a token (not padding). [B, S]
      rem: the heads' masked REMs for these queries and keys (zero at lags <= 0). [H, Tq, S]
      gate: ``sigmoid(mu)``. []

    Returns:
      Outputs in ``v``'s dtype. [B, H, Tq, D]
    """
    acc = jnp.promote_types(v.dtype, jnp.float32)
    scores = jnp.einsum("bhtd,bhsd->bhts", q, k, preferred_element_type=acc)
    # A finite floor rather than -inf: exp gives exactly 0 for masked keys in any row with a
    # valid key, and jax.nn.softmax (one fused pass and a cheap VJP) needs no NaN guard.
    probs = jax.nn.softmax(jnp.where(mask, scores, jnp.finfo(acc).min), axis=-1)
    # A row with no valid key came out uniform over masked keys: make it 0.
    probs = jnp.where(jnp.any(mask, axis=-1, keepdims=True), probs, jnp.zeros((), acc))
    attended = jnp.einsum("bhts,bhsd->bhtd", probs.astype(v.dtype), v, preferred_element_type=acc)
    v_valid = jnp.where(key_valid[:, None, :, None], v, jnp.zeros((), v.dtype))
    recurrent = jnp.einsum(
        "hts,bhsd->bhtd", rem.astype(v.dtype), v_valid, preferred_element_type=acc
    )
    gate = gate.astype(acc)
    return ((1 - gate) * attended + gate * recurrent).astype(v.dtype)


# ----------------------------------------------------------------------------------------
# Aaren


class AarenAttention(nnx.Module):
    """Multi-head attention of a learned query over every prefix: an RNN (SPEC 1.4).

    ``q = W_q q0 + b_q`` with a learned ``q0 in R^d`` and the same ``W_q`` a Transformer has;
    ``K = x W_k + b_k``, ``V = x W_v + b_v``, split into ``H`` heads of size ``D = d / H``;
    per head ``o_t = prefix_attention(<q_h, k_h,i> / sqrt(D), v_h,i)[t]``; ``y = O W_o + b_o``.
    The scan state is float32 whatever ``dtype`` is; outputs come back in the compute dtype.

    RSA-Aaren (``rsa=REMConfig(...)``, SPEC 1.6): per head
    ``o_t = (1 - sigmoid(mu)) aaren_t + sigmoid(mu) rem_t`` with ``rem_t = (P V)_t`` computed
    as a linear recurrence (``aaren_jax.rem_apply`` in parallel, ``rem_step`` streaming, no
    truncation at ``K``), so streaming stays O(1) in memory (O(p) for dilation ``p``); the
    carry is then an ``RSAState``. A padding token is skipped by the REM recurrence (it does
    not advance the lags) and its REM output is 0.

    Attributes:
      q0: the learned query. [d]
      q_proj, k_proj, v_proj, o_proj: ``nnx.Linear(d, d)`` with biases.
      rsa: the ``RecurrenceEncoding`` (gate and REM parameters), or None.
      num_heads, head_dim, d_model: the sizes.
      method, chunk_size: forwarded to ``prefix_attention``.

    Example:
      >>> layer = AarenAttention(16, 2, rngs=nnx.Rngs(0))
      >>> x = jnp.ones((3, 5, 16))
      >>> layer(x).shape
      (3, 5, 16)
      >>> carry = layer.init_carry(3)
      >>> carry, y_t = layer.step(carry, x[:, 0])
      >>> y_t.shape
      (3, 16)
    """

    def __init__(
        self,
        d_model: int,
        num_heads: int,
        *,
        dtype=None,
        param_dtype=jnp.float32,
        method: str = "auto",
        chunk_size: int | None = None,
        kernel_init=_DEFAULT_KERNEL_INIT,
        query_init=_DEFAULT_QUERY_INIT,
        rsa: REMConfig | None = None,
        rngs: nnx.Rngs,
    ):
        """Builds the layer.

        Args:
          d_model: model width ``d``.
          num_heads: number of heads ``H``; must divide ``d``.
          dtype: compute dtype of the projections (None: from inputs and params).
          param_dtype: dtype of the parameters.
          method: ``prefix_attention`` method for the parallel pass.
          chunk_size: ``prefix_attention`` chunk size.
          kernel_init: initialiser of the four projection kernels.
          query_init: initialiser of ``q0``; unit normal so that ``W_q q0`` has unit-scale
            entries under LeCun-normal ``W_q``, like a Transformer's queries.
          rsa: a ``REMConfig`` to gate REMs into the heads (RSA-Aaren), or None (plain).
          rngs: parameter RNGs.
        """
        self.head_dim = _check_heads(d_model, num_heads)
        self.d_model, self.num_heads = d_model, num_heads
        self.dtype, self.param_dtype = dtype, param_dtype
        self.method, self.chunk_size = method, chunk_size
        self.q0 = nnx.Param(query_init(rngs.params(), (d_model,), param_dtype))

        def linear():
            return nnx.Linear(
                d_model,
                d_model,
                dtype=dtype,
                param_dtype=param_dtype,
                kernel_init=kernel_init,
                rngs=rngs,
            )

        self.q_proj, self.k_proj, self.v_proj, self.o_proj = linear(), linear(), linear(), linear()
        self.rsa = (
            None if rsa is None else RecurrenceEncoding(rsa, num_heads, param_dtype=param_dtype)
        )

    def _query(self) -> Array:
        """The per-head query, pre-scaled by ``1/sqrt(D)``, in the state dtype. [H, D]"""
        acc = _state_dtype(self.dtype, self.param_dtype)
        q = self.q_proj(self.q0[...]).astype(acc)
        # Scaling the H*D query once is cheaper than scaling B*H*T scores.
        return q.reshape(self.num_heads, self.head_dim) / math.sqrt(self.head_dim)

    def init_carry(self, batch_size: int, max_len: int | None = None) -> AttentionState | RSAState:
        """The empty state: attention over no token.

        Args:
          batch_size: ``B``.
          max_len: ignored (an Aaren carry has no capacity); accepted for one interface.

        Returns:
          ``AttentionState`` with m, u [B, H] and w [B, H, D] in float32; with RSA an
          ``RSAState`` of it and an empty ``REMState`` (ring [B, H, P, 2, D], phase [B]).
        """
        del max_len
        dtype = _state_dtype(self.dtype, self.param_dtype)
        state = init_state((int(batch_size), self.num_heads), self.head_dim, dtype)
        if self.rsa is None:
            return state
        rem = init_rem_state(self.rsa.config, (int(batch_size),), self.head_dim, dtype)
        return RSAState(state, rem)

    def _split_carry(self, carry):
        """``(attention state, REM state)`` of a carry (either may be None)."""
        if self.rsa is None:
            return carry, None
        if carry is None:
            return None, None
        if not isinstance(carry, RSAState):
            raise TypeError(
                f"an RSA-Aaren layer's carry is an RSAState (from init_carry), got "
                f"{type(carry).__name__}"
            )
        return carry.attention, carry.rem

    def _gate_mix(self, aaren_out: Array, rem_out: Array) -> Array:
        """``(1 - sigmoid(mu)) aaren + sigmoid(mu) rem`` in the state dtype, cast back."""
        acc = jnp.promote_types(aaren_out.dtype, jnp.float32)
        g = self.rsa.gate(acc)
        mixed = (1 - g) * aaren_out.astype(acc) + g * rem_out.astype(acc)
        return mixed.astype(aaren_out.dtype)

    def __call__(
        self,
        x: Array,
        mask: Array | None = None,
        carry: AttentionState | None = None,
        return_carry: bool = False,
    ):
        """Runs the whole sequence in parallel (a prefix scan per head).

        Args:
          x: inputs. [B, T, d]
          mask: True = valid token; masked tokens are the scan's identity. [B, T]
          carry: state of earlier tokens (prefill continues it), or None for empty.
            m, u [B, H]; w [B, H, D] (an ``RSAState`` with RSA)
          return_carry: also return the state after the last token.

        Returns:
          ``y`` [B, T, d], or ``(y, carry)`` when ``return_carry``.
        """
        x, mask = check_inputs(x, mask, self.d_model)
        carry, rem_carry = self._split_carry(carry)
        batch, length, _ = x.shape
        heads, head_dim = self.num_heads, self.head_dim
        q = self._query()
        k = self.k_proj(x).reshape(batch, length, heads, head_dim)
        v = self.v_proj(x).reshape(batch, length, heads, head_dim)
        # sum(k * q) rather than einsum: faster on CPU at long T (MEASUREMENTS pitfall 5).
        scores = jnp.sum(k.astype(q.dtype) * q[None, None], axis=-1)  # [B, T, H]
        scores = jnp.swapaxes(scores, 1, 2)  # [B, H, T]
        values = jnp.swapaxes(v, 1, 2)  # [B, H, T, D]
        head_mask = None
        if mask is not None:
            head_mask = jnp.broadcast_to(mask[:, None, :], (batch, heads, length))
        out, state = prefix_attention(
            scores,
            values,
            head_mask,
            initial_state=carry,
            method=self.method,
            chunk_size=self.chunk_size,
        )
        if self.rsa is not None:
            rem_out, rem_state = rem_apply(
                self.rsa.config, self.rsa.params(), values, mask, initial_state=rem_carry
            )
            out = self._gate_mix(out, rem_out)
            state = RSAState(state, rem_state)
        y = self.o_proj(jnp.swapaxes(out, 1, 2).reshape(batch, length, self.d_model))
        return (y, state) if return_carry else y

    def step(
        self, carry: AttentionState, x_t: Array, mask_t: Array | None = None
    ) -> tuple[AttentionState, Array]:
        """Advances by one token in O(1) time and memory.

        Args:
          carry: the state so far. m, u [B, H]; w [B, H, D] (an ``RSAState`` with RSA)
          x_t: this token. [B, d]
          mask_t: True = valid; a masked token leaves the state unchanged. [B]

        Returns:
          ``(carry, y_t)`` with ``y_t`` [B, d].
        """
        x_t, mask_t = check_inputs(x_t, mask_t, self.d_model, name="x_t", ndim=2)
        carry, rem_carry = self._split_carry(carry)
        batch = x_t.shape[0]
        heads, head_dim = self.num_heads, self.head_dim
        q = self._query()
        k = self.k_proj(x_t).reshape(batch, heads, head_dim)
        v = self.v_proj(x_t).reshape(batch, heads, head_dim)
        score = jnp.sum(k.astype(q.dtype) * q[None], axis=-1)  # [B, H]
        head_mask = None
        if mask_t is not None:
            head_mask = jnp.broadcast_to(mask_t[:, None], (batch, heads))
        carry, out = attention_step(carry, score, v, head_mask)
        if self.rsa is not None:
            rem_carry, rem_out = rem_step(self.rsa.config, self.rsa.params(), rem_carry, v, mask_t)
            out = self._gate_mix(out, rem_out)
            carry = RSAState(carry, rem_carry)
        return carry, self.o_proj(out.reshape(batch, self.d_model))


# ----------------------------------------------------------------------------------------
# Causal self-attention with a KV cache (the baseline, SPEC 1.5)


class KVCache(NamedTuple):
    """A fixed-capacity key/value cache of one causal self-attention layer.

    Laid out ``[B, H, C, D]`` so that a decode step reads it as a batched matrix without
    transposing it (MEASUREMENTS pitfall 7: a ``[B, C, H, D]`` cache made XLA transpose the
    whole cache every step).

    Attributes:
      k: keys, written up to ``length``. [B, H, C, D]
      v: values, written up to ``length``. [B, H, C, D]
      valid: True where a slot holds a valid (unmasked, written) token. [B, C]
      length: number of slots written so far, the next write position. [] int32
    """

    k: Array
    v: Array
    valid: Array
    length: Array

    @property
    def capacity(self) -> int:
        """The number of slots ``C``."""
        return self.k.shape[2]


def check_capacity(carry, num_new: int = 1) -> None:
    """Raises if writing ``num_new`` tokens would overflow any ``KVCache`` in ``carry``.

    Works on any pytree (a layer's cache, a model's carry, an Aaren carry with no cache).
    Inside a trace the position is not known, so this checks nothing there: jitted helpers
    (``aaren_jax.make_step_fn``, ``aaren_jax.stream``) call it on the host before each call.

    Args:
      carry: a pytree that may contain ``KVCache`` nodes.
      num_new: number of tokens about to be written.

    Raises:
      ValueError: naming the capacity and the position.
    """
    caches = jax.tree.leaves(carry, is_leaf=lambda c: isinstance(c, KVCache))
    for cache in caches:
        if not isinstance(cache, KVCache):
            continue
        position = _concrete_int(cache.length)
        if position is not None and position + num_new > cache.capacity:
            raise ValueError(
                f"KV cache overflow: capacity {cache.capacity}, position {position}, cannot "
                f"write {num_new} more token(s); call init_carry with a larger max_len"
            )


def _masked_attention(q: Array, segments, gate: Array | None = None) -> Array:
    """Softmax attention with boolean key masks over one or more key segments.

    One softmax (float32, or float64 for float64 inputs) over the keys of every segment,
    without concatenating them: a decode step attends over the cache as it was before this
    token's write, and over this token apart (see ``_after``). Masked scores are excluded
    before ``exp`` (no NaN, no leak); a row with no valid key gives exactly 0. With a
    ``gate``, the segments' REM columns are mixed in as in ``_rsa_attention``.

    Args:
      q: queries, pre-scaled. [B, H, Tq, D]
      segments: ``(k, v, mask, rem)`` tuples: keys and values [B, H, S_i, D], True where
        query t may attend key s [B, 1, Tq, S_i], and the REM columns [H, Tq, S_i] or None
        (zero).
      gate: ``sigmoid(mu)`` [], or None for plain softmax attention.

    Returns:
      Outputs in the first segment's ``v`` dtype; exactly 0 for a row with no valid key.
      [B, H, Tq, D]
    """
    out_dtype = segments[0][1].dtype
    acc = jnp.promote_types(out_dtype, jnp.float32)
    scores = [
        jnp.where(mask, jnp.einsum("bhtd,bhsd->bhts", q, k, preferred_element_type=acc), -jnp.inf)
        for k, _, mask, _ in segments
    ]
    top = scores[0].max(axis=-1, keepdims=True)
    for s in scores[1:]:
        top = jnp.maximum(top, s.max(axis=-1, keepdims=True))
    # A row with every key masked has top = -inf: use 0 so exp gives 0, not NaN.
    top = jax.lax.stop_gradient(jnp.where(jnp.isneginf(top), jnp.zeros_like(top), top))
    weights = [
        jnp.exp(jnp.where(mask, s - top, -jnp.inf))
        for s, (_, _, mask, _) in zip(scores, segments, strict=True)
    ]
    denom = sum(jnp.sum(w, axis=-1, keepdims=True) for w in weights)
    # Normalise the [B, H, Tq, D] output rather than the [B, H, Tq, S] weights.
    out = sum(
        jnp.einsum("bhts,bhsd->bhtd", w.astype(v.dtype), v, preferred_element_type=acc)
        for w, (_, v, _, _) in zip(weights, segments, strict=True)
    )
    out = out / jnp.where(denom > 0, denom, jnp.ones_like(denom))
    if gate is None:
        return out.astype(out_dtype)
    recurrent = sum(
        jnp.einsum(
            "bhts,bhsd->bhtd",
            jnp.where(mask, rem.astype(v.dtype)[None], jnp.zeros((), v.dtype)),
            v,
            preferred_element_type=acc,
        )
        for _, v, mask, rem in segments
        if rem is not None
    )
    gate = gate.astype(acc)
    return ((1 - gate) * out + gate * recurrent).astype(out_dtype)


def _after(x: Array, y: Array) -> Array:
    """``x`` unchanged, but data-dependent on ``y``, so that XLA computes ``y`` first.

    A KV-cache step reads the cache, then writes this token into it. Written first and read
    after, the update and the attention's dots made XLA (CPU) copy the whole cache several
    times per step at batch 1 (the batch axis of size 1 puts a bitcast between them: about
    40 ms instead of 2 ms per layer at C = 16384); read first with no dependency, XLA cannot
    order the read before an in-place write and copies the cache too. With the update
    depending on the attention's output, the write happens in place after the reads.
    ``nan_to_num(0 * sum(y))`` is exactly 0 (also for non-finite ``y``); XLA cannot fold it.
    """
    zero = jnp.nan_to_num(jnp.zeros((), jnp.float32) * jnp.sum(y, dtype=jnp.float32))
    return x + zero.astype(x.dtype)


class CausalSelfAttention(nnx.Module):
    """Causal multi-head self-attention with a fixed-capacity KV cache (SPEC 1.5).

    The parallel pass uses ``jax.nn.dot_product_attention``. The cache is a ``KVCache``
    ``[B, H, C, D]``; a decode step writes one slot and attends over the whole buffer with a
    validity mask, so it costs O(C) per token whatever the current length, and compiles
    once for all positions (no shape depends on the position). Each layer reads its cache's
    keys once and values once per step. Query rows with no valid key (e.g. a left-padding
    position) output exactly 0, like Aaren's.

    RSA (``rsa=REMConfig(...)``, Huang et al. eq. (4)): per head
    ``[(1 - sigmoid(mu)) softmax(QK^T / sqrt(D) + causal mask) + sigmoid(mu) P] V`` with
    ``P`` the head's masked REM (truncated at power ``K``). The parallel pass builds ``P``
    ``[H, T, T]``; a cached pass or a decode step builds the REM rows of its queries at
    absolute positions ``length ..`` against the cache's slots (the non-square form,
    ``q_offset = length``) and mixes them into the softmax weights, so the cache's values
    are read once. Lags are slot differences in both paths and padded keys' REM columns
    are zeroed: with left or right padding this is the REM of the unpadded tokens.

    Attributes:
      q_proj, k_proj, v_proj, o_proj: ``nnx.Linear(d, d)`` with biases.
      rsa: the ``RecurrenceEncoding`` (gate and REM parameters), or None.
      num_heads, head_dim, d_model: the sizes.

    Example:
      >>> layer = CausalSelfAttention(16, 2, rngs=nnx.Rngs(0))
      >>> x = jnp.ones((3, 5, 16))
      >>> y, cache = layer(x, return_carry=True)  # a cache of capacity 5, full
      >>> cache = layer.init_carry(3, max_len=8)
      >>> y, cache = layer(x, carry=cache, return_carry=True)
      >>> cache, y_t = layer.step(cache, x[:, 0])
      >>> int(cache.length)
      6
    """

    def __init__(
        self,
        d_model: int,
        num_heads: int,
        *,
        dtype=None,
        param_dtype=jnp.float32,
        kernel_init=_DEFAULT_KERNEL_INIT,
        rsa: REMConfig | None = None,
        rngs: nnx.Rngs,
    ):
        """Builds the layer.

        Args:
          d_model: model width ``d``.
          num_heads: number of heads ``H``; must divide ``d``.
          dtype: compute dtype (None: from inputs and params); softmax is float32.
          param_dtype: dtype of the parameters.
          kernel_init: initialiser of the four projection kernels.
          rsa: a ``REMConfig`` to make the heads RSA heads, or None (plain).
          rngs: parameter RNGs.
        """
        self.head_dim = _check_heads(d_model, num_heads)
        self.d_model, self.num_heads = d_model, num_heads
        self.dtype, self.param_dtype = dtype, param_dtype

        def linear():
            return nnx.Linear(
                d_model,
                d_model,
                dtype=dtype,
                param_dtype=param_dtype,
                kernel_init=kernel_init,
                rngs=rngs,
            )

        self.q_proj, self.k_proj, self.v_proj, self.o_proj = linear(), linear(), linear(), linear()
        self.rsa = (
            None if rsa is None else RecurrenceEncoding(rsa, num_heads, param_dtype=param_dtype)
        )

    def _cache_dtype(self):
        return jnp.dtype(self.dtype if self.dtype is not None else self.param_dtype)

    def init_carry(self, batch_size: int, max_len: int | None = None) -> KVCache:
        """An empty cache of capacity ``max_len``.

        Args:
          batch_size: ``B``.
          max_len: capacity ``C``, the most tokens (prefill and steps) it will hold.

        Returns:
          A ``KVCache`` with k, v [B, H, C, D], valid [B, C] all False, length 0.

        Raises:
          ValueError: ``max_len`` missing or not positive.
        """
        if max_len is None or int(max_len) < 1:
            raise ValueError(
                f"a KV cache needs a capacity: pass max_len >= 1 to init_carry, got {max_len}"
            )
        shape = (int(batch_size), self.num_heads, int(max_len), self.head_dim)
        return KVCache(
            k=jnp.zeros(shape, self._cache_dtype()),
            v=jnp.zeros(shape, self._cache_dtype()),
            valid=jnp.zeros((int(batch_size), int(max_len)), jnp.bool_),
            length=jnp.zeros((), jnp.int32),
        )

    def _heads(self, y: Array) -> Array:
        """[B, T, d] -> [B, T, H, D]."""
        return y.reshape(*y.shape[:-1], self.num_heads, self.head_dim)

    def __call__(
        self,
        x: Array,
        mask: Array | None = None,
        carry: KVCache | None = None,
        return_carry: bool = False,
    ):
        """Runs the whole sequence at once, optionally prefilling a cache.

        Args:
          x: inputs. [B, T, d]
          mask: True = valid token; masked keys are never attended. [B, T]
          carry: a cache to continue (tokens go to slots ``length .. length+T-1``), or None.
          return_carry: also return the cache. With ``carry=None`` it has capacity ``T``.

        Returns:
          ``y`` [B, T, d], or ``(y, cache)`` when ``return_carry``.

        Raises:
          ValueError: the cache cannot hold ``T`` more tokens (checked when not traced).
        """
        x, mask = check_inputs(x, mask, self.d_model)
        batch, length, _ = x.shape
        q = self._heads(self.q_proj(x))
        k = self._heads(self.k_proj(x))
        v = self._heads(self.v_proj(x))
        valid = jnp.ones((batch, length), jnp.bool_) if mask is None else mask
        scale = 1.0 / math.sqrt(self.head_dim)

        if carry is None:
            causal = jnp.tril(jnp.ones((length, length), jnp.bool_))
            attend = causal[None, None] & valid[:, None, None, :]  # [B, 1, T, T]
            if self.rsa is not None:
                qh = jnp.swapaxes(q, 1, 2) * jnp.asarray(scale, q.dtype)
                out = _rsa_attention(
                    qh,
                    jnp.swapaxes(k, 1, 2),
                    jnp.swapaxes(v, 1, 2),
                    attend,
                    valid,
                    self.rsa.matrices(length, length),
                    self.rsa.gate(),
                )
                out = jnp.swapaxes(out, 1, 2)  # [B, T, H, D]
            else:
                out = jax.nn.dot_product_attention(q, k, v, mask=attend, scale=scale)
            # dot_product_attention spreads a row with no valid key uniformly over masked
            # keys; give exactly 0 instead (finite, and equal to the cached path).
            seen = jax.lax.cummax(valid.astype(jnp.int32), axis=1) > 0  # [B, T]
            out = jnp.where(seen[:, :, None, None], out, jnp.zeros_like(out))
            y = self.o_proj(out.reshape(batch, length, self.d_model))
            if not return_carry:
                return y
            carry = KVCache(
                k=jnp.swapaxes(k, 1, 2).astype(self._cache_dtype()),
                v=jnp.swapaxes(v, 1, 2).astype(self._cache_dtype()),
                valid=valid,
                length=jnp.asarray(length, jnp.int32),
            )
            return y, carry

        self._check_cache(carry, batch)
        check_capacity(carry, length)
        start = carry.length
        zero = jnp.zeros((), start.dtype)  # indices of one integer type, also under x64
        cache_k = jax.lax.dynamic_update_slice(
            carry.k, jnp.swapaxes(k, 1, 2).astype(carry.k.dtype), (zero, zero, start, zero)
        )
        cache_v = jax.lax.dynamic_update_slice(
            carry.v, jnp.swapaxes(v, 1, 2).astype(carry.v.dtype), (zero, zero, start, zero)
        )
        cache_valid = jax.lax.dynamic_update_slice(carry.valid, valid, (zero, start))
        # Query t sits at slot start + t and sees slots up to it that hold valid tokens.
        slots = jnp.arange(carry.capacity)
        query_slot = start + jnp.arange(length)
        attend = (slots[None, :] <= query_slot[:, None])[None, None] & cache_valid[:, None, None, :]
        qh = jnp.swapaxes(q, 1, 2) * jnp.asarray(scale, q.dtype)
        if self.rsa is not None:
            rem = self.rsa.matrices(length, carry.capacity, q_offset=start)
            out = _rsa_attention(
                qh, cache_k, cache_v, attend, cache_valid, rem, self.rsa.gate()
            )  # [B, H, T, D]
        else:
            out = _masked_attention(qh, [(cache_k, cache_v, attend, None)])  # [B, H, T, D]
        y = self.o_proj(jnp.swapaxes(out, 1, 2).reshape(batch, length, self.d_model))
        new = KVCache(cache_k, cache_v, cache_valid, start + jnp.asarray(length, jnp.int32))
        return (y, new) if return_carry else y

    def _check_cache(self, carry, batch: int) -> None:
        if not isinstance(carry, KVCache):
            raise TypeError(f"carry must be a KVCache, got {type(carry).__name__}")
        want = (batch, self.num_heads, carry.capacity, self.head_dim)
        if carry.k.shape != want or carry.v.shape != want:
            raise ValueError(
                f"carry.k / carry.v must have shape [B, H, C, D] = {want}, got "
                f"{carry.k.shape} / {carry.v.shape}"
            )

    def step(
        self, carry: KVCache, x_t: Array, mask_t: Array | None = None
    ) -> tuple[KVCache, Array]:
        """Decodes one token: writes its key/value at ``length`` and attends over the cache.

        Costs O(C) per token (the whole buffer, masked), not O(length).

        Args:
          carry: the cache. k, v [B, H, C, D]; valid [B, C]; length []
          x_t: this token. [B, d]
          mask_t: True = valid; a masked token's slot is never attended. [B]

        Returns:
          ``(carry, y_t)`` with ``y_t`` [B, d].

        Raises:
          ValueError: the cache is full (checked when not traced; jitted helpers check on
            the host before calling).
        """
        x_t, mask_t = check_inputs(x_t, mask_t, self.d_model, name="x_t", ndim=2)
        batch = x_t.shape[0]
        self._check_cache(carry, batch)
        check_capacity(carry, 1)
        heads, head_dim = self.num_heads, self.head_dim
        q = self.q_proj(x_t).reshape(batch, heads, 1, head_dim)
        k = self.k_proj(x_t).reshape(batch, heads, 1, head_dim).astype(carry.k.dtype)
        v = self.v_proj(x_t).reshape(batch, heads, 1, head_dim).astype(carry.v.dtype)
        valid_t = jnp.ones((batch,), jnp.bool_) if mask_t is None else mask_t
        pos = carry.length
        zero = jnp.zeros((), pos.dtype)  # indices of one integer type, also under x64
        cache_valid = jax.lax.dynamic_update_slice(carry.valid, valid_t[:, None], (zero, pos))
        q = q * jnp.asarray(1.0 / math.sqrt(head_dim), q.dtype)
        # The cache as it was (its valid slots are all before this token), then this token;
        # the write comes after the reads (_after), so it happens in place.
        old = (carry.k, carry.v, carry.valid[:, None, None, :], None)
        this = (k, v, valid_t[:, None, None, None], None)
        gate = None
        if self.rsa is not None:
            # The REM row of query position pos against every slot (App. D.2, q_offset);
            # the masked REM is strictly lower triangular, so this token's own entry is 0.
            old = old[:3] + (self.rsa.matrices(1, carry.capacity, q_offset=pos),)
            gate = self.rsa.gate()
        out = _masked_attention(q, [old, this], gate)  # [B, H, 1, D]
        cache_k = jax.lax.dynamic_update_slice(carry.k, _after(k, out), (zero, zero, pos, zero))
        cache_v = jax.lax.dynamic_update_slice(carry.v, _after(v, out), (zero, zero, pos, zero))
        y = self.o_proj(out.reshape(batch, self.d_model))
        return KVCache(cache_k, cache_v, cache_valid, pos + 1), y
