"""Residual blocks: attention and an MLP, each with LayerNorm and dropout (SPEC 1.4, 1.5).

``AarenBlock`` and ``TransformerBlock`` differ only in their attention layer; both have
the interface of SPEC 2.2 at block level (``__call__``, ``init_carry``, ``step``), the
carry being that of their attention layer.

With ``d = 512``, ``H = 8``, ``d_ff = 2048`` a ``TransformerBlock`` has 3,152,384
parameters and an ``AarenBlock`` 3,152,896: ``d`` more, the learned query (binding).

Shape notation: ``B`` batch, ``T`` time, ``d`` model width.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from aaren_jax.attention import AarenAttention, CausalSelfAttention, check_inputs
from aaren_jax.rem import REMConfig

Array = jax.Array

NORMS = ("pre", "post")


class _Block(nnx.Module):
    """Shared residual structure; subclasses choose the attention layer."""

    def __init__(
        self,
        attention: nnx.Module,
        d_model: int,
        d_ff: int,
        *,
        dropout: float,
        norm: str,
        activation: Callable[[Array], Array],
        dtype,
        param_dtype,
        rngs: nnx.Rngs,
    ):
        if norm not in NORMS:
            raise ValueError(f"norm must be one of {NORMS}, got {norm!r}")
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {dropout}")
        if d_ff < 1:
            raise ValueError(f"d_ff must be positive, got {d_ff}")
        self.d_model, self.d_ff, self.norm = d_model, d_ff, norm
        self.activation = activation
        self.attention = attention
        self.norm1 = nnx.LayerNorm(d_model, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.norm2 = nnx.LayerNorm(d_model, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.mlp_in = nnx.Linear(d_model, d_ff, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.mlp_out = nnx.Linear(d_ff, d_model, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        # Residual dropout on both branches (Vaswani et al.); follows model.train()/eval().
        self.dropout = nnx.Dropout(dropout, rngs=rngs)

    def _mlp(self, h: Array) -> Array:
        return self.mlp_out(self.activation(self.mlp_in(h)))

    def _residual(self, x: Array, attend: Callable):
        """Applies attention (through ``attend``, which also returns a carry) and the MLP."""
        pre = self.norm == "pre"
        h, carry = attend(self.norm1(x) if pre else x)
        x = x + self.dropout(h)
        if not pre:
            x = self.norm1(x)
        x = x + self.dropout(self._mlp(self.norm2(x) if pre else x))
        if not pre:
            x = self.norm2(x)
        return x, carry

    def init_carry(self, batch_size: int, max_len: int | None = None):
        """The attention layer's empty carry (see its ``init_carry``)."""
        return self.attention.init_carry(batch_size, max_len)

    def __call__(self, x: Array, mask: Array | None = None, carry=None, return_carry=False):
        """Runs the whole sequence at once.

        Args:
          x: inputs. [B, T, d]
          mask: True = valid token. [B, T]
          carry: the attention layer's carry to continue, or None.
          return_carry: also return the attention layer's carry.

        Returns:
          ``y`` [B, T, d], or ``(y, carry)`` when ``return_carry``.
        """
        x, mask = check_inputs(x, mask, self.d_model)
        y, carry = self._residual(
            x, lambda h: self.attention(h, mask, carry=carry, return_carry=True)
        )
        return (y, carry) if return_carry else y

    def step(self, carry, x_t: Array, mask_t: Array | None = None):
        """Advances by one token.

        Args:
          carry: the attention layer's carry.
          x_t: this token. [B, d]
          mask_t: True = valid token. [B]

        Returns:
          ``(carry, y_t)`` with ``y_t`` [B, d].
        """
        x_t, mask_t = check_inputs(x_t, mask_t, self.d_model, name="x_t", ndim=2)

        def attend(h):
            new_carry, out = self.attention.step(carry, h, mask_t)
            return out, new_carry

        y, carry = self._residual(x_t, attend)
        return carry, y


class AarenBlock(_Block):
    """An Aaren block: ``AarenAttention`` and an MLP, residual, LayerNorm, dropout.

    Pre-norm (default): ``x + Drop(Attn(LN1(x)))`` then ``x + Drop(MLP(LN2(x)))``.
    Post-norm: ``LN1(x + Drop(Attn(x)))`` then ``LN2(x + Drop(MLP(x)))``.
    Its carry is one ``AttentionState`` (m, u [B, H]; w [B, H, D]), constant in size.

    Attributes:
      attention: the ``AarenAttention`` layer.
      norm1, norm2: the LayerNorms before (pre) or after (post) each branch.
      mlp_in, mlp_out: the MLP, ``d -> d_ff -> d``.
      dropout: residual dropout.

    Example:
      >>> block = AarenBlock(16, 2, 32, rngs=nnx.Rngs(0))
      >>> x = jnp.ones((2, 5, 16))
      >>> y, carry = block(x, return_carry=True)
      >>> carry, y_t = block.step(carry, x[:, 0])
      >>> y_t.shape
      (2, 16)
    """

    def __init__(
        self,
        d_model: int,
        num_heads: int,
        d_ff: int,
        *,
        dropout: float = 0.0,
        norm: str = "pre",
        activation: Callable[[Array], Array] = nnx.gelu,
        dtype=None,
        param_dtype=jnp.float32,
        method: str = "auto",
        chunk_size: int | None = None,
        rsa: REMConfig | None = None,
        rngs: nnx.Rngs,
    ):
        """Builds the block.

        Args:
          d_model: model width ``d``.
          num_heads: heads ``H``; must divide ``d``.
          d_ff: MLP hidden width.
          dropout: residual dropout rate.
          norm: ``"pre"`` or ``"post"`` LayerNorm.
          activation: the MLP's nonlinearity (GELU).
          dtype: compute dtype (None: from inputs and params); the scan state is float32.
          param_dtype: parameter dtype.
          method: ``prefix_attention`` method of the parallel pass.
          chunk_size: ``prefix_attention`` chunk size.
          rsa: a ``REMConfig`` for RSA-Aaren (REMs gated into each head), or None.
          rngs: parameter and dropout RNGs.
        """
        attention = AarenAttention(
            d_model,
            num_heads,
            dtype=dtype,
            param_dtype=param_dtype,
            method=method,
            chunk_size=chunk_size,
            rsa=rsa,
            rngs=rngs,
        )
        super().__init__(
            attention,
            d_model,
            d_ff,
            dropout=dropout,
            norm=norm,
            activation=activation,
            dtype=dtype,
            param_dtype=param_dtype,
            rngs=rngs,
        )


class TransformerBlock(_Block):
    """The baseline block: ``CausalSelfAttention`` and an MLP, otherwise as ``AarenBlock``.

    Its carry is one ``KVCache`` (k, v [B, H, C, D]; valid [B, C]; length []).

    Attributes:
      attention: the ``CausalSelfAttention`` layer.
      norm1, norm2: the LayerNorms before (pre) or after (post) each branch.
      mlp_in, mlp_out: the MLP, ``d -> d_ff -> d``.
      dropout: residual dropout.

    Example:
      >>> block = TransformerBlock(16, 2, 32, rngs=nnx.Rngs(0))
      >>> x = jnp.ones((2, 5, 16))
      >>> y, cache = block(x, carry=block.init_carry(2, max_len=6), return_carry=True)
      >>> cache, y_t = block.step(cache, x[:, 0])
      >>> y_t.shape
      (2, 16)
    """

    def __init__(
        self,
        d_model: int,
        num_heads: int,
        d_ff: int,
        *,
        dropout: float = 0.0,
        norm: str = "pre",
        activation: Callable[[Array], Array] = nnx.gelu,
        dtype=None,
        param_dtype=jnp.float32,
        rsa: REMConfig | None = None,
        rngs: nnx.Rngs,
    ):
        """Builds the block.

        Args:
          d_model: model width ``d``.
          num_heads: heads ``H``; must divide ``d``.
          d_ff: MLP hidden width.
          dropout: residual dropout rate.
          norm: ``"pre"`` or ``"post"`` LayerNorm.
          activation: the MLP's nonlinearity (GELU).
          dtype: compute dtype (None: from inputs and params); softmax is float32.
          param_dtype: parameter dtype.
          rsa: a ``REMConfig`` for RSA heads (Huang et al. eq. (4)), or None.
          rngs: parameter and dropout RNGs.
        """
        attention = CausalSelfAttention(
            d_model, num_heads, dtype=dtype, param_dtype=param_dtype, rsa=rsa, rngs=rngs
        )
        super().__init__(
            attention,
            d_model,
            d_ff,
            dropout=dropout,
            norm=norm,
            activation=activation,
            dtype=dtype,
            param_dtype=param_dtype,
            rngs=rngs,
        )
