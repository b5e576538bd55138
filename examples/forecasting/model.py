"""The forecaster: a causally masked Aaren or Transformer stack with series normalisation."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from examples.common import make_backbone, sinusoidal_positions
from examples.forecasting.configs import ModelConfig


class CausalConvEmbedding(nnx.Module):
    """TSLib's ``TokenEmbedding`` made causal: a kernel-3 conv padded on the left only.

    TSLib pads circularly, which would leak the window's last values into its first tokens.
    """

    def __init__(self, in_features: int, d_model: int, kernel_size: int = 3, *, rngs: nnx.Rngs):
        self.conv = nnx.Conv(
            in_features, d_model, (kernel_size,), padding=((kernel_size - 1, 0),), rngs=rngs
        )

    def __call__(self, x: jax.Array) -> jax.Array:
        """x [B, T, C] -> [B, T, d]."""
        return self.conv(x)


class Forecaster(nnx.Module):
    """Maps an input window [B, L, C] (and its time features) to the next P steps [B, P, C].

    Each window is normalised by its own mean and standard deviation over time (Non-stationary
    Transformer, Liu et al. 2022), embedded per time step (values + time features + positions),
    passed through the causal stack, and the last token's output is projected to the whole
    horizon, which is then de-normalised.

    Attributes:
      backbone: the ``aaren_jax.Aaren`` or ``aaren_jax.Transformer`` stack (with REM heads
        for the rsa_ backbones).
      head: the projection of the last token to ``P x C`` values.
    """

    def __init__(
        self,
        cfg: ModelConfig,
        num_channels: int,
        num_marks: int,
        seq_len: int,
        pred_len: int,
        *,
        rngs: nnx.Rngs,
    ):
        # plain attributes (not the config object) keep the graph definition hashable
        self.instance_norm, self.positional, self.d_model = (
            cfg.instance_norm,
            cfg.positional,
            cfg.d_model,
        )
        self.seq_len, self.pred_len, self.num_channels = seq_len, pred_len, num_channels
        if cfg.value_embedding == "conv":
            self.value_embed = CausalConvEmbedding(num_channels, cfg.d_model, rngs=rngs)
        elif cfg.value_embedding == "linear":
            self.value_embed = nnx.Linear(num_channels, cfg.d_model, rngs=rngs)
        else:
            raise ValueError(f"unknown value_embedding {cfg.value_embedding!r}")
        self.mark_embed = nnx.Linear(num_marks, cfg.d_model, use_bias=False, rngs=rngs)
        self.dropout = nnx.Dropout(cfg.dropout, rngs=rngs)
        self.backbone = make_backbone(
            cfg.backbone,
            cfg.num_layers,
            cfg.d_model,
            cfg.num_heads,
            cfg.d_ff,
            dropout=cfg.dropout,
            norm=cfg.norm,
            rsa=cfg.rem_config(),
            rngs=rngs,
        )
        self.head = nnx.Linear(cfg.d_model, pred_len * num_channels, rngs=rngs)

    def __call__(self, x: jax.Array, x_mark: jax.Array) -> jax.Array:
        """Forecasts the horizon.

        Args:
          x: [B, L, C] scaled input window.
          x_mark: [B, L, F] time features of the input window.

        Returns:
          [B, P, C] forecast in the scaled space.
        """
        if self.instance_norm:
            mean = jnp.mean(x, axis=1, keepdims=True)
            x = x - mean
            std = jnp.sqrt(jnp.var(x, axis=1, keepdims=True) + 1e-5)
            x = x / std
        h = self.value_embed(x) + self.mark_embed(x_mark)
        if self.positional:
            h = h + jnp.asarray(sinusoidal_positions(x.shape[1], self.d_model))[None]
        h = self.backbone(self.dropout(h))
        out = self.head(h[:, -1]).reshape(x.shape[0], self.pred_len, self.num_channels)
        if self.instance_norm:
            out = out * std + mean
        return out
