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

This module knows no Flax. Shape notation: ``...`` leading axes, ``H`` heads, ``T`` time,
``D`` value size, ``Tq``/``Tk`` query/key lengths.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

Array = jax.Array

KINDS = ("regular", "cyclic_cos", "cyclic_sin")
"""The three REM families; the dilated types use the same kinds with ``dilation > 1``."""

TYPE_KINDS = ("regular", "cyclic_cos", "cyclic_sin", "regular", "cyclic_cos", "cyclic_sin")
"""Kind of each of the paper's six REM types, counted by ``(k1, ..., k6)``."""

DEFAULT_MAX_POWER = 200
METHODS = ("associative", "sequential")

_PARAM_NAMES = {"regular": ("eta",), "cyclic_cos": ("nu", "theta"), "cyclic_sin": ("nu", "theta")}


# --------------------------------------------------------------------------------------
# Configuration and initialisation
# --------------------------------------------------------------------------------------


def _as_int(name: str, value) -> int:
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
    """

    counts: tuple[int, int, int, int, int, int] = (1, 0, 0, 0, 0, 0)
    dilations: tuple[int, ...] | int = ()
    max_power: int = DEFAULT_MAX_POWER
    mu_init: float = 1.0

    def __post_init__(self):
        counts = tuple(self.counts) if isinstance(self.counts, tuple | list) else None
        if counts is None or len(counts) != 6:
            raise ValueError(f"REMConfig: counts must be 6 ints (k1..k6), got {self.counts!r}")
        counts = tuple(_as_int(f"REMConfig: counts[{i}]", k) for i, k in enumerate(counts))
        if min(counts) < 0 or sum(counts) < 1:
            raise ValueError(f"REMConfig: counts must be >= 0 with a positive sum, got {counts}")
        num_dilated = sum(counts[3:])
        dilations = self.dilations
        if isinstance(dilations, int | np.integer) and not isinstance(dilations, bool):
            dilations = (int(dilations),) * num_dilated
        elif isinstance(dilations, tuple | list):
            dilations = tuple(_as_int("REMConfig: dilations", d) for d in dilations)
        else:
            raise TypeError(f"REMConfig: dilations must be an int or ints, got {dilations!r}")
        if len(dilations) != num_dilated:
            raise ValueError(
                f"REMConfig: {len(dilations)} dilations given for k4 + k5 + k6 = "
                f"{num_dilated} dilated heads"
            )
        if any(d < 1 for d in dilations):
            raise ValueError(f"REMConfig: dilations must be >= 1, got {dilations}")
        max_power = _as_int("REMConfig: max_power", self.max_power)
        if max_power < 1:
            raise ValueError(f"REMConfig: max_power must be >= 1, got {max_power}")
        mu_init = float(self.mu_init)
        if not -3.0 <= mu_init <= 3.0:
            raise ValueError(f"REMConfig: mu_init must lie in [-3, 3], got {mu_init}")
        object.__setattr__(self, "counts", counts)
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


def _signed_spread(n: int) -> np.ndarray:
    """``n`` values over [-2, -1] U [1, 2], alternating signs: 1, -1, 1.5, -2, 2, ..."""
    pos, neg = _spread(1.0, 2.0, (n + 1) // 2), -_spread(1.0, 2.0, n // 2) if n > 1 else []
    out = np.empty(n)
    out[0::2], out[1::2] = pos, neg
    return out


def init_rem_params(config: REMConfig, key=None, dtype=jnp.float32) -> dict[str, Array]:
    """The paper's deterministic initialisation of the REM parameters (Section 3).

    ``eta`` spreads over [-2, -1] U [1, 2] within each regular type (signs alternate, so
    both decay patterns, smooth and oscillating, are present); ``nu`` spreads over [1, 2]
    within each cyclical type (so the i-th cos and i-th sin heads start as a conjugate
    pair); ``theta = pi / 4``. ``mu`` is per layer, ``config.mu_init``.

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
    eta = np.concatenate([_signed_spread(k[0]), _signed_spread(k[3])])
    nu = np.concatenate(
        [_spread(1.0, 2.0, n) if n else np.zeros(0) for n in (k[1], k[2], k[4], k[5])]
    )
    return {
        "eta": jnp.asarray(eta, dtype),
        "nu": jnp.asarray(nu, dtype),
        "theta": jnp.full(nu.shape, np.pi / 4, dtype),
    }


# --------------------------------------------------------------------------------------
# Matrix form (Appendix D.1 / D.2)
# --------------------------------------------------------------------------------------


def _float_dtype(*dtypes) -> jnp.dtype:
    """float64 if any input is float64, else float32: the accumulation dtype."""
    f64 = jnp.dtype(jnp.float64)
    return f64 if any(jnp.dtype(d) == f64 for d in dtypes) else jnp.dtype(jnp.float32)


def _check_kind(name: str, kind) -> str:
    if kind not in KINDS:
        raise ValueError(f"{name}: kind must be one of {KINDS}, got {kind!r}")
    return kind


def _get_params(name: str, kind: str, params: Mapping) -> tuple[Array, ...]:
    if not isinstance(params, Mapping):
        raise TypeError(f"{name}: params must be a mapping with keys {_PARAM_NAMES[kind]}")
    missing = [p for p in _PARAM_NAMES[kind] if p not in params]
    if missing:
        raise ValueError(f"{name}: params for kind {kind!r} lack {missing}")
    arrays = tuple(jnp.asarray(params[p]) for p in _PARAM_NAMES[kind])
    for p, x in zip(_PARAM_NAMES[kind], arrays, strict=True):
        if not jnp.issubdtype(x.dtype, jnp.floating):
            raise TypeError(f"{name}: params[{p!r}] must be floating, got {x.dtype}")
    if len(arrays) == 2 and arrays[0].shape != arrays[1].shape:
        if arrays[1].ndim == 0:
            arrays = (arrays[0], jnp.broadcast_to(arrays[1], arrays[0].shape))
        else:
            raise ValueError(
                f"{name}: params 'nu' {arrays[0].shape} and 'theta' {arrays[1].shape} must "
                "have the same shape"
            )
    return arrays


def _powers(shape_ndim: int, num_powers: int) -> Array:
    """``1 .. N`` as int32, shaped ``[1, ..., 1, N]`` to match ``shape_ndim`` leading axes."""
    return jnp.arange(1, num_powers + 1, dtype=jnp.int32).reshape((1,) * shape_ndim + (-1,))


def _regular_table(eta: Array, num_powers: int) -> Array:
    """``lambda^n`` for ``n = 1..N``, ``lambda = tanh(eta)``. [..., N]

    Integer powers (repeated squaring in ``lax.pow``): exact sign for ``lambda < 0``, a few
    ulps of error, and the right gradient ``n lambda^(n-1)`` at ``lambda = 0``, where an
    ``exp(n log|lambda|)`` form would give NaN.
    """
    lam = jnp.tanh(eta)[..., None]
    return jnp.power(lam, _powers(eta.ndim, num_powers))


def _cyclic_tables(nu: Array, theta: Array, num_powers: int) -> tuple[Array, Array]:
    """``gamma^n cos(n theta)`` and ``gamma^n sin(n theta)``, ``n = 1..N``. [..., N] each.

    ``gamma^n = exp(n log_sigmoid(nu))``: ``gamma > 0``, so the log form is exact and stable
    (no underflow to ``log 0``) and smooth in ``nu``.
    """
    n = _powers(nu.ndim, num_powers)
    nf = n.astype(nu.dtype)
    magnitude = jnp.exp(nf * jax.nn.log_sigmoid(nu)[..., None])
    angle = nf * theta[..., None]
    return magnitude * jnp.cos(angle), magnitude * jnp.sin(angle)


def _is_static_int(x) -> bool:
    return isinstance(x, int | np.integer) and not isinstance(x, bool)


def _check_lengths(name: str, q_len, k_len, q_offset) -> None:
    for arg, value in (("q_len", q_len), ("k_len", k_len)):
        if _as_int(f"{name}: {arg}", value) < 0:
            raise ValueError(f"{name}: {arg} must be >= 0, got {value}")
    if not _is_static_int(q_offset):
        q_offset = jnp.asarray(q_offset)
        if q_offset.ndim != 0 or not jnp.issubdtype(q_offset.dtype, jnp.integer):
            raise TypeError(
                f"{name}: q_offset must be an int or a scalar integer array, got "
                f"{q_offset.dtype}{list(q_offset.shape)}"
            )


def _table_size(q_len: int, k_len: int, q_offset, dilation: int, max_power: int, causal: bool):
    """Number of powers the lag matrix can reach (static), at most ``max_power``."""
    if not _is_static_int(q_offset):
        return max_power  # a traced offset: any lag may occur
    last_q, first_q = int(q_offset) + q_len - 1, int(q_offset)
    max_lag = last_q if causal else max(last_q, k_len - 1 - first_q)
    return int(min(max_power, max(max_lag // dilation, 1)))


def _power_index(q_len: int, k_len: int, q_offset, dilations: Array, max_power: int, causal):
    """Toeplitz lag matrix of Appendix D.1-D.2 as power indices.

    Args:
      dilations: dilation per matrix. [M]

    Returns:
      ``(index, valid)``: ``index = power - 1`` [M, Tq, Tk] (clipped, only meaningful where
      ``valid``) and ``valid`` [M, Tq, Tk]: lag ``>= 1`` (or ``!= 0`` unmasked), a multiple of
      the dilation, and power ``<= max_power``.
    """
    q_pos = jnp.arange(q_len, dtype=jnp.int32).reshape(1, -1, 1) + jnp.asarray(q_offset, jnp.int32)
    k_pos = jnp.arange(k_len, dtype=jnp.int32).reshape(1, 1, -1)
    lag = q_pos - k_pos
    if not causal:
        lag = jnp.abs(lag)
    p = dilations.reshape(-1, 1, 1)
    power = lag // p
    valid = (lag >= 1) & (lag % p == 0) & (power <= max_power)
    return jnp.clip(power - 1, 0, max_power - 1), valid


def rem_matrix(
    kind: str,
    params: Mapping[str, Array],
    q_len: int,
    k_len: int,
    *,
    q_offset=0,
    dilation: int = 1,
    max_power: int = DEFAULT_MAX_POWER,
    causal: bool = True,
    dtype=None,
) -> Array:
    """One REM, square or non-square (Appendix D.1, D.2; eq. (3) and Section 3).

    Entry ``(i, j)`` is ``f(l / p)`` for the lag ``l = (q_offset + i) - j`` when ``l >= 1`` is
    a multiple of the dilation ``p`` and ``l / p <= max_power``, else 0 (masked REM).
    Unmasked (``causal=False``): the same with ``|l|``, i.e. ``P + P^T``, zero diagonal.

    Args:
      kind: ``"regular"`` (``f(l) = tanh(eta)^l``), ``"cyclic_cos"`` (``sigmoid(nu)^l cos(l
        theta)``) or ``"cyclic_sin"`` (``sigmoid(nu)^l sin(l theta)``).
      params: ``{"eta": ...}`` (regular) or ``{"nu": ..., "theta": ...}`` (cyclical); any
        shape ``[...]``, one REM per entry (a scalar ``theta`` broadcasts). [...]
      q_len: number of queries ``Tq``.
      k_len: number of keys ``Tk``.
      q_offset: absolute position of the first query (keys sit at ``0 .. Tk - 1``); an int
        or a scalar integer array (traced in a decoding loop). A KV-cache step at position
        ``t`` uses ``q_len=1, q_offset=t``.
      dilation: ``p >= 1``; ``p > 1`` gives the dilated REMs (types 4-6).
      max_power: ``K``; entries of power above it are masked (Appendix D.1, ``K = 200``).
      causal: masked REM (True) or unmasked ``P + P^T`` (False).
      dtype: output dtype; default float32 (float64 for float64 params).

    Returns:
      The REM(s). [..., Tq, Tk]

    Raises:
      ValueError: unknown ``kind``, missing params, negative lengths, ``dilation`` or
        ``max_power`` below 1.
      TypeError: non-floating params or a non-integer ``q_offset``.

    Example:
      >>> P = rem_matrix("regular", {"eta": jnp.arctanh(0.5)}, 3, 3)
      >>> P.round(3).tolist()
      [[0.0, 0.0, 0.0], [0.5, 0.0, 0.0], [0.25, 0.5, 0.0]]
    """
    name = "rem_matrix"
    kind = _check_kind(name, kind)
    _check_lengths(name, q_len, k_len, q_offset)
    dilation, max_power = (
        _as_int(f"{name}: dilation", dilation),
        _as_int(f"{name}: max_power", max_power),
    )
    if dilation < 1 or max_power < 1:
        raise ValueError(
            f"{name}: dilation and max_power must be >= 1, got {dilation}, {max_power}"
        )
    arrays = _get_params(name, kind, params)
    acc = _float_dtype(*(x.dtype for x in arrays))
    arrays = tuple(x.astype(acc) for x in arrays)
    batch_ndim = arrays[0].ndim
    n = _table_size(q_len, k_len, q_offset, dilation, max_power, causal)
    if kind == "regular":
        table = _regular_table(arrays[0], n)
    else:
        table = _cyclic_tables(*arrays, n)[0 if kind == "cyclic_cos" else 1]
    index, valid = _power_index(q_len, k_len, q_offset, jnp.asarray([dilation]), max_power, causal)
    entries = jnp.take(table, jnp.minimum(index[0], n - 1), axis=-1)  # [..., Tq, Tk]
    valid = valid[0].reshape((1,) * batch_ndim + valid.shape[1:])
    out = jnp.where(valid, entries, jnp.zeros((), acc))
    return out.astype(dtype or acc)


def _head_tables(config: REMConfig, params: Mapping, num_powers: int, acc) -> Array:
    """Powers ``f_h(n)``, ``n = 1..N``, for every head in head order. [H, N]"""
    eta, nu, theta = _config_params("rem_matrices", config, params, acc)
    regular = _regular_table(eta, num_powers)
    cos, sin = _cyclic_tables(nu, theta, num_powers)
    rows = jnp.concatenate([regular, cos, sin], axis=0)  # [k_reg + 2 k_cyc, N]
    offsets = {"regular": 0, "cyclic_cos": config.num_regular}
    offsets["cyclic_sin"] = config.num_regular + config.num_cyclic
    row = [offsets[k] + i for k, i in zip(config.head_kinds, config.head_param_index, strict=True)]
    return jnp.take(rows, jnp.asarray(row, jnp.int32), axis=0)


def _config_params(name: str, config: REMConfig, params: Mapping, acc) -> tuple[Array, ...]:
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


def rem_matrices(
    config: REMConfig,
    params: Mapping[str, Array],
    q_len: int,
    k_len: int,
    *,
    q_offset=0,
    causal: bool = True,
    dtype=None,
) -> Array:
    """The REM of every head of an RSA layer (Section 3, Appendix D.1-D.2). [H, Tq, Tk]

    Args:
      config: head assignment (kinds, dilations, ``max_power``).
      params: ``{"eta": [k1 + k4], "nu": [k_cyc], "theta": [k_cyc]}`` as made by
        ``init_rem_params``.
      q_len: number of queries ``Tq``.
      k_len: number of keys ``Tk``.
      q_offset: absolute position of the first query; int or traced scalar int.
      causal: masked REMs (True) or unmasked ``P + P^T`` (False).
      dtype: output dtype; default float32 (float64 for float64 params).

    Returns:
      ``P_h`` for each head ``h`` in head order. [H, Tq, Tk]

    Raises:
      ValueError / TypeError: wrong config, params of the wrong shape or dtype, bad lengths.

    Example:
      >>> cfg = REMConfig((1, 1, 1, 1, 0, 0), dilations=2)
      >>> rem_matrices(cfg, init_rem_params(cfg), 4, 4).shape
      (4, 4, 4)
    """
    name = "rem_matrices"
    if not isinstance(config, REMConfig):
        raise TypeError(f"{name}: config must be a REMConfig, got {type(config).__name__}")
    _check_lengths(name, q_len, k_len, q_offset)
    keys = ("eta", "nu", "theta")
    acc = _float_dtype(
        *(jnp.result_type(params[k]) for k in keys if isinstance(params, Mapping) and k in params)
    )
    k = config.max_power
    n = _table_size(q_len, k_len, q_offset, 1, k, causal)
    table = _head_tables(config, params, n, acc)  # [H, N]
    dilations = jnp.asarray(config.head_dilations, jnp.int32)
    index, valid = _power_index(q_len, k_len, q_offset, dilations, k, causal)
    index = jnp.minimum(index, n - 1)  # entries of power > n are invalid anyway
    h = config.num_heads
    entries = jnp.take_along_axis(table, index.reshape(h, -1), axis=-1).reshape(index.shape)
    out = jnp.where(valid, entries, jnp.zeros((), acc))
    return out.astype(dtype or acc)


# --------------------------------------------------------------------------------------
# Recurrent form (SPEC 1.6, "Beyond the paper")
# --------------------------------------------------------------------------------------


class REMState(NamedTuple):
    """Streaming state of the causal REMs of one layer.

    Per head, a ring of ``p`` recurrence states ``s = r + v`` (the REM output so far plus
    the last value, which is all the recurrence needs), one per residue class of the
    token index modulo the head's dilation ``p``; slots at and above ``p`` are unused.
    Complex states of cyclical heads are stored as (real, imaginary) pairs; regular heads
    keep a zero imaginary part.

    Attributes:
      ring: recurrence states. [..., H, P, 2, D] with ``P = config.ring_size``
      phase: present tokens seen, modulo ``config.phase_modulus`` (int32); the slot of the
        next token of a head with dilation ``p`` is ``phase % p``. [...]
    """

    ring: Array
    phase: Array


def init_rem_state(config: REMConfig, batch_shape, dim: int, dtype=jnp.float32) -> REMState:
    """The empty state: no token seen (all REM outputs 0).

    Args:
      config: head assignment.
      batch_shape: leading axes, e.g. ``(B,)``. [...]
      dim: value size ``D``.
      dtype: state dtype; float32 unless the values are float64.

    Returns:
      ``REMState`` with ``ring`` [..., H, P, 2, D] zeros and ``phase`` [...] zeros.

    Example:
      >>> init_rem_state(REMConfig((1, 0, 0, 1, 0, 0), dilations=3), (2,), 8).ring.shape
      (2, 2, 3, 2, 8)
    """
    if not isinstance(config, REMConfig):
        raise TypeError(f"init_rem_state: config must be a REMConfig, got {type(config)}")
    if not jnp.issubdtype(dtype, jnp.floating):
        raise TypeError(f"init_rem_state: dtype must be floating, got {jnp.dtype(dtype)}")
    batch_shape = (int(batch_shape),) if np.ndim(batch_shape) == 0 else tuple(map(int, batch_shape))
    ring_shape = (*batch_shape, config.num_heads, config.ring_size, 2, int(dim))
    return REMState(jnp.zeros(ring_shape, dtype), jnp.zeros(batch_shape, jnp.int32))


def _head_coefficients(config: REMConfig, params: Mapping, acc, name: str):
    """Per-head recurrence coefficient ``a = lambda`` or ``gamma e^{i theta}``: (re, im). [H]"""
    eta, nu, theta = _config_params(name, config, params, acc)
    gamma = jnp.exp(jax.nn.log_sigmoid(nu))
    re = jnp.concatenate([jnp.tanh(eta), gamma * jnp.cos(theta)])
    im = jnp.concatenate([jnp.zeros_like(eta), gamma * jnp.sin(theta)])
    offset = {"regular": 0, "cyclic_cos": config.num_regular, "cyclic_sin": config.num_regular}
    row = [offset[k] + i for k, i in zip(config.head_kinds, config.head_param_index, strict=True)]
    row = jnp.asarray(row, jnp.int32)
    return jnp.take(re, row), jnp.take(im, row)


def _check_values(name: str, config: REMConfig, values, time_axis: bool):
    values = jnp.asarray(values)
    rank = 3 if time_axis else 2
    layout = "[..., H, T, D]" if time_axis else "[..., H, D]"
    if values.ndim < rank:
        raise ValueError(f"{name}: values must be {layout}, got shape {list(values.shape)}")
    if not jnp.issubdtype(values.dtype, jnp.floating):
        raise TypeError(f"{name}: values must be floating, got {values.dtype}")
    if values.shape[-rank] != config.num_heads:
        raise ValueError(
            f"{name}: values {layout} has H = {values.shape[-rank]} heads, config has "
            f"{config.num_heads} (counts {config.counts})"
        )
    return values


def _check_mask(name: str, mask, shape: tuple, layout: str):
    if mask is None:
        return None
    mask = jnp.asarray(mask)
    if mask.dtype != jnp.bool_:
        raise TypeError(f"{name}: mask must be boolean (True = token present), got {mask.dtype}")
    if mask.shape != shape:
        raise ValueError(
            f"{name}: mask must have shape {layout} = {list(shape)}, got {list(mask.shape)}"
        )
    return mask


def _check_state(name: str, config: REMConfig, state, batch_shape: tuple, dim: int):
    if not isinstance(state, REMState):
        raise TypeError(f"{name}: state must be a REMState, got {type(state).__name__}")
    ring_shape = (*batch_shape, config.num_heads, config.ring_size, 2, dim)
    if state.ring.shape != ring_shape or state.phase.shape != batch_shape:
        raise ValueError(
            f"{name}: state has ring {list(state.ring.shape)} and phase "
            f"{list(state.phase.shape)}, expected {list(ring_shape)} and {list(batch_shape)}"
        )
    if not jnp.issubdtype(state.phase.dtype, jnp.integer):
        raise TypeError(f"{name}: state.phase must be an integer array, got {state.phase.dtype}")


def rem_step(
    config: REMConfig,
    params: Mapping[str, Array],
    state: REMState,
    value: Array,
    mask: Array | None = None,
) -> tuple[REMState, Array]:
    """One token through every causal REM of a layer: the ``lax.scan`` body, carry first.

    For a head with coefficient ``a`` and dilation ``p``, slot ``k = phase % p`` holds
    ``s_{t-p}``; the output is ``a s_{t-p} = sum_{m>=1} f(m) v_{t-mp}`` and the slot becomes
    ``a s_{t-p} + v_t``. Regular and cos heads read the real part, sin heads the imaginary
    part (``Im z^m = gamma^m sin(m theta)``). No truncation at ``K`` (see module docstring).

    Args:
      config: head assignment.
      params: ``{"eta", "nu", "theta"}`` as made by ``init_rem_params``.
      state: state before this token.
      value: the token's values per head. [..., H, D]
      mask: True where the token is present; an absent token leaves the state (and phase)
        unchanged and outputs 0. [...]

    Returns:
      ``(state, out)``: the new state and the REM outputs ``(P V)_t`` per head, in
      ``value``'s dtype. [..., H, D]

    Example:
      >>> cfg = REMConfig((1, 0, 0, 0, 0, 0))
      >>> prm = {"eta": jnp.array([jnp.arctanh(0.5)]), "nu": jnp.zeros(0), "theta": jnp.zeros(0)}
      >>> s = init_rem_state(cfg, (), 1)
      >>> s, y = rem_step(cfg, prm, s, jnp.ones((1, 1)))
      >>> s, y = rem_step(cfg, prm, s, jnp.ones((1, 1)))
      >>> float(y[0, 0])
      0.5
    """
    name = "rem_step"
    value = _check_values(name, config, value, time_axis=False)
    batch_shape, dim = value.shape[:-2], value.shape[-1]
    mask = _check_mask(name, mask, batch_shape, "[...]")
    _check_state(name, config, state, batch_shape, dim)
    acc = _float_dtype(value.dtype, state.ring.dtype)
    a_re, a_im = _head_coefficients(config, params, acc, name)
    nb, h, ring_size = len(batch_shape), config.num_heads, config.ring_size

    dil = jnp.asarray(config.head_dilations, jnp.int32).reshape((1,) * nb + (h,))
    slot = state.phase.astype(jnp.int32)[..., None] % dil  # [..., H]
    onehot = slot[..., None] == jnp.arange(ring_size, dtype=jnp.int32).reshape(
        (1,) * (nb + 1) + (-1,)
    )
    ring = state.ring.astype(acc)
    prev = jnp.sum(jnp.where(onehot[..., None, None], ring, 0), axis=-3)  # [..., H, 2, D]
    p_re, p_im = prev[..., 0, :], prev[..., 1, :]
    a_re = a_re.reshape((1,) * nb + (h, 1))
    a_im = a_im.reshape((1,) * nb + (h, 1))
    o_re, o_im = a_re * p_re - a_im * p_im, a_re * p_im + a_im * p_re
    is_sin = np.array([k == "cyclic_sin" for k in config.head_kinds]).reshape((1,) * nb + (h, 1))
    out = jnp.where(is_sin, o_im, o_re)
    updated = jnp.stack([o_re + value.astype(acc), o_im], axis=-2)  # [..., H, 2, D]
    write = onehot
    if mask is not None:
        write = write & mask.reshape(batch_shape + (1, 1))
        out = jnp.where(mask.reshape(batch_shape + (1, 1)), out, 0)
    ring = jnp.where(write[..., None, None], updated[..., None, :, :], ring)
    step = 1 if mask is None else mask.astype(jnp.int32)
    phase = (state.phase + step) % config.phase_modulus
    return REMState(ring, phase.astype(state.phase.dtype)), out.astype(value.dtype)


def _linear_scan(a: Array, b: Array, axis: int) -> Array:
    """All prefixes of ``h_t = a_t h_{t-1} + b_t`` (``h_{-1} = 0``) by associative scan."""

    def combine(x, y):
        return x[0] * y[0], y[0] * x[1] + y[1]

    return jax.lax.associative_scan(combine, (a, b), axis=axis)[1]


def _cell_layout(mask: Array | None, phase: Array, p: int, num_tokens: int):
    """Place the present tokens of each row on a grid of ``R`` rows and ``p`` columns.

    Present token number ``j`` (counted over the whole stream, ``phase + j``) goes to
    cell ``e = phase % p + j``: column ``e % p`` is its residue class, i.e. its ring slot,
    and each column is one chain of the dilated recurrence. Cells holding no token are
    identities of the scan.

    With ``p = 1`` there is one chain and no phase: the tokens stay in place (an absent
    one is an identity where it stands), so no layout is needed.

    Returns:
      ``(src, cell_valid, token_cell, num_cells)``: token index of each cell [..., C],
      whether the cell holds a token [..., C], the cell of each token [..., T] (present
      tokens only), and ``C = R p``; ``None`` for the first three when ``p = 1``.
    """
    if p == 1:
        return None, None, None, num_tokens
    batch_shape = phase.shape
    t = jnp.arange(num_tokens, dtype=jnp.int32).reshape((1,) * len(batch_shape) + (-1,))
    r0 = (phase.astype(jnp.int32) % p)[..., None]  # [..., 1]
    num_cells = -(-(num_tokens + p - 1) // p) * p
    if mask is None:
        order = jnp.broadcast_to(t, batch_shape + (num_tokens,))
        count = jnp.full(batch_shape + (1,), num_tokens, jnp.int32)
        rank = t
    else:
        # Positions of the present tokens in order, absent ones after them.
        order = jnp.argsort(jnp.where(mask, t, t + num_tokens), axis=-1).astype(jnp.int32)
        count = jnp.sum(mask, axis=-1, dtype=jnp.int32)[..., None]
        rank = jnp.cumsum(mask, axis=-1, dtype=jnp.int32) - 1
    cell = jnp.arange(num_cells, dtype=jnp.int32).reshape((1,) * len(batch_shape) + (-1,))
    cell_rank = cell - r0
    cell_valid = (cell_rank >= 0) & (cell_rank < count)
    src = jnp.take_along_axis(order, jnp.clip(cell_rank, 0, num_tokens - 1), axis=-1)
    token_cell = jnp.clip(r0 + rank, 0, num_cells - 1)
    return src, cell_valid, token_cell, num_cells


def _apply_group(values, ring0, a, layout, p: int, mask):
    """Dilated linear recurrence for one group of heads sharing the dilation ``p``.

    Args:
      values: [..., G, T, D] (real, or complex for cyclical heads).
      ring0: initial states. [..., G, p, D]
      a: coefficient per head. [G]
      layout: ``_cell_layout`` for ``p``.
      mask: [..., T] or None.

    Returns:
      ``(out [..., G, T, D], ring [..., G, p, D])``.
    """
    src, cell_valid, token_cell, num_cells = layout
    nb = values.ndim - 3
    g, _, d = values.shape[-3:]
    rows = num_cells // p
    if src is None:  # p = 1: cells are the tokens
        cells, cell_valid = values, mask
    else:
        cells = jnp.take_along_axis(values, src[..., None, :, None], axis=-2)  # [..., G, C, D]
    cells = cells.reshape(values.shape[:-2] + (rows, p, d))
    if cell_valid is None:
        cell_valid = jnp.ones(values.shape[:-3] + (num_cells,), bool)
    valid = cell_valid.reshape(cell_valid.shape[:-1] + (1, rows, p, 1))
    a_b = a.reshape((1,) * nb + (g, 1, 1, 1))
    coef = jnp.where(valid, a_b, jnp.ones((), a.dtype))  # [..., G, R, p, 1]
    b = jnp.where(valid, cells, jnp.zeros((), cells.dtype))
    b = b.at[..., 0, :, :].add(coef[..., 0, :, :] * ring0)  # fold the initial state in
    states = _linear_scan(coef, b, axis=-3)  # [..., G, R, p, D]
    before = jnp.concatenate([ring0[..., None, :, :], states[..., :-1, :, :]], axis=-3)
    out = (a_b * before).reshape(values.shape[:-2] + (num_cells, d))
    if token_cell is not None:
        out = jnp.take_along_axis(out, token_cell[..., None, :, None], axis=-2)
    if mask is not None:
        out = jnp.where(mask[..., None, :, None], out, jnp.zeros((), out.dtype))
    return out, states[..., -1, :, :]


def rem_apply(
    config: REMConfig,
    params: Mapping[str, Array],
    values: Array,
    mask: Array | None = None,
    *,
    initial_state: REMState | None = None,
    method: str = "associative",
) -> tuple[Array, REMState]:
    """Every causal REM of a layer applied to its head's values, as a linear recurrence.

    ``out[..., h, t] = sum_{m >= 1} f_h(m) v[..., h, t - m p_h]``: the masked REM times
    ``V`` (eq. (4) without softmax and gate) with no truncation at ``K``, in O(T D) work
    per head (no ``T x T`` matrix). ``rem_apply(v2, initial_state=rem_apply(v1)[1])``
    equals the second half of ``rem_apply(concat(v1, v2))``: prefill, then continue.

    Args:
      config: head assignment.
      params: ``{"eta", "nu", "theta"}`` as made by ``init_rem_params``.
      values: values per head. [..., H, T, D]
      mask: True where the token is present; absent tokens are skipped exactly (the
        recurrence does not advance; their output is 0). [..., T]
      initial_state: state before the first token; default ``init_rem_state``.
      method: ``"associative"`` (parallel ``jax.lax.associative_scan``, O(log T) depth) or
        ``"sequential"`` (``jax.lax.scan`` of ``rem_step``).

    Returns:
      ``(out, final_state)``: ``out`` [..., H, T, D] in ``values``' dtype, ``final_state``
      after all ``T`` tokens.

    Raises:
      ValueError / TypeError: shapes or dtypes of ``values``, ``mask``, ``params`` or
        ``initial_state`` that do not match ``config``, or an unknown ``method``.

    Example:
      >>> cfg = REMConfig((1, 1, 1, 0, 1, 0), dilations=2)
      >>> v = jnp.ones((2, 4, 5, 8))
      >>> out, state = rem_apply(cfg, init_rem_params(cfg), v)
      >>> out.shape, state.ring.shape
      ((2, 4, 5, 8), (2, 4, 2, 2, 8))
    """
    name = "rem_apply"
    if method not in METHODS:
        raise ValueError(f"{name}: method must be one of {METHODS}, got {method!r}")
    values = _check_values(name, config, values, time_axis=True)
    batch_shape, num_tokens, dim = values.shape[:-3], values.shape[-2], values.shape[-1]
    mask = _check_mask(name, mask, batch_shape + (num_tokens,), "[..., T]")
    if initial_state is None:
        initial_state = init_rem_state(config, batch_shape, dim, _float_dtype(values.dtype))
    _check_state(name, config, initial_state, batch_shape, dim)
    acc = _float_dtype(values.dtype, initial_state.ring.dtype)
    a_re, a_im = _head_coefficients(config, params, acc, name)
    if num_tokens == 0:
        return jnp.zeros(values.shape, values.dtype), initial_state

    if num_tokens == 1:  # a streaming step: one update of the ring, no scan
        final, out = rem_step(
            config, params, initial_state, values[..., 0, :], None if mask is None else mask[..., 0]
        )
        return out[..., None, :], final
    if method == "sequential":
        xs = (jnp.moveaxis(values, -2, 0), None if mask is None else jnp.moveaxis(mask, -1, 0))

        def body(state, x):
            return rem_step(config, params, state, x[0], x[1])

        final, out = jax.lax.scan(body, initial_state, xs)
        return jnp.moveaxis(out, 0, -2), final

    ring = initial_state.ring.astype(acc)
    phase = initial_state.phase
    v = values.astype(acc)
    complex_dtype = jnp.complex128 if acc == jnp.float64 else jnp.complex64
    outs, rings = [None] * config.num_heads, [None] * config.num_heads
    kinds, dils = config.head_kinds, config.head_dilations
    # One scan per distinct dilation (few scans keep compile time down); a group with a
    # cyclical head runs in complex arithmetic, where a regular head's imaginary part
    # stays exactly 0.
    for p in sorted(set(dils)):
        heads = [h for h in range(config.num_heads) if dils[h] == p]
        cyclic = any(kinds[h] != "regular" for h in heads)
        idx = np.asarray(heads)
        v_g, ring_g = v[..., idx, :, :], ring[..., idx, :p, :, :]
        if cyclic:
            a = jax.lax.complex(a_re[idx], a_im[idx])
            ring0 = jax.lax.complex(ring_g[..., 0, :], ring_g[..., 1, :])
            v_g = v_g.astype(complex_dtype)
        else:
            a, ring0 = a_re[idx], ring_g[..., 0, :]
        layout = _cell_layout(mask, phase, p, num_tokens)
        out_g, ring_g = _apply_group(v_g, ring0, a, layout, p, mask)
        if cyclic:
            is_sin = np.array([kinds[h] == "cyclic_sin" for h in heads])
            is_sin = is_sin.reshape((1,) * (out_g.ndim - 3) + (-1, 1, 1))
            out_g = jnp.where(is_sin, jnp.imag(out_g), jnp.real(out_g))
            ring_g = jnp.stack([jnp.real(ring_g), jnp.imag(ring_g)], axis=-2)
        else:
            ring_g = jnp.stack([ring_g, jnp.zeros_like(ring_g)], axis=-2)
        for i, h in enumerate(heads):
            outs[h] = out_g[..., i, :, :]
            rings[h] = jnp.concatenate([ring_g[..., i, :, :, :], ring[..., h, p:, :, :]], axis=-3)
    out = jnp.stack(outs, axis=-3).astype(values.dtype)
    seen = num_tokens if mask is None else jnp.sum(mask, axis=-1, dtype=jnp.int32)
    new_phase = ((phase + seen) % config.phase_modulus).astype(phase.dtype)
    final = REMState(jnp.stack(rings, axis=-4).astype(initial_state.ring.dtype), new_phase)
    return out, final


def rem_apply_bidirectional(
    config: REMConfig,
    params: Mapping[str, Array],
    values: Array,
    mask: Array | None = None,
) -> Array:
    """The unmasked REMs ``(P + P^T) V`` (Section 3) as two recurrences, O(T D) per head.

    A forward pass gives ``P V``, a pass over the reversed sequence gives ``P^T V``. No
    truncation at ``K``; no streaming (the backward pass needs the whole sequence).

    Args:
      config: head assignment.
      params: ``{"eta", "nu", "theta"}``.
      values: values per head. [..., H, T, D]
      mask: True where the token is present; absent tokens are skipped. [..., T]

    Returns:
      ``(P + P^T) V`` per head, in ``values``' dtype. [..., H, T, D]
    """
    forward, _ = rem_apply(config, params, values, mask)
    flipped_mask = None if mask is None else jnp.flip(jnp.asarray(mask), axis=-1)
    backward, _ = rem_apply(config, params, jnp.flip(values, axis=-2), flipped_mask)
    return forward + jnp.flip(backward, axis=-2)
