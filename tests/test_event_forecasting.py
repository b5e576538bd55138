"""Event forecasting, data side: loaders, bad input, generators, the Hawkes log-likelihood.

References are independent of the code under test: counts and values read from the shared
files by hand, float64 quadrature of intensities, brute-force O(n^2) sums, the ODE of a
Hawkes process's mean intensity.
"""

import json

import numpy as np
import pytest

from examples.common.paths import default_data_root
from examples.event_forecasting import data

TPP = default_data_root() / "TPP"
needs_data = pytest.mark.skipif(not TPP.exists(), reason="../shared/data is absent")


# --- loaders on the shared files -------------------------------------------------------------


@needs_data
@pytest.mark.parametrize(
    "name, sizes, marks, events, first_gap, first_marks",
    [
        ("StackOverflow", (1401, 401, 401), 22, (90497, 25762, 26518), 0.0018310546875, [5, 13, 3]),
        ("Taxi", (1400, 200, 400), 10, (51854, 7404, 14820), 0.07888888888888888, [8, 3, 8]),
    ],
)
def test_easytpp_json_counts(name, sizes, marks, events, first_gap, first_marks):
    floor = data.STACKOVERFLOW_TIE_FLOOR if name == "StackOverflow" else None
    for split, size, n_events in zip(("train", "valid", "test"), sizes, events, strict=True):
        seqs, m = data.read_easytpp_json(TPP / name / f"{split}.json", tie_floor=floor)
        assert (len(seqs), m) == (size, marks)
        assert sum(len(s) for s in seqs) == n_events
        assert all(s.first_is_context and s.t_end is None for s in seqs)
        assert all(np.all(np.diff(s.times) > 0) for s in seqs)
    seqs, _ = data.read_easytpp_json(TPP / name / "train.json", tie_floor=floor)
    assert seqs[0].times[1] - seqs[0].times[0] == pytest.approx(first_gap)
    assert seqs[0].marks[:3].tolist() == first_marks


@needs_data
def test_stackoverflow_ties_raised_to_the_floor():
    path = TPP / "StackOverflow" / "train.json"
    raw = json.loads(path.read_text())
    ties = sum(int(np.sum(np.diff(r["time_since_start"]) == 0)) for r in raw)
    assert ties == 458
    with pytest.raises(data.EventDataError, match=r"train.json: sequence \d+: zero inter-event"):
        data.read_easytpp_json(path)
    seqs, _ = data.read_easytpp_json(path, tie_floor=data.STACKOVERFLOW_TIE_FLOOR)
    gaps = np.concatenate([np.diff(s.times) for s in seqs])
    assert np.sum(np.isclose(gaps, data.STACKOVERFLOW_TIE_FLOOR, rtol=1e-6, atol=0)) >= ties
    assert gaps.min() > 0


@needs_data
def test_wikipedia_npz_and_split():
    seqs, m = data.read_ifl_npz(TPP / "Wikipedia" / "wikipedia.npz")
    assert (len(seqs), m) == (1000, 8227)
    assert sum(len(s) for s in seqs) == 157471
    assert seqs[0].times[:3].tolist() == [0.0, 384.0, 226236.0]
    assert seqs[0].marks[:3].tolist() == [0, 7, 798]
    ds = data.load_dataset("wikipedia", max_train_events=None)
    assert (len(ds.train), len(ds.val), len(ds.test)) == (600, 200, 200)
    # every sequence is in exactly one split, and the split is fixed by the seed
    firsts = sorted(s.times[-1] for part in (ds.train, ds.val, ds.test) for s in part.seqs)
    assert firsts == sorted(s.times[-1] for s in seqs)
    again = data.load_dataset("wikipedia", max_train_events=None)
    assert [len(s) for s in again.test.seqs] == [len(s) for s in ds.test.seqs]
    # predicted events: all but each sequence's first
    assert ds.test.num_events == sum(len(s) - 1 for s in ds.test.seqs)


def test_download_easytpp_from_a_file_url(tmp_path):
    src = TPP / "Taxi"
    if not src.exists():
        pytest.skip("../shared/data is absent")
    paths = data.download_easytpp(
        tmp_path, ["taxi"], url_for=lambda name, split: (src / f"{split}.json").as_uri()
    )
    assert [p.name for p in paths] == ["train.json", "valid.json", "test.json"]
    seqs, m = data.read_easytpp_json(tmp_path / "TPP" / "Taxi" / "test.json")
    assert (len(seqs), m) == (400, 10)
    with pytest.raises(ValueError, match="sha256"):  # the wrong file for StackOverflow
        data.download_easytpp(
            tmp_path, ["stackoverflow"], url_for=lambda n, s: (src / f"{s}.json").as_uri()
        )
    assert not list((tmp_path / "TPP" / "StackOverflow").glob("*.part"))


def test_meta_tpp_npz_layout(tmp_path):
    # two sequences; inter-times, 1-indexed marks with 0 padding, masks; the last valid
    # inter-time of a row runs from its last event to the window's end
    times = np.array([[1.0, 2.0, 0.5, 3.0, 0.0], [0.25, 0.25, 1.0, 0.0, 0.0]])
    marks = np.array([[1, 2, 2, 1, 0], [3, 1, 1, 0, 0]])
    masks = np.array([[1, 1, 1, 1, 0], [1, 1, 1, 0, 0]])
    path = tmp_path / "toy.npz"
    np.savez(path, times=times, marks=marks, masks=masks)
    seqs, m = data.read_meta_tpp_npz(path, num_marks=3)
    assert m == 3
    np.testing.assert_allclose(seqs[0].times, [1.0, 3.0, 3.5])
    assert seqs[0].marks.tolist() == [0, 1, 1] and seqs[0].t_end == 6.5
    np.testing.assert_allclose(seqs[1].times, [0.25, 0.5])
    assert seqs[1].marks.tolist() == [2, 0] and seqs[1].t_end == 1.5
    assert all(s.first_is_context for s in seqs)
    b = data.make_batch(seqs, 3, 0.0, 1.0)
    # predicted: events 2..n and the survival interval after the last one
    assert b["target_mask"][0].tolist()[:4] == [False, True, True, False]
    np.testing.assert_allclose(b["tau"][0, 1:3], [2.0, 0.5])
    assert b["surv_mask"][0, 3] and b["surv_tau"][0, 3] == pytest.approx(3.0)
    # meta-tpp's split: the first 60 % / 20 % in file order
    five = np.concatenate([times, times, times[:1]])
    np.savez(
        path,
        times=five,
        marks=np.concatenate([marks] * 2 + [marks[:1]]),
        masks=np.concatenate([masks] * 2 + [masks[:1]]),
    )
    ds = data.load_meta_tpp(path, num_marks=3)
    assert (len(ds.train), len(ds.val), len(ds.test)) == (3, 1, 1)
    assert ds.val.seqs[0].t_end == 1.5 and ds.test.seqs[0].t_end == 6.5 and ds.num_marks == 3
    np.savez(path, times=-times, marks=marks, masks=masks)
    with pytest.raises(data.EventDataError, match="toy.npz: sequence 0: negative"):
        data.read_meta_tpp_npz(path)


# --- bad input -------------------------------------------------------------------------------


def _easytpp(tmp_path, records, name="bad.json"):
    path = tmp_path / name
    full = []
    for i, (times, marks) in enumerate(records):
        full.append(
            {
                "dim_process": 3,
                "seq_idx": 10 + i,
                "seq_len": len(times),
                "time_since_start": times,
                "time_since_last_event": list(np.diff(times, prepend=times[:1])),
                "type_event": marks,
            }
        )
    path.write_text(json.dumps(full))
    return path


@pytest.mark.parametrize(
    "records, message",
    [
        ([([0.0, 1.0], [0, 1]), ([0.0, 2.0, 1.0], [0, 1, 2])], r"sequence 11: times not sorted"),
        ([([0.0, 1.0, 1.0], [0, 1, 2])], r"sequence 10: zero inter-event time at event 2"),
        ([([0.0, 1.0], [0, 3])], r"sequence 10: mark 3 at event 1 not in \[0, 3\)"),
        ([([0.0, 1.0], [0, -1])], r"sequence 10: mark -1"),
        ([([0.0, 1.0], [0, 1]), ([], [])], r"sequence 11: empty sequence"),
        ([([0.0, float("nan")], [0, 1])], r"sequence 10: non-finite time"),
    ],
)
def test_bad_easytpp_input_names_file_and_sequence(tmp_path, records, message):
    path = _easytpp(tmp_path, records)
    with pytest.raises(data.EventDataError, match="bad.json: " + message):
        data.read_easytpp_json(path)


def test_inconsistent_easytpp_fields(tmp_path):
    path = _easytpp(tmp_path, [([0.0, 1.0, 3.0], [0, 1, 2])])
    rec = json.loads(path.read_text())
    rec[0]["time_since_last_event"] = [0.0, 1.0, 1.0]
    path.write_text(json.dumps(rec))
    with pytest.raises(data.EventDataError, match="sequence 10: time_since_last_event"):
        data.read_easytpp_json(path)
    rec[0]["time_since_last_event"] = [0.0, 1.0, 2.0]
    rec[0]["seq_len"] = 4
    path.write_text(json.dumps(rec))
    with pytest.raises(data.EventDataError, match="sequence 10: seq_len 4"):
        data.read_easytpp_json(path)


def test_bad_ifl_npz(tmp_path):
    path = tmp_path / "bad.npz"
    t = np.empty(2, object)
    t[0], t[1] = np.array([0.0, 5.0, 3.0]), np.array([1.0, 2.0])
    m = np.empty(2, object)
    m[0], m[1] = np.array([0, 1, 1]), np.array([0, 0])
    np.savez(path, arrival_times=t, marks=m)
    with pytest.raises(data.EventDataError, match=r"bad.npz: sequence 0: times not sorted"):
        data.read_ifl_npz(path)


# --- generators and exact log-likelihoods ----------------------------------------------------


def test_thinning_matches_the_sin_intensity():
    rng = np.random.default_rng(0)
    n_seq = 3000
    times = np.concatenate(
        [data.thinning(rng, data.sin_intensity, 2.0, data.SIN_T_END) for _ in range(n_seq)]
    )
    edges = np.linspace(0.0, data.SIN_T_END, 33)
    counts, _ = np.histogram(times, edges)
    expected = n_seq * data.sin_compensator(edges[:-1], edges[1:])  # closed-form bin mass
    # a Poisson count per bin: within 4.5 standard deviations everywhere
    assert np.all(np.abs(counts - expected) < 4.5 * np.sqrt(expected) + 1)
    # the closed form agrees with quadrature of the intensity
    grid = np.linspace(0.0, data.SIN_T_END, 200001)
    assert np.trapezoid(data.sin_intensity(grid), grid) == pytest.approx(
        data.sin_compensator(0.0, data.SIN_T_END), rel=1e-9
    )


def _hawkes_mean_counts(p: data.HawkesParams, steps: int = 20000) -> np.ndarray:
    """E N_k(T) from the ODE of the mean intensity m' = beta (alpha m - (m - mu))."""
    mu, alpha, beta = np.asarray(p.mu), np.asarray(p.alpha), p.beta
    dt = p.t_end / steps
    m, count = mu.copy(), np.zeros_like(mu)
    for _ in range(steps):  # midpoint (RK2) integration
        f = lambda x: beta * (alpha @ x - (x - mu))  # noqa: E731
        mid = m + 0.5 * dt * f(m)
        new = m + dt * f(mid)
        count += 0.5 * dt * (m + new)
        m = new
    return count


def test_ogata_matches_the_hawkes_mean_counts():
    p = data.HawkesParams(t_end=15.0)
    rng = np.random.default_rng(1)
    n_seq = 1500
    counts = np.zeros((n_seq, p.num_marks))
    for i in range(n_seq):
        _, marks = data.hawkes_sample(rng, p)
        counts[i] = np.bincount(marks, minlength=p.num_marks)
    expected = _hawkes_mean_counts(p)
    se = counts.std(0) / np.sqrt(n_seq)
    assert np.all(np.abs(counts.mean(0) - expected) < 4.5 * se), (counts.mean(0), expected)


def _hawkes_loglik_brute(times, marks, p: data.HawkesParams) -> float:
    """O(n^2) intensities at the events; the compensator by quadrature between events."""
    mu, alpha, beta = np.asarray(p.mu), np.asarray(p.alpha), p.beta

    def intensity(t):  # all marks, strictly past events
        past = times < t
        kern = alpha[:, marks[past]] * beta * np.exp(-beta * (t - times[past]))
        return mu + kern.sum(1)

    ll = sum(np.log(intensity(t)[k]) for t, k in zip(times, marks, strict=True))
    knots = np.concatenate([[0.0], times, [p.t_end]])
    comp = 0.0
    for a, b in zip(knots[:-1], knots[1:], strict=True):  # smooth between events
        x, w = np.polynomial.legendre.leggauss(20)
        t = 0.5 * (b - a) * x + 0.5 * (a + b)
        comp += 0.5 * (b - a) * sum(wi * intensity(ti).sum() for wi, ti in zip(w, t, strict=True))
    return float(ll - comp)


def test_hawkes_loglik_two_ways():
    p = data.HawkesParams(t_end=30.0)
    rng = np.random.default_rng(2)
    for _ in range(3):
        times, marks = data.hawkes_sample(rng, p)
        assert len(times) > 5
        assert data.hawkes_loglik(times, marks, p) == pytest.approx(
            _hawkes_loglik_brute(times, marks, p), rel=1e-9, abs=1e-8
        )


def test_generated_datasets_and_cache(tmp_path):
    seqs, m, ll = data.load_generated("hawkes", tmp_path, num_seqs=5, seed=3)
    again, m2, ll2 = data.load_generated("hawkes", tmp_path, num_seqs=5, seed=3)
    assert (m, m2) == (3, 3) and len(list(tmp_path.glob("*.npz"))) == 1
    for a, b in zip(seqs, again, strict=True):
        np.testing.assert_array_equal(a.times, b.times)
        np.testing.assert_array_equal(a.marks, b.marks)
    np.testing.assert_allclose(ll, ll2)
    assert all(not s.first_is_context and s.t_end == 100.0 for s in seqs)
    sin, m, ll = data.generate("sin", num_seqs=3, seed=0)
    assert m == 1 and all(s.times[-1] <= data.SIN_T_END for s in sin)
    np.testing.assert_allclose(ll, [data.sin_loglik(s.times) for s in sin])


def test_windows_predict_every_event_once():
    s = data.EventSeq(np.arange(1.0, 11.0), np.zeros(10, np.int64), 0.0, 12.0, False)
    wins = data.split_windows([s], 4)
    predicted = np.concatenate([w.times[w.predicted()] for w in wins])
    np.testing.assert_array_equal(predicted, s.times)
    assert [w.t_end for w in wins] == [None, None, 12.0]
    gaps = np.concatenate([w.gaps()[w.predicted()] for w in wins])
    np.testing.assert_allclose(gaps, s.gaps())
