"""Attention layers: Aaren's learned-query attention and the causal baseline with a KV cache.

Both layers share one interface (SPEC 2.2), at the level of a single layer:

    y = layer(x, mask=None)                                  # x [B, T, d] -> y [B, T, d]
    carry = layer.init_carry(batch_size, max_len=None)
    y, carry = layer(x, mask=None, carry=carry, return_carry=True)
    carry, y_t = layer.step(carry, x_t, mask_t=None)        # x_t [B, d] -> y_t [B, d]

and one computation: ``step`` is the sequence computation on a sequence of one token (the
pure core takes a static fast path for it), so the parallel pass and the stream cannot
drift apart. ``AarenAttention``'s carry is a compensated ``AttentionState`` of constant
size (SPEC 1.1, 1.4); ``CausalSelfAttention``'s is a ``KVCache`` of fixed capacity.

RSA (SPEC 1.6) is a sub-module, ``RecurrenceEncoding``, with its own carry (``REMState``):
either layer mixes its REM term, computed by the same recurrence (``rem_apply``), into its
heads, so the two models' REMs mean the same thing. The layer's carry is then an
``RSAState`` of its own carry and the REM state.

Bad data: a masked token's input is zeroed on entry, so whatever it holds (NaN, inf)
reaches no valid output and no gradient; a NaN at an attended token reaches every output
that attends to it. A KV cache written past its capacity raises when the position is known
(eager) and gives NaN outputs under a trace (``jit``, ``scan``), never a plausible number.

No positional encoding lives here: both layers are permutation-equivariant over the past,
so users add their own embedding. Masks are boolean, True = valid token.

Shape notation: ``B`` batch, ``T`` time, ``H`` heads, ``D`` head size, ``d`` model width,
``C`` KV cache capacity, ``S`` keys.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from aaren_jax.rem_config import REMConfig, init_rem_params
from aaren_jax.rem_matrix import rem_matrices
from aaren_jax.rem_recurrence import REMState, init_rem_state, rem_apply
from aaren_jax.scan import (
    METHODS,
    AttentionState,
    accumulation_dtype,
    as_shape,
    check_chunk_size,
    checked_prefix_attention,
    init_state,
)

Array = jax.Array

_DEFAULT_KERNEL_INIT = nnx.initializers.lecun_normal()
# Unit normal, so that W_q q0 has unit-scale entries under a LeCun-normal W_q, like the
# queries a Transformer computes from unit-scale (normalised) tokens.
_DEFAULT_QUERY_INIT = nnx.initializers.normal(stddev=1.0)


# ----------------------------------------------------------------------------------------
# Validation shared by every module (blocks and models import these).


def check_heads(d_model: int, num_heads: int) -> int:
    """The head size ``D = d / H``; ValueError unless both are positive and ``H`` divides ``d``."""
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


def zero_masked(x: Array, mask: Array | None) -> Array:
    """``x`` with masked tokens set to 0: their content, NaN included, reaches nothing. [B, T, d]"""
    if mask is None:
        return x
    return jnp.where(mask[..., None], x, jnp.zeros((), x.dtype))


def per_token(fn: Callable[[Array], Array], x: Array) -> Array:
    """``fn`` applied to every token of ``x`` [..., d] as one [tokens, d] matrix. [..., d']

    For a function that acts on each token alone (a projection, a LayerNorm, an MLP). XLA's
    CPU code for the same work over [B, T, d] was slower, most with B = 1
    (``benchmarks/token_layout.py``); the reshapes are free.
    """
    return fn(x.reshape(-1, x.shape[-1])).reshape(*x.shape[:-1], -1)


def _concrete_int(x) -> int | None:
    """``int(x)`` when ``x`` is a concrete value; None inside a trace (jit, scan)."""
    if isinstance(x, jax.core.Tracer):
        return None
    return int(x)


def check_batch_size(batch_size) -> int:
    """``batch_size`` as an int >= 1; TypeError / ValueError naming it otherwise."""
    (batch,) = as_shape("init_carry: batch_size", (batch_size,))
    if batch < 1:
        raise ValueError(f"init_carry: batch_size must be >= 1, got {batch_size!r}")
    return batch


# ----------------------------------------------------------------------------------------
# RSA: recurrence encoding (Huang et al., ICLR 2023; SPEC 1.6)


class RSAState(NamedTuple):
    """The carry of an RSA attention layer: the layer's own carry and the REM state.

    Attributes:
      attention: the attention's carry: an ``AttentionState`` (Aaren: m, u [B, H]; w
        [B, H, D]) or a ``KVCache`` (Transformer).
      rem: the REM recurrences' state, constant in size. ring [B, H, P, 2, D]; phase [B]
    """

    attention: AttentionState | KVCache
    rem: REMState


class RecurrenceEncoding(nnx.Module):
    """The RSA part of one attention layer: a gate and one REM per head (eq. (4)).

    Per head the layer outputs ``(1 - sigmoid(mu)) attention + sigmoid(mu) P V`` with ``P``
    the head's masked REM. ``P V`` is computed as a linear recurrence (``rem_apply``: in
    parallel over a sequence, a single ``rem_step`` for one token) with no truncation at
    ``K``; a masked token is absent (it does not advance the lags). This is the same for
    ``AarenAttention`` and ``CausalSelfAttention``. The matrix form (``matrices``,
    truncated at ``K``) equals it while ``T - 1 <= p K`` (see ``aaren_jax.rem``).

    ``mu`` is one scalar per layer; ``eta`` (regular heads) and ``nu``, ``theta`` (cyclical
    heads) one per head, laid out by ``REMConfig``. Initialisation as in the paper (Section
    3): ``mu = config.mu_init``, ``eta`` spread over [-2, -1] U [1, 2] (``config.eta_range``),
    ``nu`` over [1, 2], ``theta = pi / 4``. Overhead per layer:
    ``1 + (k1 + k4) + 2 (k2 + k3 + k5 + k6)``. A family with no heads has no parameter (the
    attribute is None), since Orbax cannot checkpoint zero-size arrays.

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
        self.eta, self.nu, self.theta = (
            nnx.Param(params[name]) if params[name].size else None
            for name in ("eta", "nu", "theta")
        )

    def gate(self, dtype=None) -> Array:
        """``sigmoid(mu)`` in ``dtype`` (default: float32, or float64 for float64 ``mu``). []"""
        mu = self.mu[...]
        return jax.nn.sigmoid(mu.astype(dtype or accumulation_dtype(mu.dtype)))

    def params(self) -> dict[str, Array]:
        """``{"eta", "nu", "theta"}`` for the functions of ``aaren_jax.rem``."""
        empty = jnp.zeros((0,), self.mu.dtype)  # a family with no heads
        return {
            name: empty if param is None else param[...]
            for name, param in (("eta", self.eta), ("nu", self.nu), ("theta", self.theta))
        }

    def matrices(self, q_len: int, k_len: int, q_offset=0, dtype=None) -> Array:
        """Masked REMs of queries at ``q_offset ..`` against keys ``0 .. k_len-1``. [H, Tq, Tk]"""
        return rem_matrices(
            self.config, self.params(), q_len, k_len, q_offset=q_offset, dtype=dtype
        )

    def init_carry(self, batch_size: int, dim: int, dtype) -> REMState:
        """The empty REM state. ring [B, H, P, 2, D]; phase [B]"""
        return init_rem_state(self.config, (batch_size,), dim, dtype)

    def __call__(
        self, attended: Array, values: Array, mask: Array | None, carry: REMState
    ) -> tuple[Array, REMState]:
        """Mixes ``P V`` into the attention output, eq. (4).

        Args:
          attended: the heads' attention outputs. [B, H, T, D]
          values: the heads' values. [B, H, T, D]
          mask: True = token present; absent tokens do not advance the lags. [B, T]
          carry: the REM state before these tokens.

        Returns:
          ``((1 - g) attended + g P V, carry)`` in ``attended``'s dtype, ``g = sigmoid(mu)``.
        """
        recurrent, carry = rem_apply(self.config, self.params(), values, mask, initial_state=carry)
        acc = accumulation_dtype(attended.dtype)
        g = self.gate(acc)
        mixed = (1 - g) * attended.astype(acc) + g * recurrent.astype(acc)
        return mixed.astype(attended.dtype), carry


# ----------------------------------------------------------------------------------------
# The interface of SPEC 2.2, from one computation


class SequenceModule(nnx.Module):
    """``__call__`` and ``step`` of SPEC 2.2, both from one method, ``forward``.

    A subclass defines ``d_model``, ``init_carry(batch_size, max_len=None)`` and
    ``forward(x, mask, carry, max_len) -> (y, carry)`` on validated inputs, ``carry`` None
    meaning empty. ``step`` is ``forward`` on a sequence of one token.
    """

    def __call__(
        self,
        x: Array,
        mask: Array | None = None,
        carry=None,
        return_carry: bool = False,
        max_len: int | None = None,
    ):
        """Runs the whole sequence at once, optionally continuing or returning a carry.

        Args:
          x: inputs. [B, T, d]
          mask: True = valid token; a masked token's content never reaches a valid output.
            [B, T]
          carry: the carry of earlier tokens (a prefill continues it), or None for empty.
          return_carry: also return the carry after the last token.
          max_len: with ``carry=None``, the KV cache capacity of the returned carry
            (Transformer; default ``2 T``); ignored by Aaren.

        Returns:
          ``y`` [B, T, d], or ``(y, carry)`` when ``return_carry``.
        """
        x, mask = check_inputs(x, mask, self.d_model)
        if carry is not None or return_carry:
            self._check_streamable()
        y, carry = self.forward(x, mask, carry, max_len)
        return (y, carry) if return_carry else y

    def _check_streamable(self) -> None:
        if not getattr(self, "causal", True):
            raise ValueError(
                f"{type(self).__name__}(causal=False) has no carry: every position attends over "
                "the whole sequence, so it cannot continue or stream; call it on the whole "
                "sequence without carry/return_carry, or build it with causal=True"
            )

    def step(self, carry, x_t: Array, mask_t: Array | None = None):
        """Advances by one token: ``__call__`` on a sequence of length 1.

        Args:
          carry: the carry so far (from ``init_carry`` or a prefill).
          x_t: this token. [B, d]
          mask_t: True = valid; a masked token changes no state. [B]

        Returns:
          ``(carry, y_t)`` with ``y_t`` [B, d].
        """
        x_t, mask_t = check_inputs(x_t, mask_t, self.d_model, name="x_t", ndim=2)
        self._check_streamable()
        if carry is None:
            raise TypeError("step needs a carry: pass init_carry(...) or a prefill's carry")
        y, carry = self.forward(x_t[:, None], None if mask_t is None else mask_t[:, None], carry)
        return carry, y[:, 0]


# ----------------------------------------------------------------------------------------
# What both layers share: projections, RSA, the sequence computation and its one-token step


class _Attention(SequenceModule):
    """Four projections, optional RSA; subclasses supply ``_mix`` and ``_init_own_carry``."""

    def __init__(
        self,
        d_model: int,
        num_heads: int,
        *,
        dtype,
        param_dtype,
        kernel_init,
        rsa: REMConfig | None,
        causal: bool,
        rngs: nnx.Rngs,
    ):
        self.head_dim = check_heads(d_model, num_heads)
        if not causal and rsa is not None:
            raise ValueError(
                "rsa needs causal=True: the REM recurrence runs forward in time (the RSA "
                "paper's unmasked, two-sided REMs are not implemented)"
            )
        self.d_model, self.num_heads, self.causal = d_model, num_heads, bool(causal)
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

    @property
    def state_dtype(self) -> jnp.dtype:
        """float32 whatever the compute dtype (float64 stays float64): SPEC 1.2."""
        return accumulation_dtype(self.dtype if self.dtype is not None else self.param_dtype)

    def init_carry(self, batch_size: int, max_len: int | None = None):
        """The empty carry (see the subclass); with RSA an ``RSAState`` with an empty REM."""
        batch = check_batch_size(batch_size)
        self._check_streamable()
        own = self._init_own_carry(batch, max_len)
        if self.rsa is None:
            return own
        return RSAState(own, self.rsa.init_carry(batch, self.head_dim, self.state_dtype))

    def _heads(self, y: Array) -> Array:
        """[B, T, d] -> [B, H, T, D]."""
        batch, length, _ = y.shape
        return jnp.swapaxes(y.reshape(batch, length, self.num_heads, self.head_dim), 1, 2)

    def forward(self, x: Array, mask: Array | None, carry, max_len: int | None = None):
        """The one computation, on validated inputs: ``(y [B, T, d], carry)``."""
        batch, length, _ = x.shape
        x = zero_masked(x, mask)
        if carry is None:
            own, rem = None, None
            if self.rsa is not None:
                rem = self.rsa.init_carry(batch, self.head_dim, self.state_dtype)
        else:
            own, rem = self._split_carry(carry, batch)
        values = self._heads(per_token(self.v_proj, x))
        if self.causal:
            out, own = self._mix(x, values, mask, own, max_len)  # [B, H, T, D]
        else:
            valid = jnp.ones((batch, length), jnp.bool_) if mask is None else mask
            # every query sees every valid token; masked inputs were zeroed (finite values)
            keys = (self._heads(per_token(self.k_proj, x)), values, valid[:, None, None, :])
            out = jnp.broadcast_to(
                masked_attention(self._queries(x), [keys], guarded=(False,)), values.shape
            )
        if self.rsa is not None:
            out, rem = self.rsa(out, values, mask, rem)
            own = RSAState(own, rem)
        y = per_token(self.o_proj, jnp.swapaxes(out, 1, 2).reshape(batch, length, self.d_model))
        return y, own

    def _split_carry(self, carry, batch: int):
        """``(own carry, REM state or None)``, checked against this layer."""
        if self.rsa is None:
            own, rem = carry, None
        elif isinstance(carry, RSAState):
            own, rem = carry
        else:
            raise TypeError(
                f"an RSA layer's carry is an RSAState (from init_carry), got {type(carry).__name__}"
            )
        self._check_own_carry(own, batch)
        return own, rem


# ----------------------------------------------------------------------------------------
# Aaren


class AarenAttention(_Attention):
    """Multi-head attention of a learned query over every prefix: an RNN (SPEC 1.4).

    ``q = W_q q0 + b_q`` with a learned ``q0 in R^d`` and the same ``W_q`` a Transformer has;
    ``K = x W_k + b_k``, ``V = x W_v + b_v``, split into ``H`` heads of size ``D = d / H``;
    per head ``o_t = prefix_attention(<q_h, k_h,i> / sqrt(D), v_h,i)[t]``; ``y = O W_o + b_o``.
    The scan state is float32 whatever ``dtype`` is; outputs come back in the compute dtype.
    The carry is a compensated ``AttentionState`` (``init_state(..., compensated=True)``),
    so a stream of millions of tokens stays at float32 round-off.

    RSA-Aaren (``rsa=REMConfig(...)``, SPEC 1.6): per head
    ``o_t = (1 - sigmoid(mu)) aaren_t + sigmoid(mu) rem_t`` (``RecurrenceEncoding``), so
    streaming stays O(1) in memory (O(p) for dilation ``p``); the carry is an ``RSAState``.

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
        causal: bool = True,
        rngs: nnx.Rngs,
    ):
        """Builds the layer.

        Args:
          d_model: model width ``d``.
          num_heads: number of heads ``H``; must divide ``d``.
          dtype: compute dtype of the projections (None: from inputs and params).
          param_dtype: dtype of the parameters.
          method: ``prefix_attention`` method for the parallel pass (one of ``METHODS``).
          chunk_size: ``prefix_attention`` chunk size.
          kernel_init: initialiser of the four projection kernels.
          query_init: initialiser of ``q0``; unit normal so that ``W_q q0`` has unit-scale
            entries under LeCun-normal ``W_q``, like a Transformer's queries.
          rsa: a ``REMConfig`` to gate REMs into the heads (RSA-Aaren), or None (plain).
          causal: False for a bidirectional Aaren: every position gets the attention of the
            learned query over every valid token (the forward prefix state at t combined
            with the reverse suffix state after t is the whole sequence's state, so it is
            one softmax, computed once); no carry, no ``step``; not with ``rsa``.
          rngs: parameter RNGs.

        Raises:
          ValueError: an unknown ``method``, a bad ``chunk_size`` or head count.
        """
        if method not in METHODS:
            raise ValueError(f"method must be one of {METHODS}, got {method!r}")
        check_chunk_size(chunk_size)
        super().__init__(
            d_model,
            num_heads,
            dtype=dtype,
            param_dtype=param_dtype,
            kernel_init=kernel_init,
            rsa=rsa,
            causal=causal,
            rngs=rngs,
        )
        self.method, self.chunk_size = method, chunk_size
        self.q0 = nnx.Param(query_init(rngs.params(), (d_model,), param_dtype))

    def _init_own_carry(self, batch: int, max_len: int | None) -> AttentionState:
        """Aaren's state: m, u [B, H]; w [B, H, D] and their compensation. No capacity."""
        del max_len
        shape = (batch, self.num_heads)
        return init_state(shape, self.head_dim, self.state_dtype, compensated=True)

    def _check_own_carry(self, carry, batch: int) -> None:
        if not isinstance(carry, AttentionState):
            raise TypeError(
                f"carry must be an AttentionState (from init_carry), got {type(carry).__name__}"
            )
        want = (batch, self.num_heads, self.head_dim)
        if tuple(carry.w.shape) != want:
            raise ValueError(
                f"carry.w has shape {tuple(carry.w.shape)}, this layer needs [B, H, D] = {want}"
            )

    def _query(self) -> Array:
        """The learned query per head, scaled by ``1/sqrt(D)``, in the state dtype. [H, D]"""
        q = self.q_proj(self.q0[...]).astype(self.state_dtype)
        # Scaling the H*D query once is cheaper than scaling B*H*T scores.
        return q.reshape(self.num_heads, self.head_dim) / math.sqrt(self.head_dim)

    def _queries(self, x: Array) -> Array:
        """[B, H, 1, D]: the one query, for the bidirectional softmax."""
        shape = (x.shape[0], self.num_heads, 1, self.head_dim)
        return jnp.broadcast_to(self._query()[None, :, None], shape)

    def _scores(self, x: Array) -> Array:
        """``<k_t,h, q_h>`` for every token and head, in the state dtype. [B, T, H]

        The one query is folded into the key projection, ``x_t (W_k q)_h + <b_k, q>_h``, so the
        ``[B, T, d]`` keys are never formed: a ``d x H`` matmul instead of ``d x d`` and a
        reduction (13x faster forward on CPU at T = 16,384, d = 256:
        ``benchmarks/scan_profile.py``, ``scores_from_keys`` against ``scores_folded``).
        """
        acc = self.state_dtype
        q = self._query()
        kernel = self.k_proj.kernel[...].astype(acc)
        folded = jnp.einsum("ihd,hd->ih", kernel.reshape(-1, *q.shape), q)  # [d, H]
        scores = per_token(lambda tokens: jnp.matmul(tokens, folded), x.astype(acc))
        if self.k_proj.bias is not None:
            bias = self.k_proj.bias[...].astype(acc).reshape(q.shape)
            scores = scores + jnp.sum(bias * q, axis=-1)[None, None]
        return scores

    def _mix(self, x: Array, values: Array, mask: Array | None, carry, max_len):
        del max_len
        if carry is None:
            carry = self._init_own_carry(x.shape[0], None)
        scores = jnp.swapaxes(self._scores(x), 1, 2)  # [B, H, T]
        head_mask = None if mask is None else jnp.broadcast_to(mask[:, None], scores.shape)
        # validated at the layer's boundary: the core runs unchecked
        return checked_prefix_attention(
            scores, values, head_mask, carry, self.method, check_chunk_size(self.chunk_size)
        )


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
      length: number of slots written so far, the next write position; past ``C`` the
        layer's outputs are NaN. [] int32
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
    Inside a trace the position is not known, so this checks nothing there; the layer then
    returns NaN outputs for an overflowing write (never a plausible number), and the
    jitted helpers (``make_step_fn``, ``stream``) call this on the host before each call.

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


def masked_attention(q: Array, segments, guarded: tuple[bool, ...]) -> Array:
    """Softmax attention with boolean masks over one or more key segments: the one softmax.

    One softmax (float32, or float64 for float64 inputs) over the keys of every segment,
    without concatenating them: a cached call attends over the cache as it was before this
    call's write and over the new tokens apart. Masked scores are excluded before ``exp``;
    a row with no valid key gives exactly 0; a NaN score or value at an attended key makes
    its row NaN. In a ``guarded`` segment, non-finite values at keys a row does not attend
    (a causal pass's later tokens) are kept out of the product (``0 * nan`` would leak
    them); the cache segment needs no guard (it holds earlier tokens only, masked ones
    zeroed on entry), which saves a pass over it per decoded token.

    Args:
      q: queries, pre-scaled by ``1/sqrt(D)``. [B, H, Tq, D]
      segments: ``(k, v, attend)`` tuples: keys and values [B, H, S_i, D], True where query
        t may attend key s [B, 1, Tq, S_i].
      guarded: per segment, whether to guard its values.

    Returns:
      Outputs in the first segment's ``v`` dtype. [B, H, Tq, D]
    """
    out_dtype = segments[0][1].dtype
    acc = accumulation_dtype(out_dtype)
    scores, values = [], []
    for (k, v, attend), guard in zip(segments, guarded, strict=True):
        s = jnp.einsum("bhtd,bhsd->bhts", q, k, preferred_element_type=acc)
        if guard:
            finite = jnp.isfinite(v)
            poisoned = jnp.logical_not(jnp.all(finite, axis=-1))[:, :, None, :]  # [B, H, 1, S]
            s = jnp.where(poisoned, jnp.nan, s)
            v = jnp.where(finite, v, jnp.zeros((), v.dtype))
        scores.append(jnp.where(attend, s, -jnp.inf))
        values.append(v)
    top = scores[0].max(axis=-1, keepdims=True)
    for s in scores[1:]:
        top = jnp.maximum(top, s.max(axis=-1, keepdims=True))
    # A row with every key masked has top = -inf: use 0 so exp gives 0, not NaN.
    top = jax.lax.stop_gradient(jnp.where(jnp.isneginf(top), jnp.zeros_like(top), top))
    weights = [jnp.exp(s - top) for s in scores]
    denom = sum(jnp.sum(w, axis=-1, keepdims=True) for w in weights)
    # Normalise the [B, H, Tq, D] output rather than the [B, H, Tq, S] weights.
    out = sum(
        jnp.einsum("bhts,bhsd->bhtd", w.astype(v.dtype), v, preferred_element_type=acc)
        for w, v in zip(weights, values, strict=True)
    )
    out = out / jnp.where(denom != 0, denom, jnp.ones_like(denom))
    return out.astype(out_dtype)


def _after(x: Array, y: Array) -> Array:
    """``x`` unchanged, but data-dependent on ``y``, so that XLA computes ``y`` first.

    A cached call reads the cache, then writes the new tokens into it. Unless the write
    depends on the attention's output, XLA (CPU) copies the whole cache around the update
    (at batch 1 four copies per layer and step, 20x the step at C = 16384; MEASUREMENTS).
    ``jax.lax.optimization_barrier`` over ``(keys, values, out)``, or over the cache and
    ``out``, was measured to leave those copies in place (four per layer, from the compiled
    HLO); this dependency removes them all. ``nan_to_num(0 * sum(y))`` is exactly 0, also
    for a non-finite ``y``, and XLA cannot fold it away.
    """
    zero = jnp.nan_to_num(jnp.zeros((), jnp.float32) * jnp.sum(y, dtype=jnp.float32))
    return x + zero.astype(x.dtype)


class CausalSelfAttention(_Attention):
    """Causal multi-head self-attention with a fixed-capacity KV cache (SPEC 1.5).

    One computation for every call: the new tokens' queries attend, through one masked
    softmax (``masked_attention``), over the cache as it was (if any) and causally over
    the new tokens; then the new keys and values are written after the cache's ``length``.
    A decode step is that with one token, O(C) per token whatever the current length, and
    compiles once for all positions. Each call reads the cache's keys once and values once.
    Query rows with no valid key (e.g. a left-padding position) output exactly 0, like
    Aaren's. Without a carry, a returned carry is a cache of capacity ``max_len`` (default
    ``2 T``), so ``step`` can continue from it.

    Overflow: writing past the capacity raises when the position is known (eager) and
    makes every output of that call NaN under a trace (``jit``, ``lax.scan``).

    RSA (``rsa=REMConfig(...)``): per head
    ``(1 - sigmoid(mu)) softmax(QK^T / sqrt(D) + causal mask) V + sigmoid(mu) P V`` with
    ``P V`` from the REM recurrence (``RecurrenceEncoding``), as in RSA-Aaren: no truncation
    at ``K``, padding tokens absent from the lags; the carry is an ``RSAState``.

    Attributes:
      q_proj, k_proj, v_proj, o_proj: ``nnx.Linear(d, d)`` with biases.
      rsa: the ``RecurrenceEncoding`` (gate and REM parameters), or None.
      num_heads, head_dim, d_model: the sizes.

    Example:
      >>> layer = CausalSelfAttention(16, 2, rngs=nnx.Rngs(0))
      >>> x = jnp.ones((3, 5, 16))
      >>> y, cache = layer(x, return_carry=True)  # a cache of capacity 2 T = 10
      >>> cache, y_t = layer.step(cache, x[:, 0])
      >>> int(cache.length), cache.capacity
      (6, 10)
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
        causal: bool = True,
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
          causal: False for bidirectional attention: every position attends over every
            valid token of the sequence (no carry, no ``step``; not with ``rsa``).
          rngs: parameter RNGs.
        """
        super().__init__(
            d_model,
            num_heads,
            dtype=dtype,
            param_dtype=param_dtype,
            kernel_init=kernel_init,
            rsa=rsa,
            causal=causal,
            rngs=rngs,
        )

    def _init_own_carry(self, batch: int, max_len: int | None) -> KVCache:
        """An empty cache: k, v [B, H, C, D], valid [B, C] all False, length 0."""
        if max_len is None:
            raise ValueError(
                "a KV cache needs a capacity: pass max_len >= 1 to init_carry, got None"
            )
        (capacity,) = as_shape("init_carry: max_len", (max_len,))
        if capacity < 1:
            raise ValueError(f"init_carry: max_len must be >= 1, got {max_len!r}")
        dtype = jnp.dtype(self.dtype if self.dtype is not None else self.param_dtype)
        shape = (batch, self.num_heads, capacity, self.head_dim)
        return KVCache(
            k=jnp.zeros(shape, dtype),
            v=jnp.zeros(shape, dtype),
            valid=jnp.zeros((batch, capacity), jnp.bool_),
            length=jnp.zeros((), jnp.int32),
        )

    def _check_own_carry(self, carry, batch: int) -> None:
        if not isinstance(carry, KVCache):
            raise TypeError(f"carry must be a KVCache, got {type(carry).__name__}")
        want = (batch, self.num_heads, carry.capacity, self.head_dim)
        if carry.k.shape != want or carry.v.shape != want:
            raise ValueError(
                f"carry.k / carry.v must have shape [B, H, C, D] = {want}, got "
                f"{carry.k.shape} / {carry.v.shape}"
            )

    def _queries(self, x: Array) -> Array:
        """[B, H, T, D], scaled by ``1/sqrt(D)``."""
        scale = jnp.asarray(1.0 / math.sqrt(self.head_dim), x.dtype)
        return self._heads(per_token(self.q_proj, x)) * scale

    def _mix(self, x: Array, values: Array, mask: Array | None, cache, max_len):
        batch, length, _ = x.shape
        q = self._queries(x)
        keys = self._heads(per_token(self.k_proj, x))
        valid = jnp.ones((batch, length), jnp.bool_) if mask is None else mask
        causal = jnp.tril(jnp.ones((length, length), jnp.bool_))[None, None]
        new = (keys, values, causal & valid[:, None, None, :])  # [B, 1, T, T]
        if cache is None:  # no earlier tokens; the cache returned has room to continue
            out = masked_attention(q, [new], guarded=(True,))
            capacity = 2 * length if max_len is None else max_len
            if capacity < length:
                raise ValueError(f"max_len={max_len} cannot hold the T = {length} tokens of x")
            cache = self._init_own_carry(batch, capacity)
        else:
            check_capacity(cache, length)  # eager: names the position
            if length > cache.capacity:  # a static shape: an error even under a trace
                raise ValueError(
                    f"KV cache overflow: capacity {cache.capacity}, cannot write T = {length} "
                    "tokens; call init_carry with a larger max_len"
                )
            # The cache's valid slots all hold earlier tokens: every new query sees them.
            old = (cache.k, cache.v, cache.valid[:, None, None, :])
            new = (keys.astype(cache.k.dtype), values.astype(cache.v.dtype), new[2])
            out = masked_attention(q, [old, new], guarded=(False, True))  # [B, H, T, D]
        keys, values = keys.astype(cache.k.dtype), values.astype(cache.v.dtype)
        keys, values = _after(keys, out), _after(values, out)
        start = cache.length
        zero = jnp.zeros((), start.dtype)  # indices of one integer type, also under x64
        new_cache = KVCache(
            k=jax.lax.dynamic_update_slice(cache.k, keys, (zero, zero, start, zero)),
            v=jax.lax.dynamic_update_slice(cache.v, values, (zero, zero, start, zero)),
            valid=jax.lax.dynamic_update_slice(cache.valid, valid, (zero, start)),
            length=start + jnp.asarray(length, start.dtype),
        )
        # Past the capacity the write was clamped onto earlier slots: never a plausible number.
        fits = new_cache.length <= cache.capacity
        return jnp.where(fits, out, jnp.nan), new_cache
