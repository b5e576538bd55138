"""Recurrence encoding matrices (REMs) of RSA, in both forms: the public names in one place.

``aaren_jax.rem_config`` defines the REMs and their configuration (the paper's six types,
counts ``k1..k6``, dilations, ``K``) and holds the module-level documentation of the two
forms and how they differ; ``aaren_jax.rem_matrix`` is the matrix form (Appendix D.1-D.2,
truncated at ``K``), ``aaren_jax.rem_recurrence`` the recurrent form (parallel and
streaming, no truncation).
"""

from aaren_jax.rem_config import (
    DEFAULT_MAX_POWER,
    KINDS,
    TYPE_KINDS,
    REMConfig,
    init_rem_params,
)
from aaren_jax.rem_matrix import rem_matrices, rem_matrix
from aaren_jax.rem_recurrence import (
    METHODS,
    REMState,
    init_rem_state,
    rem_apply,
    rem_apply_bidirectional,
    rem_step,
)

__all__ = [
    "DEFAULT_MAX_POWER",
    "KINDS",
    "METHODS",
    "REMConfig",
    "REMState",
    "TYPE_KINDS",
    "init_rem_params",
    "init_rem_state",
    "rem_apply",
    "rem_apply_bidirectional",
    "rem_matrices",
    "rem_matrix",
    "rem_step",
]
