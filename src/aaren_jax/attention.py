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
# Aaren


class AarenAttention(nnx.Module):
    """Multi-head attention of a learned query over every prefix: an RNN (SPEC 1.4).

    ``q = W_q q0 + b_q`` with a learned ``q0 in R^d`` and the same ``W_q`` a Transformer has;
    ``K = x W_k + b_k``, ``V = x W_v + b_v``, split into ``H`` heads of size ``D = d / H``;
    per head ``o_t = prefix_attention(<q_h, k_h,i> / sqrt(D), v_h,i)[t]``; ``y = O W_o + b_o``.
    The scan state is float32 whatever ``dtype`` is; outputs come back in the compute dtype.

    Attributes:
      q0: the learned query. [d]
      q_proj, k_proj, v_proj, o_proj: ``nnx.Linear(d, d)`` with biases.
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

    def _query(self) -> Array:
        """The per-head query, pre-scaled by ``1/sqrt(D)``, in the state dtype. [H, D]"""
        acc = _state_dtype(self.dtype, self.param_dtype)
        q = self.q_proj(self.q0[...]).astype(acc)
        # Scaling the H*D query once is cheaper than scaling B*H*T scores.
        return q.reshape(self.num_heads, self.head_dim) / math.sqrt(self.head_dim)

    def init_carry(self, batch_size: int, max_len: int | None = None) -> AttentionState:
        """The empty state: attention over no token.

        Args:
          batch_size: ``B``.
          max_len: ignored (an Aaren carry has no capacity); accepted for one interface.

        Returns:
          ``AttentionState`` with m, u [B, H] and w [B, H, D] in float32.
        """
        del max_len
        return init_state(
            (int(batch_size), self.num_heads),
            self.head_dim,
            _state_dtype(self.dtype, self.param_dtype),
        )

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
            m, u [B, H]; w [B, H, D]
          return_carry: also return the state after the last token.

        Returns:
          ``y`` [B, T, d], or ``(y, carry)`` when ``return_carry``.
        """
        x, mask = check_inputs(x, mask, self.d_model)
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
        y = self.o_proj(jnp.swapaxes(out, 1, 2).reshape(batch, length, self.d_model))
        return (y, state) if return_carry else y

    def step(
        self, carry: AttentionState, x_t: Array, mask_t: Array | None = None
    ) -> tuple[AttentionState, Array]:
        """Advances by one token in O(1) time and memory.

        Args:
          carry: the state so far. m, u [B, H]; w [B, H, D]
          x_t: this token. [B, d]
          mask_t: True = valid; a masked token leaves the state unchanged. [B]

        Returns:
          ``(carry, y_t)`` with ``y_t`` [B, d].
        """
        x_t, mask_t = check_inputs(x_t, mask_t, self.d_model, name="x_t", ndim=2)
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


def _masked_attention(q: Array, k: Array, v: Array, mask: Array) -> Array:
    """Softmax attention with a boolean key mask; rows with no valid key give exactly 0.

    Softmax in float32; masked scores are excluded before ``exp`` (no NaN, no leak).

    Args:
      q: queries, pre-scaled. [B, H, Tq, D]
      k: keys. [B, H, S, D]
      v: values. [B, H, S, D]
      mask: True where query t may attend key s. [B, 1, Tq, S]

    Returns:
      Outputs in ``v``'s dtype. [B, H, Tq, D]
    """
    scores = jnp.einsum("bhtd,bhsd->bhts", q, k, preferred_element_type=jnp.float32)
    scores = jnp.where(mask, scores, -jnp.inf)
    top = jnp.max(scores, axis=-1, keepdims=True)
    # A row with every key masked has top = -inf: use 0 so exp gives 0, not NaN.
    top = jax.lax.stop_gradient(jnp.where(jnp.isneginf(top), jnp.zeros_like(top), top))
    weights = jnp.exp(jnp.where(mask, scores - top, -jnp.inf))
    denom = jnp.sum(weights, axis=-1, keepdims=True)
    out = jnp.einsum(
        "bhts,bhsd->bhtd", weights.astype(v.dtype), v, preferred_element_type=jnp.float32
    )
    out = out / jnp.where(denom > 0, denom, jnp.ones_like(denom))
    return out.astype(v.dtype)


class CausalSelfAttention(nnx.Module):
    """Causal multi-head self-attention with a fixed-capacity KV cache (SPEC 1.5).

    The parallel pass uses ``jax.nn.dot_product_attention``. The cache is a ``KVCache``
    ``[B, H, C, D]``; a decode step writes one slot and attends over the whole buffer with a
    validity mask, so it costs O(C) per token whatever the current length, and compiles
    once for all positions (no shape depends on the position). Each layer reads its cache's
    keys once and values once per step. Query rows with no valid key (e.g. a left-padding
    position) output exactly 0, like Aaren's.

    Attributes:
      q_proj, k_proj, v_proj, o_proj: ``nnx.Linear(d, d)`` with biases.
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
        rngs: nnx.Rngs,
    ):
        """Builds the layer.

        Args:
          d_model: model width ``d``.
          num_heads: number of heads ``H``; must divide ``d``.
          dtype: compute dtype (None: from inputs and params); softmax is float32.
          param_dtype: dtype of the parameters.
          kernel_init: initialiser of the four projection kernels.
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
        cache_k = jax.lax.dynamic_update_slice(
            carry.k, jnp.swapaxes(k, 1, 2).astype(carry.k.dtype), (0, 0, start, 0)
        )
        cache_v = jax.lax.dynamic_update_slice(
            carry.v, jnp.swapaxes(v, 1, 2).astype(carry.v.dtype), (0, 0, start, 0)
        )
        cache_valid = jax.lax.dynamic_update_slice(carry.valid, valid, (0, start))
        # Query t sits at slot start + t and sees slots up to it that hold valid tokens.
        slots = jnp.arange(carry.capacity)
        query_slot = start + jnp.arange(length)
        attend = (slots[None, :] <= query_slot[:, None])[None, None] & cache_valid[:, None, None, :]
        qh = jnp.swapaxes(q, 1, 2) * jnp.asarray(scale, q.dtype)
        out = _masked_attention(qh, cache_k, cache_v, attend)  # [B, H, T, D]
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
        cache_k = jax.lax.dynamic_update_slice(carry.k, k, (0, 0, pos, 0))
        cache_v = jax.lax.dynamic_update_slice(carry.v, v, (0, 0, pos, 0))
        cache_valid = jax.lax.dynamic_update_slice(carry.valid, valid_t[:, None], (0, pos))
        # Slots beyond pos are never valid (unwritten), so validity alone is the causal mask.
        attend = cache_valid[:, None, None, :]  # [B, 1, 1, C]
        q = q * jnp.asarray(1.0 / math.sqrt(head_dim), q.dtype)
        out = _masked_attention(q, cache_k, cache_v, attend)  # [B, H, 1, D]
        y = self.o_proj(out.reshape(batch, self.d_model))
        return KVCache(cache_k, cache_v, cache_valid, pos + 1), y
