"""How a client gets an engine core: `start_core` builds the engine and returns either core, in this process
(`engine.core.loop.EngineLoop`) or in a process of its own (`engine.core.process.CoreProcess`). What a client may
ask of it, and the facts it learns at startup, are the contract in engine/core/api.py (re-exported here); the cores
import that contract, never this module, so there is no import circle between a core and its client.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from engine.core.api import QUERIES, EngineCoreClient, EngineFacts, OutputSink, StatsListener

if TYPE_CHECKING:
    from pathlib import Path

    from engine.config import EngineConfig

__all__ = ["QUERIES", "EngineCoreClient", "EngineFacts", "OutputSink", "StatsListener", "start_core"]


def start_core(model_dir: Path, config: EngineConfig, model_id: str, in_process_of_its_own: bool,
               startup_timeout_s: float | None = None,
               progress: Callable[[str], None] = lambda message: None) -> EngineCoreClient:
    """Build the engine on ``model_dir`` and return its core, not started: in a process of its own
    (`engine.core.process.CoreProcess`, waiting at most ``startup_timeout_s`` for its engine), or in this one."""
    if in_process_of_its_own:
        from engine.core.process import STARTUP_TIMEOUT_S, CoreProcess

        core = CoreProcess(model_dir, config, model_id, startup_timeout_s or STARTUP_TIMEOUT_S)
        progress(f"the engine core runs in process {core.pid}")
        return core
    from engine.core.loop import EngineLoop
    from engine.core.engine import LLMEngine

    return EngineLoop(LLMEngine(model_dir, config, model_id=model_id), owns_engine=True)
