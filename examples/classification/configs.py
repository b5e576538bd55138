"""Classification configurations: TSLib's classification defaults, shrunk for a CPU."""

from __future__ import annotations

import dataclasses

from examples.common import LoopConfig, OptimConfig


@dataclasses.dataclass
class ModelConfig:
    """The classifier: embedding, causal stack, pooling, linear head."""

    backbone: str = "aaren"  # "aaren" or "transformer": the only difference between the two runs
    num_layers: int = 3  # blocks (TSLib: e_layers 3)
    d_model: int = 64  # model width d (TSLib: 128)
    num_heads: int = 4  # attention heads
    d_ff: int = 128  # MLP width (TSLib: 256)
    dropout: float = 0.1  # dropout in the blocks, on the embedding and before the head
    norm: str = "pre"  # LayerNorm placement in the blocks
    value_embedding: str = "linear"  # "linear" or "conv" (causal, kernel 3) on the channels
    positional: bool = True  # add sinusoidal positions (both models)
    pooling: str = "mean"  # masked "mean" over time or "last" valid token (chosen on validation)
    causal: bool = True  # False: a bidirectional stack (every position sees the whole series)


@dataclasses.dataclass
class DataConfig:
    """Which dataset and how to hold out validation cases."""

    dataset: str = "JapaneseVowels"  # a folder of <data_root>/UEA
    data_root: str | None = None  # folder holding UEA/; None: ../shared/data
    val_fraction: float = 0.2  # stratified share of the training file used for early stopping
    split_seed: int = 0  # seed of that hold-out, fixed across model seeds


@dataclasses.dataclass
class Config:
    """Everything one run needs."""

    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    loop: LoopConfig = dataclasses.field(
        default_factory=lambda: LoopConfig(
            batch_size=16,
            eval_batch_size=128,
            max_epochs=100,
            patience=10,
            log_every=20,
            checkpoint_every=1,  # epochs are short; a kill loses at most one
        )
    )
    optim: OptimConfig = dataclasses.field(
        default_factory=lambda: OptimConfig(learning_rate=1e-3, warmup_steps=50, weight_decay=1e-2)
    )
    monitor: str = "nll"  # validation metric for early stopping: "nll" (min) or "accuracy" (max)


def get_config(dataset: str = "JapaneseVowels", backbone: str = "aaren", seed: int = 0) -> Config:
    """The default configuration (the same for every dataset and both models)."""
    cfg = Config()
    cfg.model.backbone = backbone
    cfg.data.dataset = dataset
    cfg.loop.seed = seed
    return cfg


def tiny_config(dataset: str = "JapaneseVowels", backbone: str = "aaren") -> Config:
    """A seconds-long configuration for tests."""
    cfg = get_config(dataset, backbone)
    cfg.model = dataclasses.replace(
        cfg.model, num_layers=1, d_model=16, num_heads=2, d_ff=32, backbone=backbone
    )
    cfg.loop = dataclasses.replace(
        cfg.loop, batch_size=8, eval_batch_size=128, max_epochs=1, progress=False
    )
    cfg.optim = dataclasses.replace(cfg.optim, warmup_steps=2)
    return cfg
