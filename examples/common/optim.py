"""AdamW with a warmup-cosine schedule and a weight-decay mask built from parameter paths."""

from __future__ import annotations

import dataclasses

import jax
import optax

# Parameter (or parent module) names that never get weight decay: Aaren's learned query, RSA
# gates and recurrence parameters, norms, biases.
NO_DECAY_NAMES = frozenset(
    {"q0", "bias", "scale", "mu", "gate", "eta", "nu", "theta", "lam", "gamma", "beta"}
)
NO_DECAY_SUBSTRINGS = ("norm", "gate")  # in a parent module's name (also: names "ln*")


@dataclasses.dataclass
class OptimConfig:
    """Optimiser hyperparameters."""

    learning_rate: float = 1e-3  # peak learning rate of the schedule
    warmup_steps: int = 100  # linear warmup from 0 to the peak
    decay_steps: int = 0  # schedule length incl. warmup; 0 = the whole run (epochs x steps)
    end_lr_factor: float = 0.01  # final learning rate as a fraction of the peak
    weight_decay: float = 1e-4  # decoupled (AdamW) weight decay on matrices only
    grad_clip: float = 1.0  # global-norm gradient clipping; 0 disables
    b1: float = 0.9  # Adam first-moment decay
    b2: float = 0.999  # Adam second-moment decay


def _name(key) -> str:
    for attr in ("key", "name", "idx"):
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)


def _decays(path, leaf) -> bool:
    names = [_name(k) for k in path]
    if names and names[-1] == "value":  # nnx.Variable leaves end in .value
        names = names[:-1]
    if getattr(leaf, "ndim", 0) < 2:  # biases, scales, gates, the learned query q0
        return False
    if any(n in NO_DECAY_NAMES for n in names):
        return False
    parents = [n.lower() for n in names[:-1]]
    if any(n.startswith("ln") for n in parents):
        return False
    return not any(s in n for n in parents for s in NO_DECAY_SUBSTRINGS)


def weight_decay_mask(params):
    """A pytree of bools, True where weight decay applies (weight matrices, embeddings).

    Excluded: any leaf of rank < 2 (biases, LayerNorm scales, gates, the learned query ``q0``)
    and anything under a name in ``NO_DECAY_NAMES`` or a module whose name mentions a norm or gate.

    Args:
      params: parameter pytree (an ``nnx.State`` of ``nnx.Param`` or plain arrays).

    Returns:
      A pytree with the structure of ``params`` and bool leaves.
    """
    return jax.tree_util.tree_map_with_path(_decays, params)


def make_schedule(cfg: OptimConfig) -> optax.Schedule:
    """Linear warmup then cosine decay to ``end_lr_factor * learning_rate``."""
    decay_steps = max(cfg.decay_steps, cfg.warmup_steps + 1)
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0,
        peak_value=cfg.learning_rate,
        warmup_steps=cfg.warmup_steps,
        decay_steps=decay_steps,
        end_value=cfg.learning_rate * cfg.end_lr_factor,
    )


_OPTIMIZERS: dict = {}


def make_optimizer(cfg: OptimConfig, params) -> optax.GradientTransformation:
    """Clipping plus AdamW on the schedule, decaying only where ``weight_decay_mask`` says so.

    Equal settings and masks return the same (memoised) transformation, so that jitted steps
    taking it as a static argument compile once per configuration.

    Args:
      cfg: optimiser hyperparameters.
      params: the parameter pytree the optimiser will update (used to build the mask).

    Returns:
      The Optax transformation.
    """
    mask = weight_decay_mask(params)
    leaves, treedef = jax.tree.flatten(mask)
    key = (dataclasses.astuple(cfg), treedef, tuple(leaves))
    if key not in _OPTIMIZERS:
        _OPTIMIZERS[key] = _make_optimizer(cfg, mask)
    return _OPTIMIZERS[key]


def _make_optimizer(cfg: OptimConfig, mask) -> optax.GradientTransformation:
    adamw = optax.adamw(
        make_schedule(cfg), b1=cfg.b1, b2=cfg.b2, weight_decay=cfg.weight_decay, mask=mask
    )
    if cfg.grad_clip and cfg.grad_clip > 0:
        return optax.chain(optax.clip_by_global_norm(cfg.grad_clip), adamw)
    return adamw
