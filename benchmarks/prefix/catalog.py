"""The workload catalog: every workload `kvserve bench prefix` and the other benchmarks can name, by name.

The plain generators live in workloads.py; the Claude Code- and Codex-shaped ones (agent_workloads.py) load the
server's Anthropic and Responses adapters, so they are imported only when one of them is built.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Callable

from benchmarks.prefix.workloads import (Workload, WorkloadParams, compacted, compaction, prefix_repetition, projects,
                                         shared_prefix, subagents, tenants, tenants_salted, tool_append, tool_change,
                                         tool_loop)


def _agent_shaped(name: str) -> Callable[[WorkloadParams], Workload]:
    def build(p: WorkloadParams) -> Workload:
        from benchmarks.prefix import agent_workloads  # loads the server's adapters: only when asked

        if name == "claude_code_raw":
            return agent_workloads.claude_code(p, normalize=False)
        return getattr(agent_workloads, name)(p)
    return build


WORKLOADS: dict[str, Callable[[WorkloadParams], Workload]] = {
    "tool_loop": tool_loop,
    "tool_loop_nothink": lambda p: tool_loop(replace(p, thinking=False)),
    "tool_change": tool_change,
    "tool_append": tool_append,
    "compaction": compaction,
    "compaction_aware": lambda p: compacted(p, aware=True),
    "compaction_naive": lambda p: compacted(p, aware=False),
    "subagents": subagents,
    "tenants": tenants,
    "tenants_salted": tenants_salted,
    "projects": projects,
    "shared_prefix": shared_prefix,
    "prefix_repetition": prefix_repetition,
    "claude_code": _agent_shaped("claude_code"),
    "claude_code_raw": _agent_shaped("claude_code_raw"),
    "codex": _agent_shaped("codex"),
    "claude_code_screenshots": _agent_shaped("claude_code_screenshots"),
}
# Workloads that send images: they need a vision-language model (--model qwen3.6-tiny), so "all", which the
# text models run, leaves them out; named on a text-only model they stop with an error (render.py).
IMAGE_WORKLOADS = frozenset({"claude_code_screenshots"})


class NeedsVisionModel(ValueError):
    """A workload that sends images, given a text-only model: the user's fix is a vision-language ``--model``."""


def build_workloads(names: list[str] | str, params: WorkloadParams = WorkloadParams()) -> list[Workload]:
    """``names``: workload names or "all" (every workload without images)."""
    if names == "all" or names == ["all"]:
        names = [n for n in WORKLOADS if n not in IMAGE_WORKLOADS]
    if isinstance(names, str):
        names = [names]
    unknown = [n for n in names if n not in WORKLOADS]
    if unknown:
        raise ValueError(f"unknown workload(s) {unknown}; known: {', '.join(WORKLOADS)}, all")
    return [WORKLOADS[n](params) for n in names]
