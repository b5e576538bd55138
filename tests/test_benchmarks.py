"""The issue-13 benchmarks' own building blocks compute what they claim (no timing asserted)."""

import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import aaren_jax as aj

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import anchors  # noqa: E402
import training  # noqa: E402


def test_linear_recurrences_match_a_loop(key):
    k1, k2 = jax.random.split(key)
    a = jax.random.uniform(k1, (2, 3, 7, 4))
    x = jax.random.normal(k2, (2, 3, 7, 4))
    h, want = np.zeros((2, 3, 4)), []
    for t in range(7):
        h = np.asarray(a[..., t, :]) * h + np.asarray(x[..., t, :])
        want.append(h)
    want = np.stack(want, axis=-2)
    np.testing.assert_allclose(anchors.linear_recurrence_associative(a, x), want, rtol=1e-5)
    np.testing.assert_allclose(anchors.linear_recurrence_sequential(a, x), want, rtol=1e-5)


@pytest.mark.parametrize("cls", [anchors.DotProductAttentionBlock, anchors.RGLRUBlock])
def test_anchor_blocks_are_causal(cls, key):
    block = cls(8, 2, 16, rngs=nnx.Rngs(0))
    x = jax.random.normal(key, (2, 6, 8))
    y = block(x)
    changed = block(x.at[:, 4:].set(5.0))  # the future changes, the past must not
    assert y.shape == x.shape and bool(jnp.all(jnp.isfinite(y)))
    np.testing.assert_allclose(changed[:, :4], y[:, :4], rtol=1e-6, atol=1e-6)


def test_floor_block_reuses_the_aaren_blocks_parts(key):
    floor = training.make_floor(8, 2, 16, rngs=nnx.Rngs(0))
    x = jax.random.normal(key, (2, 5, 8))
    step, params = training.make_train_step(floor)
    loss, (grads, grad_x) = step(params, x, x)
    assert np.isfinite(float(loss)) and grad_x.shape == x.shape
    names = {"/".join(map(str, path)) for path, _ in nnx.to_flat_state(grads)}
    assert any(name.startswith("k_proj") for name in names)  # k is not dead code


def test_rsa_forecasting_table_pairs_seeds_and_counts_wins(monkeypatch):
    import report

    def rec(model, seed, mse, mae, **extra):
        return dict(dataset="ETTh1", horizon=96, model=model, seed=seed, mse=mse, mae=mae, **extra)

    records = [
        rec("aaren", 0, 0.50, 0.40),
        rec("aaren", 1, 0.60, 0.40),  # no RSA run at seed 1: left out of the comparison
        rec("rsa_aaren", 0, 0.45, 0.41, gates=[0.7, 0.5]),
        rec("transformer", 0, 0.40, 0.30),
        rec("rsa_transformer", 0, 0.42, 0.29, gates=[0.6, 0.6]),
    ]
    monkeypatch.setattr(report, "_load", lambda name: records)
    table = report.rsa_forecasting_table()
    row = next(line for line in table.splitlines() if line.startswith("| ETTh1"))
    assert "| 1/1 |" in row and "0.500 +- 0.000 (n=1)" in row and "0.70 / 0.50" in row
    assert "rsa_aaren lowers the MSE of aaren in 1 of 1" in table
    assert "rsa_aaren lowers the MAE of aaren in 0 of 1" in table
    assert "rsa_transformer lowers the MSE of transformer in 0 of 1" in table
    assert "rsa_transformer lowers the MAE of transformer in 1 of 1" in table
    monkeypatch.setattr(report, "_load", lambda name: records[:2])
    assert report.rsa_forecasting_table() is None


def test_short_sequence_variants_agree_across_methods():
    import short_sequences

    variants = short_sequences.variants(2, 1, 9, 3)
    (s, v), g = variants["auto"][2], variants["auto"][3]
    want = variants["sequential"][0](s, v)
    want_grads = variants["sequential"][1](s, v, g)
    for method, (forward, grad, _, _) in variants.items():
        np.testing.assert_allclose(forward(s, v), want, rtol=1e-5, atol=1e-6, err_msg=method)
        for got, ref in zip(grad(s, v, g), want_grads, strict=True):
            np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-5, err_msg=method)


def test_scan_profile_pass1_and_compiled_facts(key):
    import scan_profile

    k1, k2 = jax.random.split(key)
    scores = jax.random.normal(k1, (3, 128)) * 4
    values = jax.random.normal(k2, (3, 128, 5))
    start_m, (start_u, start_w), final_m, (final_u, final_w) = scan_profile.pass1(scores, values)

    def sequential(s, v):  # another code path than the blocked kernel pass1 belongs to
        return aj.prefix_attention(s, v, method="sequential")[0]

    # the state before each block and after the last is attention over the tokens before it
    block = 128 // start_m.shape[-1]
    for j in range(start_m.shape[-1]):
        if j == 0:
            assert np.all(np.asarray(start_u[:, 0]) == 0)
            continue
        want = sequential(scores[:, : j * block], values[:, : j * block])[:, -1]
        got = start_w[:, j] / start_u[:, j, None]
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(final_m, jnp.max(scores, -1))
    want = sequential(scores, values)[:, -1]
    np.testing.assert_allclose(final_w / final_u[:, None], want, rtol=1e-5, atol=1e-6)

    facts = scan_profile.compiled_facts(1, 2, 128, 4)
    assert facts["method"] == "blocked" and facts["fusions"] > 0
    assert facts["in_place_update_fusions"] >= 1
    assert scan_profile._elements("%x = f32[2,3,4]{2,1,0} fusion(%a)") == 24


def test_scan_profile_score_variants_agree():
    import scan_profile

    table = scan_profile.variants(2, 2, 16, 4)
    keys_fn, _, args, _ = table["scores_from_keys"]
    folded_fn, _, folded_args, _ = table["scores_folded"]
    np.testing.assert_allclose(folded_fn(*folded_args), keys_fn(*args), rtol=1e-4, atol=1e-5)
    kernel_fn, _, args, _ = table["kernel"]
    flat_fn, _, flat_args, _ = table["kernel_batch1"]
    np.testing.assert_allclose(flat_fn(*flat_args)[0], kernel_fn(*args).reshape(4, 16, 4))


def test_scan_profile_minimal_loops_compute_their_recurrence(key):
    import scan_profile

    k1, k2 = jax.random.split(key)
    scores = jax.random.normal(k1, (2, 3, 4))  # [B', N, C]
    values = jax.random.normal(k2, (2, 3, 4, 5))
    s, v = np.asarray(scores), np.asarray(values)
    acc, want = np.zeros((2, 3, 5)), np.zeros((2, 3, 4, 5))
    for c in range(4):  # acc_c = acc_{c-1} / 2 + exp(s_c) v_c, written at c
        acc = acc * 0.5 + np.exp(s[:, :, c])[..., None] * v[:, :, c]
        want[:, :, c] = acc
    strided = scan_profile.minimal_loop(scores, values, axis=2)
    contiguous = scan_profile.minimal_loop(
        jnp.moveaxis(scores, -1, 0), jnp.moveaxis(values, -2, 0), axis=0
    )
    np.testing.assert_allclose(strided, want, rtol=1e-5)
    np.testing.assert_allclose(jnp.moveaxis(contiguous, 0, -2), want, rtol=1e-5)


def test_machine_info_records_what_fresh_memory_costs(monkeypatch):
    import _common

    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.hugetlb=1")
    info = _common.machine_info()
    assert info["glibc_tunables"] == "glibc.malloc.hugetlb=1"
    assert info["transparent_hugepages"] in (None, "always", "madvise", "never")
    assert info["cpu_count"] >= 1 and info["cpu_model"]
    assert info["cpu_kind"] == aj.native.cpu_kind()
    before = _common.page_faults()
    np.ones(1 << 22).sum()  # 32 MiB touched for the first time
    assert _common.page_faults() > before


def test_scan_floors_are_the_elementwise_work_and_its_gradient(key):
    import _common

    a, b, c = jax.random.normal(key, (3, 2, 5, 4))
    np.testing.assert_allclose(_common.floor_forward(a, b), a * b + a, rtol=1e-6)
    grad_a, grad_b = _common.floor_forward_backward(a, b, c)
    np.testing.assert_allclose(grad_a, (b + 1) * c, rtol=1e-5, atol=1e-6)  # d/da sum((ab+a)c)
    np.testing.assert_allclose(grad_b, a * c, rtol=1e-5, atol=1e-6)


def test_scan_benchmark_times_each_methods_own_gradient():
    import scan

    table = scan.variants(8, 1, 1, 2, ("associative", "sequential"))
    jaxprs = {}
    for method, (_, gradient, inputs, cotangent) in table.items():
        if method == "floor":
            continue
        scores, values = inputs

        def loss(s, v, method=method, g=cotangent):
            return jnp.sum(aj.prefix_attention(s, v, method=method)[0] * g)

        want = jax.grad(loss, argnums=(0, 1))(scores, values)
        got = gradient(scores, values, cotangent)
        for g, w in zip(got, want, strict=True):
            np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)
        jaxprs[method] = str(jax.make_jaxpr(gradient)(scores, values, cotangent))
    # each method's gradient is its own computation, not the last method's (late binding)
    assert jaxprs["associative"] != jaxprs["sequential"]


def test_tangent_blocks_benchmark_traces_each_size_and_the_same_gradient(monkeypatch):
    import tangent_blocks

    monkeypatch.setattr(aj.scan, "TANGENT_BLOCK", aj.scan.TANGENT_BLOCK)  # restored after
    table = tangent_blocks.variants(40, 1, 2, 3, (8, 32))
    for size in (8, 32):
        _, gradient, (scores, values), cotangent = table[f"blocked_tangent_{size}"]

        def loss(s, v, g=cotangent):
            return jnp.sum(aj.prefix_attention(s, v, method="sequential")[0] * g)

        want = jax.grad(loss, argnums=(0, 1))(scores, values)
        for g, w in zip(gradient(scores, values, cotangent), want, strict=True):
            np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5)
        # the dense tangent weights have the size's shape: [B*H, blocks, S, S]
        jaxpr = str(jax.make_jaxpr(gradient)(scores, values, cotangent))
        assert f"f32[2,{-(-40 // size)},{size},{size}]" in jaxpr


@pytest.mark.slow
def test_decision_step_benchmark_times_every_policy_and_the_environment(tmp_path):
    pytest.importorskip("gymnasium")
    pytest.importorskip("mujoco")
    import decision_step

    out = decision_step.main(["--steps", "3", "--rounds", "2", "--out", str(tmp_path / "d.json")])
    results = out["results"]
    assert set(results) == {*decision_step.POLICIES, "env"}
    for name, row in results.items():
        assert len(row["ms_per_step_per_round"]) == 2 and row["ms_per_step_median"] > 0
        assert list(row["ms_per_step_by_range"]) == ["0-2"]
        if name != "env":  # the ratios and totals agree with the per-round means
            base = results["transformer_window"]["ms_per_step_per_round"]
            want = [m / b for m, b in zip(row["ms_per_step_per_round"], base, strict=True)]
            ratios = row["ratio_to_transformer_window_per_round"]
            np.testing.assert_allclose(ratios, want, atol=2e-3)
            env = results["env"]["ms_per_step_per_round"]
            totals = [m + e for m, e in zip(row["ms_per_step_per_round"], env, strict=True)]
            assert row["with_env_ms_per_step_median"] == pytest.approx(np.median(totals), abs=1e-3)
    assert results["transformer_window"]["ratio_to_transformer_window_median"] == 1.0
    assert out["model"]["cache_tokens"] == 3 * 1000 and out["machine"]["cpu_model"]
