"""aaren_jax: attention as a recurrent neural network, in JAX and Flax NNX.

The core (``scan``) is pure functions; the modules wire parameters to it.
"""

from importlib.metadata import PackageNotFoundError, version

from aaren_jax.attention import (
    AarenAttention,
    CausalSelfAttention,
    KVCache,
    RecurrenceEncoding,
    RSAState,
    SequenceModule,
)
from aaren_jax.blocks import AarenBlock, Block, Mixer, TransformerBlock
from aaren_jax.deploy import LoadedStep, export_step, load_step, make_step_fn, stream
from aaren_jax.models import Aaren, AarenCarry, Stack, Transformer, TransformerCarry
from aaren_jax.rem_config import REMConfig, init_rem_params
from aaren_jax.rem_matrix import rem_matrices, rem_matrix
from aaren_jax.rem_recurrence import (
    REMState,
    init_rem_state,
    rem_apply,
    rem_apply_bidirectional,
    rem_step,
)
from aaren_jax.scan import (
    AttentionState,
    attention_step,
    combine,
    init_state,
    prefix_attention,
    readout,
    resolve_method,
)
from aaren_jax.sharding import sequence_parallel_prefix_attention

try:
    __version__ = version("aaren-jax")
except PackageNotFoundError:  # imported from a source tree that was never installed
    __version__ = "0+unknown"

__all__ = [
    "Aaren",
    "AarenAttention",
    "AarenBlock",
    "AarenCarry",
    "Block",
    "Mixer",
    "SequenceModule",
    "Stack",
    "CausalSelfAttention",
    "KVCache",
    "LoadedStep",
    "RecurrenceEncoding",
    "RSAState",
    "Transformer",
    "TransformerBlock",
    "TransformerCarry",
    "export_step",
    "load_step",
    "make_step_fn",
    "stream",
    "AttentionState",
    "attention_step",
    "combine",
    "init_state",
    "prefix_attention",
    "readout",
    "resolve_method",
    "sequence_parallel_prefix_attention",
    "REMConfig",
    "REMState",
    "init_rem_params",
    "init_rem_state",
    "rem_apply",
    "rem_apply_bidirectional",
    "rem_matrices",
    "rem_matrix",
    "rem_step",
]
