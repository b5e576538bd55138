"""Event forecasting, model side: the log-normal mixture, streaming, training and resumption.

The mixture is checked against float64 NumPy formulas, quadrature and Monte Carlo; streaming
against the parallel pass at every position; resumption against an uninterrupted run.
"""

import dataclasses
import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from examples.common import make_train_step
from examples.event_forecasting import configs, data, model, train

# --- the log-normal mixture ------------------------------------------------------------------


def _mixture(key, batch=(3,), k=4, shift=0.3, scale=1.7):
    k1, k2, k3 = jax.random.split(key, 3)
    return model.LogNormalMixture(
        logits=jax.random.normal(k1, batch + (k,)),
        loc=jax.random.normal(k2, batch + (k,)),
        log_scale=jax.random.uniform(k3, batch + (k,), minval=-1.0, maxval=0.5),
        shift=jnp.asarray(shift, jnp.float32),
        scale=jnp.asarray(scale, jnp.float32),
    )


def _np_log_prob(d, tau):
    """float64 NumPy: sum_k w_k N(z; loc_k, s_k) / (scale tau), z = (log tau - shift)/scale."""
    logits = np.asarray(d.logits, np.float64)
    w = np.exp(logits - logits.max(-1, keepdims=True))
    w /= w.sum(-1, keepdims=True)
    loc, s = np.asarray(d.loc, np.float64), np.exp(np.asarray(d.log_scale, np.float64))
    shift, scale = float(d.shift), float(d.scale)
    z = (np.log(tau) - shift) / scale
    dens = w * np.exp(-0.5 * ((z[..., None] - loc) / s) ** 2) / (s * math.sqrt(2 * math.pi))
    return np.log(dens.sum(-1) / (scale * tau))


def test_log_prob_matches_numpy(key):
    d = _mixture(key)
    tau = np.array([0.01, 1.3, 40.0], np.float32)
    np.testing.assert_allclose(d.log_prob(jnp.asarray(tau)), _np_log_prob(d, tau), rtol=2e-5)


def test_density_integrates_to_one_and_survival_by_quadrature(key):
    d = _mixture(key)
    # tau = exp(u): int p(tau) dtau = int p(e^u) e^u du, on a wide u grid
    u = np.linspace(-30.0, 30.0, 60001)
    tau = np.exp(u)
    for b in range(3):
        db = jax.tree.map(lambda a: a[b] if a.ndim else a, d)  # noqa: B023
        lp = _np_log_prob(db, tau)
        assert np.trapezoid(np.exp(lp) * tau, u) == pytest.approx(1.0, abs=1e-6)
        # survival at t: 1 - int_0^t p
        for t in (0.2, 1.0, 7.0):
            v = np.linspace(-30.0, math.log(t), 40001)
            cdf = np.trapezoid(np.exp(_np_log_prob(db, np.exp(v)) + v), v)
            assert float(jnp.exp(db.log_survival(jnp.asarray(t)))) == pytest.approx(
                1.0 - cdf, abs=1e-4
            )
        # and the JAX density is the NumPy one, over the grid (one batch axis per point)
        grid = jax.tree.map(lambda a: a[None] if a.ndim else a, db)
        np.testing.assert_allclose(
            grid.log_prob(jnp.asarray(tau[::1000], jnp.float32)), lp[::1000], rtol=1e-4, atol=1e-4
        )


def test_mean_matches_monte_carlo(key):
    d = _mixture(key, scale=0.8)
    samples = np.asarray(d.sample(jax.random.key(7), (200_000,)), np.float64)  # [N, 3]
    mean = np.asarray(d.mean())
    se = samples.std(0) / math.sqrt(samples.shape[0])
    assert np.all(np.abs(samples.mean(0) - mean) < 5 * se), (samples.mean(0), mean)
    assert np.all(samples > 0)


# --- streaming equals the parallel pass ------------------------------------------------------


def _tiny_model(backbone, num_marks, seed=0, copy_marks=False, gap_ema=()):
    cfg = configs.tiny_config("hawkes", backbone).model
    cfg = dataclasses.replace(
        cfg, num_layers=2, dropout=0.1, copy_marks=copy_marks, gap_ema=gap_ema
    )
    return model.EventModel(cfg, num_marks, -0.5, 1.3, rngs=nnx.Rngs(params=seed, dropout=1))


@pytest.mark.parametrize(
    ("backbone", "copy_marks", "gap_ema"),
    [("aaren", False, ()), ("transformer", False, ()), ("aaren", True, (0.0, 0.5, 0.9))],
)
def test_streaming_equals_parallel(backbone, copy_marks, gap_ema):
    seqs, m, _ = data.generate("hawkes", num_seqs=2, seed=5)
    n = 12
    # one window that starts before its first event (t_start = 0), one that starts at it
    seqs = [
        data.EventSeq(s.times[:n], s.marks[:n], t0, None, t0 > 0)
        for s, t0 in zip(seqs, (0.0, float(seqs[1].times[0])), strict=True)
    ]
    if copy_marks:  # repeated marks, so that the counts matter
        seqs[0] = dataclasses.replace(seqs[0], marks=np.array([0, 2, 2, 1, 2, 0, 0, 1, 2, 2, 1, 0]))
    net = _tiny_model(backbone, m, copy_marks=copy_marks, gap_ema=gap_ema)
    net.eval()
    batch = data.make_batch(seqs, m, -0.5, 1.3)
    par = jax.jit(lambda b: net(b))({k: jnp.asarray(v) for k, v in batch.items()})
    streamer = model.make_streamer(net, max_len=n + 1)
    state, out = streamer.start(np.array([s.t_start for s in seqs], np.float32))
    got = [out]
    for j in range(n):
        ev = model.Event(
            jnp.asarray([s.times[j] for s in seqs], jnp.float32),
            jnp.asarray([s.marks[j] for s in seqs], jnp.int32),
        )
        state, out = streamer.predict_next(state, ev)
        got.append(out)
    assert int(state.count[0]) == n
    if copy_marks:
        np.testing.assert_array_equal(state.mark_counts[0], np.bincount(seqs[0].marks, minlength=m))
    if gap_ema:  # the carried averages against a float64 loop over the parallel pass's gaps
        for i in range(len(seqs)):
            ref = np.zeros(len(gap_ema))
            for g in batch["gap"][i, : n + 1].astype(np.float64):
                ref = np.asarray(gap_ema) * ref + (1 - np.asarray(gap_ema)) * g
            np.testing.assert_allclose(state.gap_ema[i], ref, atol=1e-5)
    for j, out in enumerate(got):  # position j: after j events
        for name in ("logits", "loc", "log_scale"):
            np.testing.assert_allclose(
                getattr(out.time, name), getattr(par.time, name)[:, j], atol=2e-5, rtol=2e-5
            )
        np.testing.assert_allclose(out.mark_logits, par.mark_logits[:, j], atol=2e-5, rtol=2e-5)
        np.testing.assert_allclose(out.time.mean(), par.time.mean()[:, j], rtol=1e-4)


# --- training --------------------------------------------------------------------------------


def _tiny_sets(seqs, m, n_events=15):
    seqs = [
        dataclasses.replace(
            s,
            times=s.times[:n_events],
            marks=s.marks[:n_events],
            t_end=None if s.t_end is None else float(s.times[:n_events][-1]) + 0.5,
        )
        for s in seqs
    ]
    return data.make_data("toy", seqs[:8], seqs[8:12], seqs[12:16], m)


def _format_sets(fmt, tmp_path):
    """Sixteen short sequences read through each file format."""
    gen, m, _ = data.generate("hawkes", num_seqs=16, seed=11)
    if fmt == "generated":
        return _tiny_sets(gen, m)
    if fmt == "easytpp":
        recs = [
            {
                "dim_process": m,
                "seq_idx": i,
                "seq_len": len(s),
                "time_since_start": (s.times - s.times[0]).tolist(),
                "time_since_last_event": np.diff(s.times - s.times[0], prepend=0.0).tolist(),
                "type_event": s.marks.tolist(),
            }
            for i, s in enumerate(gen)
        ]
        (tmp_path / "x.json").write_text(json.dumps(recs))
        seqs, m = data.read_easytpp_json(tmp_path / "x.json")
    elif fmt == "ifl":
        t, mk = np.empty(16, object), np.empty(16, object)
        for i, s in enumerate(gen):
            t[i], mk[i] = s.times, s.marks
        np.savez(tmp_path / "x.npz", arrival_times=t, marks=mk)
        seqs, m = data.read_ifl_npz(tmp_path / "x.npz")
    else:  # meta-tpp: padded inter-times to the window's end, 1-indexed marks
        length = max(len(s) for s in gen) + 1
        times, marks, masks = (np.zeros((16, length)) for _ in range(3))
        for i, s in enumerate(gen):
            times[i, : len(s) + 1] = np.diff(np.append(s.times, s.t_end), prepend=0.0)
            marks[i, : len(s)] = s.marks + 1
            masks[i, : len(s) + 1] = 1
        np.savez(tmp_path / "x.npz", times=times, marks=marks.astype(int), masks=masks)
        seqs, m = data.read_meta_tpp_npz(tmp_path / "x.npz", num_marks=m)
    return _tiny_sets(seqs, m)


@pytest.mark.parametrize("backbone", ["aaren", "transformer"])
@pytest.mark.slow
def test_one_training_step_per_format(backbone, tmp_path):
    base = configs.tiny_config("hawkes", backbone)
    # the ifl-tpp format (Wikipedia's) with Wikipedia's model settings: copy head, clamp at 0
    wiki = configs.get_config("wikipedia", backbone).model
    for fmt in ("generated", "easytpp", "ifl", "meta_tpp"):
        ds = _format_sets(fmt, tmp_path)
        cfg = base
        if fmt == "ifl":
            cfg = dataclasses.replace(
                base,
                model=dataclasses.replace(
                    base.model, copy_marks=wiki.copy_marks, log_scale_max=wiki.log_scale_max
                ),
            )
        net = train.build_model(cfg, ds)
        assert (net.copy_gate is not None) == (fmt == "ifl"), fmt
        ts = make_train_step(net, model.loss_fn, cfg.optim, seed=0)
        batch = ds.train.batch(np.arange(4))
        before = jax.tree.map(jnp.copy, ts.params)
        # two steps: the warmup schedule's first learning rate is 0
        params, opt_state, loss = ts.step(ts.params, ts.opt_state, ts.rest, batch, jnp.uint32(0))
        params, _, loss = ts.step(params, opt_state, ts.rest, batch, jnp.uint32(1))
        assert np.isfinite(float(loss)), fmt
        # an NLL per event of a few nats at initialisation, and the step moved the parameters
        assert 0.0 < float(loss) < 20.0, (fmt, float(loss))
        moved = jax.tree.map(lambda a, b: bool(jnp.any(a != b)), params, before)
        assert any(jax.tree.leaves(moved)), fmt


@pytest.mark.slow
def test_train_and_evaluate_resumes_exactly(tmp_path):
    """A run stopped after one step and resumed ends where an uninterrupted run ends."""
    cfg = configs.tiny_config("hawkes", "aaren")
    cfg.loop.batch_size = 4  # two steps in the one epoch of 8 training sequences
    gen, m, _ = data.generate("hawkes", num_seqs=16, seed=11)
    ds = _tiny_sets(gen, m)
    # the process's own log-likelihood of the (shortened) test windows
    hp = data.HawkesParams()
    ds.test_loglik = np.array(
        [
            data.hawkes_loglik(s.times, s.marks, dataclasses.replace(hp, t_end=s.t_end))
            for s in ds.test.seqs
        ]
    )
    full, full_result = train.run(cfg, str(tmp_path / "a"), data=ds)
    stopped = dataclasses.replace(cfg, loop=dataclasses.replace(cfg.loop, max_steps=1))
    first = train.train_and_evaluate(stopped, str(tmp_path / "b"), data=ds)
    resumed, resumed_result = train.run(cfg, str(tmp_path / "b"), data=ds)
    assert (first["steps"], resumed["steps"], full["steps"]) == (1, 2, 2)
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7),
        full_result.params,
        resumed_result.params,
    )
    for k in ("nll", "nll_time", "nll_mark", "rmse", "accuracy"):
        assert resumed[k] == pytest.approx(full[k], rel=1e-6, abs=1e-9), k
    for k in (
        "dataset",
        "model",
        "seed",
        "nll",
        "nll_time",
        "nll_mark",
        "rmse",
        "accuracy",
        "true_nll",
        "events",
        "wall_s",
    ):
        assert k in full
    assert full["dataset"] == "toy" and full["events"] == ds.test.num_events
    assert full["nll"] == pytest.approx(full["nll_time"] + full["nll_mark"])
    assert np.isfinite(full["nll"]) and np.isfinite(full["true_nll"])
    assert 0.0 <= full["accuracy"] <= 100.0
    assert (tmp_path / "a" / "result.json").exists()


def test_copy_prior_starts_at_repeat_the_previous_mark():
    seqs, _, _ = data.generate("hawkes", num_seqs=2, seed=3)
    m, rng = 500, np.random.default_rng(0)
    seqs = [dataclasses.replace(s, marks=rng.integers(0, m, len(s.marks))) for s in seqs]
    batch = {k: jnp.asarray(v) for k, v in data.make_batch(seqs, m, -0.5, 1.3).items()}
    probs = {}
    for prior in (False, True):
        cfg = dataclasses.replace(
            configs.tiny_config("hawkes", "aaren").model, copy_marks=True, copy_prior=prior
        )
        net = model.EventModel(cfg, m, -0.5, 1.3, rngs=nnx.Rngs(params=0, dropout=1))
        net.eval()
        p = jax.nn.softmax(net(batch).mark_logits, axis=-1)
        last = np.asarray(batch["mark_in"])  # position j predicts event j + 1: its previous mark
        has_last = last < m
        probs[prior] = np.take_along_axis(np.asarray(p), np.minimum(last, m - 1)[..., None], -1)[
            ..., 0
        ][has_last]
        bias = np.asarray(net.copy_gate.bias[...])
        np.testing.assert_allclose(bias, [np.log(m), 0.0] if prior else [0.0, 0.0], rtol=1e-6)
    # log M on the previous mark against M - 1 logits near 0: about one half (the random
    # initial gate weights and mark head spread it), where without the prior it is near 1 / M
    assert 0.3 < np.median(probs[True]) < 0.7 and probs[True].min() > 10 / m
    assert probs[False].max() < 0.05
    without_head = dataclasses.replace(cfg, copy_marks=False, copy_prior=True)
    with pytest.raises(ValueError, match="copy_prior .* needs copy_marks"):
        model.EventModel(without_head, m, -0.5, 1.3, rngs=nnx.Rngs(0))
