"""Soft Actor-Critic (Haarnoja et al. 2018) in JAX: Flax NNX networks, Optax, jitted updates.

The behaviour policies of the D4RL-like datasets. As D4RL (and its SAC), two Q critics with
target copies (Polyak ``tau``), a tanh-squashed Gaussian actor and a learned temperature
``alpha`` with target entropy ``-action_dim``; all networks 256x256 ReLU MLPs, Adam 3e-4.

The state is a pytree of arrays (``SACState``); the network structures are static
(``SACNets``), so ``update`` is one jitted pure function and the state checkpoints with Orbax.
``update_many`` runs ``K`` updates in one ``lax.scan`` on ``K`` stacked batches (one dispatch).

Shape notation: ``B`` batch, ``S`` observation size, ``A`` action size, ``K`` updates.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx

Array = jax.Array
LOG_STD_MIN, LOG_STD_MAX = -5.0, 2.0


@dataclasses.dataclass
class SACConfig:
    """SAC hyperparameters (those of D4RL's behaviour SAC unless said)."""

    hidden: int = 256  # width of the two hidden layers of every network
    learning_rate: float = 3e-4  # Adam, actor, critics and temperature
    batch_size: int = 256  # transitions per update
    gamma: float = 0.99  # discount
    tau: float = 0.005  # Polyak rate of the target critics
    init_alpha: float = 1.0  # initial temperature
    start_steps: int = 5000  # first environment steps with uniform random actions
    update_every: int = 50  # environment steps between bursts of as many updates (one scan)


class MLP(nnx.Module):
    """Two hidden ReLU layers and a linear output."""

    def __init__(self, d_in: int, d_out: int, hidden: int, *, rngs: nnx.Rngs):
        self.l1 = nnx.Linear(d_in, hidden, rngs=rngs)
        self.l2 = nnx.Linear(hidden, hidden, rngs=rngs)
        self.l3 = nnx.Linear(hidden, d_out, rngs=rngs)

    def __call__(self, x: Array) -> Array:
        return self.l3(jax.nn.relu(self.l2(jax.nn.relu(self.l1(x)))))


class Actor(nnx.Module):
    """Tanh-squashed Gaussian policy: ``obs [..., S] -> (mean [..., A], log_std [..., A])``."""

    def __init__(self, obs_dim: int, act_dim: int, hidden: int, *, rngs: nnx.Rngs):
        self.net = MLP(obs_dim, 2 * act_dim, hidden, rngs=rngs)

    def __call__(self, obs: Array) -> tuple[Array, Array]:
        mean, log_std = jnp.split(self.net(obs), 2, axis=-1)
        return mean, jnp.clip(log_std, LOG_STD_MIN, LOG_STD_MAX)


class Critic(nnx.Module):
    """Two Q networks: ``(obs [..., S], act [..., A]) -> q [2, ...]``."""

    def __init__(self, obs_dim: int, act_dim: int, hidden: int, *, rngs: nnx.Rngs):
        self.q1 = MLP(obs_dim + act_dim, 1, hidden, rngs=rngs)
        self.q2 = MLP(obs_dim + act_dim, 1, hidden, rngs=rngs)

    def __call__(self, obs: Array, act: Array) -> Array:
        x = jnp.concatenate([obs, act], axis=-1)
        return jnp.stack([self.q1(x)[..., 0], self.q2(x)[..., 0]])


class SACState(NamedTuple):
    """Everything SAC learns: parameters, target critic, temperature and optimiser states."""

    actor: Any
    critic: Any
    target_critic: Any
    log_alpha: Array
    actor_opt: Any
    critic_opt: Any
    alpha_opt: Any
    steps: Array  # updates done


class SACNets(NamedTuple):
    """The static half: network structures, optimiser, sizes, hyperparameters."""

    actor: nnx.GraphDef
    critic: nnx.GraphDef
    tx: optax.GradientTransformation
    act_dim: int
    gamma: float
    tau: float


@functools.cache
def _adam(learning_rate: float) -> optax.GradientTransformation:
    """One Adam per learning rate: equal ``SACNets`` hash equal, so jitted updates compile once."""
    return optax.adam(learning_rate)


def init_sac(obs_dim: int, act_dim: int, config: SACConfig, seed: int) -> tuple[SACNets, SACState]:
    """Fresh networks and optimiser states, from ``seed``."""
    rngs = nnx.Rngs(seed)
    actor_def, actor = nnx.split(Actor(obs_dim, act_dim, config.hidden, rngs=rngs))
    critic_def, critic = nnx.split(Critic(obs_dim, act_dim, config.hidden, rngs=rngs))
    tx = _adam(config.learning_rate)
    log_alpha = jnp.asarray(jnp.log(config.init_alpha), jnp.float32)
    nets = SACNets(actor_def, critic_def, tx, act_dim, config.gamma, config.tau)
    state = SACState(
        actor=actor,
        critic=critic,
        target_critic=jax.tree.map(jnp.copy, critic),
        log_alpha=log_alpha,
        actor_opt=tx.init(actor),
        critic_opt=tx.init(critic),
        alpha_opt=tx.init(log_alpha),
        steps=jnp.zeros((), jnp.int32),
    )
    return nets, state


def _sample(nets: SACNets, actor, obs: Array, key: Array) -> tuple[Array, Array]:
    """A reparameterised action in (-1, 1) and its log-probability. [..., A], [...]"""
    mean, log_std = nnx.merge(nets.actor, actor)(obs)
    std = jnp.exp(log_std)
    u = mean + std * jax.random.normal(key, mean.shape)
    logp = jnp.sum(-0.5 * ((u - mean) / std) ** 2 - log_std - 0.5 * jnp.log(2 * jnp.pi), axis=-1)
    # tanh change of variables, in the numerically stable form log(1 - tanh(u)^2)
    logp -= jnp.sum(2.0 * (jnp.log(2.0) - u - jax.nn.softplus(-2.0 * u)), axis=-1)
    return jnp.tanh(u), logp


@functools.partial(jax.jit, static_argnames=("nets", "deterministic"))
def act(
    nets: SACNets, actor, obs: Array, key: Array, i=0, j=0, deterministic: bool = False
) -> Array:
    """The policy's action for ``obs`` [..., S]: sampled with ``fold_in(fold_in(key, i), j)``
    (folded inside, one dispatch per call), or tanh of the mean. [..., A]"""
    if deterministic:
        return jnp.tanh(nnx.merge(nets.actor, actor)(obs)[0])
    key = jax.random.fold_in(jax.random.fold_in(key, i), j)
    return _sample(nets, actor, obs, key)[0]


def _update(nets: SACNets, state: SACState, batch: dict, key: Array) -> tuple[SACState, dict]:
    k_next, k_pi = jax.random.split(key)
    alpha = jnp.exp(state.log_alpha)
    obs, action, reward = batch["obs"], batch["action"], batch["reward"]
    next_obs, not_done = batch["next_obs"], 1.0 - batch["terminal"]

    # critics: soft Bellman target from the target critics (terminal, not truncated, ends it)
    next_a, next_logp = _sample(nets, state.actor, next_obs, k_next)
    target_q = jnp.min(nnx.merge(nets.critic, state.target_critic)(next_obs, next_a), axis=0)
    y = reward + nets.gamma * not_done * (target_q - alpha * next_logp)
    y = jax.lax.stop_gradient(y)

    def critic_loss(p):
        q = nnx.merge(nets.critic, p)(obs, action)
        return jnp.mean((q - y[None]) ** 2)

    c_loss, c_grad = jax.value_and_grad(critic_loss)(state.critic)
    c_upd, critic_opt = nets.tx.update(c_grad, state.critic_opt, state.critic)
    critic = optax.apply_updates(state.critic, c_upd)

    def actor_loss(p):
        a, logp = _sample(nets, p, obs, k_pi)
        q = jnp.min(nnx.merge(nets.critic, critic)(obs, a), axis=0)
        return jnp.mean(alpha * logp - q), logp

    (a_loss, logp), a_grad = jax.value_and_grad(actor_loss, has_aux=True)(state.actor)
    a_upd, actor_opt = nets.tx.update(a_grad, state.actor_opt, state.actor)
    actor = optax.apply_updates(state.actor, a_upd)

    entropy_gap = jax.lax.stop_gradient(-logp - (-nets.act_dim))
    alpha_loss_fn = lambda la: jnp.mean(jnp.exp(la) * entropy_gap)  # noqa: E731
    al_loss, al_grad = jax.value_and_grad(alpha_loss_fn)(state.log_alpha)
    al_upd, alpha_opt = nets.tx.update(al_grad, state.alpha_opt, state.log_alpha)
    log_alpha = optax.apply_updates(state.log_alpha, al_upd)

    target = optax.incremental_update(critic, state.target_critic, nets.tau)
    new = SACState(
        actor, critic, target, log_alpha, actor_opt, critic_opt, alpha_opt, state.steps + 1
    )
    info = {"critic_loss": c_loss, "actor_loss": a_loss, "alpha": alpha, "alpha_loss": al_loss}
    return new, info


@functools.partial(jax.jit, static_argnames="nets", donate_argnames="state")
def update(nets: SACNets, state: SACState, batch: dict, key: Array) -> tuple[SACState, dict]:
    """One SAC update on ``batch`` (obs [B, S], action [B, A], reward [B], next_obs [B, S],
    terminal [B] as 0/1 floats). Returns the new state and scalar losses."""
    return _update(nets, state, batch, key)


@functools.partial(jax.jit, static_argnames="nets", donate_argnames="state")
def update_many(nets: SACNets, state: SACState, batches: dict, key: Array):
    """``K`` updates on stacked batches (every leaf [K, B, ...]), keys folded from ``key``.

    Returns the state and the losses of the last update.
    """
    k = jax.tree.leaves(batches)[0].shape[0]

    def body(s, inp):
        batch, i = inp
        return _update(nets, s, batch, jax.random.fold_in(key, i))

    state, infos = jax.lax.scan(body, state, (batches, jnp.arange(k)))
    return state, jax.tree.map(lambda x: x[-1], infos)
