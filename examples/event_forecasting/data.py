"""Event sequences: readers (EasyTPP JSON, ifl-tpp npz, meta-tpp npz), generators, batches.

A sequence is a list of events ``(t_i, k_i)``, ``i = 1..n``, with arrival times ``t_i`` sorted
and marks ``k_i`` in ``[0, M)``, observed on a window that starts at ``t_start`` and, where the
data say so, ends at ``t_end``. The inter-event time of event ``i`` is
``tau_i = t_i - t_{i-1}`` with ``t_0 = t_start``.

Two kinds of window:

* the window starts at a known time before the first event (the generated Sin and Hawkes data:
  ``t_start = 0``): every event is predicted, the first one from a learned start context;
* the window starts *at* the first event (EasyTPP, ifl-tpp and meta-tpp files, whose first
  event marks the start of the record, e.g. ``time_since_start[0] == 0``): the first event is
  context only and events ``2..n`` are predicted. ``first_is_context`` says which.

Where ``t_end`` is known (the generated data and meta-tpp files, whose last inter-time runs to
the window's end) the log-likelihood includes the survival term of the last interval.

Bad input (unsorted times, zero or negative gaps where they cannot be, marks out of range,
empty sequences, inconsistent fields) raises ``EventDataError`` naming the file and the
sequence: it never reaches the loss as a NaN.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
import os
import tempfile
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from examples.common.paths import REPO_ROOT, default_data_root

DATASETS = ("stackoverflow", "taxi", "wikipedia", "sin", "hawkes")

# EasyTPP JSON as stored in ../shared/data/TPP (see the SOURCE.txt there): the files come
# verbatim from TanXZfra/Time-aware-Hawkes-Attention at a pinned commit, checked by sha256.
EASYTPP_COMMIT = "679be79dadab8f00acbc3913e42603c37c1d444a"
EASYTPP_URL = (
    "https://raw.githubusercontent.com/TanXZfra/Time-aware-Hawkes-Attention/{commit}/"
    "data/data_{name}/{split}.json"
)
EASYTPP_SHA256 = {
    ("stackoverflow", "train"): "809e68fbaba02f657b3dc2cb02ecb4df1f58c4fc8f9fbccdfa83defe71ef5413",
    ("stackoverflow", "valid"): "4c4e595342c4c2624a77502695654ce3bec157242be30b6f3654575791741c6a",
    ("stackoverflow", "test"): "e531fafc1cc2c109fcfe0a312e43beddda16725ec7c2a98b651609550f9ffb51",
    ("taxi", "train"): "0c54b53482e792f8cd813195e76e08466a68761b35c34cd503a012b41525d989",
    ("taxi", "valid"): "9ae91594723cf9cba7333efa18f85d309f5ee76336cc25d5811d0364f05a3ddf",
    ("taxi", "test"): "dc1e765b6626c2a231ab026606e29864c082807354066e0307494fb738bcc059",
}
EASYTPP_FOLDERS = {"stackoverflow": "StackOverflow", "taxi": "Taxi"}

# StackOverflow's times are stored at a resolution of 2**-13 and 0.5 % of its gaps are 0
# (ties). A log-normal has no mass at 0, so ties are set to this floor (one resolution step);
# every other dataset refuses zero gaps.
STACKOVERFLOW_TIE_FLOOR = 2.0**-13


class EventDataError(ValueError):
    """Malformed event data; the message names the file and the sequence."""


@dataclasses.dataclass
class EventSeq:
    """One sequence of events.

    Attributes:
      times: [n] float64 arrival times, non-decreasing (strictly where ties are refused).
      marks: [n] int64 marks in [0, M).
      t_start: the window's start (<= times[0]).
      t_end: the window's end (>= times[-1]), or None when the data do not give it.
      first_is_context: True when the window starts at the first event: event 1 is not
        predicted.
    """

    times: np.ndarray
    marks: np.ndarray
    t_start: float
    t_end: float | None
    first_is_context: bool

    def __len__(self) -> int:
        return len(self.times)

    def gaps(self) -> np.ndarray:
        """[n] inter-event times ``t_i - t_{i-1}`` (``t_0 = t_start``)."""
        return np.diff(self.times, prepend=self.t_start)

    def predicted(self) -> np.ndarray:
        """[n] bool: which events are predicted (all but a context first event)."""
        out = np.ones(len(self), bool)
        out[0] = not self.first_is_context
        return out


def validate(
    seqs: Sequence[EventSeq],
    num_marks: int,
    source: str,
    *,
    names: Sequence | None = None,
    tie_floor: float | None = None,
) -> list[EventSeq]:
    """Checks every sequence; returns them with ties raised to ``tie_floor`` if allowed.

    Args:
      seqs: the sequences.
      num_marks: M; marks must lie in [0, M).
      source: the file (or generator) the sequences come from, for error messages.
      names: a name per sequence for error messages (default: its index).
      tie_floor: None refuses zero gaps between predicted events; a positive value replaces
        them (ties of the data's time resolution) by that value.

    Returns:
      The checked sequences (new objects where ties were raised).

    Raises:
      EventDataError: an empty sequence, a non-finite or unsorted time, a zero gap where ties
        are refused, a mark out of range, a window that does not contain the events.
    """
    out = []
    for i, s in enumerate(seqs):
        name = f"{source}: sequence {names[i] if names is not None else i}"
        if len(s.times) == 0:
            raise EventDataError(f"{name}: empty sequence")
        if len(s.marks) != len(s.times):
            raise EventDataError(f"{name}: {len(s.marks)} marks for {len(s.times)} times")
        if not np.all(np.isfinite(s.times)):
            raise EventDataError(f"{name}: non-finite time")
        if s.times[0] < s.t_start:
            raise EventDataError(f"{name}: first time {s.times[0]} before start {s.t_start}")
        gaps = s.gaps()
        bad = np.flatnonzero(gaps < 0)
        if len(bad):
            j = int(bad[0])
            raise EventDataError(
                f"{name}: times not sorted at event {j} ({s.times[j - 1]} then {s.times[j]})"
            )
        zero = np.flatnonzero((gaps == 0) & s.predicted())
        times, t_end = s.times, s.t_end
        if len(zero):
            if tie_floor is None:
                j = int(zero[0])
                raise EventDataError(
                    f"{name}: zero inter-event time at event {j} (time {s.times[j]}); a "
                    "log-normal needs positive gaps"
                )
            # raise each tied gap to the floor; later times (and the window end) shift by the
            # floors added before them
            gaps = np.where((gaps == 0) & s.predicted(), tie_floor, gaps)
            times = s.t_start + np.cumsum(gaps)
            if t_end is not None:
                t_end = t_end + float(times[-1] - s.times[-1])
        if np.any((s.marks < 0) | (s.marks >= num_marks)):
            j = int(np.flatnonzero((s.marks < 0) | (s.marks >= num_marks))[0])
            raise EventDataError(f"{name}: mark {s.marks[j]} at event {j} not in [0, {num_marks})")
        if t_end is not None and t_end < times[-1]:
            raise EventDataError(f"{name}: window end {t_end} before last event {times[-1]}")
        out.append(dataclasses.replace(s, times=times, t_end=t_end))
    return out


# --- readers ---------------------------------------------------------------------------------


def read_easytpp_json(
    path: str | os.PathLike, *, tie_floor: float | None = None
) -> tuple[list[EventSeq], int]:
    """Reads an EasyTPP JSON file: a list of records, one per sequence.

    Each record has ``dim_process`` (M), ``seq_len``, ``seq_idx``, ``time_since_start``,
    ``time_since_last_event`` and ``type_event``. The record starts at its first event
    (``time_since_start[0] == 0``), so the first event is context.

    Args:
      path: the ``.json`` file.
      tie_floor: see ``validate`` (None refuses zero gaps).

    Returns:
      ``(sequences, M)``.

    Raises:
      EventDataError: a malformed record (named by file and ``seq_idx``).
    """
    path = Path(path)
    with path.open() as f:
        records = json.load(f)
    if isinstance(records, dict):  # some EasyTPP dumps wrap the list: {"train": [...]}
        lists = [v for v in records.values() if isinstance(v, list)]
        if len(lists) != 1:
            raise EventDataError(f"{path}: expected a list of sequence records")
        records = lists[0]
    seqs, names, num_marks = [], [], 0
    for i, r in enumerate(records):
        name = r.get("seq_idx", i) if isinstance(r, dict) else i
        missing = {"time_since_start", "type_event"} - set(r if isinstance(r, dict) else ())
        if missing:
            raise EventDataError(f"{path}: sequence {name}: missing fields {sorted(missing)}")
        times = np.asarray(r["time_since_start"], np.float64)
        marks = np.asarray(r["type_event"], np.int64)
        if "seq_len" in r and r["seq_len"] != len(times):
            raise EventDataError(
                f"{path}: sequence {name}: seq_len {r['seq_len']} but {len(times)} times"
            )
        if not np.all(np.isfinite(times)):
            raise EventDataError(f"{path}: sequence {name}: non-finite time")
        if "time_since_last_event" in r and len(times):
            dt = np.asarray(r["time_since_last_event"], np.float64)
            ref = np.diff(times, prepend=times[0])
            if len(dt) != len(times) or not np.allclose(dt, ref, rtol=1e-6, atol=1e-6):
                raise EventDataError(
                    f"{path}: sequence {name}: time_since_last_event disagrees with "
                    "time_since_start"
                )
        num_marks = max(num_marks, int(r.get("dim_process", 0)))
        t0 = float(times[0]) if len(times) else 0.0
        seqs.append(EventSeq(times, marks, t0, None, first_is_context=True))
        names.append(name)
    if num_marks == 0:
        num_marks = 1 + max((int(s.marks.max()) for s in seqs if len(s)), default=0)
    return validate(seqs, num_marks, str(path), names=names, tie_floor=tie_floor), num_marks


def _object_rows(array: np.ndarray) -> list[np.ndarray]:
    return [np.asarray(row) for row in array]


def read_ifl_npz(path: str | os.PathLike) -> tuple[list[EventSeq], int]:
    """Reads an ifl-tpp npz (Shchur et al. 2020): object arrays ``arrival_times``, ``marks``.

    The file stores neither a window start before the first event nor a window end (the first
    times are offsets within the month of edits, not 0), so the window is taken to start at
    the first event, which is context; no survival term.

    Args:
      path: the ``.npz`` file (read with ``allow_pickle=True``: it holds object arrays).

    Returns:
      ``(sequences, M)`` with M = 1 + the largest mark (1 without marks).

    Raises:
      EventDataError: a malformed sequence (named by file and index).
    """
    path = Path(path)
    with np.load(path, allow_pickle=True) as z:
        if "arrival_times" not in z.files:
            raise EventDataError(f"{path}: no 'arrival_times' array (has {z.files})")
        times = _object_rows(z["arrival_times"])
        marks = _object_rows(z["marks"]) if "marks" in z.files else None
    if marks is None:
        marks = [np.zeros(len(t), np.int64) for t in times]
    if len(marks) != len(times):
        raise EventDataError(f"{path}: {len(marks)} mark rows for {len(times)} sequences")
    num_marks = 1 + max((int(np.max(m)) for m in marks if len(m)), default=0)
    seqs = [
        EventSeq(
            np.asarray(t, np.float64),
            np.asarray(m, np.int64),
            float(t[0]) if len(t) else 0.0,
            None,
            True,
        )
        for t, m in zip(times, marks, strict=True)
    ]
    return validate(seqs, num_marks, str(path)), num_marks


def read_meta_tpp_npz(
    path: str | os.PathLike, num_marks: int | None = None
) -> tuple[list[EventSeq], int]:
    """Reads a meta-tpp npz (Bae et al. 2023, BorealisAI/meta-tpp ``TPPDataset``).

    Layout: ``times`` [N, L] inter-event times (padded, or an object array of rows);
    optional ``marks`` [N, L], 1-indexed with 0 for padding; optional ``masks`` [N, L], 1 at
    valid entries. In each row the last valid entry is the interval from the last event to
    the window's end, and the first entry's event is input only (meta-tpp predicts events
    ``2..n`` and adds the survival term of that last interval). So here: events are the
    first ``L_valid - 1`` entries, arrival times their cumulative sums from 0, the window
    ends at the sum of all valid entries, and the first event is context.

    Args:
      path: the ``.npz`` file.
      num_marks: M (meta-tpp configs give it); default: the largest mark.

    Returns:
      ``(sequences, M)`` with marks shifted to 0-indexing.

    Raises:
      EventDataError: a malformed row (named by file and row).
    """
    path = Path(path)
    with np.load(path, allow_pickle=True) as z:
        if "times" not in z.files:
            raise EventDataError(f"{path}: no 'times' array (has {z.files})")
        times = _object_rows(z["times"])
        marks = _object_rows(z["marks"]) if "marks" in z.files else None
        masks = _object_rows(z["masks"]) if "masks" in z.files else None
    seqs, names = [], []
    for i, tau in enumerate(times):
        tau = np.asarray(tau, np.float64).reshape(-1)
        valid = (
            np.asarray(masks[i]).reshape(-1).astype(bool)
            if masks is not None
            else np.ones(len(tau), bool)
        )
        if valid.shape != tau.shape:
            raise EventDataError(f"{path}: sequence {i}: mask length differs from times")
        if valid.any() and not valid[: valid.sum()].all():
            raise EventDataError(f"{path}: sequence {i}: mask is not a prefix")
        n = int(valid.sum()) - 1  # the last valid entry is the interval to the window's end
        if n < 1:
            raise EventDataError(f"{path}: sequence {i}: empty sequence")
        if np.any(tau[: n + 1] < 0):
            j = int(np.flatnonzero(tau[: n + 1] < 0)[0])
            raise EventDataError(f"{path}: sequence {i}: negative inter-event time at entry {j}")
        mk = (
            np.asarray(marks[i], np.int64).reshape(-1)[:n] - 1
            if marks is not None
            else np.zeros(n, np.int64)
        )
        arrival = np.cumsum(tau[:n])
        seqs.append(EventSeq(arrival, mk, float(arrival[0]), float(np.sum(tau[: n + 1])), True))
        names.append(i)
    if num_marks is None:
        num_marks = 1 + max(int(s.marks.max()) for s in seqs)
    return validate(seqs, num_marks, str(path), names=names), num_marks


def load_meta_tpp(
    path: str | os.PathLike,
    num_marks: int | None = None,
    split_sizes: tuple[float, float] = (0.6, 0.2),
    *,
    max_train_events: int | None = None,
) -> EventData:
    """A meta-tpp npz with meta-tpp's split: the first train/val shares in file order.

    ``split_sizes`` are fractions, or sequence counts when above 1 (meta-tpp's ``so_fold1``
    uses ``(4777, 530)``), as in meta-tpp's ``TPPDataset._get_split_indices``.
    """
    seqs, num_marks = read_meta_tpp_npz(path, num_marks)
    n = len(seqs)
    tr, va = split_sizes
    a = int(tr) if tr > 1 else int(n * tr)
    b = a + (int(va) if va > 1 else int(n * va))
    return make_data(
        Path(path).stem,
        seqs[:a],
        seqs[a:b],
        seqs[b:],
        num_marks,
        max_train_events=max_train_events,
    )


# --- download --------------------------------------------------------------------------------


def sha256_file(path: str | os.PathLike) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def download_easytpp(
    dest: str | os.PathLike,
    names: Sequence[str] = ("stackoverflow", "taxi"),
    *,
    url_for: Callable[[str, str], str] | None = None,
) -> list[Path]:
    """Downloads the EasyTPP JSON files into ``dest/TPP/<Name>/`` and checks their sha256.

    The files are the ones in ``../shared/data/TPP`` (from TanXZfra/Time-aware-Hawkes-Attention
    at commit ``EASYTPP_COMMIT``). Files already present with the right checksum are kept.

    Args:
      dest: a data root (the layout of ``../shared/data``).
      names: "stackoverflow" and/or "taxi".
      url_for: ``url_for(name, split) -> url`` (default: the pinned GitHub raw URL); any URL
        ``urllib`` opens works, ``file://`` included.

    Returns:
      The verified files.

    Raises:
      ValueError: on a checksum mismatch (the partial download is removed).
    """
    if url_for is None:
        url_for = lambda name, split: EASYTPP_URL.format(  # noqa: E731
            commit=EASYTPP_COMMIT, name=name, split=split
        )
    paths = []
    for name in names:
        out_dir = Path(dest) / "TPP" / EASYTPP_FOLDERS[name]
        out_dir.mkdir(parents=True, exist_ok=True)
        for split in ("train", "valid", "test"):
            path, expected = out_dir / f"{split}.json", EASYTPP_SHA256[(name, split)]
            if path.exists() and sha256_file(path) == expected:
                paths.append(path)
                continue
            url = url_for(name, split)
            logging.info("downloading %s", url)
            fd, tmp = tempfile.mkstemp(dir=out_dir, suffix=".part")
            try:
                with os.fdopen(fd, "wb") as f, urllib.request.urlopen(url, timeout=60) as r:
                    while chunk := r.read(1 << 20):
                        f.write(chunk)
                digest = sha256_file(tmp)
                if digest != expected:
                    raise ValueError(f"{url}: sha256 {digest} != expected {expected}")
                os.replace(tmp, path)
            finally:
                if os.path.exists(tmp):
                    os.remove(tmp)
            paths.append(path)
    return paths


# --- generated data --------------------------------------------------------------------------

SIN_PERIOD = 4 * math.pi
SIN_T_END = 32 * math.pi


def sin_intensity(t: np.ndarray) -> np.ndarray:
    """The Sin process's intensity ``1 + sin(2 pi t / (4 pi))``: period 4 pi, in [0, 2]."""
    return 1.0 + np.sin(2 * np.pi * np.asarray(t) / SIN_PERIOD)


def sin_compensator(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """``int_a^b (1 + sin(t / 2)) dt`` in closed form."""
    return (b - a) + 2.0 * (np.cos(np.asarray(a) / 2) - np.cos(np.asarray(b) / 2))


def thinning(
    rng: np.random.Generator,
    intensity: Callable[[np.ndarray], np.ndarray],
    upper: float,
    t_end: float,
) -> np.ndarray:
    """Samples an inhomogeneous Poisson process on [0, t_end] by thinning (Lewis and Shedler).

    Candidates come from a homogeneous process of rate ``upper`` (which must bound the
    intensity); each is kept with probability ``intensity(t) / upper``.

    Returns:
      [n] sorted arrival times.
    """
    n = rng.poisson(upper * t_end)
    cand = np.sort(rng.uniform(0.0, t_end, n))
    lam = intensity(cand)
    if np.any(lam > upper * (1 + 1e-12)):
        raise ValueError("the intensity exceeds the thinning bound")
    return cand[rng.uniform(0.0, 1.0, n) * upper < lam]


@dataclasses.dataclass(frozen=True)
class HawkesParams:
    """A multivariate Hawkes process with exponential kernels.

    ``lambda_k(t) = mu_k + sum_{t_j < t} alpha[k, k_j] * beta * exp(-beta (t - t_j))``: each
    event of mark ``l`` adds ``alpha[k, l]`` expected children of mark ``k`` (branching
    matrix ``alpha``; stationary when its spectral radius is below 1).
    """

    mu: tuple[float, ...] = (0.2, 0.1, 0.15)
    alpha: tuple[tuple[float, ...], ...] = (
        (0.3, 0.1, 0.0),
        (0.2, 0.3, 0.1),
        (0.0, 0.2, 0.4),
    )
    beta: float = 1.0
    t_end: float = 100.0

    @property
    def num_marks(self) -> int:
        return len(self.mu)


def hawkes_sample(rng: np.random.Generator, p: HawkesParams) -> tuple[np.ndarray, np.ndarray]:
    """One sequence on [0, t_end] by Ogata's thinning.

    Between events the total intensity decays, so its value just after the current time
    bounds it until the next candidate; a candidate is accepted with probability
    ``lambda(t) / bound`` and its mark drawn proportionally to ``lambda_k(t)``.

    Returns:
      ``(times [n], marks [n])``.
    """
    mu, alpha, beta = np.asarray(p.mu), np.asarray(p.alpha), p.beta
    excite = np.zeros(len(mu))  # sum_j alpha[:, k_j] beta exp(-beta (t - t_j)) at time t
    t, times, marks = 0.0, [], []
    while True:
        bound = mu.sum() + excite.sum()
        w = rng.exponential(1.0 / bound)
        if t + w > p.t_end:
            break
        excite = excite * np.exp(-beta * w)
        t += w
        lam = mu + excite
        if rng.uniform() * bound <= lam.sum():
            k = int(rng.choice(len(mu), p=lam / lam.sum()))
            times.append(t)
            marks.append(k)
            excite = excite + alpha[:, k] * beta
    return np.asarray(times, np.float64), np.asarray(marks, np.int64)


def hawkes_loglik(times: np.ndarray, marks: np.ndarray, p: HawkesParams) -> float:
    """The exact log-likelihood ``sum_i log lambda_{k_i}(t_i) - sum_k int_0^T lambda_k``.

    O(n) by the exponential kernel's recursion; the compensator in closed form:
    ``int_0^T lambda_k = mu_k T + sum_j alpha[k, k_j] (1 - exp(-beta (T - t_j)))``.
    """
    mu, alpha, beta = np.asarray(p.mu), np.asarray(p.alpha), p.beta
    excite, last, ll = np.zeros(len(mu)), 0.0, 0.0
    for t, k in zip(times, marks, strict=True):
        excite = excite * np.exp(-beta * (t - last))
        ll += np.log(mu[k] + excite[k])
        excite = excite + alpha[:, k] * beta
        last = t
    comp = mu.sum() * p.t_end + np.sum(
        alpha[:, marks].sum(0) * (1 - np.exp(-beta * (p.t_end - times)))
    )
    return float(ll - comp)


def sin_loglik(times: np.ndarray) -> float:
    """The Sin process's exact log-likelihood on [0, 32 pi]."""
    return float(np.sum(np.log(sin_intensity(times))) - sin_compensator(0.0, SIN_T_END))


def generate(
    name: str, num_seqs: int = 1000, seed: int = 0, hawkes: HawkesParams | None = None
) -> tuple[list[EventSeq], int, np.ndarray]:
    """Generates ``num_seqs`` sequences of "sin" or "hawkes".

    Returns:
      ``(sequences, M, loglik)`` with each sequence's exact log-likelihood under the
      generating process (windows [0, T], every event predicted).
    """
    rng = np.random.default_rng([seed, 0 if name == "sin" else 1])
    seqs, ll = [], []
    while len(seqs) < num_seqs:
        if name == "sin":
            t = thinning(rng, sin_intensity, 2.0, SIN_T_END)
            m, t_end, num_marks = np.zeros(len(t), np.int64), SIN_T_END, 1
        elif name == "hawkes":
            hp = hawkes or HawkesParams()
            t, m = hawkes_sample(rng, hp)
            t_end, num_marks = hp.t_end, hp.num_marks
        else:
            raise ValueError(f"unknown generated dataset {name!r}")
        if len(t) == 0 or np.any(np.diff(t) <= 0):
            continue  # an empty window (or a float tie): draw again
        seqs.append(EventSeq(t, m, 0.0, t_end, first_is_context=False))
        ll.append(sin_loglik(t) if name == "sin" else hawkes_loglik(t, m, hawkes or HawkesParams()))
    return validate(seqs, num_marks, f"generated:{name}"), num_marks, np.asarray(ll)


def load_generated(
    name: str, cache_dir: str | os.PathLike | None, num_seqs: int = 1000, seed: int = 0
) -> tuple[list[EventSeq], int, np.ndarray]:
    """``generate`` with an npz cache in ``cache_dir`` (None: no cache)."""
    if cache_dir is None:
        return generate(name, num_seqs, seed)
    path = Path(cache_dir) / f"{name}_{num_seqs}_{seed}.npz"
    if path.exists():
        with np.load(path, allow_pickle=True) as z:
            seqs = [
                EventSeq(np.asarray(t, np.float64), np.asarray(m, np.int64), 0.0, float(e), False)
                for t, m, e in zip(z["times"], z["marks"], z["t_end"], strict=True)
            ]
            return validate(seqs, int(z["num_marks"]), str(path)), int(z["num_marks"]), z["loglik"]
    seqs, num_marks, ll = generate(name, num_seqs, seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    times = np.empty(len(seqs), object)
    marks = np.empty(len(seqs), object)
    for i, s in enumerate(seqs):
        times[i], marks[i] = s.times, s.marks
    tmp = path.with_suffix(".tmp.npz")
    np.savez(
        tmp,
        times=times,
        marks=marks,
        t_end=np.array([s.t_end for s in seqs]),
        num_marks=num_marks,
        loglik=ll,
    )
    os.replace(tmp, path)
    return seqs, num_marks, ll


# --- batches ---------------------------------------------------------------------------------


def bucket_length(n: int, minimum: int = 16) -> int:
    """The padded token count for ``n`` tokens: the next power of two (few compilations)."""
    return max(minimum, 1 << (n - 1).bit_length())


def split_windows(seqs: Sequence[EventSeq], max_events: int | None) -> list[EventSeq]:
    """Cuts sequences longer than ``max_events`` into windows (training only).

    Window ``w`` holds events ``[w W, (w + 1) W]``: consecutive windows share one event,
    which is context in the later one, so every predicted event is predicted exactly once
    (with a history truncated to its window). Only the last window keeps ``t_end``.
    """
    if not max_events:
        return list(seqs)
    out = []
    for s in seqs:
        if len(s) <= max_events + 1:
            out.append(s)
            continue
        starts = list(range(0, len(s) - 1, max_events))
        for j, a in enumerate(starts):
            b = min(a + max_events + 1, len(s))
            last = j == len(starts) - 1
            first = a == 0
            out.append(
                EventSeq(
                    s.times[a:b],
                    s.marks[a:b],
                    s.t_start if first else float(s.times[a]),
                    s.t_end if last else None,
                    s.first_is_context if first else True,
                )
            )
    return out


@dataclasses.dataclass
class EventSet:
    """The sequences of one split (a ``BatchSource`` of the shared loop).

    A batch has ``L = bucket_length(n_max + 1)`` token positions; position 0 is the start
    token and position ``j >= 1`` is event ``j``. The output at position ``j`` predicts event
    ``j + 1``; the output after the last event carries the survival term.

    Attributes:
      seqs: the sequences.
      num_marks: M.
      log_mean: mean of log inter-event times over the training split's predicted events.
      log_std: their standard deviation.
    """

    seqs: list[EventSeq]
    num_marks: int
    log_mean: float
    log_std: float

    def __len__(self) -> int:
        return len(self.seqs)

    @property
    def num_events(self) -> int:
        """Predicted events."""
        return int(sum(s.predicted().sum() for s in self.seqs))

    def batch(self, indices: np.ndarray) -> dict[str, np.ndarray]:
        """The padded batch of ``indices`` (see ``make_batch``)."""
        return make_batch(
            [self.seqs[i] for i in indices], self.num_marks, self.log_mean, self.log_std
        )


def make_batch(
    seqs: Sequence[EventSeq], num_marks: int, log_mean: float, log_std: float
) -> dict[str, np.ndarray]:
    """Pads sequences into model inputs and targets, all [B, L].

    Inputs at position j (0 = start token, j = event j): ``time`` (t_j - t_start; 0 at the
    start token), ``gap`` (standardised log inter-event time into event j; 0 at the start
    token, at event 1 and at padding), ``mark_in`` (mark of event j; M at the start token),
    ``token_mask``. Targets at position j (event j + 1): ``tau`` (its inter-event time; 1 at
    unused positions), ``mark`` (0 unused), ``target_mask``; the survival interval after the
    last event: ``surv_tau`` and ``surv_mask`` (only where ``t_end`` is known).
    """
    n_max = max(len(s) for s in seqs)
    length = bucket_length(n_max + 1)
    b = len(seqs)
    out = {
        "time": np.zeros((b, length), np.float32),
        "gap": np.zeros((b, length), np.float32),
        "mark_in": np.full((b, length), num_marks, np.int32),
        "token_mask": np.zeros((b, length), bool),
        "tau": np.ones((b, length), np.float32),
        "mark": np.zeros((b, length), np.int32),
        "target_mask": np.zeros((b, length), bool),
        "surv_tau": np.ones((b, length), np.float32),
        "surv_mask": np.zeros((b, length), bool),
    }
    for i, s in enumerate(seqs):
        n = len(s)
        gaps = s.gaps()
        out["time"][i, 1 : n + 1] = s.times - s.t_start
        if n > 1:
            out["gap"][i, 2 : n + 1] = (np.log(gaps[1:]) - log_mean) / log_std
        out["mark_in"][i, 1 : n + 1] = s.marks
        out["token_mask"][i, : n + 1] = True
        pred = s.predicted()
        out["tau"][i, :n] = np.where(pred, gaps, 1.0)
        out["mark"][i, :n] = s.marks
        out["target_mask"][i, :n] = pred
        if s.t_end is not None:
            out["surv_tau"][i, n] = s.t_end - s.times[-1]
            out["surv_mask"][i, n] = True
    return out


def log_gap_stats(seqs: Sequence[EventSeq]) -> tuple[float, float]:
    """Mean and standard deviation of log inter-event times of the predicted events."""
    logs = np.concatenate([np.log(s.gaps()[s.predicted()]) for s in seqs])
    std = float(np.std(logs))
    return float(np.mean(logs)), std if std > 0 else 1.0


@dataclasses.dataclass
class EventData:
    """Train, validation and test splits of one dataset.

    Attributes:
      name: the dataset.
      train: training sequences (cut into windows of at most ``max_train_events``).
      val: validation sequences (whole).
      test: test sequences (whole).
      num_marks: M (1: unmarked).
      test_loglik: [N_test] the generating process's exact log-likelihood per test sequence
        (generated data), else None.
    """

    name: str
    train: EventSet
    val: EventSet
    test: EventSet
    num_marks: int
    test_loglik: np.ndarray | None = None

    @property
    def has_marks(self) -> bool:
        return self.num_marks > 1


def split_by_sequence(n: int, fractions=(0.6, 0.2), seed: int = 0) -> tuple[np.ndarray, ...]:
    """A seeded random 60/20/20 split of ``n`` sequences into (train, val, test) indices."""
    perm = np.random.default_rng(seed).permutation(n)
    a = int(round(fractions[0] * n))
    b = a + int(round(fractions[1] * n))
    return np.sort(perm[:a]), np.sort(perm[a:b]), np.sort(perm[b:])


def make_data(
    name: str,
    train: list[EventSeq],
    val: list[EventSeq],
    test: list[EventSeq],
    num_marks: int,
    *,
    max_train_events: int | None = None,
    test_loglik: np.ndarray | None = None,
) -> EventData:
    """Standardisation from the training split; training sequences cut into windows.

    Validation and test sequences are ordered by length (with ``test_loglik``), so that
    evaluation batches hold sequences of similar length: less padding, same metrics.
    """
    log_mean, log_std = log_gap_stats(train)
    val = sorted(val, key=len)
    order = np.argsort([len(s) for s in test], kind="stable")
    test = [test[i] for i in order]
    if test_loglik is not None:
        test_loglik = np.asarray(test_loglik)[order]
    mk = lambda seqs: EventSet(seqs, num_marks, log_mean, log_std)  # noqa: E731
    return EventData(
        name,
        mk(split_windows(train, max_train_events)),
        mk(val),
        mk(test),
        num_marks,
        test_loglik,
    )


def default_cache_dir() -> Path:
    """Where generated datasets are cached (ignored by git)."""
    return REPO_ROOT / "workdirs" / "event_forecasting_cache"


def load_dataset(
    name: str,
    data_root: str | os.PathLike | None = None,
    *,
    cache_dir: str | os.PathLike | None = None,
    split_seed: int = 0,
    num_generated: int = 1000,
    max_train_events: int | None = None,
) -> EventData:
    """Loads one dataset with its fixed split.

    Args:
      name: one of ``DATASETS``.
      data_root: folder holding ``TPP/``; default ``../shared/data``.
      cache_dir: where generated data are cached (default ``workdirs/event_forecasting_cache``).
      split_seed: seed of the 60/20/20 split of Wikipedia and of the generated data.
      num_generated: sequences of a generated dataset.
      max_train_events: cut training sequences into windows of this many predicted events.

    Returns:
      The splits.
    """
    root = Path(data_root) if data_root is not None else default_data_root()
    if name in EASYTPP_FOLDERS:
        folder = root / "TPP" / EASYTPP_FOLDERS[name]
        floor = STACKOVERFLOW_TIE_FLOOR if name == "stackoverflow" else None
        splits = [
            read_easytpp_json(folder / f"{s}.json", tie_floor=floor)
            for s in ("train", "valid", "test")
        ]
        num_marks = max(m for _, m in splits)
        return make_data(
            name, *(s for s, _ in splits), num_marks, max_train_events=max_train_events
        )
    if name == "wikipedia":
        seqs, num_marks = read_ifl_npz(root / "TPP" / "Wikipedia" / "wikipedia.npz")
        tr, va, te = split_by_sequence(len(seqs), seed=split_seed)
        pick = lambda idx: [seqs[i] for i in idx]  # noqa: E731
        return make_data(
            name, pick(tr), pick(va), pick(te), num_marks, max_train_events=max_train_events
        )
    if name in ("sin", "hawkes"):
        cache = default_cache_dir() if cache_dir is None else cache_dir
        seqs, num_marks, ll = load_generated(name, cache, num_generated, split_seed)
        tr, va, te = split_by_sequence(len(seqs), seed=split_seed)
        pick = lambda idx: [seqs[i] for i in idx]  # noqa: E731
        return make_data(
            name,
            pick(tr),
            pick(va),
            pick(te),
            num_marks,
            max_train_events=max_train_events,
            test_loglik=ll[te],
        )
    raise ValueError(f"unknown dataset {name!r}; expected one of {DATASETS}")
