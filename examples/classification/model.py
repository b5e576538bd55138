"""The classifier: a causal Aaren or Transformer stack over padded series, pooled, then linear."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from examples.classification.configs import ModelConfig
from examples.common import make_backbone, sinusoidal_positions
from examples.forecasting.model import CausalConvEmbedding


class Classifier(nnx.Module):
    """Maps a padded series [B, T, C] with its mask [B, T] to class logits [B, K].

    Attributes:
      backbone: the ``aaren_jax.Aaren`` or ``aaren_jax.Transformer`` stack (given the mask).
      head: LayerNorm then a linear map from the pooled d features to K logits.
    """

    def __init__(self, cfg: ModelConfig, num_dims: int, num_classes: int, *, rngs: nnx.Rngs):
        # plain attributes (not the config object) keep the graph definition hashable
        self.pooling, self.positional, self.d_model = cfg.pooling, cfg.positional, cfg.d_model
        if cfg.pooling not in ("last", "mean"):
            raise ValueError(f"unknown pooling {cfg.pooling!r}")
        if cfg.value_embedding == "conv":
            self.value_embed = CausalConvEmbedding(num_dims, cfg.d_model, rngs=rngs)
        elif cfg.value_embedding == "linear":
            self.value_embed = nnx.Linear(num_dims, cfg.d_model, rngs=rngs)
        else:
            raise ValueError(f"unknown value_embedding {cfg.value_embedding!r}")
        self.dropout = nnx.Dropout(cfg.dropout, rngs=rngs)
        self.backbone = make_backbone(
            cfg.backbone,
            cfg.num_layers,
            cfg.d_model,
            cfg.num_heads,
            cfg.d_ff,
            dropout=cfg.dropout,
            norm=cfg.norm,
            causal=cfg.causal,
            rngs=rngs,
        )
        self.head_norm = nnx.LayerNorm(cfg.d_model, rngs=rngs)
        self.head = nnx.Linear(cfg.d_model, num_classes, rngs=rngs)

    def __call__(self, x: jax.Array, mask: jax.Array) -> jax.Array:
        """Class logits.

        Args:
          x: [B, T, C] normalised series, zero where padded.
          mask: [B, T] bool, True at real time steps (a prefix of each row).

        Returns:
          [B, K] logits.
        """
        h = self.value_embed(x)
        if self.positional:
            h = h + jnp.asarray(sinusoidal_positions(x.shape[1], self.d_model))[None]
        h = self.backbone(self.dropout(h), mask=mask)  # [B, T, d]
        if self.pooling == "last":
            last = jnp.maximum(jnp.sum(mask, axis=1) - 1, 0)  # [B]
            pooled = jnp.take_along_axis(h, last[:, None, None], axis=1)[:, 0]
        else:
            w = mask.astype(h.dtype)[..., None]
            pooled = jnp.sum(h * w, axis=1) / jnp.maximum(jnp.sum(w, axis=1), 1.0)
        return self.head(self.dropout(self.head_norm(pooled)))
