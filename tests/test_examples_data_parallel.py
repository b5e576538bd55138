"""Data parallel training of the examples: a step on 4 devices equals a step on 1 device.

The 4 devices are simulated CPU devices (``--xla_force_host_platform_device_count=4``),
which must be set before JAX starts, hence a subprocess.
"""

import json
import os
import subprocess
import sys
import textwrap

import pytest

from examples.common.paths import REPO_ROOT

SCRIPT = textwrap.dedent(
    """
    import dataclasses, functools, json
    import jax, jax.numpy as jnp, numpy as np, optax
    from flax import nnx
    from examples.common import fit
    from examples.common.loop import _train_step
    from examples.common.parallel import data_mesh, replicate, shard_batch
    from examples.forecasting import configs, train
    from examples.forecasting.data import ForecastData, WindowDataset

    assert jax.device_count() == 4, jax.devices()
    mesh = data_mesh()
    assert mesh is not None and mesh.size == 4 and data_mesh(jax.devices()[:1]) is None
    rng = np.random.default_rng(0)
    cfg = configs.tiny_config(backbone="aaren")  # dropout 0.1: the masks must agree too
    L, P, C, F = cfg.data.seq_len, cfg.data.pred_len, 3, 4

    def split(n):
        rows = n + L + P - 1
        return WindowDataset(
            rng.normal(size=(rows, C)).astype(np.float32),
            rng.uniform(-0.5, 0.5, size=(rows, F)).astype(np.float32),
            L,
            P,
        )

    data = ForecastData(
        split(32), split(16), split(16), np.zeros(C), np.ones(C), ["a", "b", "OT"], "h",
        ([0, 0, 0], [0, 0, 0]),
    )
    out = {}

    # 1. One jitted training step of the examples (the one fit runs), batch of 8 split 4 ways.
    # SGD: the update is linear in the gradient, so parameters differ by round-off only.
    # (Adam divides by |gradient|: where the exact gradient is 0, such as the key bias that
    # softmax ignores, it turns round-off into steps of +-lr that change no output.)
    model = train.build_model(cfg, data)
    model.train()
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    tx = optax.sgd(0.1)
    step = functools.partial(
        _train_step, graphdef=graphdef, tx=tx, loss_fn=train.loss_fn, base_key=jax.random.key(0)
    )
    batch = data.train.batch(np.arange(8))
    copy = lambda t: jax.tree.map(jnp.copy, t)
    p1, _, loss1 = step(copy(params), tx.init(params), rest, batch, jnp.uint32(5))
    p4, r4 = replicate((copy(params), rest), mesh)
    p4, _, loss4 = step(p4, tx.init(p4), r4, shard_batch(batch, mesh), jnp.uint32(5))
    assert all(len(x.sharding.device_set) == 4 for x in jax.tree.leaves(p4))
    maxdiff = lambda x, y: max(
        float(jnp.max(jnp.abs(a - b))) for a, b in zip(jax.tree.leaves(x), jax.tree.leaves(y))
    )
    out["step"] = {
        "loss": [float(loss1), float(loss4)],
        "max_param_diff": maxdiff(p1, p4),
        "max_update": maxdiff(p1, params),
    }

    # 2. fit shards its state over the 4 devices (whole runs against one device: the loopback
    # test below).
    loop = dataclasses.replace(cfg.loop, max_steps=1, batch_size=8, eval_batch_size=8)
    result = fit(
        train.build_model(cfg, data), train.loss_fn, train.eval_fn, data.train, data.val,
        monitor="mse", mode="min", loop=loop, optim=cfg.optim,
    )
    leaves = jax.tree.leaves(result.params)
    out["fit_devices"] = sorted({len(x.sharding.device_set) for x in leaves})

    # 3. regular_languages has a loop of its own: the same on 4 devices as on 1.
    from examples.regular_languages import train as rl_train

    out["languages"] = []
    for parallel in (False, True):
        rl_cfg = rl_train.Config(
            language="parity", model="aaren", num_layers=1, epochs=1, train_size=64,
            test_size=40, eval_batch_size=40, data_parallel=parallel,
        )
        r = rl_train.train_and_evaluate(rl_cfg)
        out["languages"].append([r["train_loss"], r["bin0"], r["bin1"]])
    print("RESULT" + json.dumps(out))
    """
)


@pytest.mark.slow
def test_one_step_on_four_devices_equals_one_device():
    env = dict(os.environ)
    env["XLA_FLAGS"] = (
        env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
    ).strip()
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), *sys.path])
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT"))
    out = json.loads(line[len("RESULT") :])
    step = out["step"]
    assert step["loss"][0] == pytest.approx(step["loss"][1], rel=1e-6)
    assert step["max_update"] > 1e-4  # the step moved the parameters ...
    assert step["max_param_diff"] < 1e-6  # ... identically, to float32 round-off
    assert out["fit_devices"] == [4]
    (loss1, *bins1), (loss4, *bins4) = out["languages"]
    assert loss4 == pytest.approx(loss1, rel=1e-5) and bins4 == bins1


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_two_processes_on_loopback_equal_one_process(tmp_path, monkeypatch):
    """The multi-host recipe (README of the examples) with two local processes."""
    from examples.forecasting import main as forecast_main
    from tests.test_examples_runs import TINY, write_tslib_csv

    csv_path = write_tslib_csv(tmp_path / "series.csv")
    args = ["--csv", str(csv_path), *TINY, "--epochs", "2"]
    env = dict(os.environ)
    env["XLA_FLAGS"] = (
        env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2"
    ).strip()
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), *sys.path])
    port = _free_port()
    workdir = tmp_path / "two"
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                str(REPO_ROOT / "examples" / "forecasting" / "main.py"),
                *args,
                "--workdir",
                str(workdir),
                "--coordinator",
                f"127.0.0.1:{port}",
                "--num-processes",
                "2",
                "--process-id",
                str(i),
            ],
            cwd=REPO_ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(2)
    ]
    for p in procs:
        _, err = p.communicate(timeout=600)
        assert p.returncode == 0, err[-4000:]
    two = json.loads((workdir / "result.json").read_text())["record"]

    monkeypatch.setattr(forecast_main, "setup_logging", lambda: None)
    one = forecast_main.main([*args, "--workdir", str(tmp_path / "one")])  # 1 process, 1 device
    assert two["steps"] == one["steps"] == 4
    for key in ("mse", "mae", "val_mse"):
        assert two[key] == pytest.approx(one[key], rel=1e-5), key
