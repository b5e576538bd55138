"""The event model: THP embedding, a causal Aaren or Transformer stack, log-normal mixture head.

Following the paper (Section 4.2: the Transformer Hawkes Process of Zuo et al. 2020 with its
Transformer replaced by Aaren, and the log-normal mixture decoder of Shchur et al. 2020 as in
Bae et al. 2023's ``thp_mix``):

* token ``j`` embeds event ``j``: THP's temporal encoding of its time, a learned mark
  embedding, and a linear map of its standardised log inter-event time; token 0 is a learned
  start token (mark index M), so the output at position ``j`` sees events ``1..j`` only and
  predicts event ``j + 1``;
* the causal stack (``aaren_jax.Aaren`` or ``aaren_jax.Transformer``, same hyperparameters);
* a tanh MLP to the parameters of a mixture of K log-normals on the inter-event time and to
  the logits of a categorical over marks; optionally (``copy_marks``, Wikipedia) a copy head
  that adds context-gated bonuses for the previous event's mark and for the marks seen so far.

Streaming: ``make_streamer(model)`` gives ``start(t_start) -> (state, dist)`` and
``predict_next(state, event) -> (state, dist)``, one ``model.step`` per event (O(1) time and
memory for Aaren; the Transformer uses its KV cache).

Shape notation: ``B`` batch, ``L`` token positions, ``K`` mixture components, ``M`` marks,
``d`` model width.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.scipy.special import log_ndtr

from examples.common import make_backbone
from examples.event_forecasting.configs import ModelConfig

Array = jax.Array
_HALF_LOG_2PI = 0.5 * math.log(2 * math.pi)


class LogNormalMixture(NamedTuple):
    """A mixture of K log-normals on ``tau > 0``, parameterised in standardised log-space.

    With ``z = (log tau - shift) / scale`` (``shift``, ``scale``: the training split's mean and
    standard deviation of log inter-event times), ``z`` is a mixture of normals
    ``N(loc_k, exp(log_scale_k)^2)`` with weights ``softmax(logits)``; the density of ``tau``
    includes the change of variables ``dz/dtau = 1 / (scale tau)``.

    Attributes:
      logits: [..., K] unnormalised log weights.
      loc: [..., K] component means of z.
      log_scale: [..., K] component log standard deviations of z (already clamped).
      shift: [] mean of log tau in the training split.
      scale: [] standard deviation of log tau in the training split.
    """

    logits: Array
    loc: Array
    log_scale: Array
    shift: Array
    scale: Array

    def log_weights(self) -> Array:
        return jax.nn.log_softmax(self.logits, axis=-1)

    def _z(self, tau: Array) -> Array:
        return ((jnp.log(tau) - self.shift) / self.scale)[..., None]

    def log_prob(self, tau: Array) -> Array:
        """log density of ``tau`` [...] (> 0) in the data's time unit. [...]"""
        z = self._z(tau)
        u = (z - self.loc) * jnp.exp(-self.log_scale)
        comp = -0.5 * u * u - self.log_scale - _HALF_LOG_2PI
        log_pz = jax.nn.logsumexp(self.log_weights() + comp, axis=-1)
        return log_pz - jnp.log(self.scale) - jnp.log(tau)

    def log_survival(self, tau: Array) -> Array:
        """log P(next gap > tau). [...]"""
        z = self._z(tau)
        u = (z - self.loc) * jnp.exp(-self.log_scale)
        return jax.nn.logsumexp(self.log_weights() + log_ndtr(-u), axis=-1)

    def mean(self) -> Array:
        """The mixture mean in closed form: ``sum_k w_k exp(m_k + s_k^2 / 2)``. [...]

        ``m_k = shift + scale loc_k`` and ``s_k = scale exp(log_scale_k)`` are the parameters
        of component k on ``log tau``.
        """
        m = self.shift + self.scale * self.loc
        s = self.scale * jnp.exp(self.log_scale)
        return jnp.exp(jax.nn.logsumexp(self.log_weights() + m + 0.5 * s * s, axis=-1))

    def sample(self, key: Array, shape: tuple[int, ...] = ()) -> Array:
        """Samples ``shape + batch_shape`` gaps: a component, then a log-normal draw."""
        k1, k2 = jax.random.split(key)
        batch = self.loc.shape[:-1]
        comp = jax.random.categorical(k1, self.logits, axis=-1, shape=shape + batch)
        take = lambda a: jnp.take_along_axis(  # noqa: E731
            jnp.broadcast_to(a, shape + a.shape), comp[..., None], axis=-1
        )[..., 0]
        z = take(self.loc) + jnp.exp(take(self.log_scale)) * jax.random.normal(k2, shape + batch)
        return jnp.exp(self.shift + self.scale * z)


class NextEvent(NamedTuple):
    """The predicted distribution of the next event.

    Attributes:
      time: the distribution of its inter-event time.
      mark_logits: [..., M] logits of its mark, or None for unmarked data.
    """

    time: LogNormalMixture
    mark_logits: Array | None


def temporal_encoding(t: Array, dim: int) -> Array:
    """THP's temporal encoding (Zuo et al. 2020, eq. 2): sin/cos of ``t / 10000^(2i/d)``.

    Args:
      t: times. [...]
      dim: width d.

    Returns:
      [..., d] with sin on even and cos on odd channels.
    """
    i = np.arange(dim)
    inv = np.power(10000.0, -2.0 * (i // 2) / dim).astype(np.float32)
    angle = t[..., None] * jnp.asarray(inv).reshape((1,) * t.ndim + (dim,))
    even = jnp.asarray((i % 2 == 0).reshape((1,) * t.ndim + (dim,)))
    return jnp.where(even, jnp.sin(angle), jnp.cos(angle))


class TimeStats(nnx.Variable):
    """Fixed statistics of the training split: mean and std of log gaps, the time unit."""


class EventModel(nnx.Module):
    """Maps event histories to the distribution of the next event (inter-event time and mark).

    Attributes:
      time_stats: [3] mean and std of the training split's log gaps, and the time unit of
        the temporal encoding (exp of that mean).
      mark_embed: M + 1 mark embeddings (index M: the start token).
      gap_embed: linear map of the standardised log inter-event time.
      backbone: the causal ``aaren_jax.Aaren`` or ``aaren_jax.Transformer`` stack.
      hidden: the decoders' shared tanh layer.
      time_head: to the 3K mixture parameters.
      mark_head: to the M mark logits (None when M = 1).
      copy_gate: to the two copy-head gates (None unless ``copy_marks`` and M > 1).
      ema_embed: linear map of the R running averages of the log gaps (None unless
        ``gap_ema``).
    """

    def __init__(
        self,
        cfg: ModelConfig,
        num_marks: int,
        log_mean: float,
        log_std: float,
        *,
        rngs: nnx.Rngs,
    ):
        d = cfg.d_model
        self.num_marks = num_marks
        self.d_model = d
        self.num_components = cfg.num_components
        self.log_scale_range = (cfg.log_scale_min, cfg.log_scale_max)
        # standardisation of log gaps (from the training split) and THP's time unit (the
        # typical gap, so that the encoding's frequencies suit any dataset's unit): state,
        # not parameters, and not static either, so that datasets share compilations
        self.time_stats = TimeStats(
            jnp.asarray([log_mean, log_std, math.exp(log_mean)], jnp.float32)
        )
        self.mark_embed = nnx.Embed(num_marks + 1, d, rngs=rngs)
        self.gap_embed = nnx.Linear(1, d, rngs=rngs)
        self.backbone = make_backbone(
            cfg.backbone,
            cfg.num_layers,
            d,
            cfg.num_heads,
            cfg.d_ff,
            dropout=cfg.dropout,
            norm=cfg.norm,
            rngs=rngs,
        )
        self.dropout = nnx.Dropout(cfg.dropout, rngs=rngs)
        self.hidden = nnx.Linear(d, d, rngs=rngs)
        self.time_head = nnx.Linear(d, 3 * cfg.num_components, rngs=rngs)
        # tied: the logit of mark k is <context, embedding of k> plus a bias, so that a context
        # that carries a recent mark's embedding favours repeating it, even for marks rarely
        # or never seen in training (Wikipedia's 8227 pages)
        self.tie_marks = cfg.tie_marks and num_marks > 1
        self.mark_head = (
            nnx.Linear(d, num_marks, rngs=rngs) if num_marks > 1 and not self.tie_marks else None
        )
        self.mark_bias = nnx.Param(jnp.zeros((num_marks,), jnp.float32)) if self.tie_marks else None
        # copy features (created last, so that the other parameters' initialisation does not
        # depend on them): two context-gated bonuses on the mark logits, for the previous
        # event's mark and for log(1 + count) of each mark so far in the window, so that a
        # mark seen earlier in the sequence can be predicted even when training never saw it
        if cfg.copy_prior and not cfg.copy_marks:
            raise ValueError("copy_prior starts the copy head: it needs copy_marks=True")
        self.copy_marks = cfg.copy_marks and num_marks > 1
        self.copy_gate = nnx.Linear(d, 2, rngs=rngs) if self.copy_marks else None
        if self.copy_gate is not None and cfg.copy_prior:
            self.copy_gate.bias[...] = jnp.array([np.log(num_marks), 0.0], jnp.float32)
        # recency features (last, for the same reason): the running averages of the log gaps
        # give every token the recent rhythm of the stream, which a softmax over the whole
        # history (Aaren's query is one learned vector) otherwise has to dig out itself
        self.gap_ema = tuple(float(a) for a in cfg.gap_ema)
        if any(not 0.0 <= a < 1.0 for a in self.gap_ema):
            raise ValueError(f"gap_ema: decay rates must lie in [0, 1), got {cfg.gap_ema}")
        self.ema_embed = nnx.Linear(len(self.gap_ema), d, rngs=rngs) if self.gap_ema else None

    def embed(self, time: Array, gap: Array, mark: Array, ema: Array | None = None) -> Array:
        """Tokens from event time (since the window's start), standardised log gap, mark.

        Args:
          time: [...] event times (0 for the start token).
          gap: [...] standardised log inter-event times (0 where undefined).
          mark: [...] int marks (M for the start token).
          ema: [..., R] running averages of ``gap`` up to this token (``gap_ema`` only).

        Returns:
          [..., d] tokens.
        """
        enc = temporal_encoding(time / self.time_stats[...][2], self.d_model)
        x = enc + self.mark_embed(mark) + self.gap_embed(gap[..., None])
        if self.ema_embed is not None:
            x = x + self.ema_embed(ema)
        return self.dropout(x)

    def ema_update(self, ema: Array, gap: Array) -> Array:
        """One step of the running averages: ``a ema + (1 - a) gap`` per rate. [..., R]"""
        rate = jnp.asarray(self.gap_ema, jnp.float32).reshape((1,) * gap.ndim + (-1,))
        return rate * ema + (1.0 - rate) * gap[..., None]

    def gap_averages(self, gap: Array) -> Array:
        """The running averages at every position, by a parallel scan. ``gap`` [B, L] -> [B, L, R]

        Each position's average includes its own gap; the start token's gap is 0, so the
        averages start from 0 as the streamed carry does.
        """
        rate = jnp.asarray(self.gap_ema, jnp.float32).reshape((1,) * gap.ndim + (-1,))
        decay = jnp.broadcast_to(rate, gap.shape + rate.shape[-1:])
        inject = (1.0 - rate) * gap[..., None]

        def combine(left, right):  # two affine maps e -> a e + x, left applied first
            return left[0] * right[0], right[0] * left[1] + right[1]

        return jax.lax.associative_scan(combine, (decay, inject), axis=-2)[1]

    def decode(
        self, h: Array, last_mark: Array | None = None, counts: Array | None = None
    ) -> NextEvent:
        """The next event's distribution from the stack's output ``h`` [..., d].

        Args:
          h: [..., d] the stack's output.
          last_mark: [...] int the latest event's mark (M for none); used by the copy head.
          counts: [..., M] how often each mark occurred so far in the window; copy head only.
        """
        c = jnp.tanh(self.hidden(h))
        logits, loc, raw = jnp.split(self.time_head(c), 3, axis=-1)
        lo, hi = self.log_scale_range
        dist = LogNormalMixture(
            logits=logits.astype(jnp.float32),
            loc=loc.astype(jnp.float32),
            log_scale=jnp.clip(raw, lo, hi).astype(jnp.float32),
            shift=self.time_stats[...][0],
            scale=self.time_stats[...][1],
        )
        if self.tie_marks:
            table = self.mark_embed.embedding[...][: self.num_marks]  # [M, d]
            marks = (c @ table.T + self.mark_bias[...]).astype(jnp.float32)
        elif self.mark_head is not None:
            marks = self.mark_head(c).astype(jnp.float32)
        else:
            marks = None
        if self.copy_gate is not None:
            gate = self.copy_gate(c).astype(jnp.float32)  # [..., 2]
            last = jax.nn.one_hot(last_mark, self.num_marks, dtype=jnp.float32)  # M: zeros
            marks = marks + gate[..., :1] * last + gate[..., 1:] * jnp.log1p(counts)
        return NextEvent(dist, marks)

    def __call__(self, batch) -> NextEvent:
        """The parallel pass: the distribution of the next event at every position.

        Args:
          batch: ``time``, ``gap``, ``mark_in``, ``token_mask``, all [B, L] (``data.make_batch``).

        Returns:
          ``NextEvent`` with [B, L, K] mixture parameters and [B, L, M] mark logits.
        """
        ema = self.gap_averages(batch["gap"]) if self.ema_embed is not None else None
        x = self.embed(batch["time"], batch["gap"], batch["mark_in"], ema)
        h = self.backbone(x, mask=batch["token_mask"])
        if self.copy_gate is None:
            return self.decode(h)
        # events 1..j at position j (the start token and padding carry mark M: no count)
        counts = jnp.cumsum(
            jax.nn.one_hot(batch["mark_in"], self.num_marks, dtype=jnp.float32), axis=-2
        )
        return self.decode(h, batch["mark_in"], counts)


# --- losses and metrics ----------------------------------------------------------------------


def per_sequence_terms(model: EventModel, batch) -> dict[str, Array]:
    """Per-sequence sums [B]: time NLL (with survival), mark NLL, squared error, hits, events."""
    out = model(batch)
    tmask = batch["target_mask"]
    zero = jnp.zeros_like(batch["tau"])
    lp = jnp.where(tmask, out.time.log_prob(batch["tau"]), zero)
    ls = jnp.where(batch["surv_mask"], out.time.log_survival(batch["surv_tau"]), zero)
    nll_time = -jnp.sum(lp, axis=1) - jnp.sum(ls, axis=1)
    err = jnp.where(tmask, out.time.mean() - batch["tau"], zero)
    terms = {
        "nll_time": nll_time,
        "sq_err": jnp.sum(err * err, axis=1),
        "events": jnp.sum(tmask, axis=1).astype(jnp.float32),
    }
    if out.mark_logits is not None:
        logp = jax.nn.log_softmax(out.mark_logits, axis=-1)
        picked = jnp.take_along_axis(logp, batch["mark"][..., None], axis=-1)[..., 0]
        terms["nll_mark"] = -jnp.sum(jnp.where(tmask, picked, zero), axis=1)
        hit = (jnp.argmax(out.mark_logits, axis=-1) == batch["mark"]) & tmask
        terms["correct"] = jnp.sum(hit, axis=1).astype(jnp.float32)
    else:
        terms["nll_mark"] = jnp.zeros_like(nll_time)
    return terms


def loss_fn(model: EventModel, batch) -> tuple[Array, None]:
    """NLL per predicted event of the batch (time with survival, plus mark): the objective."""
    t = per_sequence_terms(model, batch)
    total = jnp.sum(t["nll_time"] + t["nll_mark"])
    return total / jnp.maximum(jnp.sum(t["events"]), 1.0), None


def eval_fn(model: EventModel, batch) -> dict[str, Array]:
    """Sums over the batch weighted by ``batch["weight"]``; ``n`` counts predicted events."""
    t = per_sequence_terms(model, batch)
    w = batch["weight"]
    sums = {
        "nll_time": jnp.sum(w * t["nll_time"]),
        "nll_mark": jnp.sum(w * t["nll_mark"]),
        "sq_err": jnp.sum(w * t["sq_err"]),
        "n": jnp.sum(w * t["events"]),
    }
    sums["nll"] = sums["nll_time"] + sums["nll_mark"]
    if "correct" in t:
        sums["correct"] = jnp.sum(w * t["correct"])
    return sums


# --- streaming -------------------------------------------------------------------------------


class Event(NamedTuple):
    """One arriving event per stream.

    Attributes:
      time: [B] its arrival time (same unit and origin as ``start``'s ``t_start``).
      mark: [B] int its mark (0 for unmarked data).
    """

    time: Array
    mark: Array


class StreamState(NamedTuple):
    """What a stream carries between events.

    Attributes:
      carry: the backbone's carry (``AarenCarry``: constant size; ``TransformerCarry``: a KV
        cache of fixed capacity).
      t_start: [B] the window's start.
      last_time: [B] the latest event's time (``t_start`` before any).
      count: [B] int32 events seen.
      mark_counts: [B, M] occurrences of each mark so far (the copy head's), or None.
      gap_ema: [B, R] running averages of the log gaps (``gap_ema``), or None.
    """

    carry: Any
    t_start: Array
    last_time: Array
    count: Array
    mark_counts: Array | None = None
    gap_ema: Array | None = None


def stream_start(
    model: EventModel, t_start: Array, max_len: int | None = None
) -> tuple[StreamState, NextEvent]:
    """Feeds the start token: the distribution of the first event. ``t_start`` [B]."""
    b = t_start.shape[0]
    carry = model.backbone.init_carry(b, max_len)
    ema = jnp.zeros((b, len(model.gap_ema)), jnp.float32) if model.gap_ema else None
    x = model.embed(
        jnp.zeros((b,), jnp.float32),
        jnp.zeros((b,), jnp.float32),
        jnp.full((b,), model.num_marks, jnp.int32),
        ema,
    )
    carry, h = model.backbone.step(carry, x)
    t_start = t_start.astype(jnp.float32)
    counts = jnp.zeros((b, model.num_marks), jnp.float32) if model.copy_marks else None
    state = StreamState(carry, t_start, t_start, jnp.zeros((b,), jnp.int32), counts, ema)
    return state, model.decode(h, jnp.full((b,), model.num_marks, jnp.int32), counts)


def stream_next(
    model: EventModel, state: StreamState, event: Event
) -> tuple[StreamState, NextEvent]:
    """Feeds one event; returns the distribution of the event after it.

    The log-gap feature is that of the parallel pass: 0 for the first event (whose gap from
    the window's start is not an inter-event time when the window starts at it), else the
    standardised log of the time since the previous event.
    """
    time = event.time.astype(jnp.float32)
    gap = jnp.maximum(time - state.last_time, jnp.finfo(jnp.float32).tiny)
    log_mean, log_std = model.time_stats[...][0], model.time_stats[...][1]
    feat = (jnp.log(gap) - log_mean) / log_std
    feat = jnp.where(state.count == 0, 0.0, feat)
    ema = model.ema_update(state.gap_ema, feat) if model.gap_ema else None
    x = model.embed(time - state.t_start, feat, event.mark.astype(jnp.int32), ema)
    carry, h = model.backbone.step(state.carry, x)
    mark = event.mark.astype(jnp.int32)
    counts = state.mark_counts
    if counts is not None:
        counts = counts + jax.nn.one_hot(mark, model.num_marks, dtype=jnp.float32)
    new = StreamState(carry, state.t_start, time, state.count + 1, counts, ema)
    return new, model.decode(h, mark, counts)


class Streamer(NamedTuple):
    """Jitted streaming functions of one model (eval mode: no dropout).

    Attributes:
      start: ``start(t_start [B]) -> (state, NextEvent)``: the first event's distribution.
      predict_next: ``predict_next(state, Event) -> (state, NextEvent)``: feed one event,
        get the next one's distribution; the state is donated.
    """

    start: Callable[[Array], tuple[StreamState, NextEvent]]
    predict_next: Callable[[StreamState, Event], tuple[StreamState, NextEvent]]


def make_streamer(model: EventModel, max_len: int | None = None) -> Streamer:
    """Streaming functions for ``model`` (switched to eval mode).

    Args:
      model: the trained model.
      max_len: the Transformer's KV-cache capacity in tokens (events + 1); ignored by Aaren.
        Stepping a Transformer past it raises (outside jit) or is undefined (inside).

    Returns:
      A ``Streamer``.
    """
    model.eval()
    graphdef, params = nnx.split(model)

    @jax.jit
    def _start(params, t_start):
        return stream_start(nnx.merge(graphdef, params), t_start, max_len)

    @functools.partial(jax.jit, donate_argnums=1)
    def _next(params, state, event):
        return stream_next(nnx.merge(graphdef, params), state, event)

    return Streamer(
        start=lambda t_start: _start(params, jnp.asarray(t_start)),
        predict_next=lambda state, event: _next(params, state, event),
    )
