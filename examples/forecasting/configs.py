"""Forecasting configurations: one default for all datasets and horizons, and both models."""

from __future__ import annotations

import dataclasses

from examples.common import LoopConfig, OptimConfig

# Protocol constants (TSLib long-term forecasting).
HORIZONS = (96, 192, 336, 720)
ILLNESS_HORIZONS = (24, 36, 48, 60)  # TSLib's ILI protocol: input 36, horizons 24-60
PAPER_DATASETS = ("ETTh1", "ETTh2", "ETTm1", "ETTm2", "weather")


@dataclasses.dataclass
class ModelConfig:
    """The forecaster: input normalisation, embeddings, causal stack, horizon head."""

    backbone: str = "aaren"  # "aaren" or "transformer": the only difference between the two runs
    num_layers: int = 2  # blocks in the causal stack
    d_model: int = 64  # model width d
    num_heads: int = 4  # attention heads
    d_ff: int = 128  # MLP width
    dropout: float = 0.1  # dropout in the blocks and on the embedding
    norm: str = "pre"  # LayerNorm placement in the blocks
    value_embedding: str = "linear"  # "linear" or "conv" (causal, kernel 3) on the channels
    positional: bool = True  # add sinusoidal positions (both models, to keep them identical)
    instance_norm: bool = True  # Non-stationary Transformer series normalisation (mean, std)


@dataclasses.dataclass
class DataConfig:
    """Which series and windows."""

    dataset: str = "ETTh1"  # a key of data.DATASETS, or the name of the run's CSV
    data_root: str | None = None  # folder with ETT/, weather/, illness/; None: ../shared/data
    csv: str | None = None  # any TSLib-format CSV (replaces the named dataset when set)
    csv_sha256: str | None = None  # the CSV's content: an edited file is another run
    target: str = "OT"  # target column, moved last for the 70/10/20 split (as TSLib does)
    freq: str | None = None  # time-feature frequency (h, t, d, 15min, ...); None: inferred
    split: str = "auto"  # for a CSV: auto (ETT months if the name says ETTh/ETTm), custom, ...
    seq_len: int = 96  # input length L
    pred_len: int = 96  # horizon P


@dataclasses.dataclass
class Config:
    """Everything one run needs."""

    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    loop: LoopConfig = dataclasses.field(
        default_factory=lambda: LoopConfig(
            batch_size=32, max_epochs=10, patience=3, steps_per_epoch=250
        )
    )
    optim: OptimConfig = dataclasses.field(
        default_factory=lambda: OptimConfig(learning_rate=1e-3, warmup_steps=100, weight_decay=1e-4)
    )


def get_config(
    dataset: str = "ETTh1", pred_len: int = 96, backbone: str = "aaren", seed: int = 0
) -> Config:
    """The default configuration; illness uses TSLib's input length 36."""
    cfg = Config()
    cfg.model.backbone = backbone
    cfg.data.dataset = dataset
    cfg.data.pred_len = pred_len
    cfg.data.seq_len = 36 if dataset == "illness" else 96
    cfg.loop.seed = seed
    return cfg


def tiny_config(dataset: str = "ETTh1", backbone: str = "aaren") -> Config:
    """A seconds-long configuration for tests."""
    cfg = get_config(dataset, pred_len=8, backbone=backbone)
    cfg.data.seq_len = 16
    cfg.model = dataclasses.replace(
        cfg.model, num_layers=1, d_model=16, num_heads=2, d_ff=32, backbone=backbone
    )
    cfg.loop = dataclasses.replace(
        cfg.loop, batch_size=8, eval_batch_size=64, max_epochs=3, patience=5, progress=False
    )
    cfg.optim = dataclasses.replace(cfg.optim, warmup_steps=2)
    return cfg


def horizons_for(dataset: str) -> tuple[int, ...]:
    """The protocol's horizons for a dataset."""
    return ILLNESS_HORIZONS if dataset == "illness" else HORIZONS
