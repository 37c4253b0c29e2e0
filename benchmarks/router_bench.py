"""``kvserve bench router``: N kvserve replicas of a tiny model on this machine behind real routers (vLLM's router,
SGLang's router, Dynamo's KV indexer), the same concurrent agent sessions through each routing policy in one run,
side by side: prefix-cache hit rate (cached / prompt tokens, as the replicas report them in `usage`) and TTFT (the
latency of a one-token request, router included). Every policy gets fresh replicas, so each starts cold. Then a
fault: one replica is SIGKILLed mid-run behind the KV-event router, and later restarted on the same ports.

The workload is `projects` (benchmarks/prefix/workloads.py): sessions over a few projects, each session's turns in
order, all sessions at once. Which replica served a request is read from the response's `system_fingerprint` (the
replica's instance id).
"""
from __future__ import annotations

import argparse
import asyncio
import re
import statistics
import time
from collections import Counter, defaultdict
from contextlib import ExitStack
from datetime import datetime
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from benchmarks.prefix.report import markdown_table, pct
from benchmarks.prefix.workloads import ChatRequest, WorkloadParams, projects
from benchmarks.router_procs import Alternating, Replica, ReplicaConfig, RouterSpec, start_replicas, start_router

POLICIES: dict[str, RouterSpec] = {
    "round_robin": RouterSpec("round_robin", "vllm-router", "round_robin", "nothing (rotation)"),
    "cache_aware": RouterSpec("cache_aware", "vllm-router", "cache_aware", "request text (its own tree)"),
    "kv_aware": RouterSpec("kv_aware", "vllm-router", "kv_aware", "KV events (+ /render token ids)"),
    # the same, a session kept on its replica while it is active (vllm-router reads the x-session-id header)
    "kv_aware_sessions": RouterSpec("kv_aware_sessions", "vllm-router", "kv_aware",
                                    "KV events + session affinity", ("--kv-aware-session-affinity-ttl-secs", "600")),
    "sglang_cache_aware": RouterSpec("sglang_cache_aware", "sglang-router", "cache_aware",
                                     "request text (its own tree)"),
    "dynamo_indexer": RouterSpec("dynamo_indexer", "dynamo-indexer", "longest indexed prefix",
                                 "KV events (+ /render token ids)"),
    # for the fault run: what a client sees of a replica's death when the router does not retry
    "kv_aware_no_retries": RouterSpec("kv_aware_no_retries", "vllm-router", "kv_aware",
                                      "KV events (+ /render token ids)", ("--disable-retries",)),
}


@dataclass(frozen=True)
class RouterBenchOptions:
    replica: ReplicaConfig = field(default_factory=ReplicaConfig)
    replicas: int = 2
    policies: tuple[str, ...] = ("round_robin", "cache_aware", "kv_aware", "sglang_cache_aware", "dynamo_indexer")
    workload: WorkloadParams = WorkloadParams(sessions=8, projects=2, session_steps=6, head_words=600,
                                              result_words=(20, 200))
    router_instances: tuple[int, ...] = (1, 2)  # each policy runs behind this many instances of its router
    session_stagger_s: float = 0.3  # session i starts i * this after the run begins
    fault_policy: str | None = "kv_aware"  # None: no fault run
    kill_at: float = 0.4  # the replica is killed when this fraction of requests has finished
    restart_at: float = 0.7  # ... and restarted at this fraction (>= 1: never)
    late_sessions: int = 2  # sessions of the fault run that start only after the restart
    out_dir: str = "results/router"


@dataclass
class RoutedResult:
    session: str
    turn: int
    start: float  # seconds since the run began
    end: float
    ok: bool
    prompt_tokens: int = 0
    cached_tokens: int = 0
    replica: int | None = None  # which replica answered (from system_fingerprint)
    error: str | None = None

    @property
    def ttft_s(self) -> float:
        return self.end - self.start


def sessions_of(requests: list[ChatRequest]) -> list[list[ChatRequest]]:
    by_session: dict[str, list[ChatRequest]] = defaultdict(list)
    for r in requests:
        by_session[r.session].append(r)
    return [sorted(turns, key=lambda r: r.turn) for turns in by_session.values()]


class Run:
    """One pass of the workload through a router; ``on_finished(n)`` is awaited after each request finishes."""

    def __init__(self, router: Any, model: str, instances: dict[str, int], stagger_s: float) -> None:
        self.router, self.model, self.instances, self.stagger_s = router, model, instances, stagger_s
        self.results: list[RoutedResult] = []
        self.on_finished = None
        self.gates: dict[int, asyncio.Event] = {}  # session index -> starts once set
        self._t0 = 0.0

    def now(self) -> float:
        return time.perf_counter() - self._t0

    async def request(self, client: httpx.AsyncClient, req: ChatRequest) -> RoutedResult:
        body = chat_body(self.model, req)
        start = self.now()
        try:
            async with self.router.route(client, body) as url:
                # the session id as agent clients send it (Claude Code: x-claude-code-session-id): a router may
                # keep a session in place by it
                response = await client.post(url + "/v1/chat/completions", json=body,
                                             headers={"x-session-id": req.session})
            if response.status_code != 200:
                raise RuntimeError(f"HTTP {response.status_code}: {response.text[:200]}")
            reply = response.json()
            usage = reply["usage"]
            return RoutedResult(req.session, req.turn, start, self.now(), True,
                                 usage["prompt_tokens"], usage["prompt_tokens_details"]["cached_tokens"],
                                 self.instances.get(reply.get("system_fingerprint")))
        except (httpx.HTTPError, RuntimeError, KeyError, ValueError) as exc:
            return RoutedResult(req.session, req.turn, start, self.now(), False,
                                 error=f"{type(exc).__name__}: {exc}"[:300])

    async def session(self, client: httpx.AsyncClient, index: int, turns: list[ChatRequest]) -> None:
        await asyncio.sleep(index * self.stagger_s)
        if index in self.gates:
            await self.gates[index].wait()
        for req in turns:
            self.results.append(await self.request(client, req))
            if self.on_finished is not None:
                await self.on_finished(len(self.results))

    async def run(self, sessions: list[list[ChatRequest]]) -> list[RoutedResult]:
        self._t0 = time.perf_counter()
        async with httpx.AsyncClient(timeout=300) as client:
            await asyncio.gather(*(self.session(client, i, turns) for i, turns in enumerate(sessions)))
        return self.results


def summarize(results: list[RoutedResult], replicas: int) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    ttfts = sorted(r.ttft_s for r in ok)
    prompt, cached = sum(r.prompt_tokens for r in ok), sum(r.cached_tokens for r in ok)
    share = Counter(r.replica for r in ok)
    return {
        "requests": len(results), "failed": len(results) - len(ok), "prompt_tokens": prompt, "cached_tokens": cached,
        "hit_rate": cached / prompt if prompt else 0.0,
        "later_turn_hit_rate": _hit_rate([r for r in ok if r.turn > 0]),
        "ttft_mean_s": statistics.fmean(ttfts) if ttfts else None,
        "ttft_p50_s": ttfts[len(ttfts) // 2] if ttfts else None,
        "ttft_p90_s": ttfts[min(len(ttfts) - 1, int(0.9 * len(ttfts)))] if ttfts else None,
        "per_replica": [share.get(i, 0) for i in range(replicas)],
        "wall_s": max((r.end for r in results), default=0.0),
    }


def _hit_rate(results: list[RoutedResult]) -> float:
    prompt = sum(r.prompt_tokens for r in results)
    return sum(r.cached_tokens for r in results) / prompt if prompt else 0.0


def chat_body(model: str, req: ChatRequest) -> dict[str, Any]:
    return {"model": model, "messages": req.messages, "tools": req.tools, "max_tokens": 1, "temperature": 0}


def prompt_token_ids(url: str, model: str, sessions: list[list[ChatRequest]]) -> dict[tuple[str, int], list[int]]:
    """Every request's prompt as a replica runs it (`/v1/chat/completions/render`: what its usage counts)."""
    with httpx.Client(timeout=300) as client:
        return {(req.session, req.turn): client.post(url + "/v1/chat/completions/render",
                                                     json=chat_body(model, req)).raise_for_status().json()["token_ids"]
                for turns in sessions for req in turns}


def ideal_cached_tokens(results: list[RoutedResult], prompts: dict[tuple[str, int], list[int]],
                        block_size: int) -> dict[tuple[str, int], int]:
    """Per answered request, what the best placement could have found cached: the longest prefix its prompt shares
    with any prompt answered before it was sent (one cache holding all of them), in whole blocks and at most
    ``len - 1`` tokens, as the cache serves. A prefill still in flight may have stored some blocks already, so a
    policy can beat this by luck, never by design."""
    ok = [r for r in results if r.ok]
    arrays = {key: np.asarray(ids) for key, ids in prompts.items()}
    ideal = {}
    for r in ok:
        ids, best = arrays[(r.session, r.turn)], 0
        for q in ok:
            if q.end <= r.start:
                other = arrays[(q.session, q.turn)]
                n = min(len(ids), len(other))
                differ = np.flatnonzero(ids[:n] != other[:n])
                best = max(best, int(differ[0]) if len(differ) else n)
        ideal[(r.session, r.turn)] = min(best, len(ids) - 1) // block_size * block_size
    return ideal


def router_credits(log: str, results: list[RoutedResult], urls: list[str]) -> dict[str, int]:
    """vllm-router's ``kv_aware`` decisions against what happened: the tokens it credited the replica it chose with
    (from its KV events) and what that replica had cached, for the answered requests whose decision its debug log
    shows (matched by prompt length and replica); ``credited_short`` counts those credited less than was there
    (events not yet arrived), ``credited_over`` those credited more (a hash the router could not match is never
    credited: over-credit would mean a stale index)."""
    decisions: dict[tuple[str, int], list[int]] = defaultdict(list)
    for line in log.splitlines():
        m = _DECISION_TOKENS.search(re.sub(r"\x1b\[[0-9;]*m", "", line))
        if m:
            decisions[(m.group(1), int(m.group(2)))].append(int(m.group(3)))
    matched = [(decisions[key].pop(0), r.cached_tokens) for r in sorted(results, key=lambda r: r.start)  # as decided
               if r.ok and r.replica is not None and decisions.get(key := (urls[r.replica], r.prompt_tokens))]
    return {"decisions_matched": len(matched), "credited_tokens": sum(c for c, _ in matched),
            "cached_tokens": sum(k for _, k in matched), "credited_short": sum(c < k for c, k in matched),
            "credited_over": sum(c > k for c, k in matched),
            "render_over_budget": sum("Prefix input preparation unavailable" in line for line in log.splitlines())}


_DECISION_TOKENS = re.compile(r'KV prefix decision .*worker="([^"]+)" input_tokens=(\d+) '
                              r'.*credited_prefix_tokens=(\d+)')


def run_policy(spec: RouterSpec, opts: RouterBenchOptions, sessions: list[list[ChatRequest]], log_dir: Path,
               router_instances: int) -> dict[str, Any]:
    log_dir = log_dir / f"{spec.name}-x{router_instances}"
    with ExitStack() as stack:
        replicas = start_replicas(stack, opts.replicas, opts.replica, log_dir)
        routers = [start_router(stack, spec, replicas, opts.replica, log_dir, j) for j in range(router_instances)]
        instances = {r.instance_id(): r.index for r in replicas}
        run = Run(Alternating(routers), opts.replica.model, instances, opts.session_stagger_s)
        results = asyncio.run(run.run(sessions))
        prompts = prompt_token_ids(replicas[0].url, opts.replica.model, sessions)
    ideal = ideal_cached_tokens(results, prompts, opts.replica.block_size)
    row = {"policy": spec.name, "router": spec.router, "routes_by": spec.signal, "router_instances": router_instances,
           **summarize(results, opts.replicas), "results": [asdict(r) for r in results]}
    ideal_hit_rate = sum(ideal.values()) / row["prompt_tokens"] if row["prompt_tokens"] else 0.0
    row.update(ideal_hit_rate=ideal_hit_rate, of_ideal=row["hit_rate"] / ideal_hit_rate if ideal_hit_rate else None)
    if spec.router == "vllm-router" and spec.policy == "kv_aware":
        logs = "\n".join(router.process.log.read_text(errors="replace") for router in routers)
        row["router_credits"] = router_credits(logs, results, [r.url for r in replicas])
    return row


def run_fault(spec: RouterSpec, opts: RouterBenchOptions, sessions: list[list[ChatRequest]],
              log_dir: Path) -> dict[str, Any]:
    """The policy's run with replica 1 SIGKILLed once ``kill_at`` of the first sessions' requests finished, and
    restarted on the same ports at ``restart_at``; the last ``late_sessions`` sessions start only after the restart
    (new conversations, which a router may send to the restarted replica)."""
    early = len(sessions) - opts.late_sessions
    total = sum(len(s) for s in sessions[:early])
    events: dict[str, float] = {}
    with ExitStack() as stack:
        replicas = start_replicas(stack, opts.replicas, opts.replica, log_dir / f"fault-{spec.name}")
        router = start_router(stack, spec, replicas, opts.replica, log_dir / f"fault-{spec.name}")
        victim = replicas[1]
        instances = {r.instance_id(): r.index for r in replicas}
        run = Run(router, opts.replica.model, instances, opts.session_stagger_s)
        restarted = asyncio.Event()
        run.gates = {i: restarted for i in range(early, len(sessions))}

        async def on_finished(done: int) -> None:
            served_by_victim = sum(r.replica == victim.index for r in run.results)
            if "kill" not in events and done >= opts.kill_at * total and served_by_victim >= 2:
                events["kill"] = run.now()
                victim.kill()
            elif "restart" not in events and "kill" in events and done >= opts.restart_at * total:
                events["restart"] = run.now()
                events["restart_wall"] = time.time()
                victim.start()  # same ports; the new process has a new instance id and an empty cache
                await asyncio.to_thread(victim.wait_ready)
                instances[await asyncio.to_thread(victim.instance_id)] = victim.index
                events["restarted"] = run.now()
                deadline = time.monotonic() + 15  # new sessions arrive once the router has it in rotation again
                while "router_marked_up" not in events and time.monotonic() < deadline:
                    await asyncio.sleep(0.2)
                restarted.set()

        async def main() -> list[RoutedResult]:
            watcher = asyncio.create_task(watch_health(router, victim, run, events))
            try:
                return await run.run(sessions)
            finally:
                watcher.cancel()

        run.on_finished = on_finished
        results = asyncio.run(main())
        router_log = router.process.log.read_text(errors="replace")
    return {"policy": spec.name, "router": spec.router, "events": events,
            **fault_summary(results, events, victim.index),
            "router_log": router_log_facts(router_log, victim.url, events.get("restart_wall")),
            "results": [asdict(r) for r in results]}


async def watch_health(router: Any, victim: Replica, run: Run, events: dict[str, float]) -> None:
    """When the router itself reports the victim unhealthy, and healthy again (vllm-router's GET /workers)."""
    if not hasattr(router, "url") or router.spec.router != "vllm-router":
        return
    async with httpx.AsyncClient(timeout=5) as client:
        while True:
            try:
                workers = (await client.get(router.url + "/workers")).json()["workers"]
                healthy = next(w["is_healthy"] for w in workers if w["url"] == victim.url)
                if not healthy and "kill" in events and "router_marked_down" not in events:
                    events["router_marked_down"] = run.now()
                if healthy and "restart" in events and "router_marked_up" not in events:
                    events["router_marked_up"] = run.now()
            except (httpx.HTTPError, KeyError, StopIteration, ValueError):
                pass
            await asyncio.sleep(0.2)


def fault_summary(results: list[RoutedResult], events: dict[str, float], victim: int) -> dict[str, Any]:
    kill, restart = events.get("kill", float("inf")), events.get("restarted", float("inf"))
    in_flight = [r for r in results if r.start < kill < r.end]
    down = [r for r in results if kill <= r.start < restart]
    after = [r for r in results if r.start >= restart]
    return {
        "in_flight_at_kill": len(in_flight),
        "in_flight_failed": sum(not r.ok for r in in_flight),
        "failed_outside_kill": sum(not r.ok for r in results if r not in in_flight),
        "errors": sorted({r.error for r in results if r.error}),
        "while_down": len(down), "while_down_to_victim": sum(r.replica == victim for r in down),
        "while_down_failed": sum(not r.ok for r in down),
        "after_restart": len(after), "after_restart_to_victim": sum(r.replica == victim for r in after),
        "after_restart_victim_cached_tokens": sum(r.cached_tokens for r in after if r.replica == victim),
        "hit_rate_before_kill": _hit_rate([r for r in results if r.ok and r.end <= kill]),
        "hit_rate_while_down": _hit_rate([r for r in down if r.ok]),
        "hit_rate_after_restart": _hit_rate([r for r in after if r.ok]),
    }


_DECISION = re.compile(r'^(\S+ \S+) .*KV prefix decision .*worker="([^"]+)".*credited_prefix_tokens=(\d+)')


def router_log_facts(log: str, victim_url: str, restart_wall: float | None) -> dict[str, int]:
    """From vllm-router's debug log: retried attempts, event-stream restarts it detected, and what its decisions for
    the restarted replica credited it with (tokens it believed cached there)."""
    lines = [re.sub(r"\x1b\[[0-9;]*m", "", line) for line in log.splitlines()]
    credited = []
    for line in lines:
        m = _DECISION.match(line)
        if m and m.group(2) == victim_url and restart_wall is not None and _epoch(m.group(1)) >= int(restart_wall):
            credited.append(int(m.group(3)))
    return {
        "retried_attempts": sum("KV request selected attempt=1" in line for line in lines),
        "event_stream_restarts_detected": sum("restart seq" in line for line in lines),
        "render_over_budget": sum("Prefix input preparation unavailable" in line for line in lines),
        "restarted_decisions": len(credited),
        "restarted_credited_tokens": sum(credited),
    }


def _epoch(stamp: str) -> float:
    return datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S").timestamp()


def policy_table(rows: list[dict[str, Any]]) -> str:
    def secs(x: float | None) -> str:
        return "-" if x is None else f"{x:.2f}"

    def of_ideal(r: dict[str, Any]) -> str:
        return "-" if r.get("of_ideal") is None else f"{pct(r['ideal_hit_rate'])} / {pct(r['of_ideal'])}"

    def credits(r: dict[str, Any]) -> str:
        c = r.get("router_credits")
        return "-" if c is None else (f"{c['credited_tokens']:,} / {c['cached_tokens']:,} "
                                      f"({c['credited_short']} short, {c['render_over_budget']} renders late)")

    return markdown_table(
        ["policy", "router", "routes by", "router instances", "requests", "failed", "hit rate", "ideal / of ideal",
         "later turns", "TTFT mean s", "p50 s", "p90 s", "requests per replica", "credited / cached tokens",
         "wall s"],
        [[r["policy"], r["router"], r["routes_by"], r["router_instances"], r["requests"], r["failed"],
          pct(r["hit_rate"]), of_ideal(r),
          pct(r["later_turn_hit_rate"]), secs(r["ttft_mean_s"]), secs(r["ttft_p50_s"]), secs(r["ttft_p90_s"]),
          " / ".join(map(str, r["per_replica"])), credits(r), f"{r['wall_s']:.1f}"] for r in rows],
    )


def fault_table(f: dict[str, Any]) -> str:
    e, log = f["events"], f["router_log"]

    def at(key: str) -> str:
        return f"{e[key]:.1f} s" if key in e else "-"

    rows = [
        ["replica 1 SIGKILLed at", at("kill"), ""],
        ["router reports it unhealthy at", at("router_marked_down"), "its health check, every 1 s"],
        ["requests in flight then / failed / retried by the router",
         f"{f['in_flight_at_kill']} / {f['in_flight_failed']} / {log['retried_attempts']}",
         "a retry goes to a healthy replica"],
        ["requests while it was down / sent to it / failed",
         f"{f['while_down']} / {f['while_down_to_victim']} / {f['while_down_failed']}", ""],
        ["failed requests outside the kill", f["failed_outside_kill"], ""],
        ["restarted on the same ports, serving at", at("restarted"), "a new process: empty cache"],
        ["router reports it healthy again at", at("router_marked_up"), ""],
        ["event-stream restarts the router detected", log["event_stream_restarts_detected"],
         "batch 0 again (AllBlocksCleared): its index drops the dead process's blocks"],
        ["requests after the restart / sent to it", f"{f['after_restart']} / {f['after_restart_to_victim']}", ""],
        ["their tokens: the router credited / the replica had cached",
         f"{log['restarted_credited_tokens']} / {f['after_restart_victim_cached_tokens']}",
         "more credit than cache would be the dead process's blocks"],
        ["hit rate before the kill / while down / after the restart",
         f"{pct(f['hit_rate_before_kill'])} / {pct(f['hit_rate_while_down'])} / {pct(f['hit_rate_after_restart'])}",
         ""],
    ]
    return markdown_table(["fault run (" + f["policy"] + ")", "value", "meaning"], rows)


def run_router_bench(opts: RouterBenchOptions) -> dict[str, Any]:
    unknown = [p for p in opts.policies if p not in POLICIES]
    if unknown:
        raise ValueError(f"unknown policies {unknown}; known: {', '.join(POLICIES)}")
    sessions = sessions_of(projects(opts.workload).requests)
    log_dir = Path(opts.out_dir) / "logs"
    rows = []
    for k in opts.router_instances:
        for name in opts.policies:
            print(f"policy {name}, {k} router instance(s): {opts.replicas} fresh replicas, {len(sessions)} "
                  "sessions ...", flush=True)
            rows.append(run_policy(POLICIES[name], opts, sessions, log_dir, k))
            print(policy_table(rows[-1:]).splitlines()[-1], flush=True)
    figures: dict[str, Any] = {"options": asdict(opts), "policies": rows, "markdown": policy_table(rows)}
    print("\n" + figures["markdown"])
    if opts.fault_policy:
        print(f"\nfault run ({opts.fault_policy}) ...", flush=True)
        fault = run_fault(POLICIES[opts.fault_policy], opts, sessions, log_dir)
        figures["fault"] = fault
        figures["fault_markdown"] = fault_table(fault)
        print(figures["fault_markdown"])
    Path(opts.out_dir).mkdir(parents=True, exist_ok=True)
    (Path(opts.out_dir) / "router.md").write_text(figures["markdown"] + "\n\n" + figures.get("fault_markdown", ""))
    return figures


def configure(parser: argparse.ArgumentParser) -> None:
    d = RouterBenchOptions()
    parser.add_argument("--model", default=d.replica.model, help="registry model each replica serves")
    parser.add_argument("--replicas", type=int, default=d.replicas, help="kvserve processes behind each router")
    parser.add_argument("--policies", default=",".join(d.policies),
                        help=f"comma-separated, run in this order: {', '.join(POLICIES)}")
    parser.add_argument("--sessions", type=int, default=d.workload.sessions, help="concurrent agent sessions")
    parser.add_argument("--projects", type=int, default=d.workload.projects,
                        help="projects the sessions work on (a project's sessions share its head)")
    parser.add_argument("--steps", type=int, default=d.workload.session_steps,
                        help="tool calls per session (each session sends steps + 1 requests)")
    parser.add_argument("--head-words", type=int, default=d.workload.head_words,
                        help="system prompt + rules + skills of a project, in words")
    parser.add_argument("--router-instances", default=",".join(map(str, d.router_instances)),
                        help="comma-separated: run every policy behind this many instances of its router, requests "
                        "alternating between them (a client-side load balancer)")
    parser.add_argument("--num-kv-blocks", type=int, default=d.replica.num_kv_blocks, help="KV blocks per replica")
    parser.add_argument("--fault-policy", default=d.fault_policy,
                        help="policy of the kill-a-replica run ('none': skip it)")
    parser.add_argument("--seed", type=int, default=0)


def run(args: argparse.Namespace) -> dict:
    d = RouterBenchOptions()
    workload = replace(d.workload, sessions=args.sessions, projects=args.projects, session_steps=args.steps,
                       head_words=args.head_words, seed=args.seed)
    return run_router_bench(RouterBenchOptions(
        replica=replace(d.replica, model=args.model, num_kv_blocks=args.num_kv_blocks), replicas=args.replicas,
        policies=tuple(p.strip() for p in args.policies.split(",") if p.strip()), workload=workload,
        router_instances=tuple(int(k) for k in args.router_instances.split(",") if k.strip()),
        fault_policy=None if args.fault_policy in (None, "none") else args.fault_policy, out_dir=args.out_dir))
