"""Recurrence encoding matrices (REMs) of RSA, and their recurrent form.

Implements the REMs of "Encoding Recurrence into Transformers" (Huang et al., ICLR 2023),
as restated in SPEC 1.6: a linear RNN decomposes into scalar RNNs, each equal to a
self-attention head whose attention matrix is a fixed function ``P`` of the lag
``l = i - j`` between query ``i`` and key ``j`` (Prop. 1-2 and eq. (3) of the paper):

    regular        f(l) = lambda^l,                lambda = tanh(eta)
    cyclical cos   f(l) = gamma^l cos(l theta),    gamma = sigmoid(nu)
    cyclical sin   f(l) = gamma^l sin(l theta)
    dilated (p)    f_p(l) = f(l / p) where l mod p == 0, else 0        (Prop. 4, App. C.1)

The masked (causal) REM holds ``f(l)`` for ``l >= 1`` (strictly lower triangular, zero
diagonal); the unmasked one is ``P + P^T`` (Section 3). Six head types, counted by
``(k1, ..., k6)``: regular, cos, sin, and their dilated versions (Section 3, "Hyperparameters
k_i and d"). An RSA head computes ``[(1 - sigmoid(mu)) softmax(QK^T) + sigmoid(mu) P] V``
(eq. (4)); this module provides ``P`` and ``P V``, not the gate.

Two forms of the same operator:

* **matrix form** (``rem_matrix``, ``rem_matrices``): built from the Toeplitz lag matrix of
  Appendix D.1, with entries of power above ``K`` (``max_power``, 200 by default) masked,
  and in the non-square form of Appendix D.2 (queries at absolute positions
  ``q_offset .. q_offset + Tq - 1`` against keys ``0 .. Tk - 1``), so that a KV-cache step
  (one query at position ``t``, keys ``0 .. t``) can use it.
* **recurrent form** (``rem_apply``, ``rem_step``; SPEC 1.6 "Beyond the paper"): each causal
  REM applied to values is a linear recurrence. With ``s_t = r_t + v_t``,

      s_t = a s_{t-p} + v_t,      out_t = a s_{t-p}  (= sum_{m>=1} a^m v_{t-mp})

  with ``a = lambda`` (regular) or ``a = z = gamma e^{i theta}`` (cyclical: ``Re`` gives the
  cos REM, ``Im`` the sin REM), ``p`` the dilation (``p = 1``: ``r_t = a (r_{t-1} + v_{t-1})``
  of SPEC 1.6). It runs in parallel through ``jax.lax.associative_scan`` and in O(1) memory
  per token through ``rem_step``.

Truncation (a real difference between the two forms): the matrix form drops every term of
power above ``K`` (lag above ``p K``), as the paper does; the recurrent form keeps them all.
They agree exactly while ``T - 1 <= p K``; beyond, the recurrent output exceeds the matrix
one by ``sum_{m > K} f(m) v_{t - m p}``, at most ``|a|^(K+1) / (1 - |a|)`` times the
largest ``|v|``: 1.8e-2 for the largest initial ``lambda = tanh(2)`` and ``K = 200``, 7e-11
for ``gamma = sigmoid(2)``; it grows as ``|lambda|`` is trained towards 1.

Padding (``mask``, True = token present): a masked token is *absent*. The recurrence does
not advance on it (``a = 1, b = 0``: the state and the phase of a dilated ring are kept),
so the outputs of the present tokens equal the REM applied to the compacted sequence of
present tokens; the output at a masked position is 0. For left or right padding (the
present tokens contiguous) this is exactly the matrix form with the padded keys' columns
zeroed, since lags between present tokens are unchanged. For a mask with holes the matrix
form would count the holes in the lags; the recurrent form does not.

The matrix form lives in ``aaren_jax.rem_matrix``, the recurrent form in
``aaren_jax.rem_recurrence``; this module holds what both read: the configuration, the
initialisation and the per-head parameters; ``aaren_jax.rem`` gathers the public names of
all three. None of them knows Flax.

Shape notation: ``...`` leading axes, ``H`` heads, ``T`` time, ``D`` value size,
``Tq``/``Tk`` query/key lengths.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np

Array = jax.Array

KINDS = ("regular", "cyclic_cos", "cyclic_sin")
"""The three REM families; the dilated types use the same kinds with ``dilation > 1``."""

TYPE_KINDS = ("regular", "cyclic_cos", "cyclic_sin", "regular", "cyclic_cos", "cyclic_sin")
"""Kind of each of the paper's six REM types, counted by ``(k1, ..., k6)``."""

DEFAULT_MAX_POWER = 200

PARAM_NAMES = {"regular": ("eta",), "cyclic_cos": ("nu", "theta"), "cyclic_sin": ("nu", "theta")}


# --------------------------------------------------------------------------------------
# Configuration and initialisation
# --------------------------------------------------------------------------------------


def as_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    return int(value)


@dataclasses.dataclass(frozen=True)
class REMConfig:
    """Assignment of the six REM types to the heads of one RSA layer.

    Heads are ordered by type: the ``k1`` regular heads first, then ``k2`` cos, ``k3`` sin,
    ``k4`` dilated regular, ``k5`` dilated cos, ``k6`` dilated sin (paper, Section 3 and
    Table 2). Parameters are shared by type family: ``eta`` holds the regular heads (types
    1 then 4), ``nu`` and ``theta`` the cyclical heads (types 2, 3, 5 then 6).

    Hashable, so it can be a static argument of ``jax.jit``.

    Attributes:
      counts: ``(k1, k2, k3, k4, k5, k6)``, heads of each type; their sum is ``H``.
      dilations: dilating factor ``p >= 1`` of each dilated head (types 4, 5, 6 in head
        order), ``k4 + k5 + k6`` ints; one int is used for all of them.
      max_power: ``K``, REM entries of power above it are masked in the matrix form
        (Appendix D.1).
      mu_init: initial gate parameter ``mu``, in [-3, 3] (Section 3, "Initialization";
        Appendix E.1 found ``mu = 1`` best, hence the default).
      eta_range: ``(lo, hi)``, ``0 < lo <= hi``: the regular heads' ``|eta|`` spreads over
        ``[lo, hi]`` at initialisation. The paper's ``(1, 2)`` starts ``|lambda|`` at
        0.76-0.96, memories that fade within tens of tokens; a larger range (``(2.5, 3.5)``:
        0.987-0.998) starts them near a counter, beyond the paper.
    """

    counts: tuple[int, int, int, int, int, int] = (1, 0, 0, 0, 0, 0)
    dilations: tuple[int, ...] | int = ()
    max_power: int = DEFAULT_MAX_POWER
    mu_init: float = 1.0
    eta_range: tuple[float, float] = (1.0, 2.0)

    def __post_init__(self):
        counts = tuple(self.counts) if isinstance(self.counts, tuple | list) else None
        if counts is None or len(counts) != 6:
            raise ValueError(f"REMConfig: counts must be 6 ints (k1..k6), got {self.counts!r}")
        counts = tuple(as_int(f"REMConfig: counts[{i}]", k) for i, k in enumerate(counts))
        if min(counts) < 0 or sum(counts) < 1:
            raise ValueError(f"REMConfig: counts must be >= 0 with a positive sum, got {counts}")
        num_dilated = sum(counts[3:])
        dilations = self.dilations
        if isinstance(dilations, int | np.integer) and not isinstance(dilations, bool):
            dilations = (int(dilations),) * num_dilated
        elif isinstance(dilations, tuple | list):
            dilations = tuple(as_int("REMConfig: dilations", d) for d in dilations)
        else:
            raise TypeError(f"REMConfig: dilations must be an int or ints, got {dilations!r}")
        if len(dilations) != num_dilated:
            raise ValueError(
                f"REMConfig: {len(dilations)} dilations given for k4 + k5 + k6 = "
                f"{num_dilated} dilated heads"
            )
        if any(d < 1 for d in dilations):
            raise ValueError(f"REMConfig: dilations must be >= 1, got {dilations}")
        max_power = as_int("REMConfig: max_power", self.max_power)
        if max_power < 1:
            raise ValueError(f"REMConfig: max_power must be >= 1, got {max_power}")
        mu_init = float(self.mu_init)
        if not -3.0 <= mu_init <= 3.0:
            raise ValueError(f"REMConfig: mu_init must lie in [-3, 3], got {mu_init}")
        try:
            lo, hi = (float(x) for x in self.eta_range)
        except (TypeError, ValueError):  # not two numbers
            lo = hi = math.nan
        if isinstance(self.eta_range, str) or not 0.0 < lo <= hi < math.inf:
            raise ValueError(
                f"REMConfig: eta_range must be two finite floats 0 < lo <= hi, "
                f"got {self.eta_range!r}"
            )
        object.__setattr__(self, "counts", counts)
        object.__setattr__(self, "eta_range", (lo, hi))
        object.__setattr__(self, "dilations", dilations)
        object.__setattr__(self, "max_power", max_power)
        object.__setattr__(self, "mu_init", mu_init)

    @property
    def num_heads(self) -> int:
        """``H = k1 + ... + k6``."""
        return sum(self.counts)

    @property
    def num_regular(self) -> int:
        """Number of regular heads, the length of ``eta``: ``k1 + k4``."""
        return self.counts[0] + self.counts[3]

    @property
    def num_cyclic(self) -> int:
        """Number of cyclical heads, the length of ``nu`` and ``theta``: ``k2+k3+k5+k6``."""
        return self.counts[1] + self.counts[2] + self.counts[4] + self.counts[5]

    @property
    def head_types(self) -> tuple[int, ...]:
        """Paper type (1..6) of each head."""
        return tuple(t + 1 for t, k in enumerate(self.counts) for _ in range(k))

    @property
    def head_kinds(self) -> tuple[str, ...]:
        """Kind (one of ``KINDS``) of each head."""
        return tuple(TYPE_KINDS[t - 1] for t in self.head_types)

    @property
    def head_dilations(self) -> tuple[int, ...]:
        """Dilation of each head: 1 for types 1-3, ``dilations`` for types 4-6."""
        undilated = (1,) * sum(self.counts[:3])
        return undilated + tuple(self.dilations)

    @property
    def head_param_index(self) -> tuple[int, ...]:
        """Index of each head's parameters in ``eta`` (regular) or ``nu``/``theta``."""
        index, n_reg, n_cyc = [], 0, 0
        for kind in self.head_kinds:
            if kind == "regular":
                index.append(n_reg)
                n_reg += 1
            else:
                index.append(n_cyc)
                n_cyc += 1
        return tuple(index)

    @property
    def ring_size(self) -> int:
        """Slots of the recurrent state per head: the largest dilation."""
        return max(self.head_dilations)

    @property
    def phase_modulus(self) -> int:
        """The token counter of ``REMState`` is kept modulo the lcm of the dilations."""
        return math.lcm(*self.head_dilations)


def _spread(lo: float, hi: float, n: int) -> np.ndarray:
    if n == 1:
        return np.array([(lo + hi) / 2.0])
    return np.linspace(lo, hi, n)


def _signed_spread(n: int, lo: float, hi: float) -> np.ndarray:
    """``n`` values over [-hi, -lo] U [lo, hi], alternating signs; (1, 2): 1, -1, 1.5, -2, 2."""
    pos, neg = _spread(lo, hi, (n + 1) // 2), -_spread(lo, hi, n // 2) if n > 1 else []
    out = np.empty(n)
    out[0::2], out[1::2] = pos, neg
    return out


def init_rem_params(config: REMConfig, key=None, dtype=jnp.float32) -> dict[str, Array]:
    """The paper's deterministic initialisation of the REM parameters (Section 3).

    ``eta`` spreads over [-2, -1] U [1, 2] (``config.eta_range``) within each regular type
    (signs alternate, so both decay patterns, smooth and oscillating, are present); ``nu``
    spreads over [1, 2] within each cyclical type (so the i-th cos and i-th sin heads start
    as a conjugate pair); ``theta = pi / 4``. ``mu`` is per layer, ``config.mu_init``.

    Args:
      config: head assignment.
      key: unused (the initialisation is deterministic, as in the paper); accepted so that
        callers can pass a PRNG key uniformly.
      dtype: parameter dtype.

    Returns:
      ``{"eta": [k1 + k4], "nu": [k2 + k3 + k5 + k6], "theta": [k2 + k3 + k5 + k6]}``.

    Example:
      >>> p = init_rem_params(REMConfig((2, 1, 1, 0, 0, 0)))
      >>> p["eta"].tolist(), p["nu"].tolist()
      ([1.5, -1.5], [1.5, 1.5])
    """
    del key
    if not isinstance(config, REMConfig):
        raise TypeError(f"init_rem_params: config must be a REMConfig, got {type(config)}")
    k = config.counts
    eta = np.concatenate([_signed_spread(n, *config.eta_range) for n in (k[0], k[3])])
    nu = np.concatenate(
        [_spread(1.0, 2.0, n) if n else np.zeros(0) for n in (k[1], k[2], k[4], k[5])]
    )
    return {
        "eta": jnp.asarray(eta, dtype),
        "nu": jnp.asarray(nu, dtype),
        "theta": jnp.full(nu.shape, np.pi / 4, dtype),
    }


def config_params(name: str, config: REMConfig, params: Mapping, acc) -> tuple[Array, ...]:
    if not isinstance(config, REMConfig):
        raise TypeError(f"{name}: config must be a REMConfig, got {type(config).__name__}")
    if not isinstance(params, Mapping):
        raise TypeError(f"{name}: params must be a mapping with keys 'eta', 'nu', 'theta'")
    expected = {"eta": (config.num_regular,), "nu": (config.num_cyclic,)}
    expected["theta"] = expected["nu"]
    out = []
    for key, shape in expected.items():
        if key not in params:
            raise ValueError(f"{name}: params lack {key!r} (expected shape {list(shape)})")
        x = jnp.asarray(params[key])
        if x.shape != shape:
            raise ValueError(
                f"{name}: params[{key!r}] has shape {list(x.shape)}, expected {list(shape)} "
                f"for counts {config.counts}"
            )
        if not jnp.issubdtype(x.dtype, jnp.floating):
            raise TypeError(f"{name}: params[{key!r}] must be floating, got {x.dtype}")
        out.append(x.astype(acc))
    return tuple(out)
