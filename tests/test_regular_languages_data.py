"""The regular-language data of RSA App. E.2 against independent recognisers."""

import itertools
import re

import numpy as np
import pytest

from examples.regular_languages import data as rl  # noqa: E402


def _dyck_regex(n: int) -> str:
    inner = "(?:ab)*"
    for _ in range(n - 1):
        inner = f"(?:a{inner}b)*"
    return inner


def _tomita3(s: str) -> bool:
    runs = [(ch, len(list(g))) for ch, g in itertools.groupby(s)]
    return not any(
        a == ("1", a[1]) and a[1] % 2 == 1 and b[0] == "0" and b[1] % 2 == 1
        for a, b in itertools.pairwise(runs)
    )


# Recognisers written from the definitions, independent of the DFAs under test.
RECOGNISERS = {
    "parity": lambda s: set(s) <= {"0", "1"} and s.count("1") % 2 == 0,
    "tomita3": lambda s: set(s) <= {"0", "1"} and _tomita3(s),
    "tomita5": lambda s: set(s) <= {"0", "1"} and s.count("0") % 2 == 0 and s.count("1") % 2 == 0,
    "tomita6": lambda s: set(s) <= {"0", "1"} and (s.count("0") - s.count("1")) % 3 == 0,
    "d2": lambda s: re.fullmatch(_dyck_regex(2), s) is not None,
    "d4": lambda s: re.fullmatch(_dyck_regex(4), s) is not None,
}


def _brute_legal(name: str, prefix: str, horizon: int = 6) -> frozenset:
    """Legal next symbols by searching completions up to ``horizon`` symbols."""
    member = RECOGNISERS[name]
    alphabet = rl.language_spec(name).alphabet
    legal = {rl.END} if member(prefix) else set()
    for c in alphabet:
        for k in range(horizon):
            if any(member(prefix + c + "".join(w)) for w in itertools.product(alphabet, repeat=k)):
                legal.add(c)
                break
    return frozenset(legal)


@pytest.mark.parametrize("name", rl.LANGUAGES)
def test_dfa_membership_matches_recogniser_exhaustively(name):
    alphabet = rl.language_spec(name).alphabet
    for n in range(0, 11):
        for w in itertools.product(alphabet, repeat=n):
            s = "".join(w)
            assert rl.is_member(name, s) == RECOGNISERS[name](s), s


@pytest.mark.parametrize("name", rl.LANGUAGES)
def test_datasets_lengths_sizes_membership_and_disjointness(name):
    spec = rl.language_spec(name)
    data = rl.make_datasets(name, seed=1, train_size=400, test_size=100)
    bins = {"train": spec.train_lengths, "bin0": spec.train_lengths, "bin1": spec.bin1_lengths}
    strings = {}
    for split, (lo, hi) in bins.items():
        d = data[split]
        n = 400 if split == "train" else 100
        assert d.tokens.shape == (n, hi) and d.mask.shape == (n, hi)
        assert d.targets.shape == (n, hi, len(spec.alphabet) + 1)
        assert d.tokens.dtype == np.int32 and d.mask.dtype == bool
        assert lo <= d.lengths.min() and d.lengths.max() <= hi
        np.testing.assert_array_equal(d.mask, np.arange(hi)[None] < d.lengths[:, None])
        assert (d.tokens[~d.mask] == len(spec.alphabet)).all()  # padding id
        assert (d.targets[~d.mask] == 0).all()
        strings[split] = rl.decode(name, d.tokens, d.lengths)
        assert all(RECOGNISERS[name](s) for s in strings[split])
        assert len(set(strings[split])) == n  # de-duplicated
    assert not set(strings["train"]) & set(strings["bin0"])


def test_paper_sizes_and_ranges():
    assert rl.language_spec("parity")[2:6] == ((2, 50), (51, 100), 10_000, 2_000)
    assert rl.language_spec("d4")[2:6] == ((2, 100), (101, 200), 5_000, 1_000)
    data = rl.make_datasets("d4", seed=0)  # full size: fast enough to check
    assert [len(data[k].lengths) for k in ("train", "bin0", "bin1")] == [5000, 1000, 1000]
    assert data["bin1"].lengths.min() >= 101 and data["bin1"].lengths.max() <= 200


@pytest.mark.parametrize("name", rl.LANGUAGES)
def test_targets_are_the_legal_next_symbols(name):
    rng = np.random.default_rng(3)
    strings = rl.sample_strings(name, 12, 2, 14, rng)
    d = rl.encode(name, strings)
    symbols = rl.language_spec(name).alphabet + rl.END
    for i, s in enumerate(strings):
        for t in range(len(s)):
            expected = _brute_legal(name, s[: t + 1])
            got = frozenset(symbols[v] for v in np.nonzero(d.targets[i, t])[0])
            assert got == expected, (s[: t + 1], got, expected)
            assert rl.legal_next(name, s[: t + 1]) == expected


def test_known_target_sets():
    legal = rl.legal_next
    assert legal("tomita3", "1") == {"0", "1", "$"}
    assert legal("tomita3", "10") == {"0"}  # an odd 0-run after an odd 1-run must grow
    assert legal("tomita3", "101") == frozenset()  # dead
    assert legal("d2", "a") == {"a", "b"} and legal("d2", "aa") == {"b"}
    assert legal("d2", "ab") == {"a", "$"}
    assert legal("d4", "aaaa") == {"b"}
    assert legal("parity", "1") == {"0", "1"} and legal("parity", "11") == {"0", "1", "$"}
    assert legal("tomita6", "001") == {"0", "1"} and legal("tomita6", "0011") == {"0", "1", "$"}


def test_repo_target_mode():
    d = rl.encode("tomita3", ["100", "110"], target_mode="repo")
    # The repository lists the characters c with prefix + c a member.
    np.testing.assert_array_equal(d.targets[0], [[0, 1], [1, 0], [0, 1]])
    np.testing.assert_array_equal(d.targets[1], [[0, 1], [1, 1], [1, 1]])
    d = rl.encode("parity", ["101"], target_mode="repo")  # one-hot membership of prefixes
    np.testing.assert_array_equal(d.targets[0], [[1, 0], [1, 0], [0, 1]])
    d = rl.encode("d2", ["aabb"], target_mode="repo")
    np.testing.assert_array_equal(d.targets[0], [[1, 1], [0, 1], [1, 1], [1, 0]])


def test_deterministic_and_seeded():
    a = rl.make_datasets("tomita5", seed=7, train_size=50, test_size=10)
    b = rl.make_datasets("tomita5", seed=7, train_size=50, test_size=10)
    c = rl.make_datasets("tomita5", seed=8, train_size=50, test_size=10)
    for k in a:
        np.testing.assert_array_equal(a[k].tokens, b[k].tokens)
        np.testing.assert_array_equal(a[k].targets, b[k].targets)
    assert not np.array_equal(a["train"].tokens, c["train"].tokens)


def test_exact_match():
    d = rl.encode("d2", ["ab", "aabb"])
    pred = d.targets.copy()
    assert rl.exact_match(pred, d.targets, d.mask).tolist() == [True, True]
    pred[1, 2, 0] = 1 - pred[1, 2, 0]
    pred[0, 3, 0] = 1.0  # padding does not count
    assert rl.exact_match(pred, d.targets, d.mask).tolist() == [True, False]


def test_bad_inputs():
    with pytest.raises(ValueError, match="unknown language"):
        rl.language_spec("tomita9")
    with pytest.raises(ValueError, match="only"):
        rl.sample_strings("tomita5", 10, 2, 3, np.random.default_rng(0))
    with pytest.raises(ValueError, match="outside"):
        rl.encode("d2", ["abc"])
    with pytest.raises(ValueError, match="target_mode"):
        rl.encode("d2", ["ab"], target_mode="bits")


@pytest.mark.parametrize("name", ["parity", "d4"])
def test_validation_split_holds_the_longest_training_lengths_and_leaves_the_bins(name):
    plain = rl.make_datasets(name, 3, train_size=400, test_size=50)
    held = rl.make_datasets(name, 3, train_size=400, test_size=50, validation=True)
    lo, hi = rl.validation_lengths(name)
    t_lo, t_hi = rl.language_spec(name).train_lengths
    assert t_lo < lo <= hi == t_hi and hi - lo + 1 == (t_hi - t_lo + 1) // 5

    def strings(split):
        return rl.decode(name, split.tokens, split.lengths)

    train, val = strings(held["train"]), strings(held["val"])
    assert val and all(lo <= len(s) <= hi for s in val) and all(len(s) < lo for s in train)
    assert sorted(train + val) == sorted(strings(plain["train"]))  # the same draw, split
    for split in ("bin0", "bin1"):
        np.testing.assert_array_equal(held[split].tokens, plain[split].tokens)
    assert held["val"].tokens.shape[1] == plain["train"].tokens.shape[1]  # padded to hi


def test_validation_fraction_holds_out_the_upper_part_of_the_training_lengths():
    assert rl.validation_lengths("d4", 0.5) == (52, 100)  # 49 of the 99 lengths 2-100
    assert rl.validation_lengths("parity", 0.5) == (27, 50)
    assert rl.validation_lengths("parity", 0.01) == (50, 50)  # at least one length
    assert rl.validation_lengths("parity", 0.999) == (3, 50)  # length 2 stays in training
    for bad in (0, 1, -0.5):
        with pytest.raises(ValueError, match="fraction must lie in"):
            rl.validation_lengths("parity", bad)
    held = rl.make_datasets(
        "parity", 3, train_size=400, test_size=50, validation=True, validation_fraction=0.5
    )
    assert held["val"].lengths.min() == 27 and held["train"].lengths.max() == 26
