"""REMs in matrix form (RSA, Appendix D.1-D.2): the Toeplitz lag matrix, truncated at ``K``.

See ``aaren_jax.rem`` for the REMs' definition; ``aaren_jax.rem_recurrence`` computes the
same operator applied to values as a recurrence, with no truncation.

Shape notation: ``...`` leading axes, ``H`` heads, ``Tq``/``Tk`` query/key lengths.
"""

from __future__ import annotations

from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np

from aaren_jax.rem_config import (
    DEFAULT_MAX_POWER,
    KINDS,
    PARAM_NAMES,
    REMConfig,
    as_int,
    config_params,
)
from aaren_jax.scan import accumulation_dtype

Array = jax.Array


# --------------------------------------------------------------------------------------
# Matrix form (Appendix D.1 / D.2)
# --------------------------------------------------------------------------------------


def _check_kind(name: str, kind) -> str:
    if kind not in KINDS:
        raise ValueError(f"{name}: kind must be one of {KINDS}, got {kind!r}")
    return kind


def _get_params(name: str, kind: str, params: Mapping) -> tuple[Array, ...]:
    if not isinstance(params, Mapping):
        raise TypeError(f"{name}: params must be a mapping with keys {PARAM_NAMES[kind]}")
    missing = [p for p in PARAM_NAMES[kind] if p not in params]
    if missing:
        raise ValueError(f"{name}: params for kind {kind!r} lack {missing}")
    arrays = tuple(jnp.asarray(params[p]) for p in PARAM_NAMES[kind])
    for p, x in zip(PARAM_NAMES[kind], arrays, strict=True):
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
        if as_int(f"{name}: {arg}", value) < 0:
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
        as_int(f"{name}: dilation", dilation),
        as_int(f"{name}: max_power", max_power),
    )
    if dilation < 1 or max_power < 1:
        raise ValueError(
            f"{name}: dilation and max_power must be >= 1, got {dilation}, {max_power}"
        )
    arrays = _get_params(name, kind, params)
    acc = accumulation_dtype(*(x.dtype for x in arrays))
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
    eta, nu, theta = config_params("rem_matrices", config, params, acc)
    regular = _regular_table(eta, num_powers)
    cos, sin = _cyclic_tables(nu, theta, num_powers)
    rows = jnp.concatenate([regular, cos, sin], axis=0)  # [k_reg + 2 k_cyc, N]
    offsets = {"regular": 0, "cyclic_cos": config.num_regular}
    offsets["cyclic_sin"] = config.num_regular + config.num_cyclic
    row = [offsets[k] + i for k, i in zip(config.head_kinds, config.head_param_index, strict=True)]
    return jnp.take(rows, jnp.asarray(row, jnp.int32), axis=0)


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
    acc = accumulation_dtype(
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
