"""Shared example utilities: weight-decay mask, result records, checkpoint round trip."""

import multiprocessing

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from examples.common import (  # noqa: E402
    CheckpointIO,
    OptimConfig,
    append_record,
    load_records,
    make_backbone,
    make_optimizer,
    record_key,
    weight_decay_mask,
)
from examples.common.loop import epoch_permutation  # noqa: E402


@pytest.mark.parametrize("kind", ["aaren", "transformer"])
def test_weight_decay_mask_excludes_query_norms_biases(kind):
    model = make_backbone(kind, 1, 8, 2, 16, rngs=nnx.Rngs(0))
    params = nnx.state(model, nnx.Param)
    mask = weight_decay_mask(params)
    flat = {jax.tree_util.keystr(p): m for p, m in jax.tree_util.tree_leaves_with_path(mask)}
    shapes = {
        jax.tree_util.keystr(p): x.shape for p, x in jax.tree_util.tree_leaves_with_path(params)
    }
    assert any(flat.values()), "some matrices must decay"
    for path, decays in flat.items():
        if "q0" in path or "bias" in path or "scale" in path or len(shapes[path]) < 2:
            assert not decays, path
        elif "kernel" in path:
            assert decays, path
    if kind == "aaren":
        assert any("q0" in p for p in flat)


def test_make_backbone_rsa_kinds_carry_their_rems_and_refuse_a_mismatch():
    import aaren_jax as aj

    rem = aj.REMConfig((1, 1, 0, 0, 0, 0))
    x = jnp.ones((1, 5, 8))
    for kind in ("rsa_aaren", "rsa_transformer"):
        model = make_backbone(kind, 1, 8, 2, 16, rsa=rem, rngs=nnx.Rngs(0))
        assert model.blocks[0].attention.rsa is not None
        plain = make_backbone(kind.removeprefix("rsa_"), 1, 8, 2, 16, rngs=nnx.Rngs(0))
        out_shape = lambda m: nnx.eval_shape(lambda m: m(x), m).shape  # traced, not run
        assert out_shape(model) == out_shape(plain) == x.shape
    with pytest.raises(ValueError, match="rsa must be a REMConfig"):
        make_backbone("rsa_aaren", 1, 8, 2, 16, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="rsa must be None"):
        make_backbone("aaren", 1, 8, 2, 16, rsa=rem, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="unknown backbone"):
        make_backbone("rsa", 1, 8, 2, 16, rngs=nnx.Rngs(0))


def test_optimizer_applies_no_decay_to_masked_leaves():
    params = {"w": jnp.ones((2, 2)), "bias": jnp.ones((2,)), "q0": jnp.ones((2,))}
    cfg = OptimConfig(learning_rate=0.1, warmup_steps=0, decay_steps=10, weight_decay=0.5)
    tx = make_optimizer(cfg, params)
    state = tx.init(params)
    zeros = jax.tree.map(jnp.zeros_like, params)
    for _ in range(2):  # step 0 of the schedule has lr 0.1 (no warmup); step 1 decays w
        updates, state = tx.update(zeros, state, params)
    assert float(jnp.abs(updates["w"]).sum()) > 0
    assert float(jnp.abs(updates["bias"]).sum()) == 0
    assert float(jnp.abs(updates["q0"]).sum()) == 0


def test_records_append_and_skip(tmp_path):
    path = tmp_path / "r" / "results.json"
    assert load_records(path) == []
    append_record(path, {"dataset": "a", "seed": 0, "mse": 1.0})
    append_record(path, {"dataset": "a", "seed": 1, "mse": 2.0})
    records = load_records(path)
    assert [r["seed"] for r in records] == [0, 1]
    done = {record_key(r, ("dataset", "seed")) for r in records}
    assert ("a", 1) in done and ("a", 2) not in done


def _append_many(path, worker, count):
    for i in range(count):
        append_record(path, {"worker": worker, "i": i})


def test_concurrent_appends_keep_every_record(tmp_path):
    path = tmp_path / "results.json"
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_append_many, args=(path, w, 15)) for w in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
        assert p.exitcode == 0
    records = load_records(path)
    assert sorted((r["worker"], r["i"]) for r in records) == [
        (w, i) for w in range(3) for i in range(15)
    ]


def test_epoch_permutation_is_seeded():
    a = epoch_permutation(50, seed=3, epoch=2)
    np.testing.assert_array_equal(a, epoch_permutation(50, seed=3, epoch=2))
    assert not np.array_equal(a, epoch_permutation(50, seed=3, epoch=3))
    assert sorted(a) == list(range(50))


def test_checkpoint_round_trip(tmp_path):
    tree = {"params": {"w": jnp.arange(6.0).reshape(2, 3)}, "count": jnp.asarray(4, jnp.int32)}
    io = CheckpointIO(tmp_path / "ckpt")
    io.save(7, tree, {"step": 7, "history": [{"epoch": 1}]})
    io.close()
    io = CheckpointIO(tmp_path / "ckpt")
    assert io.latest_step() == 7
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)
    restored, meta = io.restore(abstract)
    io.close()
    np.testing.assert_array_equal(restored["params"]["w"], tree["params"]["w"])
    assert meta == {"step": 7, "history": [{"epoch": 1}]}


@pytest.mark.parametrize("dim", [20, 7])
def test_sinusoidal_positions_against_the_formula(dim):
    from examples.common import sinusoidal_positions

    pe = sinusoidal_positions(200, dim)
    t, c = np.meshgrid(np.arange(200), np.arange(dim), indexing="ij")
    angle = t / 10000.0 ** (2 * (c // 2) / dim)
    want = np.where(c % 2 == 0, np.sin(angle), np.cos(angle))
    assert pe.shape == (200, dim) and pe.dtype == np.float32
    np.testing.assert_allclose(pe, want, atol=1e-6)


def test_claim_run_is_exclusive_until_released(tmp_path):
    from examples.common import claim_run

    lock = tmp_path / "runs" / "hopper-medium-aaren-0.lock"
    with claim_run(lock) as first:
        assert first
        with claim_run(lock) as second:  # another open file description: refused at once
            assert not second
    with claim_run(lock) as again:
        assert again
