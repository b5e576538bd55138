"""Regular-language data of the RSA paper (Huang et al., ICLR 2023, Section 4.2, App. E.2).

Six languages from Bhattamishra et al. (2020), "On the Ability and Limitations of
Transformers to Recognize Formal Languages" (repository satwik77/Transformer-Formal-Languages):

* ``parity``  over {0, 1}: an even number of 1s.
* ``tomita3`` over {0, 1}: no odd-length run of 1s immediately followed by an odd-length
  run of 0s (Tomita, 1982).
* ``tomita5`` over {0, 1}: even numbers of 0s and of 1s.
* ``tomita6`` over {0, 1}: ``#0 - #1`` a multiple of 3.
* ``d2``, ``d4`` over {a, b}: ``D_1 = (ab)*``, ``D_n = (a D_{n-1} b)*``: balanced strings of
  depth at most ``n``.

Task (character prediction, Bhattamishra et al. Section 5; RSA App. E.2): the model reads
the string and, after each character, outputs the set of symbols that may legally come
next: a multi-hot vector over the alphabet plus an end symbol ``$`` (the repository's
terminal ``T``). Here a character ``c`` is legal after prefix ``w`` when ``wc`` can still
be completed into a member (the DFA state after ``wc`` is live), and ``$`` is legal when
``w`` itself is a member. A sample counts as right only if every position is right in
every symbol (``exact_match``).

``target_mode="repo"`` reproduces the repository's two-column targets instead: for
parity, Tomita 5 and 6 the one-hot membership of the prefix (every character is always
legal there, so only ``$`` carries information); for D_n the legal characters (``$``
is implied: legal exactly when only ``a`` is); for Tomita 3, where the repository lists
the DFA's rejecting state ``q3`` among its dead states, the characters ``c`` with ``wc``
a member (after ``1``, ``0`` is not listed although ``100`` is a member).

Lengths and sizes follow App. E.2: train and bin 0 in [2, 50] (Parity, Tomita) or
[2, 100] (D_n); bin 1 in [51, 100] or [101, 200]; 10K train and 2K per bin (Parity,
Tomita) or 5K and 1K (D_n). As in the repository, train and bin 0 are drawn as one
de-duplicated pool and split, so no string is in both; bin 1 is a separate
de-duplicated draw (its lengths cannot meet the others').

Sampling: a length, then a string drawn uniformly among the members of that length (exact,
by counting accepting paths of the DFA). Lengths follow the repository where it is
sensible: for parity and Tomita 5 and 6 its truncated geometric law (stop probability
``1 / (1 + L)``, ``L`` the middle of the range, truncated at the maximum, conditioned on the
minimum and on the existence of members); uniform for Tomita 3 (as its generator) and D_n.
Two deliberate departures: the repository builds Tomita 3 strings by runs and D_n strings
by nested random lengths, which are not uniform over members (and the D_n one yields too
few distinct strings of length <= 100 for 6K unique samples); here both are uniform given
the length.

Arrays: ``tokens`` [N, T] int32 (alphabet index, ``PAD`` = alphabet size on padding),
``targets`` [N, T, V] float32 multi-hot (zero on padding), ``mask`` [N, T] bool,
``lengths`` [N]; ``T`` is the bin's maximum length. Everything is numpy, seeded by a
``numpy.random.Generator``, and deterministic.

Example:
  >>> data = make_datasets("tomita3", seed=0, train_size=100, test_size=20)
  >>> data["train"].tokens.shape, data["train"].targets.shape
  ((100, 50), (100, 50, 3))
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import NamedTuple

import numpy as np

LANGUAGES = ("parity", "tomita3", "tomita5", "tomita6", "d2", "d4")
END = "$"
TARGET_MODES = ("legal", "repo")


class DFA(NamedTuple):
    """A complete deterministic automaton; state 0 is the start.

    Attributes:
      alphabet: the input symbols, in token order.
      transitions: next state for each state and symbol. [S, A]
      accepting: whether each state accepts. [S]
      live: whether an accepting state is reachable from each state. [S]
    """

    alphabet: str
    transitions: np.ndarray
    accepting: np.ndarray
    live: np.ndarray


class LanguageSpec(NamedTuple):
    """Data settings of one language (RSA App. E.2).

    Attributes:
      name: one of ``LANGUAGES``.
      alphabet: input symbols in token order.
      train_lengths: ``(min, max)`` length of train and bin 0.
      bin1_lengths: ``(min, max)`` length of bin 1.
      train_size: training samples.
      test_size: samples per test bin.
      length_law: ``"geometric"`` (repository's truncated geometric) or ``"uniform"``.
    """

    name: str
    alphabet: str
    train_lengths: tuple[int, int]
    bin1_lengths: tuple[int, int]
    train_size: int
    test_size: int
    length_law: str


class Split(NamedTuple):
    """Padded arrays of one split.

    Attributes:
      tokens: symbol indices, ``len(alphabet)`` on padding. [N, T] int32
      targets: legal next symbols after each prefix (multi-hot), 0 on padding. [N, T, V]
      mask: True on real characters. [N, T] bool
      lengths: string lengths. [N] int32
    """

    tokens: np.ndarray
    targets: np.ndarray
    mask: np.ndarray
    lengths: np.ndarray


def _complete(alphabet: str, transitions, accepting) -> DFA:
    transitions = np.asarray(transitions, np.int64)
    accepting = np.asarray(accepting, bool)
    live = accepting.copy()
    for _ in range(len(live)):  # backward reachability
        live = live | live[transitions].any(axis=1)
    return DFA(alphabet, transitions, accepting, live)


def _dyck_dfa(n: int) -> DFA:
    # States: depth 0..n, and n + 1 = dead (depth above n or below 0).
    dead = n + 1
    up = [d + 1 if d < n else dead for d in range(n + 1)] + [dead]
    down = [d - 1 if d > 0 else dead for d in range(n + 1)] + [dead]
    return _complete("ab", np.stack([up, down], axis=1), [d == 0 for d in range(n + 2)])


def language_dfa(name: str) -> DFA:
    """The minimal DFA of a language (state 0 is the start)."""
    if name == "parity":  # state = parity of the 1s
        return _complete("01", [[0, 1], [1, 0]], [True, False])
    if name == "tomita3":
        # 0: no pending odd 1-run (accept); 1: inside an odd 1-run (accept);
        # 2: even 0s after an odd 1-run (accept); 3: odd 0s after an odd 1-run; 4: dead.
        # Same automaton as the repository's Tomita3Language.
        return _complete(
            "01", [[0, 1], [3, 0], [3, 1], [2, 4], [4, 4]], [True, True, True, False, False]
        )
    if name == "tomita5":  # state = 2 * (#0 mod 2) + (#1 mod 2)
        return _complete("01", [[2, 1], [3, 0], [0, 3], [1, 2]], [True, False, False, False])
    if name == "tomita6":  # state = (#0 - #1) mod 3
        return _complete("01", [[1, 2], [2, 0], [0, 1]], [True, False, False])
    if name in ("d2", "d4"):
        return _dyck_dfa(int(name[1]))
    raise ValueError(f"unknown language {name!r}; expected one of {LANGUAGES}")


def language_spec(name: str) -> LanguageSpec:
    """Lengths, sizes and length law of a language, as in RSA App. E.2."""
    if name in ("parity", "tomita3", "tomita5", "tomita6"):
        law = "uniform" if name == "tomita3" else "geometric"
        return LanguageSpec(name, "01", (2, 50), (51, 100), 10_000, 2_000, law)
    if name in ("d2", "d4"):
        return LanguageSpec(name, "ab", (2, 100), (101, 200), 5_000, 1_000, "uniform")
    raise ValueError(f"unknown language {name!r}; expected one of {LANGUAGES}")


def _run(dfa: DFA, string: str) -> int:
    state = 0
    for ch in string:
        state = dfa.transitions[state, dfa.alphabet.index(ch)]
    return int(state)


def is_member(name: str, string: str) -> bool:
    """Whether ``string`` is in the language (through its DFA)."""
    dfa = language_dfa(name)
    if any(ch not in dfa.alphabet for ch in string):
        return False
    return bool(dfa.accepting[_run(dfa, string)])


def legal_next(name: str, prefix: str) -> frozenset[str]:
    """Symbols that may follow ``prefix``: characters keeping it completable, and ``END``."""
    dfa = language_dfa(name)
    state = _run(dfa, prefix)
    legal = {c for i, c in enumerate(dfa.alphabet) if dfa.live[dfa.transitions[state, i]]}
    if dfa.accepting[state]:
        legal.add(END)
    return frozenset(legal)


def _completions(dfa: DFA, max_len: int) -> np.ndarray:
    """``counts[r, s]``: strings of length ``r`` leading from ``s`` to acceptance. [R+1, S]"""
    counts = np.zeros((max_len + 1, len(dfa.accepting)))
    counts[0] = dfa.accepting
    for r in range(1, max_len + 1):
        counts[r] = counts[r - 1][dfa.transitions].sum(axis=1)
    return counts


def _sample_lengths(spec_law: str, lo: int, hi: int, num: int, rng, weights_ok) -> np.ndarray:
    lengths = np.arange(lo, hi + 1)
    if spec_law == "uniform":
        prob = np.ones(len(lengths))
    else:  # the repository's law: P(k) ~ (1 - q)^k q for k < hi, the tail mass at hi
        q = 1.0 / (1 + (lo + hi) // 2)
        prob = (1 - q) ** lengths * q
        prob[-1] = (1 - q) ** hi
    prob = prob * weights_ok
    return rng.choice(lengths, size=num, p=prob / prob.sum())


def _sample_members(dfa: DFA, lengths: np.ndarray, counts: np.ndarray, rng) -> np.ndarray:
    """Uniform members of the given lengths, as token arrays padded with -1. [N, max]"""
    num, width = len(lengths), int(lengths.max(initial=0))
    tokens = np.full((num, width), -1, np.int64)
    state = np.zeros(num, np.int64)
    for t in range(width):
        active = t < lengths
        remaining = np.maximum(lengths - t - 1, 0)
        # Weight of each symbol: completions of the rest from the state it leads to.
        weight = counts[remaining[:, None], dfa.transitions[state]]  # [N, A]
        cum = np.cumsum(weight, axis=1)
        u = rng.random(num) * cum[:, -1]
        choice = np.minimum((u[:, None] >= cum).sum(axis=1), len(dfa.alphabet) - 1)
        tokens[active, t] = choice[active]
        state = np.where(active, dfa.transitions[state, choice], state)
    return tokens


def _to_string(alphabet: str, row: np.ndarray) -> str:
    return "".join(alphabet[i] for i in row if i >= 0)


def sample_strings(
    name: str,
    num: int,
    min_len: int,
    max_len: int,
    rng: np.random.Generator,
    *,
    length_law: str | None = None,
    exclude: Iterable[str] = (),
) -> list[str]:
    """Distinct members of the language with lengths in ``[min_len, max_len]``.

    Args:
      name: one of ``LANGUAGES``.
      num: number of strings.
      min_len: minimum length.
      max_len: maximum length.
      rng: the random generator (advanced).
      length_law: ``"geometric"`` or ``"uniform"``; default the language's.
      exclude: strings not to return.

    Returns:
      ``num`` distinct strings, in sampling order.

    Raises:
      ValueError: unknown language, bad lengths, or fewer than ``num`` members exist.
    """
    if not 1 <= min_len <= max_len:
        raise ValueError(f"need 1 <= min_len <= max_len, got [{min_len}, {max_len}]")
    dfa = language_dfa(name)
    law = length_law or language_spec(name).length_law
    counts = _completions(dfa, max_len)
    per_length = counts[min_len : max_len + 1, 0]
    exclude = set(exclude)
    if per_length.sum() < num + len(exclude):
        raise ValueError(
            f"{name}: only {per_length.sum():.0f} members with lengths in "
            f"[{min_len}, {max_len}], {num} requested"
        )
    out, seen = [], set(exclude)
    for _ in range(1000):
        batch = max(2 * (num - len(out)), 64)
        lengths = _sample_lengths(law, min_len, max_len, batch, rng, per_length > 0)
        for row in _sample_members(dfa, lengths, counts, rng):
            s = _to_string(dfa.alphabet, row)
            if s not in seen:
                seen.add(s)
                out.append(s)
                if len(out) == num:
                    return out
    raise RuntimeError(f"{name}: could not draw {num} distinct strings in [{min_len}, {max_len}]")


def encode(
    name: str, strings: Sequence[str], max_len: int | None = None, *, target_mode: str = "legal"
) -> Split:
    """Padded tokens, next-symbol targets and mask for a list of strings.

    Args:
      name: one of ``LANGUAGES``.
      strings: members (or any strings over the alphabet).
      max_len: padded length ``T``; default the longest string.
      target_mode: ``"legal"`` (alphabet + ``END``, ``V = A + 1``) or ``"repo"`` (the
        repository's two columns; see the module docstring).

    Returns:
      A ``Split``; position ``t`` holds character ``t`` and the targets after
      ``strings[:t + 1]``.
    """
    if target_mode not in TARGET_MODES:
        raise ValueError(f"target_mode must be one of {TARGET_MODES}, got {target_mode!r}")
    dfa = language_dfa(name)
    lengths = np.array([len(s) for s in strings], np.int32)
    width = int(lengths.max(initial=0)) if max_len is None else int(max_len)
    if lengths.size and lengths.max() > width:
        raise ValueError(f"a string of length {lengths.max()} exceeds max_len={width}")
    pad = len(dfa.alphabet)
    tokens = np.full((len(strings), width), pad, np.int32)
    for i, s in enumerate(strings):
        try:
            tokens[i, : len(s)] = [dfa.alphabet.index(ch) for ch in s]
        except ValueError as e:
            raise ValueError(f"{name}: {s!r} has a symbol outside {dfa.alphabet!r}") from e
    mask = np.arange(width)[None, :] < lengths[:, None]
    # DFA state after each prefix; padding keeps the state (masked out anyway).
    states = np.zeros((len(strings), width), np.int64)
    state = np.zeros(len(strings), np.int64)
    for t in range(width):
        step = dfa.transitions[state, np.minimum(tokens[:, t], pad - 1)]
        state = np.where(mask[:, t], step, state)
        states[:, t] = state
    nxt = dfa.transitions[states]  # [N, T, A]
    if target_mode == "legal":
        targets = np.concatenate([dfa.live[nxt], dfa.accepting[states][..., None]], axis=-1)
    elif name == "tomita3":
        targets = dfa.accepting[nxt]
    elif name in ("d2", "d4"):
        targets = dfa.live[nxt]
    else:
        acc = dfa.accepting[states]
        targets = np.stack([~acc, acc], axis=-1)
    targets = (targets & mask[..., None]).astype(np.float32)
    return Split(tokens, targets, mask, lengths)


def decode(name: str, tokens: np.ndarray, lengths: np.ndarray) -> list[str]:
    """Strings back from padded tokens."""
    alphabet = language_dfa(name).alphabet
    return [_to_string(alphabet, row[:n]) for row, n in zip(tokens, lengths, strict=True)]


# The share of the training lengths, longest first, that a validation split holds out.
DEFAULT_VALIDATION_FRACTION = 0.2


def make_datasets(
    name: str,
    seed: int = 0,
    *,
    train_size: int | None = None,
    test_size: int | None = None,
    target_mode: str = "legal",
    validation: bool = False,
    validation_fraction: float = DEFAULT_VALIDATION_FRACTION,
) -> dict[str, Split]:
    """Train, bin 0 and bin 1 of one language (RSA App. E.2), and a validation split.

    Args:
      name: one of ``LANGUAGES``.
      seed: seeds ``numpy.random.default_rng([seed, language index])``; the result is a
        function of ``(name, seed)``.
      train_size: default the paper's (10K, or 5K for D_n).
      test_size: per bin; default the paper's (2K, or 1K for D_n).
      target_mode: ``"legal"`` or ``"repo"`` (see ``encode``).
      validation: move the training strings of ``validation_lengths(name,
        validation_fraction)`` (the longest fifth of the training range by default) into a
        ``"val"`` split: model selection then measures generalisation to longer strings
        without ever seeing bin 1. Bins 0 and 1 are the same draw either way.
      validation_fraction: the share of the training lengths, longest first, held out
        (0.5: train on the lower half, validate on the upper, about bin 1's 2x).

    Returns:
      ``{"train", "bin0", "bin1"}`` (and ``"val"``); train, validation and bin 0 padded to
      the train maximum length, bin 1 to its own maximum.
    """
    spec = language_spec(name)
    train_size = spec.train_size if train_size is None else int(train_size)
    test_size = spec.test_size if test_size is None else int(test_size)
    rng = np.random.default_rng([int(seed), LANGUAGES.index(name)])
    lo, hi = spec.train_lengths
    pool = sample_strings(name, train_size + test_size, lo, hi, rng)
    # De-duplication favours early draws; shuffle so train and bin 0 share one law.
    pool = [pool[i] for i in rng.permutation(len(pool))]
    bin1 = sample_strings(name, test_size, *spec.bin1_lengths, rng)
    train = pool[:train_size]
    splits = {}
    if validation:
        v_lo, v_hi = validation_lengths(name, validation_fraction)
        held_out = [s for s in train if v_lo <= len(s) <= v_hi]
        train = [s for s in train if not v_lo <= len(s) <= v_hi]
        splits["val"] = encode(name, held_out, hi, target_mode=target_mode)
    return {
        "train": encode(name, train, hi, target_mode=target_mode),
        **splits,
        "bin0": encode(name, pool[train_size:], hi, target_mode=target_mode),
        "bin1": encode(name, bin1, spec.bin1_lengths[1], target_mode=target_mode),
    }


def validation_lengths(name: str, fraction: float = DEFAULT_VALIDATION_FRACTION) -> tuple[int, int]:
    """The lengths of the validation split: the longest ``fraction`` of the training range
    (rounded down, at least one length; the shortest length always stays in training)."""
    if not 0 < fraction < 1:
        raise ValueError(f"fraction must lie in (0, 1), got {fraction!r}")
    lo, hi = language_spec(name).train_lengths
    count = min(max(int((hi - lo + 1) * fraction), 1), hi - lo)
    return hi - count + 1, hi


def exact_match(predictions: np.ndarray, targets: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """Whether every symbol at every real position is right (Bhattamishra et al.).

    Args:
      predictions: multi-hot predictions (bool) or probabilities (thresholded at 0.5).
        [N, T, V]
      targets: multi-hot targets. [N, T, V]
      mask: real positions. [N, T]

    Returns:
      One bool per sample. [N]
    """
    predictions = np.asarray(predictions)
    if predictions.dtype != bool:
        predictions = predictions > 0.5
    right = (predictions == (np.asarray(targets) > 0.5)).all(axis=-1) | ~np.asarray(mask)
    return right.all(axis=-1)
