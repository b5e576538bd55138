"""The offline-RL example: data round trip, SAC, Decision Transformer / Aaren, streaming, resume."""

import dataclasses
import json
import re
from pathlib import Path
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("minari")
pytest.importorskip("gymnasium")
pytest.importorskip("mujoco")

from flax import nnx  # noqa: E402

from aaren_jax.native import cpu_kind, cpu_model  # noqa: E402
from examples.common import default_run_dir, loop  # noqa: E402
from examples.offline_rl import (  # noqa: E402
    conditioning,
    configs,
    data,
    drift,
    generate,
    model,
    pack,
    report,
    sac,
    train,
)


# session scope: the slow tests run first (conftest.py), so this module's tests are not
# contiguous, and a module fixture would generate the data twice
@pytest.fixture(scope="session")
def generated(tmp_path_factory):
    """A tiny Hopper generation: SAC for 400 steps, datasets of ~300 transitions."""
    root = tmp_path_factory.mktemp("minari")
    cfg = configs.tiny_gen_config()
    entry = generate.generate("hopper", cfg, root)
    return root, cfg, entry


def _rtg_reference(rewards):
    out, acc = np.zeros(len(rewards)), 0.0
    for t in range(len(rewards) - 1, -1, -1):
        acc += float(rewards[t])
        out[t] = acc
    return out


def test_writer_reader_round_trip(generated):
    root, cfg, entry = generated
    for name in configs.DATASETS:
        meta = entry["datasets"][name]
        tr = data.load_trajectories(data.dataset_id("hopper", name), root)
        assert tr.num_transitions == meta["transitions"]
        assert len(tr.actions) == meta["episodes"]
        assert tr.obs_dim == 11 and tr.act_dim == 3
        for rew, ret in zip(tr.rewards, tr.returns, strict=True):
            np.testing.assert_allclose(ret, _rtg_reference(rew), rtol=1e-5, atol=1e-4)
        allobs = np.concatenate(tr.observations)
        np.testing.assert_allclose(tr.state_mean, allobs.mean(0), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(tr.state_std, allobs.std(0) + 1e-6, rtol=1e-5, atol=1e-6)
    # medium-replay is the replay buffer's prefix, read back from its folder (a path works too)
    tr = data.load_trajectories(root / data.dataset_id("hopper", "medium-replay"))
    assert tr.num_transitions == entry["medium_step"]
    me = entry["datasets"]
    assert me["medium-expert"]["transitions"] == (
        me["medium"]["transitions"] + me["expert"]["transitions"]
    )
    # the windows: normalised states, scaled returns-to-go, padding after the episode's end
    seq = data.SequenceData(tr, 4, 1e-3)
    last = len(seq) - 1  # the last transition: one step inside, three padded
    b = seq.batch(np.array([0, last]))
    np.testing.assert_allclose(
        b["states"][0], (tr.observations[0][:4] - tr.state_mean) / tr.state_std, rtol=1e-5
    )
    np.testing.assert_allclose(b["returns"][0], tr.returns[0][:4] * 1e-3, rtol=1e-5)
    np.testing.assert_array_equal(b["mask"][1], [1, 0, 0, 0])
    np.testing.assert_array_equal(b["timesteps"][1][1:] - b["timesteps"][1][:-1], [1, 1, 1])


def test_pack_restores_datasets_that_read_back_equal(generated, tmp_path):
    root, _, entry = generated
    ids = [data.dataset_id("hopper", name) for name in configs.DATASETS]
    header = pack.export(ids, root, tmp_path / "hopper.npz")
    # medium-expert is combined again from its parts, which travel instead
    assert header["combined"] == {
        ids[2]: {"of": [ids[0], data.dataset_id("hopper", "expert")], "digest": mock.ANY}
    }
    assert sorted(header["datasets"]) == sorted(
        [ids[0], ids[1], data.dataset_id("hopper", "expert")]
    )
    other = tmp_path / "elsewhere"
    assert sorted(pack.restore(tmp_path / "hopper.npz", other)) == sorted(
        [*header["datasets"], *header["combined"]]
    )
    for spec in ids:
        a, b = data.load_trajectories(spec, root), data.load_trajectories(spec, other)
        assert data.trajectory_digest(a) == data.trajectory_digest(b)
        for x, y in zip(a.observations + a.returns, b.observations + b.returns, strict=True):
            np.testing.assert_array_equal(x, y)
        assert a.ref_scores == b.ref_scores
    restored = json.loads((other / "manifest.json").read_text())["hopper"]
    assert restored["datasets"] == entry["datasets"]  # own-normalised scores need it
    # a pack whose digest does not match what is read back is refused
    with np.load(tmp_path / "hopper.npz") as z:
        arrays = {k: z[k] for k in z.files}
    bad = json.loads(str(arrays["header"]))
    bad["datasets"][ids[0]]["digest"] = "0" * 64
    np.savez_compressed(tmp_path / "bad.npz", **{**arrays, "header": np.array(json.dumps(bad))})
    with pytest.raises(ValueError, match="digest"):
        pack.restore(tmp_path / "bad.npz", tmp_path / "third")
    # a digest sees a change in the last bit of one observation
    tr = data.load_trajectories(ids[0], root)
    before = data.trajectory_digest(tr)
    tr.observations[0][0, 0] = np.nextafter(tr.observations[0][0, 0], np.float32(np.inf))
    assert data.trajectory_digest(tr) != before


def test_sweep_workers_share_the_sweep(tmp_path, monkeypatch):
    from examples.offline_rl import sweep

    started = []

    class Worker:
        def __init__(self, cmd, env):
            started.append((cmd, env))

        def wait(self):
            return 0

    monkeypatch.setattr(sweep.subprocess, "Popen", Worker)
    args = ["--results", str(tmp_path / "r.json"), "--envs", "hopper", "--workers", "3"]
    sweep.main(args)
    assert len(started) == 3
    for cmd, env in started:
        # each worker is the same sweep with one worker; JAX leaves the GPU's memory to share
        assert cmd[-len(args) - 2 :] == [*args, "--workers", "1"]
        assert env["XLA_PYTHON_CLIENT_PREALLOCATE"] == "false"
    with pytest.raises(SystemExit, match="workers"):
        sweep.main([*args[:-1], "0"])


def test_data_table_from_the_manifest(generated):
    _, _, entry = generated
    rows = report.data_table({"hopper": entry}).splitlines()
    drawn_on = entry["machine"]
    assert f"drawn on {drawn_on['cpu_model']} ({drawn_on['cpu_kind']}), MuJoCo " in rows[0]
    cells = {r.split("|")[1].strip(): r.split("|")[2:-1] for r in rows if r.startswith("| ")}
    # own-normalised: the random policy at 0, the expert at 100
    assert float(cells["random policy"][-1]) == 0.0
    assert float(cells[next(k for k in cells if k.startswith("expert"))][-1]) == 100.0
    d4rl_lo, d4rl_hi = configs.D4RL_REF["hopper"]
    medium = entry["datasets"]["medium"]
    assert int(cells["medium"][0].replace(",", "")) == medium["transitions"]
    expected = 100 * (medium["mean_return"] - d4rl_lo) / (d4rl_hi - d4rl_lo)
    assert float(cells["medium"][3]) == pytest.approx(expected, abs=0.051)


def test_sac_update(generated):
    # the generator's sizes (Hopper, the tiny SAC): its compiled update is reused
    sc = configs.tiny_gen_config().sac
    nets, state = sac.init_sac(11, 3, sc, 0)
    rng = np.random.default_rng(0)
    k, b = sc.update_every, sc.batch_size
    batch = {
        "obs": rng.normal(size=(k, b, 11)).astype(np.float32),
        "action": rng.uniform(-1, 1, (k, b, 3)).astype(np.float32),
        "reward": rng.normal(size=(k, b)).astype(np.float32),
        "next_obs": rng.normal(size=(k, b, 11)).astype(np.float32),
        "terminal": (rng.uniform(size=(k, b)) < 0.2).astype(np.float32),
    }
    before = jax.tree.map(np.array, state)
    state, info = sac.update_many(nets, state, batch, jax.random.key(1))
    assert all(np.isfinite(float(v)) for v in info.values())
    assert int(state.steps) == k
    for name in ("actor", "critic", "target_critic", "log_alpha"):
        changed = jax.tree.map(
            lambda a, b: not np.allclose(a, b), getattr(before, name), getattr(state, name)
        )
        assert any(jax.tree.leaves(changed)), name
    a = sac.act(nets, state.actor, batch["obs"][0], jax.random.key(2))
    assert a.shape == (b, 3) and np.all(np.abs(np.asarray(a)) <= 1)


@pytest.mark.parametrize(
    "backbone, rsa", [("transformer", False), ("aaren", False), ("transformer", True)]
)
@pytest.mark.slow
def test_train_step_and_online_evaluation(generated, backbone, rsa, tmp_path):
    root, _, entry = generated
    cfg = configs.tiny_config("hopper", "medium", backbone)
    cfg.data.data_root = str(root)
    cfg.model = dataclasses.replace(cfg.model, rsa=rsa)
    records = train.train_and_evaluate(cfg, str(tmp_path / backbone))
    modes = ["window", "stream"] if backbone == "aaren" else ["window"]
    assert [(r["eval"], r["target"]) for r in records] == [
        (m, t) for m in modes for t in ("corl", "data_best")
    ]
    best = max(float(np.sum(r)) for r in train.load_data(cfg).rewards)
    for r in records:
        expected = configs.TARGET_RETURNS["hopper"][0] if r["target"] == "corl" else best
        assert r["target_return"] == pytest.approx(expected)
        assert r["model"] == backbone and r["env"] == "hopper" and r["dataset"] == "medium"
        assert r["train_steps"] == r["updates_asked"] == 2 and r["finished"]
        assert r.get("rsa", False) == rsa
        assert r["eval_episodes"] == 1 and np.isfinite(r["score"]) and r["ms_per_env_step"] > 0
        assert r["cpu_model"] == cpu_model() and r["jax"] == jax.__version__
        assert r["cpu_kind"] == cpu_kind()
        assert r["device"] == jax.devices()[0].device_kind
        assert r["data_digest"] == data.trajectory_digest(train.load_data(cfg))
        assert r["data_manifest"] == data.manifest_fingerprint(entry)
        ref = (entry["random_policy_return"], entry["expert_policy_return"])
        assert r["score_own"] == pytest.approx(100 * (r["return"] - ref[0]) / (ref[1] - ref[0]))
    # a finished run folder returns its records without training again
    assert train.train_and_evaluate(cfg, str(tmp_path / backbone)) == records


def test_a_kept_run_is_evaluated_again_without_training(generated, tmp_path, monkeypatch, caplog):
    root, _, _ = generated
    cfg = configs.tiny_config("hopper", "medium", "transformer")
    cfg.data.data_root = str(root)
    cfg.eval.data_target = False
    first = train.train_and_evaluate(cfg, str(tmp_path / "kept"), keep_checkpoints=True)
    train.train_and_evaluate(cfg, str(tmp_path / "dropped"))
    more = dataclasses.replace(cfg, eval=dataclasses.replace(cfg.eval, eval_episodes=2))
    assert default_run_dir("offline_rl", "run", more) == default_run_dir("offline_rl", "run", cfg)

    def no_training(*args, **kwargs):
        raise AssertionError("a kept run was trained again")

    with monkeypatch.context() as patch:
        patch.setattr(train, "loss_fn", no_training)
        again = train.train_and_evaluate(more, str(tmp_path / "kept"))
    assert [r["eval_episodes"] for r in first + again] == [1, 2]
    assert again[0]["fit_mse"] == first[0]["fit_mse"] and again[0]["train_steps"] == 2
    assert (tmp_path / "kept" / "checkpoints").exists()  # kept for the next evaluation too
    assert train.train_and_evaluate(more, str(tmp_path / "kept")) == again  # stored now
    # without kept checkpoints the run trains again, and says so
    with caplog.at_level("WARNING"):
        retrained = train.train_and_evaluate(more, str(tmp_path / "dropped"))
    assert "trained again" in caplog.text and retrained[0]["eval_episodes"] == 2
    # a second training stopped before its first checkpoint leaves an empty folder behind:
    # the run says it trains again, and does
    (tmp_path / "dropped" / "checkpoints").mkdir()
    third = dataclasses.replace(cfg, eval=dataclasses.replace(cfg.eval, eval_episodes=3))
    caplog.clear()
    with caplog.at_level("WARNING"):
        retrained = train.train_and_evaluate(third, str(tmp_path / "dropped"))
    assert "trained again" in caplog.text and retrained[0]["fit_mse"] == first[0]["fit_mse"]


@pytest.mark.parametrize("fold_return, rsa", [(False, False), (True, False), (False, True)])
def test_aaren_stream_equals_parallel(fold_return, rsa):
    cfg = dataclasses.replace(
        configs.tiny_config(backbone="aaren").model, fold_return=fold_return, rsa=rsa
    )
    m = model.DecisionModel(cfg, 5, 2, rngs=nnx.Rngs(0))
    # RSA: every block's attention carries the REM gate; CORL's: none does
    assert all((b.attention.rsa is not None) == rsa for b in m.backbone.blocks)
    m.eval()
    t_len, rng = 7, np.random.default_rng(0)
    states = jnp.asarray(rng.normal(size=(2, t_len, 5)), jnp.float32)
    actions = jnp.asarray(rng.uniform(-1, 1, (2, t_len, 2)), jnp.float32)
    returns = jnp.asarray(rng.normal(size=(2, t_len)), jnp.float32)
    timesteps = jnp.broadcast_to(jnp.arange(t_len, dtype=jnp.int32), (2, t_len))
    parallel = nnx.jit(lambda m, *x: m(*x))(m, states, actions, returns, timesteps)
    start, step = nnx.jit(model.stream_start), nnx.jit(model.stream_next)
    carry, a = start(m, returns[:, 0], states[:, 0])
    streamed = [a]
    for t in range(1, t_len):
        ts = jnp.full((2,), t, jnp.int32)
        carry, a = step(m, carry, actions[:, t - 1], returns[:, t], states[:, t], ts)
        streamed.append(a)
    np.testing.assert_allclose(np.stack(streamed, 1), parallel, rtol=1e-4, atol=1e-5)
    tokens = m.tokens(states, actions, returns, timesteps)
    assert tokens.shape == (2, len(cfg.token_kinds) * t_len, cfg.embedding_dim)
    # each step's action reads that step's return: through its own token, or folded in
    later = returns.at[:, 3].add(1.0)
    moved = np.abs(np.asarray(m(states, actions, later, timesteps) - parallel)).max(axis=(0, 2))
    assert np.all(moved[:3] < 1e-6) and moved[3] > 1e-4  # earlier steps: round-off only


@pytest.mark.slow
def test_resume_gives_the_same_parameters(generated, tmp_path):
    root, _, _ = generated
    cfg = configs.tiny_config("hopper", "medium-replay", "transformer")
    cfg.data.data_root = str(root)
    # checkpoints only where a run stops: after step 1 (max_steps) and at the end
    cfg.loop = dataclasses.replace(cfg.loop, steps_per_epoch=2, max_epochs=2, checkpoint_every=9)
    traj = train.load_data(cfg)
    straight = train.fit_model(cfg, traj, None)
    compiled_steps = loop._train_step._cache_size()
    cut = dataclasses.replace(cfg, loop=dataclasses.replace(cfg.loop, max_steps=1))
    first = train.fit_model(cut, traj, str(tmp_path))
    assert first.step == 1 and not first.done
    resumed = train.fit_model(cfg, traj, str(tmp_path))
    assert resumed.step == 4 and resumed.done
    # bitwise: on one machine a run cut anywhere and resumed is the run made straight
    jax.tree.map(np.testing.assert_array_equal, straight.params, resumed.params)
    # and with the same compiled step: the restored (committed) state compiles nothing new
    assert loop._train_step._cache_size() == compiled_steps


def test_generation_against_a_reference_stops_at_the_first_other_snapshot(
    generated, tmp_path, monkeypatch
):
    """Drawn again from its seed, a generation equals its manifest entry to the last bit; a
    reference whose second snapshot differs stops the agent at that snapshot, before any
    dataset is written, naming the step; another configuration is refused before training."""
    _, cfg, entry = generated
    monkeypatch.setenv("MINARI_DATASETS_PATH", str(tmp_path))  # generate() repoints Minari
    assert set(entry["machine"]) == {"cpu_model", "cpu_kind", "mujoco", "jax"}
    if Path("/proc/cpuinfo").exists():  # the family, model and vector width, named
        assert entry["machine"]["cpu_kind"].startswith("family ")
    again = generate.generate("hopper", cfg, tmp_path / "same", reference=entry)
    assert data.manifest_fingerprint(again) == data.manifest_fingerprint(entry)

    other = json.loads(json.dumps(entry))
    other["snapshot_returns"][1] = float(np.nextafter(other["snapshot_returns"][1], np.inf))
    with pytest.raises(generate.OtherDraw, match=r"snapshot at 400 steps evaluates"):
        generate.generate("hopper", cfg, tmp_path / "other", reference=other)
    assert not (tmp_path / "other" / "manifest.json").exists()
    assert not list((tmp_path / "other").glob(f"{data.NAMESPACE}/**/data"))

    other = json.loads(json.dumps(entry))
    other["random_policy_return"] += 1.0
    with pytest.raises(generate.OtherDraw, match="differs from the reference manifest in "
                       "random_policy_return"):  # fmt: skip
        generate.generate("hopper", cfg, tmp_path / "same", reference=other)

    with pytest.raises(ValueError, match=r"sac_steps=400, here 600"):
        generate.generate(
            "hopper", dataclasses.replace(cfg, sac_steps=600), tmp_path / "x", reference=entry
        )
    assert not (tmp_path / "x" / "behaviour").exists()


def test_sac_resume_gives_the_same_agent(tmp_path):
    """Stopped at an episode end and resumed, the agent and buffer equal an uninterrupted run."""
    cfg = configs.tiny_gen_config()
    cfg = dataclasses.replace(cfg, sac_steps=300, snapshot_every=300, save_every_s=1e9)
    straight = generate.train_behaviour("hopper", cfg, tmp_path / "a")
    part = generate.train_behaviour("hopper", cfg, tmp_path / "b", stop_after=250)
    assert 250 <= part["env_steps"] < 300 and not part["done"]
    resumed = generate.train_behaviour("hopper", cfg, tmp_path / "b")
    assert resumed["done"] and resumed["buffer"].size == straight["buffer"].size == 300
    for name, a in straight["buffer"].arrays.items():
        np.testing.assert_array_equal(a, resumed["buffer"].arrays[name], err_msg=name)
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7),
        straight["state"],
        resumed["state"],
    )
    assert straight["snapshot_returns"] == resumed["snapshot_returns"]


def test_report_keeps_only_the_seeds_asked_for(tmp_path, capsys):
    def record(seed, score):
        return {"env": "hopper", "dataset": "medium", "model": "transformer", "seed": seed,
                "eval": "window", "target": "corl", "score": score, "score_std": 0.5,
                "score_own": score, "ms_per_env_step": 1.0}  # fmt: skip

    path = tmp_path / "results.json"
    path.write_text(json.dumps([record(0, 10.0), record(1, 20.0), record(2, 90.0)]))
    report.main([str(path), "--seeds", "0", "1"])
    row = next(r for r in capsys.readouterr().out.splitlines() if r.startswith("| hopper"))
    assert "15.0 ± 5.0 (2 seeds)" in row  # seed 2's 90 left out
    report.main([str(path)])
    row = next(r for r in capsys.readouterr().out.splitlines() if r.startswith("| hopper"))
    assert "40.0 ± 35.6 (3 seeds)" in row


def test_report_counts_the_cells_that_meet_the_target(tmp_path, capsys):
    def record(env, model, mode, seed, score):
        return {"env": env, "dataset": "medium", "model": model, "seed": seed, "eval": mode,
                "target": "corl", "score": score, "score_std": 0.0, "score_own": score,
                "ms_per_env_step": 1.0}  # fmt: skip

    # hopper: the Transformer 20 ± 2 (18, 22); Aaren's window 18.5 (met, ahead on seed 1),
    # its stream 17.5 (not met). walker2d: one Aaren seed only, not judged.
    records = [record("hopper", "transformer", "window", s, v) for s, v in ((0, 18), (1, 22))]
    records += [record("hopper", "aaren", "window", s, v) for s, v in ((0, 14), (1, 23))]
    records += [record("hopper", "aaren", "stream", s, v) for s, v in ((0, 17), (1, 18))]
    records += [record("walker2d", "transformer", "window", s, 10.0) for s in (0, 1)]
    records += [record("walker2d", "aaren", m, 0, 30.0) for m in ("window", "stream")]
    path = tmp_path / "results.json"
    path.write_text(json.dumps(records))
    report.main([str(path)])
    out = capsys.readouterr().out.splitlines()
    assert next(r for r in out if r.startswith("| hopper")).endswith(
        "| met (ahead 1/2) / not met (ahead 0/2) |"
    )
    assert next(r for r in out if r.startswith("| walker2d")).endswith("| - / - |")
    assert "Decision Aaren (window) meets the target in 1 of 1 cells" in "\n".join(out)
    assert "Decision Aaren (stream) meets the target in 0 of 1 cells" in "\n".join(out)


def test_report_per_seed_lists_every_seed_and_marks_the_missing_ones(tmp_path, capsys):
    def record(model, mode, seed, score, target="corl"):
        return {"env": "hopper", "dataset": "medium", "model": model, "seed": seed,
                "eval": mode, "target": target, "score": score, "score_std": 0.0,
                "score_own": score, "ms_per_env_step": 1.0, "fit_mse": 0.1 * (seed + 1)
                + (0.0 if model == "transformer" else 0.05 - 0.1 * seed)}  # fmt: skip

    # the Transformer 20 ± 2 over seeds 0-1; Aaren's window 14 / 23 and its stream seed 2 only
    records = [record("transformer", "window", s, v) for s, v in ((0, 18), (1, 22))]
    records += [record("aaren", "window", s, v) for s, v in ((0, 14), (1, 23))]
    records += [record("aaren", "stream", 2, 30.0), record("aaren", "window", 0, 5.0, "data_best")]
    path = tmp_path / "results.json"
    path.write_text(json.dumps(records))
    report.main([str(path), "--per-seed"])
    rows = [r for r in capsys.readouterr().out.splitlines() if r.startswith("| hopper")]
    assert rows == [
        "| hopper medium | CORL | 18.0 / 22.0 / -: 20.0 ± 2.0 | 14.0 / 23.0 / -: 18.5 ± 4.5 "
        "| - / - / 30.0 | met / - |",
        "| hopper medium | data best | - | 5.0 / - / - | - | - / - |",
        # the fits: the Transformer's 0.1 / 0.2; Aaren's 0.15 each, paired on seeds 0 and 1
        "| hopper medium | 0.1000 / 0.2000 / - | 0.1500 / 0.1500 / 0.1500 | 1 of 2 seeds |",
    ]


def test_report_judges_the_target_on_the_seeds_both_models_recorded(tmp_path, capsys):
    def record(model, mode, seed, score):
        return {"env": "hopper", "dataset": "medium", "model": model, "seed": seed,
                "eval": mode, "target": "corl", "score": score, "score_std": 0.0,
                "score_own": score, "ms_per_env_step": 1.0}  # fmt: skip

    # the Transformer 20 ± 2 over seeds 0-1 (threshold 18); Aaren 14 / 20 on them (17: not
    # met), and a seed 2 at 50 that the Transformer has not reached yet, which would lift
    # Aaren's mean over its own seeds to 28
    records = [record("transformer", "window", s, v) for s, v in ((0, 18), (1, 22))]
    records += [record("aaren", m, s, v) for m in ("window", "stream")
                for s, v in ((0, 14), (1, 20), (2, 50))]  # fmt: skip
    assert report.verdict(records[:2], records[2:5]) is False
    path = tmp_path / "results.json"
    path.write_text(json.dumps(records))
    report.main([str(path), "--per-seed"])
    row = next(r for r in capsys.readouterr().out.splitlines() if r.startswith("| hopper"))
    assert row.endswith("| not met (without seed 2) / not met (without seed 2) |")
    report.main([str(path)])
    row = next(r for r in capsys.readouterr().out.splitlines() if r.startswith("| hopper"))
    assert row.endswith(
        "| not met (without seed 2, ahead 0/2) / not met (without seed 2, ahead 0/2) |"
    )


def test_report_against_a_baseline_pairs_the_same_runs_only(tmp_path, capsys):
    def record(model, mode, seed, score, dataset="medium", target="corl"):
        return {"env": "hopper", "dataset": dataset, "model": model, "seed": seed,
                "eval": mode, "target": target, "score": score, "score_std": 0.0,
                "score_own": score, "ms_per_env_step": 1.0}  # fmt: skip

    baseline = [record("transformer", "window", s, 10.0) for s in (0, 1)]
    baseline += [record("aaren", "stream", s, 20.0) for s in (0, 1)]
    baseline += [record("aaren", "window", 0, 50.0, "medium-expert")]
    # seed 2 and the data-best record have no baseline pair; the stream is higher on seed 1 only
    records = [record("transformer", "window", s, v) for s, v in ((0, 12.0), (1, 14.0), (2, 99.0))]
    records += [record("aaren", "stream", s, v) for s, v in ((0, 16.0), (1, 21.0))]
    records += [record("aaren", "window", 0, 40.0, "medium-expert"),
                record("transformer", "window", 0, 0.0, target="data_best")]  # fmt: skip
    paths = tmp_path / "now.json", tmp_path / "then.json"
    for path, rows in zip(paths, (records, baseline), strict=True):
        path.write_text(json.dumps(rows))
    report.main([str(paths[0]), "--against", str(paths[1])])
    out = capsys.readouterr().out.splitlines()
    rows = [r for r in out if r.startswith(("| medium", "| all"))]
    assert rows == [
        "| medium | 2 of 2: 10.0 -> 13.0 | - | 1 of 2: 20.0 -> 18.5 |",
        "| medium-replay | - | - | - |",
        "| medium-expert | - | 0 of 1: 50.0 -> 40.0 | - |",
        "| all | 2 of 2: 10.0 -> 13.0 | 0 of 1: 50.0 -> 40.0 | 1 of 2: 20.0 -> 18.5 |",
    ]


def test_report_noise_sets_the_evaluation_error_against_the_spread_over_seeds(tmp_path, capsys):
    def record(model, mode, seed, score, score_std, episodes, target="corl"):
        return {"env": "hopper", "dataset": "medium", "model": model, "seed": seed,
                "eval": mode, "target": target, "score": score, "score_std": score_std,
                "eval_episodes": episodes, "score_own": score,
                "ms_per_env_step": 1.0}  # fmt: skip

    # the Transformer: variance over seeds 2 (10, 12); squared standard errors 3^2 / 9 = 1 and
    # 6^2 / 12 = 3, mean 2, all of it; Aaren's window one seed; its stream no spread at all
    records = [record("transformer", "window", 0, 10.0, 3.0, 10),
               record("transformer", "window", 1, 12.0, 6.0, 13),
               record("aaren", "window", 0, 11.0, 1.0, 10),
               record("aaren", "stream", 0, 11.0, 3.0, 10),
               record("aaren", "stream", 1, 11.0, 3.0, 10),
               record("transformer", "window", 2, 90.0, 3.0, 10, "data_best")]  # fmt: skip
    path = tmp_path / "results.json"
    path.write_text(json.dumps(records))
    report.main([str(path), "--noise"])
    rows = [r for r in capsys.readouterr().out.splitlines() if r.startswith("| hopper")]
    assert rows == ["| hopper medium | 1.4 / 1.4: 100% (2 seeds) | - | 0.0 / 1.0: - (2 seeds) |"]
    # one evaluation episode gives no error to set against the spread
    records = [record("transformer", "window", s, 10.0 + 2 * s, 0.0, 1) for s in (0, 1)]
    path.write_text(json.dumps(records))
    report.main([str(path), "--noise"])
    rows = [r for r in capsys.readouterr().out.splitlines() if r.startswith("| hopper")]
    assert rows == ["| hopper medium | 1.4 / no error from 1 episode (2 seeds) | - | - |"]
    # a record without its episode count gives no error either, and says why
    for r in records:
        del r["eval_episodes"]
    path.write_text(json.dumps(records))
    report.main([str(path), "--noise"])
    rows = [r for r in capsys.readouterr().out.splitlines() if r.startswith("| hopper")]
    assert rows == ["| hopper medium | 1.4 / no episode count recorded (2 seeds) | - | - |"]


def test_report_names_the_machines_of_its_records():
    base = {"env": "hopper", "dataset": "medium", "model": "aaren", "seed": 0, "eval": "window",
            "target": "corl", "score": 1.0, "score_std": 0.0, "score_own": 1.0,
            "ms_per_env_step": 1.0}  # fmt: skip
    avx2 = {"cpu_model": "AMD EPYC", "cpu_kind": "family 25, model 1, AVX2"}
    records = [{**base, "cpu_model": "AMD EPYC"}, {**base, "seed": 1, "cpu_model": "AMD EPYC"},
               {**base, "seed": 2, "cpu_model": "Intel Xeon"}, {**base, "seed": 3},
               {**base, "seed": 4, "cpu_model": "AMD EPYC", "device": "NVIDIA H200"},
               {**base, "seed": 5, "cpu_model": "Intel Xeon", "device": "cpu"},
               {**base, "seed": 6, **avx2}]  # fmt: skip
    assert report.table(records).splitlines()[-1] == (
        "Records by machine (ms per env step compares only within one): AMD EPYC (2), "
        "AMD EPYC (family 25, model 1, AVX2) (1), AMD EPYC + NVIDIA H200 (1), Intel Xeon (2), "
        "not recorded (1)."
    )


def test_drift_by_timestep_counts_only_steps_inside_the_episodes():
    rng = np.random.default_rng(0)
    window = rng.normal(size=(60, 2, 3)).astype(np.float32)  # [T, B, A]
    stream = window.copy()
    stream[25:, 0] += 0.5  # episode 0 drifts from step 25 on
    stream[40:, 1] = 1e6  # episode 1 ended at step 40: whatever follows must not count
    out = drift.drift_by_timestep(window, stream, np.array([60, 40]), context=20)
    assert [(b["t_from"], b["t_to"], b["steps"]) for b in out] == [
        (0, 20, 40),
        (20, 50, 50),
        (50, 60, 10),
    ]
    assert out[0]["rms_diff"] == 0.0 and out[0]["relative"] == 0.0
    # t 20-49: 25 drifting steps of episode 0 among 30 + 20 inside; every entry off by 0.5
    w = np.concatenate([window[20:50, 0], window[20:40, 1]])
    np.testing.assert_allclose(out[1]["rms_diff"], 0.5 * np.sqrt(25 / 50), rtol=1e-6)
    np.testing.assert_allclose(
        out[1]["relative"], out[1]["rms_diff"] / np.sqrt(np.mean(w**2)), rtol=1e-5
    )
    np.testing.assert_allclose(out[2]["rms_diff"], 0.5, rtol=1e-6)
    # the first range is the window's length, whatever it is
    longer = drift.drift_by_timestep(window, stream, np.array([60, 40]), context=30)
    assert [(b["t_from"], b["t_to"]) for b in longer] == [(0, 30), (30, 50), (50, 60)]
    assert longer[0]["rms_diff"] > 0  # steps 25-29 of episode 0 differ


@pytest.mark.slow
def test_drift_script_stream_equals_window_while_the_window_holds_the_episode(generated, tmp_path):
    root, _, _ = generated
    out = tmp_path / "drift.json"
    argv = ["--data-root", str(root), "--steps", "500", "--max-steps", "2", "--no-progress"]
    argv += ["--workdir", str(tmp_path / "run"), "--episodes", "1", "--out", str(out)]
    record = drift.main(argv)
    assert record["train_steps"] == 2 and json.loads(out.read_text()) == [record]
    assert len(record["data_digest"]) == 64 and record["cpu_count"] >= 1  # data and machine
    first = record["buckets"][0]
    assert (first["t_from"], first["steps"]) == (0, min(20, int(record["episode_len"])))
    assert first["rms_diff"] < 1e-5  # same history, same action: one model, two paths
    # the same model also streams in closed loop; scores are D4RL-normalised returns
    assert record["stream_episode_len"] >= 1 and np.isfinite(record["stream_return"])
    low, high = configs.D4RL_REF["hopper"]
    for prefix in ("", "stream_"):
        want = 100 * (record[prefix + "return"] - low) / (high - low)
        assert record[prefix + "score"] == pytest.approx(want)


def test_run_length_and_context():
    cfg = configs.set_run_length(configs.get_config(), steps=2300, context=60)
    assert cfg.loop.max_epochs * cfg.loop.steps_per_epoch == 2000  # whole epochs of 500
    assert cfg.optim.warmup_steps == 200 and cfg.model.seq_len == 60
    kept = configs.set_run_length(configs.get_config())
    assert kept == configs.get_config()  # None keeps every value
    with pytest.raises(ValueError, match="context"):
        configs.set_run_length(configs.get_config(), context=0)


def test_sweep_refuses_a_results_file_of_another_kind_of_run(tmp_path):
    from examples.offline_rl import sweep

    results = tmp_path / "runs.json"
    record = {"env": "hopper", "dataset": "medium", "model": "aaren", "seed": 0,
              "train_steps": 2000, "eval_episodes": 10}  # fmt: skip
    results.write_text(json.dumps([record]))
    # a record without context_steps was trained at CORL's 20: fine for 20, not for 60
    args = ["--results", str(results), "--dry-run", "--steps", "2000"]
    sweep.main([*args, "--envs", "hopper", "--seeds", "0"])
    sweep.main([*args, "--eval-episodes", "10", "--context", "20"])  # the defaults, given
    # the refusal names the kind asked for: (context, fold_return, rsa, steps, episodes)
    for option, kind in [
        (["--context", "60"], "(60, False, False, 2000, 10)"),
        (["--fold-return"], "(20, True, False, 2000, 10)"),
        (["--rsa"], "(20, False, True, 2000, 10)"),
        (["--eval-episodes", "100"], "(20, False, False, 2000, 100)"),
    ]:
        with pytest.raises(SystemExit, match=re.escape(f"another file for {kind}")):
            sweep.main([*args, *option])
    with pytest.raises(SystemExit, match="updates_asked"):
        sweep.main(["--results", str(results), "--dry-run", "--steps", "5000"])
    # a small dataset's run trains whole passes, fewer updates than asked: the same kind
    short = {**record, "dataset": "medium-replay", "train_steps": 624, "updates_asked": 2000}
    results.write_text(json.dumps([record, short]))
    sweep.main([*args, "--envs", "hopper", "--seeds", "1"])
    with pytest.raises(SystemExit, match=re.escape("(20, False, False, 2000, 10)]")):
        sweep.main(["--results", str(results), "--dry-run", "--steps", "624"])


def test_sweep_refuses_to_mix_runs_on_other_data(generated, tmp_path, monkeypatch):
    from examples.offline_rl import sweep

    monkeypatch.setenv("AAREN_RUNS_ROOT", str(tmp_path / "runs"))  # the sweep's claims
    root, _, entry = generated
    spec = data.dataset_id("hopper", "medium")
    # what another CPU's generator writes: the same sizes, other returns
    other = json.loads(json.dumps(entry))
    other["snapshot_returns"][0] = np.nextafter(other["snapshot_returns"][0], np.inf)
    assert data.manifest_fingerprint(other) != data.manifest_fingerprint(entry)
    # the wall time and the checkpoint cadence do not decide the data
    again = json.loads(json.dumps(entry))
    again["sac_wall_s"] += 1.0
    again["config"]["save_every_s"] += 1.0
    assert data.manifest_fingerprint(again) == data.manifest_fingerprint(entry)
    results = tmp_path / "runs.json"
    record = {"env": "hopper", "dataset": "medium", "model": "aaren", "seed": 0,
              "train_steps": 500, "eval_episodes": 1, "dataset_id": spec,
              "data_manifest": data.manifest_fingerprint(other)}  # fmt: skip
    results.write_text(json.dumps([record]))
    args = ["--results", str(results), "--data-root", str(root), "--envs", "hopper"]
    args += ["--datasets", "medium", "--models", "aaren", "--seeds", "1", "--steps", "500"]
    args += ["--eval-episodes", "1"]
    with pytest.raises(SystemExit, match="other data \\(data_manifest"):
        sweep.main(args)
    assert json.loads(results.read_text()) == [record]  # refused before training
    cfg = configs.tiny_config("hopper", "medium", "aaren")
    cfg.data.data_root = str(root)
    here = train.data_provenance(cfg, train.load_data(cfg))
    sweep.check_same_data(results, "aaren/hopper/other-v0", here)  # another dataset: fine
    results.write_text(json.dumps([{**record, "data_manifest": None}, {**record, **here}]))
    sweep.check_same_data(results, spec, here)  # the same data, or not recorded: fine
    results.write_text(json.dumps([{**record, **here, "data_digest": "0" * 64}]))
    with pytest.raises(SystemExit, match="data_digest 000000000000"):
        sweep.check_same_data(results, spec, here)


@pytest.mark.parametrize("backbone", ["transformer", "aaren"])
def test_conditioning_weights_rebuild_the_layer_output(backbone):
    """The last state token's weights, applied to the layer's values, give its output."""
    cfg = dataclasses.replace(configs.tiny_config(backbone=backbone).model, num_heads=2)
    layer = model.DecisionModel(cfg, 5, 2, rngs=nnx.Rngs(0)).backbone.blocks[0].attention
    x = jnp.asarray(np.random.default_rng(0).normal(size=(3, 9, 16)), jnp.float32)
    w = conditioning.last_state_weights(layer, x)  # [B, H, T - 1]
    assert w.shape == (3, 2, 8)
    np.testing.assert_allclose(np.sum(np.asarray(w, np.float64), axis=-1), 1.0, rtol=1e-6)
    values = np.asarray(layer.v_proj(x[:, :8]), np.float64).reshape(3, 8, 2, 8)
    mixed = np.einsum("bht,bthd->bhd", np.asarray(w, np.float64), values).reshape(3, 16)
    want = mixed @ np.asarray(layer.o_proj.kernel[...]) + np.asarray(layer.o_proj.bias[...])
    np.testing.assert_allclose(np.asarray(layer(x))[:, 7], want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("fold_return", [False, True])
@pytest.mark.slow
def test_conditioning_script_records_every_target(generated, tmp_path, fold_return):
    root, _, _ = generated
    out = tmp_path / "conditioning.json"
    argv = ["--data-root", str(root), "--steps", "500", "--max-steps", "2", "--no-progress"]
    argv += ["--models", "aaren", "--fractions", "1", "2", "--episodes", "1", "--heads", "2"]
    argv += ["--fold-return"] if fold_return else []
    argv += ["--workdir-root", str(tmp_path / "runs"), "--out", str(out)]
    records = conditioning.main(argv)
    assert json.loads(out.read_text()) == records
    cfg = configs.get_config()
    cfg.data.data_root = str(root)
    best = max(float(np.sum(r)) for r in train.load_data(cfg).rewards)
    assert [r["target"] for r in records] == ["1x best", "2x best", "corl"]
    assert records[0]["target_return"] == pytest.approx(best)
    assert records[1]["target_return"] == pytest.approx(2 * best)
    assert records[2]["target_return"] == configs.TARGET_RETURNS["hopper"][0]
    run = "hopper-medium-aaren-0-500-h2" + ("-fold" if fold_return else "")
    assert [p.name for p in (tmp_path / "runs").iterdir()] == [run]
    kinds = ["state", "action"] if fold_return else ["return", "state", "action"]
    for r in records:
        assert r["num_heads"] == 2 and r["train_steps"] == 2
        assert r.get("fold_return", False) == fold_return
        assert np.isfinite(r["score"]) and r["stream_score"] is not None
        assert r["open_loop_mse"] > 0 and len(r["attention_share"]) == 3
        for layer in r["attention_share"]:
            assert sorted(layer) == sorted(["layer", *kinds])
            assert sum(layer[kind] for kind in kinds) == pytest.approx(1.0, abs=1e-5)


def test_conditioning_summary_averages_seeds_and_counts_a_rerun_once():
    def record(seed, score, fold=False):
        share = {"layer": 0, "state": 0.6, "action": 0.4}
        if not fold:
            share = {"layer": 0, "return": 0.2 + 0.1 * seed, "state": 0.5, "action": 0.3}
        return {"env": "hopper", "dataset": "medium", "model": "aaren", "seed": seed,
                "train_steps": 5000, "context_steps": 20, "num_heads": 1, "target": "corl",
                "score": score, "stream_score": None, "open_loop_mse": 0.1,
                "attention_share": [share], **({"fold_return": True} if fold else {})}  # fmt: skip

    text = conditioning.summary(
        [record(0, 99.0), record(0, 10.0), record(1, 20.0), record(0, 5.0, fold=True)]
    )
    rows = [line for line in text.splitlines() if line.startswith("| corl")]
    # seed 0's rerun (10.0) replaces its first record; the folded study is a table of its own
    assert rows == ["| corl | 15.0 ± 5.0 | - | 0.100 ± 0.000 | 0.25 ± 0.05 |",
                    "| corl | 5.0 | - | 0.100 | - |"]  # fmt: skip
    assert "return folded into the state token, 10 episodes, seeds [0]" in text


def test_report_names_a_file_that_holds_no_sweep_records(tmp_path):
    drift = {"env": "hopper", "dataset": "medium", "seed": 0, "command": "python drift.py"}
    path = tmp_path / "drift.json"
    path.write_text(json.dumps([drift]))
    lacks = "record 0 lacks model, score, score_std, ms_per_env_step, made by: python drift.py"
    with pytest.raises(ValueError, match=f"drift.json holds no sweep records: {lacks}"):
        report.main([str(path)])
    manifest = tmp_path / "manifest.json"
    manifest.write_text(json.dumps({"hopper": {}}))
    with pytest.raises(ValueError, match="read with --manifest"):
        report.main([str(manifest)])


def test_report_summary_counts_each_files_cells_at_both_targets(tmp_path, capsys):
    def record(env, model, mode, seed, score, target="corl"):
        return {"env": env, "dataset": "medium", "model": model, "seed": seed, "eval": mode,
                "target": target, "score": score, "score_std": 0.5, "ms_per_env_step": 1.0,
                "context_steps": 20, "train_steps": 2000, "eval_episodes": 10}  # fmt: skip

    # hopper: Aaren's window level with the Transformer, its stream far below; walker2d:
    # both of Aaren's above at CORL's target, both far below at the data's best return.
    scores = {("hopper", "transformer", "window"): lambda seed, shift: 20.0 + seed,
              ("hopper", "aaren", "window"): lambda seed, shift: 20.5 + seed,
              ("hopper", "aaren", "stream"): lambda seed, shift: 5.0 + seed,
              ("walker2d", "transformer", "window"): lambda seed, shift: 10.0 + shift,
              ("walker2d", "aaren", "window"): lambda seed, shift: 11.0 - 3 * shift,
              ("walker2d", "aaren", "stream"): lambda seed, shift: 12.0 - 3 * shift}  # fmt: skip
    records = [
        record(env, model, mode, seed, score(seed, shift), target)
        for (env, model, mode), score in scores.items()
        for seed in (0, 1, 2)
        for target, shift in (("corl", 0.0), ("data_best", 5.0))
    ]
    path = tmp_path / "grid.json"
    path.write_text(json.dumps(records))
    report.main(["--summary", str(path)])
    row = capsys.readouterr().out.splitlines()[-1].split(" | ")
    assert row[1:] == ["K 20, updates 2000, episodes 10, softmax", "12", "2 of 2 / 1 of 2",
                       "1 of 2 / 0 of 2", "none / hopper medium |"]  # fmt: skip


def test_a_small_dataset_trains_the_updates_asked_for(generated, monkeypatch, caplog):
    root, _, _ = generated
    cfg = configs.tiny_config("hopper", "medium", "aaren")
    cfg.data.data_root = str(root)
    traj = train.load_data(cfg)
    windows = len(data.SequenceData(traj, cfg.model.seq_len, cfg.data.reward_scale))
    # two batches per pass, epochs of three updates: fit caps an epoch at one pass, so the
    # configured loop would train 2 updates; whole passes train 4, at least the 3 asked for
    cfg.loop = dataclasses.replace(cfg.loop, batch_size=windows // 2, steps_per_epoch=3)
    loops = []
    monkeypatch.setattr(train, "fit", lambda *args, loop, **kwargs: loops.append(loop))
    train.fit_model(cfg, traj, None)
    assert loops == [dataclasses.replace(cfg.loop, max_epochs=2)]
    assert "training 2 whole passes, 4 updates (asked for 3)" in caplog.text
    big = dataclasses.replace(cfg.loop, batch_size=8)  # many batches per pass: as configured
    assert train.whole_passes(dataclasses.replace(cfg, loop=big), windows) == big
