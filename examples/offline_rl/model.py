"""Decision Transformer (Chen et al. 2021) as CORL's ``dt.py``, and Decision Aaren.

One module, ``DecisionModel``, whose causal stack is ``aaren_jax.Transformer`` (the Decision
Transformer) or ``aaren_jax.Aaren`` (Decision Aaren, the paper's Section 4.1), everything else
equal. As CORL:

* per step ``t`` three tokens, in the order return-to-go ``R_t``, state ``s_t``, action
  ``a_t``, each a linear embedding plus a learned embedding of the absolute timestep ``t``
  (with ``fold_return``, not CORL's: two, the state token plus the return token, so the
  state token's residual carries the return it is conditioned on);
* LayerNorm and dropout on the token sequence, the pre-norm stack (MLP width 4d, GELU,
  dropout 0.1, a final LayerNorm; with ``rsa``, not CORL's, RSA heads: a learned regular
  REM gated into each softmax head), then ``a_t = max_action * tanh(W h)`` read at the state
  token of step ``t``;
* loss: the squared error of the actions, masked outside the episode and averaged over every
  entry (padding included, as CORL's ``(loss * mask).mean()``).

Streaming (``stream_start`` / ``stream_next``): the stack's ``step`` takes one token at a
time, so an episode is fed as ``R_0, s_0 -> a_0``, then ``a_{t-1}, R_t, s_t -> a_t`` (folded:
``s_0 -> a_0``, then ``a_{t-1}, s_t -> a_t``); for Aaren the carry is constant in size over
the whole episode.

Shape notation: ``B`` batch, ``K`` steps, ``S`` observation size, ``A`` action size, ``d``
embedding width, ``n`` tokens per step (3, or 2 folded).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from examples.common import make_backbone
from examples.offline_rl.configs import ModelConfig

Array = jax.Array
_INIT = nnx.initializers.normal(0.02)  # CORL's _init_weights for linear layers and embeddings


class DecisionModel(nnx.Module):
    """The Decision Transformer / Decision Aaren.

    Attributes:
      config: the model configuration.
      timestep_emb, return_emb, state_emb, action_emb: token embeddings.
      emb_norm, emb_drop: LayerNorm and dropout of the embedded sequence.
      backbone: the causal ``aaren_jax`` stack (its final LayerNorm is CORL's ``out_norm``).
      action_head: the linear layer before ``tanh``.
    """

    def __init__(self, config: ModelConfig, state_dim: int, action_dim: int, *, rngs: nnx.Rngs):
        d = config.embedding_dim
        self.config = config
        self.timestep_emb = nnx.Embed(
            config.episode_len + config.seq_len, d, embedding_init=_INIT, rngs=rngs
        )
        lin = lambda n_in, n_out: nnx.Linear(n_in, n_out, kernel_init=_INIT, rngs=rngs)  # noqa: E731
        self.return_emb = lin(1, d)
        self.state_emb = lin(state_dim, d)
        self.action_emb = lin(action_dim, d)
        self.emb_norm = nnx.LayerNorm(d, rngs=rngs)
        self.emb_drop = nnx.Dropout(config.dropout, rngs=rngs)
        self.backbone = make_backbone(
            ("rsa_" if config.rsa else "") + config.backbone,
            config.num_layers,
            d,
            config.num_heads,
            4 * d,
            dropout=config.dropout,
            norm="pre",
            rsa=config.rem_config(),
            rngs=rngs,
        )
        self.action_head = lin(d, action_dim)

    def _time(self, timesteps: Array) -> Array:
        t = jnp.clip(timesteps, 0, self.config.episode_len + self.config.seq_len - 1)
        return self.timestep_emb(t)

    def _token(self, emb: Array) -> Array:
        return self.emb_drop(self.emb_norm(emb))

    def embed_return(self, returns: Array, timesteps: Array) -> Array:
        """Return-to-go tokens: returns [...] (scaled), timesteps [...] -> [..., d]."""
        return self._token(self.return_emb(returns[..., None]) + self._time(timesteps))

    def embed_state(self, states: Array, returns: Array, timesteps: Array) -> Array:
        """State tokens: states [..., S] (normalised), returns [...] (scaled; read only with
        ``fold_return``) -> [..., d].

        Folded, the token is the sum of the state and return tokens, each normalised on its
        own: a return beyond the data's range then moves the token by a bounded amount. (A
        first design normalised the two together; there an out-of-range return swamped the
        state, and both models collapsed beyond the data.)
        """
        token = self._token(self.state_emb(states) + self._time(timesteps))
        if self.config.fold_return:
            token = token + self.embed_return(returns, timesteps)
        return token

    def embed_action(self, actions: Array, timesteps: Array) -> Array:
        """Action tokens: actions [..., A] -> [..., d]."""
        return self._token(self.action_emb(actions) + self._time(timesteps))

    def head(self, h: Array) -> Array:
        """Actions from the stack's outputs at state tokens: [..., d] -> [..., A]."""
        return self.config.max_action * jnp.tanh(self.action_head(h))

    def __call__(
        self,
        states: Array,
        actions: Array,
        returns: Array,
        timesteps: Array,
        mask: Array | None = None,
    ) -> Array:
        """Predicted actions for every step of windows.

        Args:
          states: [B, K, S] normalised states.
          actions: [B, K, A] actions (the one of the predicted step is never seen).
          returns: [B, K] scaled returns-to-go.
          timesteps: [B, K] absolute timesteps.
          mask: [B, K] 1 for steps inside the episode (None: all).

        Returns:
          [B, K, A] the action predicted at each step's state token.
        """
        n = len(self.config.token_kinds)
        token_mask = None
        if mask is not None:
            token_mask = jnp.repeat(mask.astype(bool), n, axis=1)
        h = self.backbone(self.tokens(states, actions, returns, timesteps), mask=token_mask)
        return self.head(h[:, n - 2 :: n])

    def tokens(self, states: Array, actions: Array, returns: Array, timesteps: Array) -> Array:
        """The embedded sequence ``R_0, s_0, a_0, R_1, ...`` (folded: ``s_0, a_0, s_1, ...``):
        [B, K, ...] inputs as in ``__call__`` -> [B, nK, d]."""
        b, k = returns.shape
        per_step = [
            self.embed_state(states, returns, timesteps),
            self.embed_action(actions, timesteps),
        ]
        if not self.config.fold_return:
            per_step.insert(0, self.embed_return(returns, timesteps))
        return jnp.stack(per_step, axis=2).reshape(b, len(per_step) * k, -1)


def loss_fn(model: DecisionModel, batch: dict) -> tuple[Array, dict]:
    """CORL's masked action MSE, averaged over every entry (padding included)."""
    pred = model(batch["states"], batch["actions"], batch["returns"], batch["timesteps"],
                 batch["mask"])  # fmt: skip
    err = (pred - batch["actions"]) ** 2 * batch["mask"][..., None]
    return jnp.mean(err), {}


def eval_fn(model: DecisionModel, batch: dict) -> dict:
    """Sums for ``fit``: ``mse`` (per action entry inside the episode, per window) and ``n``."""
    pred = model(batch["states"], batch["actions"], batch["returns"], batch["timesteps"],
                 batch["mask"])  # fmt: skip
    m = batch["mask"][..., None]
    err = jnp.sum((pred - batch["actions"]) ** 2 * m, axis=(1, 2))
    per_window = err / jnp.maximum(jnp.sum(m, axis=(1, 2)) * pred.shape[-1], 1.0)
    w = batch["weight"]
    return {"mse": jnp.sum(per_window * w), "n": jnp.sum(w)}


def stream_start(
    model: DecisionModel, returns: Array, states: Array, max_len: int | None = None
) -> tuple:
    """Feeds ``R_0, s_0`` (folded: ``s_0``) to an empty carry (eval mode):
    ``(carry, a_0 [B, A])``.

    Args:
      model: the model, in eval mode.
      returns: [B] scaled target returns.
      states: [B, S] normalised first states.
      max_len: the Transformer's KV-cache capacity in tokens (ignored by Aaren).
    """
    b = returns.shape[0]
    t = jnp.zeros((b,), jnp.int32)
    carry = model.backbone.init_carry(b, max_len)
    return _feed_step(model, carry, returns, states, t)


def stream_next(
    model: DecisionModel, carry, prev_actions: Array, returns: Array, states: Array, t: Array
) -> tuple:
    """Feeds ``a_{t-1}, R_t, s_t`` (folded: ``a_{t-1}, s_t``): ``(carry, a_t [B, A])``; ``t``
    [B] the step index (>= 1)."""
    carry, _ = model.backbone.step(carry, model.embed_action(prev_actions, t - 1))
    return _feed_step(model, carry, returns, states, t)


def _feed_step(model: DecisionModel, carry, returns: Array, states: Array, t: Array) -> tuple:
    """Feeds step ``t``'s return (unless folded) and state tokens: ``(carry, a_t [B, A])``."""
    if not model.config.fold_return:
        carry, _ = model.backbone.step(carry, model.embed_return(returns, t))
    carry, h = model.backbone.step(carry, model.embed_state(states, returns, t))
    return carry, model.head(h)
