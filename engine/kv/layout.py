"""What the model runner allocated, which sizes the KV manager: one value from the runner to the scheduler."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class KVLayout:
    """The device pool and each lower tier, both halves of a tier (blocks, and a hybrid model's state snapshots)
    sized together by the runner (engine/worker/model_runner.py `ModelRunner.kv_layout`)."""

    num_blocks: int  # full-attention (or MLA / compressed) blocks on the device
    state_rows: int = 0  # hybrid models: recurrent-state rows (the running sequences' and the snapshots')
    window_blocks: int = 0  # sliding-window models: window pages on the device
    window: int = 0  # ... and the window in tokens
    host_blocks: int = 0
    host_states: int = 0
    disk_blocks: int = 0
    disk_states: int = 0
