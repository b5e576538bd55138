"""The model factory: the same causal stack interface (SPEC 2.2) for Aaren and the Transformer."""

from __future__ import annotations

import numpy as np
from flax import nnx

BACKBONES = ("aaren", "transformer", "rsa_aaren", "rsa_transformer")


def sinusoidal_positions(length: int, dim: int) -> np.ndarray:
    """Vaswani et al.'s absolute sinusoidal positions, any length. [T, d] float32

    Channel ``2i`` is ``sin(t / 10000^(2i/d))``, channel ``2i+1`` the cosine of the same.
    """
    pos = np.arange(length)[:, None]
    div = np.exp(np.arange(0, dim, 2) * (-np.log(10000.0) / dim))
    pe = np.zeros((length, dim), np.float32)
    pe[:, 0::2] = np.sin(pos * div)
    pe[:, 1::2] = np.cos(pos * div)[:, : dim // 2]
    return pe


def make_backbone(
    kind: str,
    num_layers: int,
    d_model: int,
    num_heads: int,
    d_ff: int,
    *,
    dropout: float = 0.0,
    norm: str = "pre",
    causal: bool = True,
    rsa=None,
    rngs: nnx.Rngs,
) -> nnx.Module:
    """Builds a stack, ``y = model(x, mask=None)`` with x, y [B, T, d] and mask [B, T].

    Args:
      kind: "aaren" or "transformer" (both get exactly the same hyperparameters), or
        "rsa_aaren" / "rsa_transformer": the same with REM heads gated in.
      num_layers: number of blocks.
      d_model: model width d.
      num_heads: attention heads H (d divisible by H).
      d_ff: MLP hidden width.
      dropout: dropout rate inside the blocks.
      norm: "pre" or "post" LayerNorm.
      causal: False for a bidirectional stack (every position sees the whole sequence).
      rsa: the ``aaren_jax.REMConfig`` of the ``rsa_`` kinds (required there, refused
        elsewhere).
      rngs: parameter and dropout randomness.

    Returns:
      The ``aaren_jax.Aaren`` or ``aaren_jax.Transformer`` module.

    Raises:
      ValueError: for an unknown kind, or ``rsa`` given to a plain kind or missing from an
        ``rsa_`` one.
    """
    try:
        import aaren_jax as aj
    except ImportError:  # an uninstalled checkout: use src/
        from examples.common.paths import ensure_importable

        ensure_importable()
        import aaren_jax as aj

    if kind not in BACKBONES:
        raise ValueError(f"unknown backbone {kind!r}; expected one of {BACKBONES}")
    if kind.startswith("rsa_") != (rsa is not None):
        raise ValueError(
            f"backbone {kind!r}: rsa must be {'a REMConfig' if rsa is None else 'None'}, "
            f"got {rsa!r}"
        )
    cls = aj.Aaren if kind.endswith("aaren") else aj.Transformer
    return cls(
        num_layers,
        d_model,
        num_heads,
        d_ff,
        dropout=dropout,
        norm=norm,
        causal=causal,
        rsa=rsa,
        rngs=rngs,
    )
