"""Stacks of blocks: ``Aaren`` and the ``Transformer`` baseline, with one interface (SPEC 2.2).

    y = model(x, mask=None)                                   # x [B, T, d] -> y [B, T, d]
    carry = model.init_carry(batch_size, max_len=None)        # Transformer needs max_len
    y, carry = model(x, mask=None, carry=carry, return_carry=True)   # prefill
    carry, y_t = model.step(carry, x_t, mask_t=None)          # x_t [B, d] -> y_t [B, d]

One stack (``Stack``) of ``Block``s around a ``Mixer``; ``Aaren`` and ``Transformer`` are
its public constructors. A stacked Aaren is a stacked RNN: its carry holds one
constant-size state per layer, so streaming costs the same at every position. The
Transformer's carry holds one ``KVCache`` per layer, of fixed capacity; a prefill without
a carry returns caches of capacity ``max_len`` (default ``2 T``) so that ``step`` can
continue. Either model swaps for the other behind a flag.

The models add no positional encoding: Aaren is position-aware only through its causal
order, and the baseline matches it; users add their own embedding before the stack.

Shape notation: ``B`` batch, ``T`` time, ``d`` model width.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
from flax import nnx

from aaren_jax.attention import KVCache, RSAState, SequenceModule, per_token, zero_masked
from aaren_jax.blocks import Block, Mixer
from aaren_jax.rem_config import REMConfig
from aaren_jax.scan import AttentionState

Array = jax.Array


class AarenCarry(NamedTuple):
    """The streaming state of an ``Aaren`` model: constant in size whatever the length.

    Attributes:
      layers: one compensated ``AttentionState`` per layer (m, u [B, H]; w [B, H, D] and
        their rounding errors; float32), or, for RSA-Aaren, one ``RSAState`` per layer
        (that state and the layer's ``REMState``, ring [B, H, P, 2, D] and phase [B]).
    """

    layers: tuple[AttentionState | RSAState, ...]


class TransformerCarry(NamedTuple):
    """The streaming state of a ``Transformer``: one KV cache per layer.

    Attributes:
      layers: one ``KVCache`` per layer (k, v [B, H, C, D]; valid [B, C]; length []), or
        for the RSA-Transformer one ``RSAState`` (that cache and a ``REMState``).
    """

    layers: tuple[KVCache | RSAState, ...]


_CARRY_TYPES = {"aaren": AarenCarry, "transformer": TransformerCarry}


class Stack(SequenceModule):
    """``L`` blocks around one ``Mixer`` and an optional final LayerNorm.

    Attributes:
      blocks: the ``num_layers`` ``Block``s.
      final_norm: the final LayerNorm, or None.
    """

    def __init__(
        self,
        mixer: Mixer,
        num_layers: int,
        d_model: int,
        num_heads: int,
        d_ff: int,
        *,
        final_norm: bool = True,
        rngs: nnx.Rngs,
        **block_options,
    ):
        """Builds the stack.

        Args:
          mixer: the token mixer of every block.
          num_layers: number of blocks ``L``.
          d_model: model width ``d``.
          num_heads: heads ``H``; must divide ``d``.
          d_ff: MLP hidden width.
          final_norm: a LayerNorm after the last block (the usual for pre-norm: the
            residual stream is never normalised inside pre-norm blocks).
          rngs: parameter and dropout RNGs.
          **block_options: ``dropout``, ``norm``, ``activation``, ``dtype``,
            ``param_dtype`` of every ``Block``.

        Raises:
          ValueError: ``num_layers < 1`` and the blocks' own errors.
        """
        if num_layers < 1:
            raise ValueError(f"num_layers must be at least 1, got {num_layers}")
        self.mixer, self.d_model, self.causal = mixer, d_model, mixer.causal
        self.blocks = nnx.List(
            [
                Block(mixer, d_model, num_heads, d_ff, rngs=rngs, **block_options)
                for _ in range(num_layers)
            ]
        )
        dtype = block_options.get("dtype")
        param_dtype = block_options.get("param_dtype", jax.numpy.float32)
        self.final_norm = (
            nnx.LayerNorm(d_model, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
            if final_norm
            else None
        )

    @property
    def num_layers(self) -> int:
        return len(self.blocks)

    @property
    def carry_type(self) -> type:
        return _CARRY_TYPES[self.mixer.kind]

    def init_carry(self, batch_size: int, max_len: int | None = None):
        """An empty carry: one empty state per layer (a ``KVCache`` needs ``max_len``)."""
        return self.carry_type(
            tuple(block.init_carry(batch_size, max_len) for block in self.blocks)
        )

    def _check_carry(self, carry, batch: int) -> None:
        if not isinstance(carry, self.carry_type):
            raise TypeError(
                f"carry must be a {self.carry_type.__name__} (from init_carry), got "
                f"{type(carry).__name__}"
            )
        if len(carry.layers) != self.num_layers:
            raise ValueError(
                f"carry has {len(carry.layers)} layer states, the model has {self.num_layers}"
            )
        carry_batch = jax.numpy.shape(jax.tree.leaves(carry.layers[0])[0])[0]
        if carry_batch != batch:
            raise ValueError(f"carry is for batch size {carry_batch}, the input has batch {batch}")

    def forward(self, x: Array, mask: Array | None, carry, max_len: int | None = None):
        """The stack on validated inputs: ``(y [B, T, d], carry)``."""
        if carry is not None:
            self._check_carry(carry, x.shape[0])
        x = zero_masked(x, mask)
        states = []
        for i, block in enumerate(self.blocks):
            state = None if carry is None else carry.layers[i]
            x, state = block.forward(x, mask, state, max_len)
            states.append(state)
        y = x if self.final_norm is None else per_token(self.final_norm, x)
        return y, self.carry_type(tuple(states))


class Aaren(Stack):
    """A stack of ``AarenBlock``s: attention as a stacked RNN (SPEC 1.4).

    Trains in parallel (a prefix scan per layer and head) and streams one token at a time
    with a carry of constant size (``AarenCarry``), whatever the number of tokens seen.

    Args (of the constructor): ``num_layers, d_model, num_heads, d_ff`` and the keywords
    ``dropout=0.0, norm="pre", final_norm=True, activation=nnx.gelu, dtype=None,
    param_dtype=float32, method="auto", chunk_size=None, rsa=None, causal=True, rngs`` (see
    ``Stack``, ``Block`` and ``Mixer``). ``rsa=REMConfig(...)`` gives RSA-Aaren: every layer
    gets a gate ``mu`` and REMs per head, ``o_t = (1 - sigmoid(mu)) aaren_t + sigmoid(mu)
    rem_t``. ``causal=False`` gives a bidirectional Aaren: every position attends over the
    whole sequence (an encoder; no carry and no ``step``).

    Attributes:
      blocks: the ``num_layers`` ``Block``s.
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

    def __init__(
        self,
        num_layers: int,
        d_model: int,
        num_heads: int,
        d_ff: int,
        *,
        method: str = "auto",
        chunk_size: int | None = None,
        rsa: REMConfig | None = None,
        causal: bool = True,
        **options,
    ):
        mixer = Mixer("aaren", method=method, chunk_size=chunk_size, rsa=rsa, causal=causal)
        super().__init__(mixer, num_layers, d_model, num_heads, d_ff, **options)


class Transformer(Stack):
    """The baseline: a stack of ``TransformerBlock``s with causal attention and KV caches.

    Same hyperparameters and interface as ``Aaren``; streaming uses ``TransformerCarry``,
    one fixed-capacity ``KVCache`` per layer (``init_carry(batch, max_len)``, or a
    prefill's, of capacity ``max_len``, default ``2 T``). A step costs O(capacity) per
    layer. ``rsa=REMConfig(...)`` gives the RSA-Transformer (Huang et al. eq. (4)).

    Attributes:
      blocks: the ``num_layers`` ``Block``s.
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

    def __init__(
        self,
        num_layers: int,
        d_model: int,
        num_heads: int,
        d_ff: int,
        *,
        rsa: REMConfig | None = None,
        causal: bool = True,
        **options,
    ):
        mixer = Mixer("transformer", rsa=rsa, causal=causal)
        super().__init__(mixer, num_layers, d_model, num_heads, d_ff, **options)
