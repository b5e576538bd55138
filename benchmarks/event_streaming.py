"""Streams events one at a time through the event-forecasting model: latency and carry bytes.

    python benchmarks/event_streaming.py                 # 1k, 10k, 100k events, both models
    python benchmarks/event_streaming.py --quick         # 100 and 1000 events (a smoke run)

The model is ``examples/event_forecasting``'s default (2 blocks, d=32, 4 heads, MLP 64, 8
log-normal components, 3 marks), randomly initialised: latency does not depend on training.
The stream is one long sequence of the generated multivariate Hawkes process (Ogata thinning).

For each checkpoint ``t`` and model, the stream state is brought to ``t`` events by a jitted
``lax.scan`` of the same ``stream_next`` the user-facing ``predict_next`` runs (chunks of
``--chunk`` events), then ``--steps`` calls of ``predict_next(state, event)`` (jitted, state
donated, batch 1, float32) are timed one by one with ``block_until_ready``: events
``t+1 .. t+steps``. Each call returns the next event's full distribution (mixture parameters
and mark logits).

Aaren's carry has a constant size. The Transformer's carry is a KV cache of capacity
``t + steps + 2`` tokens at checkpoint ``t`` (the start token and an untimed first call
included), re-allocated per
checkpoint, and its step reads the whole capacity. Filling a 100k-token cache by stepping costs
O(t^2) (hours on a small CPU), so the Transformer is timed two ways:

* ``transformer``: the cache filled with the ``t`` real events (up to ``--max-filled``);
* ``transformer_empty``: an empty cache of the same capacity. A step reads and masks all
  ``capacity`` slots whatever is in them, so this costs the same (the JSON shows both where
  both exist) and is what is measured at 100k.

Writes ``results/event_streaming_<backend>.json`` (also printed).
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from _common import REPO, machine_info, summary, tree_bytes, write_json
from flax import nnx

sys.path.insert(0, str(REPO))  # the examples
from examples.event_forecasting import configs, data, model  # noqa: E402


def hawkes_stream(n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """At least ``n`` events of the default Hawkes process, as one sequence."""
    p = data.HawkesParams()
    rate = np.linalg.solve(np.eye(p.num_marks) - np.asarray(p.alpha), np.asarray(p.mu)).sum()
    t_end = 1.3 * n / rate
    while True:
        times, marks = data.hawkes_sample(
            np.random.default_rng(seed), data.HawkesParams(t_end=t_end)
        )
        if len(times) >= n:
            return times[:n], marks[:n]
        t_end *= 1.5


def build(backbone: str, log_mean: float, log_std: float) -> model.EventModel:
    cfg = configs.get_config("hawkes", backbone).model
    net = model.EventModel(cfg, 3, log_mean, log_std, rngs=nnx.Rngs(0))
    net.eval()
    return net


def make_fill(net: model.EventModel):
    """``fill(state, times, marks) -> state``: a jitted scan of ``stream_next``."""
    graphdef, params = nnx.split(net)

    @functools.partial(jax.jit, donate_argnums=1)
    def fill(params, state, times, marks):
        m = nnx.merge(graphdef, params)

        def body(s, ev):
            s, _ = model.stream_next(m, s, model.Event(ev[0][None], ev[1][None]))
            return s, None

        return jax.lax.scan(body, state, (times, marks))[0]

    return lambda state, times, marks: fill(params, state, times, marks)


def measure(net, times, marks, t: int, steps: int, chunk: int, filled: bool) -> dict:
    """Per-event latency of ``predict_next`` after ``t`` events (filled or empty carry)."""
    # the start token, t events, then steps + 1 calls (the first one compiles)
    streamer = model.make_streamer(net, max_len=t + steps + 2)
    state, _ = streamer.start(np.zeros(1, np.float32))
    t_fill = 0.0
    if filled and t:
        fill = make_fill(net)
        start = time.perf_counter()
        for a in range(0, t, chunk):
            b = min(a + chunk, t)
            state = fill(state, jnp.asarray(times[a:b], jnp.float32), jnp.asarray(marks[a:b]))
        jax.block_until_ready(state)
        t_fill = time.perf_counter() - start
        assert int(state.count[0]) == t
    offset = t if filled else 0
    seconds = []
    for j in range(steps + 1):  # the first call compiles
        ev = model.Event(
            jnp.asarray(times[t + j : t + j + 1], jnp.float32),
            jnp.asarray(marks[t + j : t + j + 1], jnp.int32),
        )
        start = time.perf_counter()
        state, out = streamer.predict_next(state, ev)
        jax.block_until_ready(out)
        if j:
            seconds.append(time.perf_counter() - start)
    assert int(state.count[0]) == offset + steps + 1
    finite = bool(np.all(np.isfinite(np.asarray(out.time.mean()))))
    return {
        "events": t,
        "filled": filled,
        "latency_ms": summary(seconds, 1e3),
        "carry_bytes": tree_bytes(state.carry),
        "state_bytes": tree_bytes(state),
        "fill_s": round(t_fill, 3),
        "finite": finite,
    }


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--events", nargs="+", type=int, default=[1000, 10000, 100000])
    p.add_argument("--steps", type=int, default=200, help="timed events per checkpoint")
    p.add_argument("--chunk", type=int, default=1000, help="events per fill scan")
    p.add_argument("--max-filled", type=int, default=10000, help="largest filled KV cache")
    p.add_argument("--quick", action="store_true", help="100 and 1000 events, 50 steps")
    p.add_argument("--out", default=None, help="default: results/event_streaming_<backend>.json")
    args = p.parse_args(argv)
    if args.quick:
        args.events, args.steps, args.chunk = [100, 1000], 50, 100
    info = machine_info()
    times, marks = hawkes_stream(max(args.events) + args.steps + 1)
    gaps = np.diff(times, prepend=0.0)[1:]
    log_mean, log_std = float(np.log(gaps).mean()), float(np.log(gaps).std())
    results = {"aaren": [], "transformer": [], "transformer_empty": []}
    for t in args.events:
        for name, backbone, filled in (
            ("aaren", "aaren", True),
            ("transformer", "transformer", True),
            ("transformer_empty", "transformer", False),
        ):
            if name == "transformer" and t > args.max_filled:
                continue
            net = build(backbone, log_mean, log_std)
            row = measure(net, times, marks, t, args.steps, args.chunk, filled)
            results[name].append(row)
            print(name, row, file=sys.stderr, flush=True)
    cfg = configs.get_config("hawkes").model
    out = {
        "benchmark": "event_streaming",
        "command": " ".join(["python", "benchmarks/event_streaming.py", *sys.argv[1:]]),
        "model": {
            "layers": cfg.num_layers,
            "d_model": cfg.d_model,
            "heads": cfg.num_heads,
            "d_ff": cfg.d_ff,
            "components": cfg.num_components,
            "marks": 3,
        },
        "steps_timed": args.steps,
        "batch": 1,
        "dtype": "float32",
        "machine": info,
        "results": results,
    }
    path = args.out or REPO / "results" / f"event_streaming_{jax.default_backend()}.json"
    write_json(Path(path), out)


if __name__ == "__main__":
    main()
