"""Stacks of blocks: ``Aaren`` and the ``Transformer`` baseline, with one interface (SPEC 2.2).

    y = model(x, mask=None)                                   # x [B, T, d] -> y [B, T, d]
    carry = model.init_carry(batch_size, max_len=None)        # Transformer needs max_len
    y, carry = model(x, mask=None, carry=carry, return_carry=True)   # prefill
    carry, y_t = model.step(carry, x_t, mask_t=None)          # x_t [B, d] -> y_t [B, d]

A stacked Aaren is a stacked RNN: its carry holds one constant-size ``AttentionState`` per
layer, so streaming costs the same at every position. The Transformer's carry holds one
``KVCache`` per layer, of fixed capacity. Either model swaps for the other behind a flag.

The models add no positional encoding: Aaren is position-aware only through its causal
order, and the baseline matches it; users add their own embedding before the stack.

Shape notation: ``B`` batch, ``T`` time, ``d`` model width.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from aaren_jax.attention import KVCache, RSAState, check_inputs
from aaren_jax.blocks import AarenBlock, TransformerBlock
from aaren_jax.rem import REMConfig
from aaren_jax.scan import AttentionState

Array = jax.Array


class AarenCarry(NamedTuple):
    """The streaming state of an ``Aaren`` model: constant in size whatever the length.

    Attributes:
      layers: one ``AttentionState`` per layer (m, u [B, H]; w [B, H, D]; float32), or,
        for RSA-Aaren, one ``RSAState`` per layer (that state and the layer's ``REMState``,
        ring [B, H, P, 2, D] and phase [B]).
    """

    layers: tuple[AttentionState | RSAState, ...]


class TransformerCarry(NamedTuple):
    """The streaming state of a ``Transformer``: one KV cache per layer.

    Attributes:
      layers: one ``KVCache`` per layer (k, v [B, H, C, D]; valid [B, C]; length []).
    """

    layers: tuple[KVCache, ...]


class _Stack(nnx.Module):
    """``L`` blocks and an optional final LayerNorm; subclasses pick the block and carry."""

    _carry_type: type = tuple

    def __init__(self, blocks, d_model: int, *, final_norm: bool, dtype, param_dtype, rngs):
        if not blocks:
            raise ValueError("num_layers must be at least 1")
        self.d_model = d_model
        self.blocks = nnx.List(blocks)
        # For pre-norm the residual stream is never normalised inside the blocks, so a
        # final LayerNorm is the usual choice; post-norm blocks already end in one.
        self.final_norm = (
            nnx.LayerNorm(d_model, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
            if final_norm
            else None
        )

    @property
    def num_layers(self) -> int:
        return len(self.blocks)

    def _finish(self, y: Array) -> Array:
        return self.final_norm(y) if self.final_norm is not None else y

    def _check_carry(self, carry, batch: int) -> None:
        if not isinstance(carry, self._carry_type):
            raise TypeError(
                f"carry must be a {self._carry_type.__name__} (from init_carry), got "
                f"{type(carry).__name__}"
            )
        if len(carry.layers) != self.num_layers:
            raise ValueError(
                f"carry has {len(carry.layers)} layer states, the model has {self.num_layers}"
            )
        carry_batch = jnp.shape(jax.tree.leaves(carry.layers[0])[0])[0]
        if carry_batch != batch:
            raise ValueError(f"carry is for batch size {carry_batch}, the input has batch {batch}")

    def init_carry(self, batch_size: int, max_len: int | None = None):
        """An empty carry: one empty state per layer."""
        return self._carry_type(
            tuple(block.init_carry(batch_size, max_len) for block in self.blocks)
        )

    def __call__(
        self,
        x: Array,
        mask: Array | None = None,
        carry=None,
        return_carry: bool = False,
    ):
        """Runs the whole sequence at once (training, or a prefill).

        Args:
          x: inputs. [B, T, d]
          mask: True = valid token; padding never influences valid tokens. [B, T]
          carry: the carry to continue from (a prefill), or None to start empty.
          return_carry: also return the carry after the last token.

        Returns:
          ``y`` [B, T, d], or ``(y, carry)`` when ``return_carry``.

        Raises:
          TypeError: non-floating ``x``, non-boolean mask, a foreign carry.
          ValueError: shapes of ``x``, mask or carry that do not fit.
        """
        x, mask = check_inputs(x, mask, self.d_model)
        if carry is not None:
            self._check_carry(carry, x.shape[0])
        states = []
        for i, block in enumerate(self.blocks):
            state = None if carry is None else carry.layers[i]
            x, state = block(x, mask, carry=state, return_carry=True)
            states.append(state)
        y = self._finish(x)
        return (y, self._carry_type(tuple(states))) if return_carry else y

    def step(self, carry, x_t: Array, mask_t: Array | None = None):
        """Advances every layer by one token: the body of a ``lax.scan``.

        Args:
          carry: the model's carry.
          x_t: this token. [B, d]
          mask_t: True = valid token; a masked token changes no state. [B]

        Returns:
          ``(carry, y_t)`` with ``y_t`` [B, d].

        Raises:
          ValueError: bad shapes, or a full KV cache (checked when not traced).
        """
        x_t, mask_t = check_inputs(x_t, mask_t, self.d_model, name="x_t", ndim=2)
        self._check_carry(carry, x_t.shape[0])
        states = []
        for block, state in zip(self.blocks, carry.layers, strict=True):
            state, x_t = block.step(state, x_t, mask_t)
            states.append(state)
        return self._carry_type(tuple(states)), self._finish(x_t)


class Aaren(_Stack):
    """A stack of ``AarenBlock``s: attention as a stacked RNN (SPEC 1.4).

    Trains in parallel (a prefix scan per layer and head) and streams one token at a time
    with a carry of constant size (``AarenCarry``), whatever the number of tokens seen.

    Attributes:
      blocks: the ``num_layers`` ``AarenBlock``s.
      final_norm: the final LayerNorm, or None.

    Example:
      >>> model = Aaren(2, 16, 2, 32, rngs=nnx.Rngs(0))
      >>> x = jnp.ones((3, 5, 16))
      >>> y = model(x)
      >>> y, carry = model(x[:, :4], return_carry=True)       # prefill 4 tokens
      >>> carry, y_t = model.step(carry, x[:, 4])             # then stream
      >>> bool(jnp.allclose(y_t, y[:, 4], atol=1e-5))
      True
    """

    _carry_type = AarenCarry

    def __init__(
        self,
        num_layers: int,
        d_model: int,
        num_heads: int,
        d_ff: int,
        *,
        dropout: float = 0.0,
        norm: str = "pre",
        final_norm: bool = True,
        activation: Callable[[Array], Array] = nnx.gelu,
        dtype=None,
        param_dtype=jnp.float32,
        method: str = "auto",
        chunk_size: int | None = None,
        rsa: REMConfig | None = None,
        rngs: nnx.Rngs,
    ):
        """Builds the model.

        Args:
          num_layers: number of blocks ``L``.
          d_model: model width ``d``.
          num_heads: heads ``H``; must divide ``d``.
          d_ff: MLP hidden width.
          dropout: residual dropout rate.
          norm: ``"pre"`` or ``"post"`` LayerNorm in each block.
          final_norm: a LayerNorm after the last block (the usual for pre-norm).
          activation: the MLP's nonlinearity (GELU).
          dtype: compute dtype (None: from inputs and params); scan state is float32.
          param_dtype: parameter dtype.
          method: ``prefix_attention`` method of the parallel pass.
          chunk_size: ``prefix_attention`` chunk size.
          rsa: a ``REMConfig`` for RSA-Aaren: every layer gets a gate ``mu`` and REMs per
            head, ``o_t = (1 - sigmoid(mu)) aaren_t + sigmoid(mu) rem_t``; None is plain.
          rngs: parameter and dropout RNGs.
        """
        blocks = [
            AarenBlock(
                d_model,
                num_heads,
                d_ff,
                dropout=dropout,
                norm=norm,
                activation=activation,
                dtype=dtype,
                param_dtype=param_dtype,
                method=method,
                chunk_size=chunk_size,
                rsa=rsa,
                rngs=rngs,
            )
            for _ in range(num_layers)
        ]
        super().__init__(
            blocks,
            d_model,
            final_norm=final_norm,
            dtype=dtype,
            param_dtype=param_dtype,
            rngs=rngs,
        )

    def init_carry(self, batch_size: int, max_len: int | None = None) -> AarenCarry:
        """The empty carry: one identity ``AttentionState`` per layer.

        Args:
          batch_size: ``B``.
          max_len: ignored: an Aaren carry has no capacity (kept for one interface).

        Returns:
          ``AarenCarry``; per layer m, u [B, H] and w [B, H, D], float32.
        """
        return super().init_carry(batch_size, max_len)


class Transformer(_Stack):
    """The baseline: a stack of ``TransformerBlock``s with causal attention and KV caches.

    Same hyperparameters and interface as ``Aaren``; streaming uses ``TransformerCarry``,
    one fixed-capacity ``KVCache`` per layer. A step costs O(capacity) per layer.

    Attributes:
      blocks: the ``num_layers`` ``TransformerBlock``s.
      final_norm: the final LayerNorm, or None.

    Example:
      >>> model = Transformer(2, 16, 2, 32, rngs=nnx.Rngs(0))
      >>> x = jnp.ones((3, 5, 16))
      >>> carry = model.init_carry(3, max_len=8)
      >>> y, carry = model(x, carry=carry, return_carry=True)   # prefill 5 of 8 slots
      >>> carry, y_t = model.step(carry, x[:, 0])
      >>> y_t.shape
      (3, 16)
    """

    _carry_type = TransformerCarry

    def __init__(
        self,
        num_layers: int,
        d_model: int,
        num_heads: int,
        d_ff: int,
        *,
        dropout: float = 0.0,
        norm: str = "pre",
        final_norm: bool = True,
        activation: Callable[[Array], Array] = nnx.gelu,
        dtype=None,
        param_dtype=jnp.float32,
        rsa: REMConfig | None = None,
        rngs: nnx.Rngs,
    ):
        """Builds the model.

        Args:
          num_layers: number of blocks ``L``.
          d_model: model width ``d``.
          num_heads: heads ``H``; must divide ``d``.
          d_ff: MLP hidden width.
          dropout: residual dropout rate.
          norm: ``"pre"`` or ``"post"`` LayerNorm in each block.
          final_norm: a LayerNorm after the last block (the usual for pre-norm).
          activation: the MLP's nonlinearity (GELU).
          dtype: compute dtype (None: from inputs and params); softmax is float32.
          param_dtype: parameter dtype.
          rsa: a ``REMConfig`` for the RSA-Transformer (Huang et al. eq. (4)): every layer
            gets a gate ``mu`` and REM parameters per head; None is the plain baseline.
          rngs: parameter and dropout RNGs.
        """
        blocks = [
            TransformerBlock(
                d_model,
                num_heads,
                d_ff,
                dropout=dropout,
                norm=norm,
                activation=activation,
                dtype=dtype,
                param_dtype=param_dtype,
                rsa=rsa,
                rngs=rngs,
            )
            for _ in range(num_layers)
        ]
        super().__init__(
            blocks,
            d_model,
            final_norm=final_norm,
            dtype=dtype,
            param_dtype=param_dtype,
            rngs=rngs,
        )

    def init_carry(self, batch_size: int, max_len: int | None = None) -> TransformerCarry:
        """Empty KV caches of capacity ``max_len``, one per layer.

        Args:
          batch_size: ``B``.
          max_len: capacity ``C``: the most tokens (prefill and steps) the carry holds.

        Returns:
          ``TransformerCarry``; per layer k, v [B, H, C, D], valid [B, C], length [].

        Raises:
          ValueError: ``max_len`` missing.
        """
        return super().init_carry(batch_size, max_len)
