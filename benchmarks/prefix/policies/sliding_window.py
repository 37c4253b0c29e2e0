"""Sliding-window models' prefix cache on the agent workloads: hit rate against window memory for kvserve's window
group, vLLM's sliding-window manager and llama.cpp's SWA cache, simulated on the same token requests.

A hit at position P needs the full-attention pages of ``[0, P)`` and the window layers' K/V of ``(P - W, P)``. The
full-attention pages are the same for every policy (unbounded here); what differs is which windows survive, and what
keeping them costs. Each policy runs the requests one at a time in arrival order (a parent before its children), a
prompt in prefill chunks of ``chunk`` tokens, its reply after it:
  - kvserve (`engine.kv.window_pool`, through the engine's own KV manager): a running sequence holds only its window;
    windows are retained at the snapshot policy's points (server hints, breakpoints, the prompt's last block, the
    reply's last block boundary) in a pool of ``pages`` window pages beyond the running sequence's, evicted least
    recently used first (one superseded by a deeper one on its unbranched path first; one whose pages others hold
    never); a hit ends at the deepest matched block with a retained window;
  - vLLM (its SlidingWindowManager, retention interval 0, the default): blocks that fall out of a running sequence's
    window are freed but keep their hash (evictable, least recently freed first; at the end of a request its
    remaining blocks are freed last block first, so a request's tail is evicted before its head); a hit ends at
    the longest prefix whose last ``W - 1`` tokens' blocks are all still cached, anywhere in the prompt;
  - llama.cpp: a slot per session (sessions never share a cache). Without ``--swa-full`` the SWA cache holds the
    window at the slot's end, plus ``checkpoints`` copies of it taken at prompt ends: a request resumes where its
    common prefix with the slot ends only if that is the slot's end, else at the last checkpoint inside it. With
    ``--swa-full`` every layer keeps every token: any common prefix resumes, at the memory of a dense model.
Memory is what each keeps of the window layers beyond the running sequence's own window, priced with a released
model's shape (`SHAPES`): retained windows and cached pages (kvserve), cached out-of-window blocks (vLLM),
checkpoints or full-size window layers (llama.cpp).
"""
from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from engine.kv.block_hashing import BlockHasher
from engine.kv.manager import KVCacheManager
from engine.kv.snapshot_policy import SnapshotPolicy
from engine.kv.window_pool import DEFAULT_RETENTION_FRACTION, first_window_block, pages_per_window

from benchmarks.prefix.traces.trace import TokenRequest

KIB, GIB = 2**10, 2**30


@dataclass(frozen=True)
class WindowShape:
    """What a released sliding-window model keeps per token, in bf16 (from its config.json)."""

    name: str
    window: int
    window_layers: int
    full_layers: int
    window_bytes_per_layer: int  # one token's K and V in one window layer
    full_bytes_per_layer: int  # ... in one full-attention layer

    @property
    def window_bytes_per_token(self) -> int:
        return self.window_layers * self.window_bytes_per_layer

    @property
    def full_bytes_per_token(self) -> int:
        return self.full_layers * self.full_bytes_per_layer

    @property
    def full_share(self) -> float:
        """The share of a token's bytes (every layer full) its full-attention layers take."""
        return self.full_bytes_per_token / self.dense_bytes_per_token

    @property
    def dense_bytes_per_token(self) -> int:
        """Every layer keeping every token (llama.cpp's --swa-full, kvserve --no-sliding-window-cache)."""
        return self.window_bytes_per_token + self.full_bytes_per_token

    def running_window_pages(self, block_size: int) -> int:
        """The pages a decoding sequence holds in the window layers: its window, the block its last boundary's
        window starts in, and the block it writes."""
        return -(-(self.window - 1) // block_size) + 2

    def session_bytes_per_token(self, context: int, block_size: int = 16, retained_windows: int = 0) -> float:
        """Bytes per token of context of one ``context``-token session with the window group: its full-attention
        pages, its running window and ``retained_windows`` windows kept for resuming."""
        pages = self.running_window_pages(block_size) + retained_windows * -(-(self.window - 1) // block_size)
        return (context * self.full_bytes_per_token + pages * block_size * self.window_bytes_per_token) / context


def _kv(heads: int, head_dim: int) -> int:
    return 2 * heads * head_dim * 2  # K and V, bf16


SHAPES = {
    # 62 layers, every 6th global (52 window of 1024, 10 global), 16 KV heads of 128
    "Gemma 3 27B": WindowShape("Gemma 3 27B", 1024, 52, 10, _kv(16, 128), _kv(16, 128)),
    # 60 layers, 5 window (1024) : 1 global; window layers 16 KV heads of 256, global ones 4 of 512. Their values come
    # from k_proj (attention_k_eq_v) but are normed apart from the keys, which are rotated: K and V both kept
    # (engine/models/gemma4.py)
    "Gemma-4-31B": WindowShape("Gemma-4-31B", 1024, 50, 10, _kv(16, 256), _kv(4, 512)),
    # 30 layers, 5 window (1024) : 1 global; window layers 8 KV heads of 256, global ones 2 of 512
    "Gemma-4-26B-A4B": WindowShape("Gemma-4-26B-A4B", 1024, 25, 5, _kv(8, 256), _kv(2, 512)),
    # E2B: 35 layers, 4 window (512) : 1 global, 1 KV head of 256 / 512; the last 20 reuse the K/V of layers 13
    # (window) and 14 (global) and keep none, so 12 window and 3 global layers keep pages (engine/models/gemma4.py)
    "Gemma-4-E2B": WindowShape("Gemma-4-E2B", 512, 12, 3, _kv(1, 256), _kv(1, 512)),
    # E4B: 42 layers, 5 window (512) : 1 global, 2 KV heads of 256 / 512; the last 18 shared: 20 window, 4 global kept
    "Gemma-4-E4B": WindowShape("Gemma-4-E4B", 512, 20, 4, _kv(2, 256), _kv(2, 512)),
    # 52 layers, 3 window (2048) : 1 full (NoPE), 2 KV heads of 128
    "Muse-Glimmer-30B": WindowShape("Muse-Glimmer-30B", 2048, 39, 13, _kv(2, 128), _kv(2, 128)),
    # 24 layers alternating window (128) / full, 8 KV heads of 64
    "gpt-oss-20b": WindowShape("gpt-oss-20b", 128, 12, 12, _kv(8, 64), _kv(8, 64)),
}


@dataclass
class PolicyRun:
    policy: str
    pages: int  # window pages beyond the running sequence's (llama.cpp: 0, its memory is per slot)
    prompt_tokens: int = 0
    cached_tokens: int = 0
    peak_window_tokens: int = 0  # window-layer tokens kept beyond the running window, at the peak
    per_request: list[int] = field(default_factory=list)

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    def record(self, request: TokenRequest, cached: int) -> None:
        self.prompt_tokens += len(request.prompt)
        self.cached_tokens += cached
        self.per_request.append(cached)


def _chunks(start: int, end: int, chunk: int) -> list[tuple[int, int]]:
    return [(s, min(s + chunk, end)) for s in range(start, end, chunk)]


def running_pages(window: int, block_size: int = 16, chunk: int = 2048) -> int:
    """The window pages one running sequence holds at most: its window, the block its last boundary's window starts
    in, the block it writes, and a prefill chunk's."""
    return -(-chunk // block_size) + -(-(window - 1) // block_size) + 2


@dataclass(frozen=True)
class Tier:
    """A window model's host tier: full-attention blocks and window rows (retained windows)."""

    blocks: int = 0
    windows: int = 0

    @classmethod
    def split(cls, dense_blocks: int, window: int, full_layers: float, block_size: int = 16,
              fraction: float = DEFAULT_RETENTION_FRACTION) -> Tier:
        """A tier of ``dense_blocks`` dense blocks' bytes split as the runner splits it (`ModelRunner._new_offload`):
        ``fraction`` for window rows of `pages_per_window` pages, full-attention blocks the rest."""
        row = pages_per_window(window, block_size) * (1 - full_layers)
        windows = int(fraction * dense_blocks / row)
        return cls(int((dense_blocks - windows * row) / full_layers), windows)


def run_kvserve(requests: Sequence[TokenRequest], window: int, pages: int, block_size: int = 16,
                chunk: int = 2048, hints: bool = True, include_output: bool = True,
                full_blocks: int | None = None, host: Tier = Tier()) -> PolicyRun:
    """kvserve's window group (the engine's KV manager) with ``pages`` window pages beyond the running sequence's;
    ``full_blocks``: the full-attention pool (default: all the requests' blocks); ``host``: a host tier of
    full-attention blocks and retained windows."""
    bs, policy = block_size, SnapshotPolicy()
    blocks = full_blocks or sum(-(-len(r.committed_ids(include_output)) // bs) for r in requests) + 1
    kv = KVCacheManager(blocks, bs, window_blocks=running_pages(window, bs, chunk) + pages, window=window,
                        host_blocks=host.blocks, host_states=host.windows)
    hasher = BlockHasher(bs, "window-sim")
    run = PolicyRun("kvserve" if hints else "kvserve, no server hints", pages)
    for r in requests:
        ids = r.committed_ids(include_output)
        hashes = hasher.hashes(ids, r.salt)
        cached = kv.admit(r.request_id, hashes, r.prompt, 0)
        assert cached is not None, "the simulated pools hold the running sequence"
        run.record(r, cached)
        points = policy.prompt_points(len(r.prompt), bs, r.snapshot_hints if hints else (),
                                      [p.num_tokens for p in r.pins])
        for start, end in _chunks(cached, len(ids) - 1, chunk):  # the last token is never computed
            kv.slide(r.request_id, start)
            assert kv.allocate(r.request_id, end) is not None
            kv.commit(r.request_id, hashes, ids, end)
            for point in points:
                if start < point <= end:
                    kv.keep_window(r.request_id, point)
            if end // bs * bs > len(r.prompt):
                kv.keep_window(r.request_id, end // bs * bs, replaces_reply=True)
        kv.free(r.request_id)
        kv.take_transfers()  # (no runner copies them)
        kept = {page for node in kv.window.anchors for page in node.window_pages} | set(kv.window.cached)
        run.peak_window_tokens = max(run.peak_window_tokens, len(kept) * bs)
    return run


class _VllmWindowBlocks:
    """vLLM's window-layer blocks: held by the running sequence, or freed with their hash (evictable)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.held: set[bytes] = set()
        self.cached: OrderedDict[bytes, None] = OrderedDict()  # least recently freed first
        self.num_held = 0  # held pages (a partial block has no hash but a page)

    def take(self, block_hash: bytes | None) -> None:
        if self.num_held + len(self.cached) >= self.capacity:
            self.cached.popitem(last=False)
        self.num_held += 1
        if block_hash is not None:
            self.held.add(block_hash)

    def reuse(self, block_hash: bytes) -> None:
        del self.cached[block_hash]
        self.held.add(block_hash)
        self.num_held += 1

    def release(self, block_hash: bytes | None) -> None:
        self.num_held -= 1
        if block_hash is not None and block_hash in self.held:
            self.held.discard(block_hash)
            self.cached[block_hash] = None


def run_vllm(requests: Sequence[TokenRequest], window: int, pages: int, block_size: int = 16, chunk: int = 2048,
             include_output: bool = True) -> PolicyRun:
    """vLLM's sliding-window manager, retention interval 0, with ``pages`` window pages beyond the running
    sequence's (its freed, still-hashed blocks live in them)."""
    bs = block_size
    blocks = _VllmWindowBlocks(running_pages(window, bs, chunk) + pages)
    full: set[bytes] = set()  # full-attention blocks (unbounded)
    hasher = BlockHasher(bs, "window-sim")
    run = PolicyRun("vLLM (drop out-of-window blocks, retention interval 0)", pages)
    for r in requests:
        ids = r.committed_ids(include_output)
        hashes = hasher.hashes(ids, r.salt)
        hit = 0
        for k in range((len(r.prompt) - 1) // bs, 0, -1):
            if hashes[k - 1] in full and all(hashes[i] in blocks.cached
                                             for i in range(first_window_block(k * bs, window, bs), k)):
                hit = k
                break
        run.record(r, hit * bs)
        table: list[bytes | None] = [None] * hit  # the hashes of the pages it holds (None: none, or partial)
        for i in range(first_window_block(hit * bs, window, bs), hit):
            blocks.reuse(hashes[i])
            table[i] = hashes[i]
        live = first_window_block(hit * bs, window, bs)
        for start, end in _chunks(hit * bs, len(ids) - 1, chunk):
            first = first_window_block(start, window, bs)
            for i in range(live, first):  # out of the window: freed, hash kept
                blocks.release(table[i])
            live = max(live, first)
            for i in range(len(table), -(-end // bs)):
                full_block = (i + 1) * bs <= len(ids) - 1
                table.append(hashes[i] if full_block and i < len(hashes) else None)
                blocks.take(table[-1])
                if full_block and i < len(hashes):
                    full.add(hashes[i])
        for i in range(len(table) - 1, live - 1, -1):  # the request ends: its last blocks freed first
            blocks.release(table[i])
        run.peak_window_tokens = max(run.peak_window_tokens, len(blocks.cached) * bs)
    return run


def run_llama_cpp(requests: Sequence[TokenRequest], window: int, swa_full: bool, checkpoints: int = 3,
                  include_output: bool = True) -> PolicyRun:
    """llama.cpp: a slot per session; ``swa_full``: full-size window layers, else the SWA cache plus
    ``checkpoints`` prompt-end copies of it per slot."""
    slots: dict[str, tuple[list[int], deque[int]]] = {}
    name = "llama.cpp --swa-full" if swa_full else f"llama.cpp ({checkpoints} SWA checkpoints)"
    run = PolicyRun(name, 0)
    for r in requests:
        tokens, kept = slots.get(r.session, ([], deque()))
        common = 0
        limit = min(len(tokens), len(r.prompt) - 1)
        while common < limit and tokens[common] == r.prompt[common]:
            common += 1
        if swa_full or common == len(tokens):
            hit = common
        else:
            hit = max((c for c in kept if c <= common), default=0)
        run.record(r, hit)
        ids = r.committed_ids(include_output)
        kept.append(len(r.prompt) - 1)
        while len(kept) > checkpoints:
            kept.popleft()
        slots[r.session] = (ids[:-1], kept)
        if swa_full:  # beyond a running window: every slot's window layers hold all their tokens
            held = sum(max(0, len(t) - window) for t, _ in slots.values())
        else:  # every slot's live window (but the running one's) and its checkpoints' copies
            held = (len(slots) - 1) * window + sum(len(k) for _, k in slots.values()) * window
        run.peak_window_tokens = max(run.peak_window_tokens, held)
    return run


def run_dense(requests: Sequence[TokenRequest], blocks: int, block_size: int = 16, chunk: int = 2048,
              include_output: bool = True, host_blocks: int = 0) -> PolicyRun:
    """The same requests on a model whose every layer keeps every token, in ``blocks`` blocks (the engine's KV
    manager, least recently used first), over a host tier of ``host_blocks``."""
    kv, hasher = KVCacheManager(blocks, block_size, host_blocks=host_blocks), BlockHasher(block_size, "window-sim")
    run = PolicyRun("every layer full", 0)
    for r in requests:
        ids = r.committed_ids(include_output)
        hashes = hasher.hashes(ids, r.salt)
        cached = kv.admit(r.request_id, hashes, r.prompt, 0)
        assert cached is not None
        run.record(r, cached)
        for _, end in _chunks(cached, len(ids) - 1, chunk):
            if kv.allocate(r.request_id, end) is None:  # the pool is smaller than the request: the rest uncached
                break
            kv.commit(r.request_id, hashes, ids, end)
        kv.free(r.request_id)
        kv.take_transfers()
    return run


def under_pressure(requests: Sequence[TokenRequest], dense_blocks: int, window: int, full_layers: float,
                   block_size: int = 16, chunk: int = 2048, retention_fraction: float = DEFAULT_RETENTION_FRACTION,
                   host_blocks: int = 0) -> tuple[PolicyRun, PolicyRun]:
    """The same requests on a dense model with ``dense_blocks`` blocks and on the window group in the same memory,
    split as the runner splits it: the running sequence's window pages, ``retention_fraction`` of the rest for
    retained windows, full-attention blocks the remainder. ``full_layers``: the share of a block's bytes the
    full-attention layers take (Gemma 3: 1/6). ``host_blocks``: a host tier of that many dense blocks' bytes
    under both, the window model's split likewise (`Tier.split`)."""
    page = 1 - full_layers  # a window page's bytes, a dense block's being 1
    running = running_pages(window, block_size, chunk)
    rest = dense_blocks - running * page
    retained = int(retention_fraction * rest / page)
    full_blocks = int((rest - retained * page) / full_layers)
    host = Tier.split(host_blocks, window, full_layers, block_size, retention_fraction) if host_blocks else Tier()
    dense = run_dense(requests, dense_blocks, block_size, chunk, host_blocks=host_blocks)
    windowed = run_kvserve(requests, window, retained, block_size, chunk, full_blocks=full_blocks, host=host)
    return dense, windowed


def compare(requests: Sequence[TokenRequest], window: int, page_counts: Sequence[int], block_size: int = 16,
            checkpoints: int = 3) -> list[PolicyRun]:
    """Every policy at every pool size (llama.cpp once each: its memory is its slots')."""
    runs = []
    for pages in page_counts:
        runs.append(run_kvserve(requests, window, pages, block_size))
        runs.append(run_kvserve(requests, window, pages, block_size, hints=False))
        runs.append(run_vllm(requests, window, pages, block_size))
    runs.append(run_llama_cpp(requests, window, swa_full=False, checkpoints=checkpoints))
    runs.append(run_llama_cpp(requests, window, swa_full=True))
    return runs


@dataclass(frozen=True)
class WindowOptions:
    model: str = "qwen3-tiny"  # its template and tokenizer render the workloads
    workloads: tuple[str, ...] = ("claude_code", "codex", "subagents", "tool_loop")
    shape: str = "Gemma 3 27B"  # whose window and sizes price the memory
    windows: tuple[int, ...] = (1024, 128)  # windows: ``shape``'s and gpt-oss'
    page_counts: tuple[int, ...] = (64, 256, 1024)
    pressure_blocks: tuple[int, ...] = (400, 800, 1600)  # dense pools the sessions table compares at
    pressure_host: int = 2  # ... and over a host tier this many times the pool's size
    checkpoints: int = 3
    seed: int = 0
    out_dir: str = "results/prefix"


def memory_markdown(context: int = 100_000, block_size: int = 16) -> str:
    from benchmarks.prefix.report import markdown_table

    rows = []
    for s in SHAPES.values():
        dense = s.dense_bytes_per_token
        group = s.session_bytes_per_token(context, block_size)
        kept = s.session_bytes_per_token(context, block_size, retained_windows=1)
        rows.append([s.name, s.window, f"{s.window_layers} / {s.full_layers}", f"{dense / KIB:.1f} KiB",
                     f"{group / KIB:.1f} KiB", f"{kept / KIB:.1f} KiB", f"{dense / group:.1f}x",
                     f"{context * dense / GIB:.1f} / {context * group / GIB:.1f} GiB"])
    return markdown_table(["model", "window", "window / full layers", "every layer full", "window group",
                           "+ one retained window", "less", f"{context:,}-token session"], rows)


def _pressure_rows(opts: WindowOptions, shape: WindowShape) -> list[dict]:
    """Interleaved agent sessions (16 x 5 turns): the window group against a dense model in the same memory."""
    from benchmarks.prefix.agent_sessions import SessionsParams, agent_sessions

    requests = agent_sessions(SessionsParams(sessions=16, turns=5, seed=opts.seed))
    rows = []
    for blocks in opts.pressure_blocks:
        for host in (0, opts.pressure_host * blocks):
            for window in opts.windows:
                dense, windowed = under_pressure(requests, blocks, window, shape.full_share, host_blocks=host)
                rows.append({"dense_blocks": blocks, "host_blocks": host, "window": window,
                             "dense_hit_rate": dense.hit_rate, "window_hit_rate": windowed.hit_rate,
                             "ratio": windowed.cached_tokens / dense.cached_tokens if dense.cached_tokens else 0.0})
    return rows


def run_sliding_window(opts: WindowOptions) -> dict:
    """The comparison table: per workload, window, policy and pool, the hit rate and the window memory."""
    from pathlib import Path

    from benchmarks.prefix.traces.render import load_model_text, tokenize_workload
    from benchmarks.prefix.report import markdown_table, pct
    from benchmarks.prefix.catalog import build_workloads
    from benchmarks.prefix.workloads import WorkloadParams

    shape = SHAPES[opts.shape]
    mt = load_model_text(opts.model)
    rows, figures = [], []
    for workload in build_workloads(list(opts.workloads), WorkloadParams(seed=opts.seed)):
        requests = tokenize_workload(workload, mt)
        for window in opts.windows:
            for run in compare(requests, window, opts.page_counts, checkpoints=opts.checkpoints):
                gib = run.peak_window_tokens * shape.window_bytes_per_token / GIB
                figures.append({"workload": workload.name, "window": window, "policy": run.policy,
                                "pages": run.pages, "hit_rate": run.hit_rate,
                                "peak_window_tokens": run.peak_window_tokens, "window_gib": gib})
                rows.append([workload.name, window, run.policy, run.pages or "per session", pct(run.hit_rate),
                             f"{run.peak_window_tokens:,}", f"{gib:.2f}"])
    table = markdown_table(["workload", "window", "policy", "window pages", "hit rate", "peak window tokens kept",
                            f"GiB ({opts.shape})"], rows)
    pressure = _pressure_rows(opts, shape)
    figures += [{"workload": "agent_sessions", **row} for row in pressure]
    sessions = markdown_table(["dense blocks", "host tier (dense blocks)", "window", "dense hit rate",
                               "window group hit rate", "cached tokens, window / dense"],
                              [[r["dense_blocks"], r["host_blocks"], r["window"], pct(r["dense_hit_rate"]),
                                pct(r["window_hit_rate"]), f"{r['ratio']:.2f}"] for r in pressure])
    markdown = f"{memory_markdown()}\n\n{table}\n\n{sessions}\n"
    out = Path(opts.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "sliding_window.md").write_text(markdown)
    return {"model": opts.model, "shape": opts.shape, "runs": figures, "markdown": markdown}
