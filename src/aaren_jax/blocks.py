"""Residual blocks: a token mixer and an MLP, each with LayerNorm and dropout (SPEC 1.4, 1.5).

One block, configured by its token mixer (``Mixer``): ``AarenBlock`` mixes with
``AarenAttention``, ``TransformerBlock`` with ``CausalSelfAttention``; both have the
interface of SPEC 2.2 (``__call__``, ``init_carry``, ``step``), their carry being the
mixer's, and ``step`` is the block's computation on one token.

With ``d = 512``, ``H = 8``, ``d_ff = 2048`` a ``TransformerBlock`` has 3,152,384
parameters and an ``AarenBlock`` 3,152,896: ``d`` more, the learned query (binding).

Shape notation: ``B`` batch, ``T`` time, ``d`` model width.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from aaren_jax.attention import (
    AarenAttention,
    CausalSelfAttention,
    SequenceModule,
    per_token,
    zero_masked,
)
from aaren_jax.rem_config import REMConfig

Array = jax.Array

NORMS = ("pre", "post")
MIXERS = ("aaren", "transformer")


@dataclasses.dataclass(frozen=True)
class Mixer:
    """The token mixer of a block: which attention, and its options.

    Attributes:
      kind: ``"aaren"`` (``AarenAttention``) or ``"transformer"`` (``CausalSelfAttention``).
      method: ``prefix_attention`` method of Aaren's parallel pass.
      chunk_size: ``prefix_attention`` chunk size (Aaren).
      rsa: a ``REMConfig`` gating REMs into every head (RSA), or None.
      causal: False for a bidirectional mixer: every position attends over the whole
        sequence (no carry, no ``step``; an encoder, e.g. for classification).
    """

    kind: str = "aaren"
    method: str = "auto"
    chunk_size: int | None = None
    rsa: REMConfig | None = None
    causal: bool = True

    def __post_init__(self):
        if self.kind not in MIXERS:
            raise ValueError(f"mixer kind must be one of {MIXERS}, got {self.kind!r}")

    def build(self, d_model: int, num_heads: int, *, dtype, param_dtype, rngs) -> SequenceModule:
        """The attention layer this configuration names."""
        common = dict(
            dtype=dtype, param_dtype=param_dtype, rsa=self.rsa, causal=self.causal, rngs=rngs
        )
        if self.kind == "aaren":
            return AarenAttention(
                d_model, num_heads, method=self.method, chunk_size=self.chunk_size, **common
            )
        return CausalSelfAttention(d_model, num_heads, **common)


class Block(SequenceModule):
    """A residual block around any ``Mixer``: attention and an MLP, LayerNorm, dropout.

    Pre-norm (default): ``x + Drop(Attn(LN1(x)))`` then ``x + Drop(MLP(LN2(x)))``.
    Post-norm: ``LN1(x + Drop(Attn(x)))`` then ``LN2(x + Drop(MLP(x)))``.

    Attributes:
      attention: the mixer's attention layer.
      norm1, norm2: the LayerNorms before (pre) or after (post) each branch.
      mlp_in, mlp_out: the MLP, ``d -> d_ff -> d``.
      dropout: residual dropout; follows ``model.train()`` / ``model.eval()``.
    """

    def __init__(
        self,
        mixer: Mixer,
        d_model: int,
        num_heads: int,
        d_ff: int,
        *,
        dropout: float = 0.0,
        norm: str = "pre",
        activation: Callable[[Array], Array] = nnx.gelu,
        dtype=None,
        param_dtype=jnp.float32,
        rngs: nnx.Rngs,
    ):
        """Builds the block.

        Args:
          mixer: the token mixer.
          d_model: model width ``d``.
          num_heads: heads ``H``; must divide ``d``.
          d_ff: MLP hidden width.
          dropout: residual dropout rate, in [0, 1).
          norm: ``"pre"`` or ``"post"`` LayerNorm.
          activation: the MLP's nonlinearity (GELU).
          dtype: compute dtype (None: from inputs and params); attention state and softmax
            are float32.
          param_dtype: parameter dtype.
          rngs: parameter and dropout RNGs.

        Raises:
          ValueError: an unknown norm, a dropout outside [0, 1), a non-positive ``d_ff``.
        """
        if norm not in NORMS:
            raise ValueError(f"norm must be one of {NORMS}, got {norm!r}")
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {dropout}")
        if d_ff < 1:
            raise ValueError(f"d_ff must be positive, got {d_ff}")
        self.attention = mixer.build(
            d_model, num_heads, dtype=dtype, param_dtype=param_dtype, rngs=rngs
        )
        self.d_model, self.d_ff, self.norm = d_model, d_ff, norm
        self.causal = mixer.causal
        self.activation = activation
        self.norm1 = nnx.LayerNorm(d_model, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.norm2 = nnx.LayerNorm(d_model, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.mlp_in = nnx.Linear(d_model, d_ff, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.mlp_out = nnx.Linear(d_ff, d_model, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        # Residual dropout on both branches (Vaswani et al.).
        self.dropout = nnx.Dropout(dropout, rngs=rngs)

    def init_carry(self, batch_size: int, max_len: int | None = None):
        """The attention layer's empty carry (see its ``init_carry``)."""
        return self.attention.init_carry(batch_size, max_len)

    def forward(self, x: Array, mask: Array | None, carry, max_len: int | None = None):
        """The block on validated inputs: ``(y [B, T, d], carry)``."""
        x = zero_masked(x, mask)
        pre = self.norm == "pre"
        norm1, norm2 = (functools.partial(per_token, norm) for norm in (self.norm1, self.norm2))
        h, carry = self.attention.forward(norm1(x) if pre else x, mask, carry, max_len)
        x = x + self.dropout(h)
        if not pre:
            x = norm1(x)
        h = norm2(x) if pre else x
        x = x + self.dropout(per_token(self._mlp, h))
        if not pre:
            x = norm2(x)
        return x, carry

    def _mlp(self, h: Array) -> Array:
        """The MLP on tokens: ``mlp_out(activation(mlp_in(h)))``. [N, d] -> [N, d]"""
        return self.mlp_out(self.activation(self.mlp_in(h)))


class AarenBlock(Block):
    """An Aaren block: ``AarenAttention`` and an MLP (``Block`` with ``Mixer("aaren")``).

    Its carry is one compensated ``AttentionState`` (m, u [B, H]; w [B, H, D]) or, with
    RSA, an ``RSAState``: constant in size.

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
        method: str = "auto",
        chunk_size: int | None = None,
        rsa: REMConfig | None = None,
        causal: bool = True,
        **options,
    ):
        """Builds the block: ``method``, ``chunk_size``, ``rsa``, ``causal`` as in ``Mixer``; the
        other options (``dropout``, ``norm``, ``activation``, ``dtype``, ``param_dtype``,
        ``rngs``) as in ``Block``."""
        mixer = Mixer("aaren", method=method, chunk_size=chunk_size, rsa=rsa, causal=causal)
        super().__init__(mixer, d_model, num_heads, d_ff, **options)


class TransformerBlock(Block):
    """The baseline block: ``CausalSelfAttention`` and an MLP (``Mixer("transformer")``).

    Its carry is one ``KVCache`` (k, v [B, H, C, D]; valid [B, C]; length []) or, with RSA,
    an ``RSAState``.

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
        rsa: REMConfig | None = None,
        causal: bool = True,
        **options,
    ):
        """Builds the block: ``rsa``, ``causal`` as in ``Mixer``; the other options as in
        ``Block``."""
        mixer = Mixer("transformer", rsa=rsa, causal=causal)
        super().__init__(mixer, d_model, num_heads, d_ff, **options)
