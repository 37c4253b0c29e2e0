"""Agent and synthetic workloads as OpenAI-style chat requests: pure data, deterministic from a seed.

Each generator returns a ``Workload``: requests in arrival order, each with the messages and tools the agent sends,
the reply the model gives (scripted, so the next turn's history is known), the request it continues (``parent``)
and an optional cache salt. Rendering and tokenizing through a model's template is a separate step (render.py).
"""
from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from typing import Callable

from benchmarks.prefix.text import TextGen


@dataclass
class ChatRequest:
    request_id: str
    session: str
    messages: list[dict]
    tools: list[dict] | None
    reply: dict
    parent: str | None = None
    salt: str | None = None
    turn: int = 0
    arrival: int = 0  # earliest scheduler step at which the session's first request may start
    normalize: bool = True  # apply the server's cache-stability rules (server/cache/normalize.py) when rendering


@dataclass
class Workload:
    name: str
    description: str
    requests: list[ChatRequest]
    enable_thinking: bool = True


@dataclass(frozen=True)
class WorkloadParams:
    """Sizes of all workloads; the defaults give prompts of a few thousand to ~15k tokens."""

    seed: int = 0
    thinking: bool = True
    head_words: int = 1200  # system prompt + project rules + skill catalog
    num_tools: int = 10
    tasks: int = 4  # user tasks per agent session
    steps_per_task: int = 5  # tool calls per task
    result_words: tuple[int, int] = (20, 500)  # tool result length, uniform
    reasoning_words: tuple[int, int] = (15, 60)
    compaction_words: int = 3500  # history size (in words) that triggers compaction
    compaction_tail: int = 4  # raw messages kept after the summary
    compaction_every: int = 6  # compaction_aware / compaction_naive: requests between two compactions
    forked_workers: int = 2
    fresh_workers: int = 3
    worker_steps: int = 3
    sessions: int = 6  # concurrent tenants sharing one system prompt (projects: sessions in all)
    projects: int = 2  # projects: repositories whose sessions share a head
    session_steps: int = 4
    groups: int = 4  # shared-prefix groups
    questions: int = 8  # questions per group
    shared_prefix_words: int = 700
    question_words: int = 40
    num_prefixes: int = 4  # prefix repetition: distinct prefixes
    repetitions: int = 6  # prefix repetition: requests per prefix
    repeated_prefix_words: int = 500


# ---- building blocks ------------------------------------------------------------------------------------------
_TOOL_NAMES = (
    "read_file", "write_file", "edit_file", "list_dir", "grep", "run_tests", "run_shell", "git_diff", "web_fetch",
    "ask_user", "search_symbols", "open_pr",
)


def make_tool(gen: TextGen, name: str) -> dict:
    props = {
        gen.rng.choice(("path", "pattern", "command", "query", "url")): {"type": "string", "description": gen.sentence(4, 10)}
        for _ in range(gen.rng.randint(1, 3))
    }
    props["timeout"] = {"type": "integer", "description": gen.sentence(3, 8)}
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": gen.sentence(10, 25),
            "parameters": {"type": "object", "properties": props, "required": sorted(props)[:1]},
        },
    }


def make_head(gen: TextGen, words: int) -> str:
    """System prompt, project rules file and skill catalog: the long stable head of an agent's context."""
    return (
        f"You are a coding agent working in a repository.\n\n{gen.prose(words // 2)}\n\n"
        f"# Project rules (AGENTS.md)\n\n{gen.prose(words // 3)}\n\n"
        "# Skills\n\n"
        + "\n".join(f"- {gen.ident()}: {gen.sentence(6, 14)}" for _ in range(max(1, words // 60)))
    )


class _Session:
    """One conversation: messages grow append-only unless the caller rewrites them; each call emits a request."""

    def __init__(
        self, gen: TextGen, p: WorkloadParams, sid: str, messages: list[dict], tools: list[dict] | None,
        salt: str | None = None, parent: str | None = None,
    ) -> None:
        self.gen, self.p, self.sid, self.salt = gen, p, sid, salt
        self.messages, self.tools = messages, tools
        self.last_id = parent
        self.turn = 0
        self.requests: list[ChatRequest] = []
        self._calls = 0

    def call(self, reply: dict) -> ChatRequest:
        req = ChatRequest(
            f"{self.sid}/{self.turn}", self.sid, copy.deepcopy(self.messages), copy.deepcopy(self.tools), reply,
            parent=self.last_id, salt=self.salt, turn=self.turn,
        )
        self.requests.append(req)
        self.messages.append(copy.deepcopy(reply))
        self.last_id, self.turn = req.request_id, self.turn + 1
        return req

    def _reasoning(self) -> dict:
        if not self.p.thinking:
            return {}
        return {"reasoning_content": self.gen.prose(self.gen.rng.randint(*self.p.reasoning_words))}

    def tool_step(self) -> None:
        """The model calls a tool; the tool's result is appended."""
        names = [t["function"]["name"] for t in self.tools or []] or ["run_shell"]
        name = self.gen.rng.choice(names)
        self._calls += 1
        call_id = f"call_{self.sid.replace('/', '_')}_{self._calls}"
        args = json.dumps({"path": self.gen.path(), "timeout": self.gen.rng.randint(5, 120)})
        self.call({
            "role": "assistant", "content": "", **self._reasoning(),
            "tool_calls": [{"id": call_id, "type": "function", "function": {"name": name, "arguments": args}}],
        })
        words = self.gen.rng.randint(*self.p.result_words)
        self.messages.append({"role": "tool", "tool_call_id": call_id, "content": self.gen.tool_output(words)})

    def answer(self) -> None:
        self.call({"role": "assistant", "content": self.gen.prose(self.gen.rng.randint(20, 80)), **self._reasoning()})

    def user(self, text: str) -> None:
        self.messages.append({"role": "user", "content": text})

    def task(self, steps: int) -> None:
        """A user task: the user asks, the model calls tools ``steps`` times, then answers."""
        self.user(f"Task: {self.gen.sentence(8, 20)} {self.gen.sentence()}")
        for _ in range(steps):
            self.tool_step()
        self.answer()


def _interleave(sessions: list[list[ChatRequest]], starts: list[int]) -> list[ChatRequest]:
    """Concurrent sessions in arrival order, by (start step + turn), ties in session order; sets ``arrival``."""
    keyed = []
    for i, (start, reqs) in enumerate(zip(starts, sessions)):
        for r in reqs:
            r.arrival = start
            keyed.append((start + r.turn, i, r.turn, r))
    return [r for *_, r in sorted(keyed, key=lambda k: k[:3])]


def _agent(gen: TextGen, p: WorkloadParams, sid: str, tools: list[dict], head: str, salt: str | None = None) -> _Session:
    return _Session(gen, p, sid, [{"role": "system", "content": head}], tools, salt=salt)


def _tools(gen: TextGen, p: WorkloadParams) -> list[dict]:
    return [make_tool(gen, name) for name in _TOOL_NAMES[: p.num_tools]]


# ---- workloads ------------------------------------------------------------------------------------------------
def tool_loop(p: WorkloadParams) -> Workload:
    gen = TextGen(p.seed)
    s = _agent(gen, p, "main", _tools(gen, p), make_head(gen, p.head_words))
    for _ in range(p.tasks):
        s.task(p.steps_per_task)
    thinking = "on" if p.thinking else "off"
    return Workload("tool_loop" if p.thinking else "tool_loop_nothink",
                    f"append-only tool loop, {p.tasks} tasks x {p.steps_per_task} tool calls, thinking {thinking}",
                    s.requests, p.thinking)


def _midway_session(p: WorkloadParams, change: Callable[[TextGen, _Session], None]) -> list[ChatRequest]:
    gen = TextGen(p.seed)
    tools = _tools(gen, p)
    s = _agent(gen, p, "main", tools, make_head(gen, p.head_words))
    for task in range(p.tasks):
        if task == p.tasks // 2:
            change(gen, s)
        s.task(p.steps_per_task)
    return s.requests


def tool_change(p: WorkloadParams) -> Workload:
    """Midway a tool is added to the request's tool list: the template puts tools first, so the head changes."""
    def change(gen: TextGen, s: _Session) -> None:
        s.tools = [*s.tools, make_tool(gen, _TOOL_NAMES[p.num_tools % len(_TOOL_NAMES)] + "_v2")]
    return Workload("tool_change", "tool loop whose tool list changes midway (head invalidated)",
                    _midway_session(p, change), p.thinking)


def tool_append(p: WorkloadParams) -> Workload:
    """The same new tool announced at the tail of the conversation instead: the head stays cached."""
    def change(gen: TextGen, s: _Session) -> None:
        tool = make_tool(gen, _TOOL_NAMES[p.num_tools % len(_TOOL_NAMES)] + "_v2")
        s.messages.append({"role": "system", "content": "A new tool is available:\n" + json.dumps(tool)})
    return Workload("tool_append", "tool loop with a new tool appended at the tail (head kept)",
                    _midway_session(p, change), p.thinking)


def _words(messages: list[dict]) -> int:
    return sum(len(str(m.get("content", "")).split()) + len(str(m.get("reasoning_content", "")).split()) for m in messages)


def compaction(p: WorkloadParams) -> Workload:
    """When the history passes a size, it is replaced by a summary plus a raw tail: each compaction starts an epoch."""
    gen = TextGen(p.seed)
    s = _agent(gen, p, "main", _tools(gen, p), make_head(gen, p.head_words))
    for _ in range(p.tasks * 2):
        if _words(s.messages[1:]) > p.compaction_words:
            tail = s.messages[-p.compaction_tail :]
            while tail and tail[0]["role"] == "tool":  # a tail must not start with an orphaned tool result
                tail = tail[1:]
            summary = {"role": "user", "content": "Summary of the work so far:\n" + gen.prose(150)}
            s.messages = [s.messages[0], summary, *tail]
        s.task(p.steps_per_task)
    return Workload("compaction", f"long tool loop compacted at ~{p.compaction_words} words of history",
                    s.requests, p.thinking)


def compacted(p: WorkloadParams, aware: bool) -> Workload:
    """A tool loop compacted every ``p.compaction_every`` requests, by a summary turn and a new epoch, as kvserve's
    remote compaction does it (``aware``: server/api/compaction.py) or as a naive one does.

    Cache-aware: the summary turn is the conversation so far plus one user message (it extends the cached prompt),
    and the next epoch keeps the head (system prompt, tools) byte-identical, then the user messages, then the
    summary. Naive: the summary turn is a fresh summariser prompt over the transcript, and the next epoch folds the
    summary into the system prompt, so every epoch rewrites the head."""
    from server.api.compaction import COMPACTION_PROMPT, SUMMARY_PREFIX  # what kvserve's summary turn sends

    gen = TextGen(p.seed)
    tools = _tools(gen, p)
    head = make_head(gen, p.head_words)
    s = _agent(gen, p, "main", tools, head)
    compactions = 0
    for _ in range(p.tasks * 2):
        s.task(p.steps_per_task)
        if s.turn < p.compaction_every * (compactions + 1):
            continue
        compactions += 1
        summary = {"role": "assistant", "content": gen.prose(150)}
        users = [m for m in s.messages if m["role"] == "user"][-2:]
        if aware:
            s.messages.append({"role": "user", "content": COMPACTION_PROMPT})
            s.call(summary)
            s.messages = [{"role": "system", "content": head}, *users,
                          {"role": "user", "content": SUMMARY_PREFIX + summary["content"]}]
        else:
            transcript = "\n\n".join(f"{m['role']}: {m.get('content') or json.dumps(m.get('tool_calls'))}"
                                      for m in s.messages[1:])
            s.messages, s.tools = [{"role": "system", "content": "You summarise transcripts."},
                                   {"role": "user", "content": "Summarise this session:\n\n" + transcript}], None
            s.call(summary)
            s.messages, s.tools = [{"role": "system", "content": head + "\n\n# The session so far\n\n" +
                                    summary["content"]}, *users], tools
    kind = "cache-aware" if aware else "naive"
    return Workload(f"compaction_{'aware' if aware else 'naive'}",
                    f"tool loop compacted every {p.compaction_every} requests, {kind}", s.requests, p.thinking)


def subagents(p: WorkloadParams) -> Workload:
    """A main loop spawning forked workers (copy of its context) and fresh workers (own instructions + task packet)."""
    gen = TextGen(p.seed)
    tools = _tools(gen, p)
    main = _agent(gen, p, "main", tools, make_head(gen, p.head_words))
    worker_head = "You are a worker agent. Do exactly the task in the packet and report back.\n\n" + gen.prose(400)
    sessions, starts = [main], [0]
    for task in range(p.tasks):
        main.task(p.steps_per_task)
        spawn_at = main.turn
        for w in range(p.forked_workers):
            fork = _Session(gen, p, f"fork{task}.{w}", copy.deepcopy(main.messages), tools, parent=main.last_id)
            fork.task(p.worker_steps)
            sessions.append(fork)
            starts.append(spawn_at)
        for w in range(p.fresh_workers):
            fresh = _agent(gen, p, f"fresh{task}.{w}", tools, worker_head)
            fresh.user("Task packet:\n" + gen.prose(120))
            for _ in range(p.worker_steps):
                fresh.tool_step()
            fresh.answer()
            sessions.append(fresh)
            starts.append(spawn_at)
    return Workload("subagents", "main loop with forked and fresh subagents running concurrently",
                    _interleave([s.requests for s in sessions], starts), p.thinking)


def _tenants(p: WorkloadParams, salted: bool) -> list[ChatRequest]:
    gen = TextGen(p.seed)
    tools, head = _tools(gen, p), make_head(gen, p.head_words)
    sessions = []
    for i in range(p.sessions):
        s = _agent(gen, p, f"tenant{i}", tools, head, salt=f"tenant-{i}" if salted else None)
        s.task(p.session_steps)
        sessions.append(s.requests)
    return _interleave(sessions, list(range(p.sessions)))  # one new session per step


def tenants(p: WorkloadParams) -> Workload:
    return Workload("tenants", f"{p.sessions} concurrent sessions sharing one system prompt, no salt",
                    _tenants(p, salted=False), p.thinking)


def tenants_salted(p: WorkloadParams) -> Workload:
    return Workload("tenants_salted", f"{p.sessions} concurrent sessions sharing one system prompt, salt per tenant",
                    _tenants(p, salted=True), p.thinking)


def projects(p: WorkloadParams) -> Workload:
    """``sessions`` concurrent agent sessions over ``projects`` repositories: a project's sessions share its head
    (system prompt, rules file, tools), each session runs one task of ``session_steps`` tool calls. Behind several
    replicas, a session's later turns hit only where its earlier turns ran."""
    gen = TextGen(p.seed)
    heads = [(_tools(gen, p), make_head(gen, p.head_words)) for _ in range(p.projects)]
    sessions = []
    for i in range(p.sessions):
        tools, head = heads[i % p.projects]
        s = _agent(gen, p, f"p{i % p.projects}s{i}", tools, head)
        s.task(p.session_steps)
        sessions.append(s.requests)
    return Workload("projects", f"{p.sessions} concurrent sessions over {p.projects} projects (a head each)",
                    _interleave(sessions, list(range(p.sessions))), p.thinking)


def _single_turn(sid: str, system: str, question: str, gen: TextGen) -> ChatRequest:
    messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
    return ChatRequest(f"{sid}/0", sid, messages, None, {"role": "assistant", "content": gen.sentence()})


def _stream(reqs: list[ChatRequest], gen: TextGen) -> list[ChatRequest]:
    """Shuffled, then one arrival per step: a steady stream rather than one burst."""
    gen.rng.shuffle(reqs)
    for i, r in enumerate(reqs):
        r.arrival = i
    return reqs


def shared_prefix(p: WorkloadParams) -> Workload:
    """SGLang-style generated shared prefix: G system prompts, each shared by Q questions, in shuffled order."""
    gen = TextGen(p.seed)
    systems = [gen.prose(p.shared_prefix_words) for _ in range(p.groups)]
    reqs = [_single_turn(f"g{g}.q{q}", systems[g], gen.prose(p.question_words), gen)
            for g in range(p.groups) for q in range(p.questions)]
    return Workload("shared_prefix", f"{p.groups} groups x {p.questions} questions sharing a system prompt",
                    _stream(reqs, gen), enable_thinking=False)


def prefix_repetition(p: WorkloadParams) -> Workload:
    """vLLM-style prefix repetition: N distinct prefixes, each repeated with a different suffix, shuffled."""
    gen = TextGen(p.seed)
    prefixes = [gen.prose(p.repeated_prefix_words) for _ in range(p.num_prefixes)]
    reqs = [_single_turn(f"p{i}.r{r}", "You are a helpful assistant.", prefixes[i] + "\n\n" + gen.prose(p.question_words), gen)
            for i in range(p.num_prefixes) for r in range(p.repetitions)]
    return Workload("prefix_repetition", f"{p.num_prefixes} prefixes x {p.repetitions} repetitions",
                    _stream(reqs, gen), enable_thinking=False)
