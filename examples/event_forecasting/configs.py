"""Event-forecasting configurations: meta-tpp's ``thp_mix`` shape, shrunk for a 2-core CPU."""

from __future__ import annotations

import dataclasses

from examples.common import LoopConfig, OptimConfig


@dataclasses.dataclass
class ModelConfig:
    """Embedding, causal stack and decoders."""

    backbone: str = "aaren"  # "aaren" or "transformer": the only difference between the runs
    num_layers: int = 2  # blocks (meta-tpp thp_mix: 2)
    d_model: int = 32  # model width d (thp_mix: 64)
    num_heads: int = 4  # attention heads (thp_mix: 1 head of size 64)
    d_ff: int = 64  # MLP width (thp_mix: d_inner 64)
    dropout: float = 0.1  # dropout on the embedding and in the blocks (thp_mix: 0.1)
    norm: str = "pre"  # LayerNorm placement in the blocks
    num_components: int = 8  # log-normal mixture components K (thp_mix: 8)
    log_scale_min: float = -5.0  # clamp of the components' log std (standardised log-space)
    log_scale_max: float = 1.0  # upper clamp: keeps exp(s^2 / 2) in the mean finite
    # mark logits = <context, mark embedding> + bias (a copy-friendly head); tried once on
    # Wikipedia (seed 0, Aaren): val NLL 17.479 against 17.535 untied, no better accuracy; off
    tie_marks: bool = False
    # copy head: context-gated bonuses on the logits of the previous event's mark and of the
    # marks seen so far in the window (log(1 + count)); streaming carries [B, M] counts
    copy_marks: bool = False
    # start the copy head at the repeat-the-previous-mark predictor: the previous mark's gate
    # bias at log M (then it gets about half the probability among M uniform logits)
    copy_prior: bool = False
    # recency features: exponential moving averages of the standardised log gaps over the
    # events so far, one per decay rate, embedded into each token (an O(1) carry when
    # streaming); () for none
    gap_ema: tuple[float, ...] = ()


@dataclasses.dataclass
class DataConfig:
    """Which dataset and how to split it."""

    dataset: str = "sin"  # stackoverflow, taxi, wikipedia, sin, hawkes
    data_root: str | None = None  # folder holding TPP/; None: ../shared/data
    cache_dir: str | None = None  # generated data cache; None: workdirs/event_forecasting_cache
    split_seed: int = 0  # seed of the 60/20/20 split (Wikipedia, generated) and of generation
    num_generated: int = 1000  # sequences of a generated dataset
    max_train_events: int | None = 256  # training windows (predicted events); None: whole


@dataclasses.dataclass
class Config:
    """Everything one run needs."""

    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    loop: LoopConfig = dataclasses.field(
        default_factory=lambda: LoopConfig(
            batch_size=32,
            eval_batch_size=32,
            max_epochs=60,  # Sin, seed 0: still improving at 30 epochs of lr 1e-3
            steps_per_epoch=40,
            patience=5,
            log_every=20,
            checkpoint_every=5,
        )
    )
    optim: OptimConfig = dataclasses.field(
        # the paper used meta-tpp's Adam at lr 5e-4 (Appendix E); here AdamW at 3e-3, chosen on
        # Sin's validation split (val NLL 0.702 against 0.773 at 1e-3, seed 0, Aaren)
        default_factory=lambda: OptimConfig(learning_rate=3e-3, warmup_steps=50, weight_decay=1e-4)
    )


# Per-dataset settings that depend on the data's shape only (never on a model). Wikipedia:
# an 8227-way mark softmax over sequences of up to 1936 events needs small evaluation batches,
# an epoch costs minutes on a shared 2-core CPU, and validation NLL rises after 2-3 epochs
# (seed 0, Aaren), so it stops sooner.
# StackOverflow: 120 epochs with patience 10 (the cosine schedule spans the 120), for both
# models, chosen on validation at seed 0: mean val NLL of the two models 2.2064 against 2.2178
# at 60 epochs with patience 5 (Aaren 2.1993 against 2.2236, which had stopped at epoch 35;
# Transformer 2.2135 against 2.2119).
EVAL_BATCH = {"wikipedia": 4}
PATIENCE = {"wikipedia": 2, "stackoverflow": 10}
# Wikipedia's model settings, for both models (chosen on its validation split, seed 0, Aaren;
# README): the copy head, because 45 % of the test events' marks (pages) never occur in the
# training split while 90 % occurred earlier in their own sequence; an upper log-scale clamp
# below the default 1 (first 0, now -0.5: below), so that no component is wider than the
# training split's whole spread of log gaps (sigma_s = 2.46 nats here: the clamp at 1 let the
# mean's factor exp(s^2 / 2) reach e^22). The other
# datasets keep the settings their recorded runs used. Three epochs (63 steps) for Wikipedia:
# its validation NLL went 11.84, 11.18, 11.10 over the first three (seed 0, Aaren, copy head)
# while an epoch costs about 3 minutes on the shared CPU. Eight epochs (the cosine schedule
# over 168 steps, patience 2; seed 0) did worse on validation for both models: best val NLL
# Aaren 11.114 at epoch 3 (against 11.088 with three), Transformer 11.136 at epoch 2 (11.120),
# both rising after; `main.py --dataset wikipedia --epochs 8`.
# Dropout 0.3 (three epochs, seed 0) was worse too: val NLL Aaren 11.145, Transformer 11.155.
# Recency features (`--gap-ema 0.5 0.8 0.95`, three epochs, seed 0, Aaren): val NLL 11.087
# against 11.088 without, no gain on validation, so they stay off.
# The upper clamp at -0.5 (`--log-scale-max -0.5`, seed 0, Aaren): val NLL 11.054 and val
# RMSE 5.41e4 against 11.088 and 7.96e4 at 0, so -0.5 since (components no wider than
# 0.61 of the spread of log gaps: the mean's factor exp(s^2 / 2) stays below 3.1).
# Its epochs are a full pass of 21 steps, so the 50-step warmup (sized for runs of up to 2400
# steps) would take most of the 63: 10 steps instead (seed 0, Aaren, validation: README).
COPY_MARKS = {"wikipedia": True}
# The copy head started at repeat-the-previous-mark (`--copy-prior`, seed 0, both models): val
# NLL Aaren 11.043 and Transformer 11.034 against 11.054 and 11.126 without, so on since.
COPY_PRIOR = {"wikipedia": True}
LOG_SCALE_MAX = {"wikipedia": -0.5}
MAX_EPOCHS = {"wikipedia": 3, "stackoverflow": 120}
WARMUP_STEPS = {"wikipedia": 10}


def get_config(dataset: str = "sin", backbone: str = "aaren", seed: int = 0) -> Config:
    """The default configuration (the same for both models)."""
    cfg = Config()
    cfg.model.backbone = backbone
    cfg.data.dataset = dataset
    cfg.loop.seed = seed
    cfg.loop.eval_batch_size = EVAL_BATCH.get(dataset, cfg.loop.eval_batch_size)
    cfg.loop.patience = PATIENCE.get(dataset, cfg.loop.patience)
    cfg.loop.max_epochs = MAX_EPOCHS.get(dataset, cfg.loop.max_epochs)
    cfg.optim.warmup_steps = WARMUP_STEPS.get(dataset, cfg.optim.warmup_steps)
    cfg.model.copy_marks = COPY_MARKS.get(dataset, cfg.model.copy_marks)
    cfg.model.copy_prior = COPY_PRIOR.get(dataset, cfg.model.copy_prior)
    cfg.model.log_scale_max = LOG_SCALE_MAX.get(dataset, cfg.model.log_scale_max)
    return cfg


def tiny_config(dataset: str = "sin", backbone: str = "aaren") -> Config:
    """A seconds-long configuration for tests and the notebook."""
    cfg = get_config(dataset, backbone)
    cfg.model = dataclasses.replace(
        cfg.model,
        num_layers=1,
        d_model=16,
        num_heads=2,
        d_ff=32,
        num_components=3,
        backbone=backbone,
    )
    cfg.data.num_generated = 40
    cfg.data.max_train_events = 64
    cfg.loop = dataclasses.replace(
        cfg.loop,
        batch_size=8,
        eval_batch_size=16,
        max_epochs=1,
        steps_per_epoch=2,
        progress=False,
    )
    cfg.optim = dataclasses.replace(cfg.optim, warmup_steps=2)
    return cfg
