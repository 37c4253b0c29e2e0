"""One step's batch as the kernels read it: `AttentionMetadata` (where each new token's K/V goes, the block tables,
the lengths) and, for hybrid models, `StateBatch` (each sequence's recurrent-state slot). The worker builds them
(engine/worker/step_inputs.py), the models hand them to the ops (`kernels.ops` re-exports both), and the kernels
read them: this module is their one owner.

Words: a *block* is the KV cache's unit of allocation (``block_size`` tokens, one row of every page tensor
``[num_blocks, block_size, ...]``); a *slot* is one token's place in the blocks, ``block_id * block_size + offset``
(``slot_mapping``). Recurrent layers have *state slots* of their own kind: one row per running sequence (or
snapshot) of a layer's state tensors, unrelated to KV slots.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class AttentionMetadata:
    """Where this step's tokens live in the KV blocks; shapes as in `kernels.reference`.

    ``max_query_len`` / ``max_context_len`` are host-side upper bounds (the runner knows them from its Python lists)
    so the attention kernel sizes its launch without a device-to-host copy per layer; under CUDA-graph capture they
    are the fixed bounds every replay stays within.
    """

    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    context_lens: torch.Tensor
    query_start_loc: torch.Tensor
    max_query_len: int
    max_context_len: int
    states: StateBatch | None = None  # hybrid models: each sequence's state slot (recurrent layers)


@dataclass
class StateBatch:
    """One step's sequences as the recurrent ops see them: device tensors, and host copies to plan with (no
    device sync)."""

    query_start_loc: torch.Tensor  # [B + 1] int32: sequence b owns rows query_start_loc[b]:query_start_loc[b + 1]
    state_slots: torch.Tensor  # [B] int64
    has_initial_state: torch.Tensor  # [B] bool
    host_starts: np.ndarray  # [B + 1] the same offsets on the host
    host_slots: np.ndarray  # [B]
    host_has_initial: np.ndarray  # [B] bool

    @property
    def decode_rows(self) -> np.ndarray:
        """Sequences with one new token that continue a state: the recurrent form, all together."""
        return np.nonzero((np.diff(self.host_starts) == 1) & self.host_has_initial & (self.host_slots >= 0))[0]

    @property
    def prefill_rows(self) -> np.ndarray:
        """The other sequences with new tokens; a row whose slot is < 0 is padding (a decode graph's filler)."""
        lens = np.diff(self.host_starts)
        return np.nonzero((lens > 0) & ~((lens == 1) & self.host_has_initial) & (self.host_slots >= 0))[0]

    @property
    def longest(self) -> int:
        """New tokens of the longest row (sizes the Triton kernels' grids without reading the device)."""
        return int(np.diff(self.host_starts).max()) if len(self.host_starts) > 1 else 0
