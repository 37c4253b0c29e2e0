"""One step's batch as the kernels read it: `AttentionMetadata` (where each new token's K/V goes, the block tables,
the lengths) and, for hybrid models, `StateBatch` (each sequence's recurrent-state row). The worker builds them
(engine/worker/step_inputs.py), the models hand them to the ops (`kernels.ops` re-exports both), and the kernels
read them: this module is their one owner.

Words: a *block* is the KV cache's unit of allocation (``block_size`` tokens, one row of every page tensor
``[num_blocks, block_size, ...]``); a *slot* is one token's place in the blocks, ``block_id * block_size + offset``
(``slot_mapping``). Recurrent layers have *state rows* of their own kind: one row per running sequence (or
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
    states: StateBatch | None = None  # hybrid models: each sequence's state row (recurrent layers)
    # sliding-window models with a window group: what the window layers read instead (the slots and block tables of
    # their own pages, `engine.kv.window_pool`); None: every layer reads the fields above
    window: AttentionMetadata | None = None
    # the token rows whose hidden state is read after the forward (the sampled ones), set for a model whose last
    # layers store no K/V (Gemma 4's shared KV layers) when nothing else reads the others: those layers compute these
    # rows alone, each sampling sequence's last rows as its queries (``read``: their metadata); None: every row
    read_rows: torch.Tensor | None = None
    read: AttentionMetadata | None = None


@dataclass
class StateBatch:
    """One step's sequences as the recurrent ops see them: device tensors, and host copies to plan with (no
    device sync)."""

    query_start_loc: torch.Tensor  # [B + 1] int32: sequence b owns rows query_start_loc[b]:query_start_loc[b + 1]
    state_rows: torch.Tensor  # [B] int64
    has_initial_state: torch.Tensor  # [B] bool
    host_starts: np.ndarray  # [B + 1] the same offsets on the host
    host_slots: np.ndarray  # [B]
    host_has_initial: np.ndarray  # [B] bool
    # Speculative decoding: per token, a slot to also write the state after that token to (-1: none), so that the
    # state after the last accepted draft is kept without recomputing. A row whose first token has one runs token by
    # token (the recurrent form, which has every intermediate state); None: no row keeps per-token states.
    token_state_rows: torch.Tensor | None = None  # [T] int64
    host_token_state_rows: np.ndarray | None = None  # [T]

    @property
    def stepwise_rows(self) -> np.ndarray:
        """Sequences that keep the state after each of their tokens (verification rows: a token and its drafts)."""
        if self.host_token_state_rows is None:
            return np.zeros(0, dtype=np.int64)
        lens = np.diff(self.host_starts)
        firsts = self.host_token_state_rows[np.minimum(self.host_starts[:-1], len(self.host_token_state_rows) - 1)]
        return np.nonzero((lens > 0) & (firsts >= 0) & (self.host_slots >= 0))[0]

    @property
    def decode_rows(self) -> np.ndarray:
        """Sequences with one new token that continue a state: the recurrent form, all together."""
        rows = (np.diff(self.host_starts) == 1) & self.host_has_initial & (self.host_slots >= 0)
        rows[self.stepwise_rows] = False
        return np.nonzero(rows)[0]

    @property
    def prefill_rows(self) -> np.ndarray:
        """The other sequences with new tokens; a row whose slot is < 0 is padding (a decode graph's filler)."""
        lens = np.diff(self.host_starts)
        rows = (lens > 0) & ~((lens == 1) & self.host_has_initial) & (self.host_slots >= 0)
        rows[self.stepwise_rows] = False
        return np.nonzero(rows)[0]

    @property
    def longest(self) -> int:
        """New tokens of the longest row (sizes the Triton kernels' grids without reading the device)."""
        return int(np.diff(self.host_starts).max()) if len(self.host_starts) > 1 else 0
