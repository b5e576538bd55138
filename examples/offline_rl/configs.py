"""Offline-RL configurations: CORL's Decision Transformer (``dt.py``), sized for a 2-core CPU.

CORL (Tarasov et al. 2022, ``algorithms/offline/dt.py``): embedding 128, 3 layers, 1 head,
context 20 (60 tokens), dropout 0.1 (embedding, attention and residual), AdamW lr 1e-4,
betas (0.9, 0.999), weight decay 1e-4, linear warm-up 10k steps then constant, gradient clip
0.25, batch 64, reward scale 1e-3, 100k updates, target returns per environment. Here the same
except the number of updates (``train_steps``, with the warm-up scaled in proportion) and the
weight-decay mask (the project's: biases and norms are not decayed; CORL decays everything).
Decision Aaren differs from the Decision Transformer in ``model.backbone`` only.
"""

from __future__ import annotations

import dataclasses

from examples.common import LoopConfig, OptimConfig
from examples.common.paths import ensure_importable
from examples.common.runs import OMIT_DEFAULT
from examples.offline_rl.sac import SACConfig

ensure_importable()
import aaren_jax as aj  # noqa: E402

ENV_IDS = {"hopper": "Hopper-v5", "halfcheetah": "HalfCheetah-v5", "walker2d": "Walker2d-v5"}
DATASETS = ("medium", "medium-replay", "medium-expert")
# D4RL's reference returns (random, expert) of the v2 environments, for its normalised score
D4RL_REF = {
    "hopper": (-20.272305, 3234.3),
    "halfcheetah": (-280.178953, 12135.0),
    "walker2d": (1.629008, 4592.3),
}
# CORL dt.py target returns (the first is the one reported)
TARGET_RETURNS = {"hopper": (3600.0, 1800.0), "halfcheetah": (12000.0, 6000.0),
                  "walker2d": (5000.0, 2500.0)}  # fmt: skip


@dataclasses.dataclass
class GenConfig:
    """Behaviour agent and dataset sizes (D4RL: 1M transitions per dataset)."""

    seed: int = 0  # everything the generator draws (resets, exploration, batches, rollouts)
    sac_steps: int = 300_000  # environment steps of the SAC agent (one update per step)
    snapshot_every: int = 10_000  # environment steps between evaluated policy snapshots
    eval_episodes: int = 5  # deterministic episodes per snapshot evaluation (and random policy)
    size: int = 200_000  # transitions of medium and of the expert half of medium-expert
    medium_fraction: float = 1.0 / 3.0  # medium policy: first snapshot at this share of final
    save_every_s: float = 180.0  # seconds between checkpoints of the agent (episode ends)
    sac: SACConfig = dataclasses.field(default_factory=SACConfig)


@dataclasses.dataclass(unsafe_hash=True)  # a static attribute of the model: hashed by NNX
class ModelConfig:
    """The Decision Transformer / Decision Aaren (CORL dt.py)."""

    backbone: str = "transformer"  # "transformer" or "aaren": the only difference
    embedding_dim: int = 128  # token width d
    num_layers: int = 3  # blocks
    num_heads: int = 1  # attention heads
    seq_len: int = 20  # context K in environment steps (3K tokens; 2K folded: token_kinds)
    # False (CORL): the return-to-go is a token of its own; True: the return token is added
    # to the state token (2K tokens: state + return, action), so the state token's residual
    # carries it rather than attention alone
    fold_return: bool = dataclasses.field(default=False, metadata=OMIT_DEFAULT)
    # False (CORL): softmax heads only; True: every head is an RSA head (Huang et al. 2023)
    # with a regular REM, a learned decay lambda^lag of the tokens before it gated into its
    # softmax (``rem_config``); streamed by Aaren as a recurrence, still O(1) per token
    rsa: bool = dataclasses.field(default=False, metadata=OMIT_DEFAULT)
    episode_len: int = 1000  # timestep embedding covers episode_len + seq_len positions
    dropout: float = 0.1  # embedding, attention and residual dropout
    max_action: float = 1.0  # actions = max_action * tanh(head)

    def rem_config(self) -> aj.REMConfig | None:
        """The REM heads of ``rsa``: one regular REM per head (RSA's defaults), else None."""
        return aj.REMConfig((self.num_heads, 0, 0, 0, 0, 0)) if self.rsa else None

    @property
    def token_kinds(self) -> tuple[str, ...]:
        """The kinds of a step's tokens, in order (the state token is the last but one)."""
        return ("state", "action") if self.fold_return else ("return", "state", "action")


@dataclasses.dataclass
class DataConfig:
    """Which dataset."""

    env: str = "hopper"  # hopper, halfcheetah, walker2d (the evaluation environment)
    dataset: str = "medium"  # medium, medium-replay, medium-expert
    dataset_id: str | None = None  # any Minari id or dataset folder; None: the generated one
    data_root: str | None = None  # Minari datasets folder; None: workdirs/offline_rl_data
    reward_scale: float = 1e-3  # returns-to-go are multiplied by this (CORL)


@dataclasses.dataclass
class EvalConfig:
    """Online evaluation."""

    eval_episodes: int = 10  # episodes per evaluation, run in lockstep as one batch (CORL: 100)
    target_return: float | None = None  # None: CORL's first target return of the environment
    # also condition on the dataset's best episode return: CORL's targets are D4RL-sized, and
    # far beyond the returns of datasets from weaker behaviour agents (ours)
    data_target: bool = True
    stream: bool = True  # also evaluate Aaren streaming the whole episode (O(1) per step)
    timing_steps: int = 200  # environment steps of the batch-1 timing of each evaluation mode
    seed: int = 1000  # offset of the evaluation episodes' environment seeds


@dataclasses.dataclass
class Config:
    """Everything one run needs."""

    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    eval: EvalConfig = dataclasses.field(default_factory=EvalConfig)
    loop: LoopConfig = dataclasses.field(
        default_factory=lambda: LoopConfig(
            batch_size=64,
            eval_batch_size=256,
            max_epochs=20,  # 20 "epochs" of 500 updates: train_steps = 10k (CORL: 100k)
            steps_per_epoch=500,  # also the checkpoint interval (minutes on a busy 2-core CPU)
            patience=1_000_000,  # no early stopping: CORL trains a fixed number of updates
            log_every=100,
            checkpoint_every=1,
        )
    )
    optim: OptimConfig = dataclasses.field(
        default_factory=lambda: OptimConfig(
            learning_rate=1e-4,
            warmup_steps=1000,  # CORL: 10k of 100k; the same tenth of the run
            end_lr_factor=1.0,  # constant after the warm-up, as CORL's LambdaLR
            weight_decay=1e-4,
            grad_clip=0.25,
        )
    )


def get_config(env: str = "hopper", dataset: str = "medium", backbone: str = "transformer",
               seed: int = 0) -> Config:  # fmt: skip
    """The default configuration (the same for both models)."""
    cfg = Config()
    cfg.model.backbone = backbone
    cfg.data.env, cfg.data.dataset = env, dataset
    cfg.loop.seed = seed
    return cfg


def set_run_length(cfg: Config, steps: int | None = None, context: int | None = None) -> Config:
    """Sets the training updates (rounded down to whole epochs of ``steps_per_epoch``, the
    warm-up kept at a tenth) and the context ``K`` in environment steps; None keeps a value."""
    if steps is not None:
        per_epoch = cfg.loop.steps_per_epoch
        cfg.loop.max_epochs = max(1, steps // per_epoch)
        cfg.optim.warmup_steps = max(1, cfg.loop.max_epochs * per_epoch // 10)
    if context is not None:
        if context < 1:
            raise ValueError(f"context must be at least 1 environment step, got {context}")
        cfg.model.seq_len = context
    return cfg


def tiny_config(env: str = "hopper", dataset: str = "medium", backbone: str = "aaren") -> Config:
    """A seconds-long configuration for tests and the notebook."""
    cfg = get_config(env, dataset, backbone)
    cfg.model = dataclasses.replace(
        cfg.model, embedding_dim=16, num_layers=1, num_heads=1, seq_len=4, backbone=backbone
    )
    cfg.loop = dataclasses.replace(
        cfg.loop, batch_size=8, eval_batch_size=16, max_epochs=1, steps_per_epoch=2, progress=False
    )
    cfg.optim = dataclasses.replace(cfg.optim, warmup_steps=1)
    cfg.eval = dataclasses.replace(
        cfg.eval, eval_episodes=1, timing_steps=5
    )  # batch 1: one compile
    return cfg


def tiny_gen_config(seed: int = 0) -> GenConfig:
    """A generator that trains SAC a few hundred steps: for tests and the notebook."""
    return GenConfig(
        seed=seed,
        sac_steps=400,
        snapshot_every=200,
        eval_episodes=1,
        size=300,
        sac=SACConfig(hidden=32, batch_size=32, start_steps=200, update_every=50),
    )
