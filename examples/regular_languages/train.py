"""Regular-language recognition (RSA paper, Section 4.2, App. E.2): training and evaluation.

Four models with one embedding and one output head, so that only the attention differs:

* ``transformer``: the causal Transformer baseline (``aaren_jax.Transformer``);
* ``rsa_transformer``: the same with RSA heads (``Transformer(..., rsa=REMConfig(...))``);
* ``aaren``: Aaren (``aaren_jax.Aaren``);
* ``rsa_aaren``: Aaren with REMs gated in (``Aaren(..., rsa=REMConfig(...))``).

Protocol of App. E.2: 3 layers, 5 heads, width 20; Adam at 0.005 halved every 5 epochs
(an ``optax.exponential_decay`` staircase schedule); 25 epochs, no early stopping;
character prediction (after each character, the multi-hot set of legal next symbols, a
sigmoid output trained with binary cross-entropy); a sample is right only if every
position is right (``data.exact_match``), reported on bin 0 (train lengths) and bin 1
(longer). Positional information (``DEFAULT_POSITIONAL``): the plain models add absolute
sinusoidal positions to the token embedding (the RSA paper's vanilla-Transformer baseline);
the RSA models add none, their REMs being their (relative, length-free) positional encoding.
``Config.positional`` overrides either, for ablations.

Shape notation: ``B`` batch, ``T`` time, ``d`` width, ``V`` output symbols.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from examples.common.backbone import make_backbone, sinusoidal_positions
from examples.common.loop import make_train_step
from examples.common.parallel import data_mesh, replicate, shard_batch
from examples.common.paths import ensure_importable
from examples.regular_languages import data

ensure_importable()
import aaren_jax as aj  # noqa: E402

MODELS = ("transformer", "rsa_transformer", "aaren", "rsa_aaren")
POSITIONAL = ("sinusoidal", "none")
# Absolute sinusoidal positions break length generalisation (bin 1 holds positions never seen
# in training); the REMs encode relative position, so the RSA models need no absolute one.
DEFAULT_POSITIONAL = {
    "transformer": "sinusoidal",
    "rsa_transformer": "none",
    "aaren": "sinusoidal",
    "rsa_aaren": "none",
}


@dataclasses.dataclass(frozen=True)
class Config:
    """One training run. Defaults are the paper's protocol (App. E.2)."""

    language: str = "parity"  # one of data.LANGUAGES
    model: str = "transformer"  # one of MODELS
    seed: int = 0  # seeds the data draw, the parameters and the batch order
    num_layers: int = 3  # blocks (paper: 3)
    num_heads: int = 5  # heads (paper: 5)
    d_model: int = 20  # embedding size (paper: 20)
    d_ff: int = 40  # MLP hidden width (not given by the paper; 2 d)
    dropout: float = 0.0  # residual dropout (not given by the paper; none)
    rsa_counts: tuple[int, ...] = (3, 1, 1, 0, 0, 0)  # (k1..k6): the paper's Case III
    rsa_dilations: tuple[int, ...] = ()  # dilations of the k4 + k5 + k6 dilated heads
    mu_init: float = 1.0  # initial gate parameter (paper: in [-3, 3]; App. E.1 found 1 best)
    eta_range: tuple[float, float] = (1.0, 2.0)  # initial |eta| of the regular heads (paper)
    learning_rate: float = 0.005  # Adam's initial learning rate (paper: 0.005)
    decay_every: int = 5  # epochs between learning-rate halvings (paper: 5)
    decay_rate: float = 0.5  # the factor (paper: 0.5)
    epochs: int = 25  # epochs, no early stopping (paper: 25)
    batch_size: int = 32  # training batch (not given by the paper)
    eval_batch_size: int = 500  # evaluation batch (no effect on results)
    train_size: int | None = None  # None: the paper's (10K; 5K for D_n)
    test_size: int | None = None  # per bin; None: the paper's (2K; 1K for D_n)
    log_every_epochs: int = 1  # epochs between log lines
    positional: str | None = None  # one of POSITIONAL; None: DEFAULT_POSITIONAL[model]
    data_parallel: bool = True  # shard each batch over all devices (a no-op on one device)

    @property
    def positional_encoding(self) -> str:
        """The absolute positions this run adds to the token embedding."""
        if self.positional is not None:
            return self.positional
        return DEFAULT_POSITIONAL.get(self.model, "sinusoidal")

    def rem_config(self) -> aj.REMConfig:
        return aj.REMConfig(
            tuple(self.rsa_counts),
            dilations=tuple(self.rsa_dilations),
            mu_init=self.mu_init,
            eta_range=tuple(self.eta_range),
        )


class LanguageModel(nnx.Module):
    """Token embedding (+ sinusoidal positions), a causal stack, a linear multi-hot head.

    Attributes:
      embed: token embedding (the alphabet and a padding token).
      backbone: the ``aaren_jax`` stack.
      head: ``d -> V`` logits of the legal next symbols.
    """

    def __init__(self, cfg: Config, vocab_in: int, vocab_out: int, *, rngs: nnx.Rngs):
        if cfg.model not in MODELS:
            raise ValueError(f"unknown model {cfg.model!r}; expected one of {MODELS}")
        if cfg.positional_encoding not in POSITIONAL:
            raise ValueError(
                f"unknown positional {cfg.positional_encoding!r}; expected one of {POSITIONAL}"
            )
        self.d_model = cfg.d_model
        self.positional = cfg.positional_encoding
        self.embed = nnx.Embed(vocab_in, cfg.d_model, rngs=rngs)
        self.backbone = make_backbone(
            cfg.model,
            cfg.num_layers,
            cfg.d_model,
            cfg.num_heads,
            cfg.d_ff,
            dropout=cfg.dropout,
            rsa=cfg.rem_config() if cfg.model.startswith("rsa_") else None,
            rngs=rngs,
        )
        self.head = nnx.Linear(cfg.d_model, vocab_out, rngs=rngs)

    def __call__(self, tokens: jax.Array, mask: jax.Array) -> jax.Array:
        """Logits. tokens [B, T] int, mask [B, T] bool -> [B, T, V]"""
        x = self.embed(tokens)
        if self.positional == "sinusoidal":
            x = x + jnp.asarray(sinusoidal_positions(tokens.shape[1], self.d_model))[None]
        return self.head(self.backbone(x, mask))


def bce_loss(logits, targets, mask):
    """Binary cross-entropy per symbol, averaged over real positions and symbols."""
    per = optax.sigmoid_binary_cross_entropy(logits, targets)  # [B, T, V]
    weight = mask[..., None].astype(per.dtype)
    return jnp.sum(per * weight) / (jnp.sum(weight) * per.shape[-1])


def loss_fn(model: LanguageModel, batch: dict) -> tuple[jax.Array, None]:
    """BCE of a batch ``{"t": tokens, "y": targets, "m": mask}`` (the shared loop's form)."""
    return bce_loss(model(batch["t"], batch["m"]), batch["y"], batch["m"]), None


@functools.partial(jax.jit, static_argnames=("graphdef",))
def eval_step(params, rest, tokens, targets, mask, weight, *, graphdef):
    """Exact matches (every position, every symbol) and BCE, summed with ``weight``."""
    logits = nnx.merge(graphdef, params, rest)(tokens, mask)
    right = jnp.all((logits > 0) == (targets > 0.5), axis=-1) | ~mask
    exact = jnp.all(right, axis=-1).astype(jnp.float32)
    return jnp.sum(exact * weight), jnp.sum(weight)


def evaluate(graphdef, params, rest, split: data.Split, batch_size: int, mesh=None) -> float:
    """Exact-match accuracy on a split (fixed-shape batches, padding rows weighted 0).

    ``mesh``: a data-parallel mesh over which each batch is split (None: no split).
    """
    n = len(split.tokens)
    hits = count = 0.0
    for start in range(0, n, batch_size):
        idx = np.arange(start, min(start + batch_size, n))
        weight = np.ones(batch_size, np.float32)
        if len(idx) < batch_size:
            weight[len(idx) :] = 0
            idx = np.concatenate([idx, np.zeros(batch_size - len(idx), idx.dtype)])
        b = shard_batch(
            {"t": split.tokens[idx], "y": split.targets[idx], "m": split.mask[idx], "w": weight},
            mesh,
        )
        h, c = eval_step(params, rest, b["t"], b["y"], b["m"], b["w"], graphdef=graphdef)
        hits, count = hits + float(h), count + float(c)
    return hits / count


def make_schedule(cfg: Config, steps_per_epoch: int) -> optax.Schedule:
    """``lr * decay_rate ** floor(step / (decay_every epochs))``: halved every 5 epochs."""
    return optax.exponential_decay(
        init_value=cfg.learning_rate,
        transition_steps=cfg.decay_every * steps_per_epoch,
        decay_rate=cfg.decay_rate,
        staircase=True,
    )


def make_optimizer(cfg: Config, steps_per_epoch: int) -> optax.GradientTransformation:
    """Adam (default betas, no weight decay, no clipping) on ``make_schedule``."""
    return optax.adam(make_schedule(cfg, steps_per_epoch))


def train_and_evaluate(
    cfg: Config,
    workdir: str | None = None,
    datasets=None,
    history_out: list | None = None,
    model_out: list | None = None,
) -> dict[str, Any]:
    """Trains one model on one language and returns its record.

    Args:
      cfg: the run's configuration.
      workdir: unused (runs are short; the sweep resumes at run granularity, ``main.py``
        keeps a run folder); accepted for the examples' common CLI shape.
      datasets: ``data.make_datasets`` output to reuse (else drawn from ``cfg``).
      history_out: if given, receives one ``{"epoch", "train_loss"}`` dict per epoch.
      model_out: if given, receives the trained model (eval mode), for analysis.

    Returns:
      ``{"language", "model", "seed", "bin0", "bin1", "train_loss", "epochs", "train_size",
      "params", "rsa_counts", "wall_s", "step_ms", ...}``.
    """
    del workdir
    t0 = time.perf_counter()
    if datasets is None:
        datasets = data.make_datasets(
            cfg.language, cfg.seed, train_size=cfg.train_size, test_size=cfg.test_size
        )
    train = datasets["train"]
    vocab_in = int(train.tokens.max()) + 1  # alphabet + padding token
    vocab_in = max(vocab_in, len(data.language_dfa(cfg.language).alphabet) + 1)
    vocab_out = train.targets.shape[-1]
    model = LanguageModel(cfg, vocab_in, vocab_out, rngs=nnx.Rngs(cfg.seed))
    n = len(train.tokens)
    steps_per_epoch = n // cfg.batch_size
    if steps_per_epoch == 0:
        raise ValueError(f"{n} training samples < batch size {cfg.batch_size}")
    # the examples' shared jitted step: dropout reseeded from (seed, step)
    step_fn, params, opt_state, rest = make_train_step(
        model, loss_fn, make_optimizer(cfg, steps_per_epoch), cfg.seed
    )
    num_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))
    # Data parallel: replicated state, each batch split over all devices (None: one device).
    mesh = data_mesh() if cfg.data_parallel else None
    if mesh is not None and cfg.batch_size % mesh.size:
        raise ValueError(f"batch size {cfg.batch_size} is not a multiple of {mesh.size} devices")
    eval_mesh = mesh if mesh is not None and cfg.eval_batch_size % mesh.size == 0 else None
    params, opt_state, rest = replicate((params, opt_state, rest), mesh)

    desc = f"{cfg.language}/{cfg.model}/seed{cfg.seed}"
    t_train = time.perf_counter()
    loss = jnp.zeros(())
    history = []
    for epoch in range(cfg.epochs):
        perm = np.random.default_rng([cfg.seed, epoch]).permutation(n)
        losses = []
        for i in range(steps_per_epoch):
            idx = perm[i * cfg.batch_size : (i + 1) * cfg.batch_size]
            b = shard_batch(
                {"t": train.tokens[idx], "y": train.targets[idx], "m": train.mask[idx]}, mesh
            )
            global_step = jnp.asarray(epoch * steps_per_epoch + i, jnp.uint32)
            params, opt_state, loss = step_fn(params, opt_state, rest, b, global_step)
            losses.append(loss)
        epoch_loss = float(jnp.mean(jnp.stack(losses)))
        history.append(epoch_loss)
        if history_out is not None:
            history_out.append({"epoch": epoch + 1, "train_loss": epoch_loss})
        if (epoch + 1) % cfg.log_every_epochs == 0 or epoch + 1 == cfg.epochs:
            elapsed = time.perf_counter() - t_train
            logging.info(
                "%s epoch %d/%d train_bce %.5f (%.1f s, %.0f tokens/s)",
                desc,
                epoch + 1,
                cfg.epochs,
                epoch_loss,
                elapsed,
                (epoch + 1) * steps_per_epoch * cfg.batch_size * train.tokens.shape[1] / elapsed,
            )
    train_s = time.perf_counter() - t_train

    model.eval()
    graphdef_eval, _, rest_eval = nnx.split(model, nnx.Param, ...)
    rest_eval = replicate(rest_eval, mesh)
    result = {
        "language": cfg.language,
        "model": cfg.model,
        "seed": cfg.seed,
        "bin0": evaluate(
            graphdef_eval, params, rest_eval, datasets["bin0"], cfg.eval_batch_size, eval_mesh
        ),
        "bin1": evaluate(
            graphdef_eval, params, rest_eval, datasets["bin1"], cfg.eval_batch_size, eval_mesh
        ),
        "train_loss": history[-1] if history else None,
        "epochs": cfg.epochs,
        "train_size": n,
        "test_size": len(datasets["bin0"].tokens),
        "batch_size": cfg.batch_size,
        "params": num_params,
        "rsa_counts": list(cfg.rsa_counts) if cfg.model.startswith("rsa_") else None,
        "rsa_dilations": list(cfg.rsa_dilations) if cfg.model.startswith("rsa_") else None,
        "mu_init": cfg.mu_init if cfg.model.startswith("rsa_") else None,
        "eta_range": list(cfg.eta_range) if cfg.model.startswith("rsa_") else None,
        "positional": cfg.positional_encoding,
        "backend": jax.default_backend(),
        "step_ms": 1e3 * train_s / max(cfg.epochs * steps_per_epoch, 1),
        "wall_s": time.perf_counter() - t0,
    }
    if "val" in datasets:  # model selection (select_rsa.py): strings of the training range
        result["val"] = evaluate(
            graphdef_eval, params, rest_eval, datasets["val"], cfg.eval_batch_size, eval_mesh
        )
    nnx.update(model, params)
    if model_out is not None:
        model_out.append(model)
    if cfg.model.startswith("rsa_"):
        result["gates"] = [
            float(jax.nn.sigmoid(b.attention.rsa.mu[...])) for b in model.backbone.blocks
        ]
    logging.info(
        "%s bin0 %.4f bin1 %.4f (%.0f s)", desc, result["bin0"], result["bin1"], result["wall_s"]
    )
    return result
