"""`kvserve inspect`: the cache inspector (`kvserve serve --ui`) in a terminal, for machines without a browser.

It reads the same JSON as the page (/ui/api/*) from a running server, so it shows the same thing: the sessions, one
session's requests (cached tokens per tier, TTFT, where each turn first changed and why, the two prompts side by side
there), one request's prompt coloured by what the cache served, or the cache itself.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

_EPILOG = """\
examples:
  kvserve serve --model qwen3-8b --ui --api-key sk-team-a --operator-key sk-ops
  kvserve inspect --api-key sk-team-a                    # your sessions
  kvserve inspect agent-7f3a --api-key sk-team-a         # one session (by the client's id or the inspector's s12)
  kvserve inspect --request chatcmpl-1ba6... --api-key sk-team-a   # one prompt, coloured by what the cache served
  kvserve inspect --cache --api-key sk-ops               # the cache: blocks per tier, evictions, largest prefixes
"""
SPARK = "▁▂▃▄▅▆▇█"
# ANSI backgrounds for what served a prompt token (as on the page).
_TIER_COLORS = {"device": "\x1b[42;30m", "host": "\x1b[44;30m", "disk": "\x1b[45;30m", "computed": "\x1b[43;30m"}
_RESET = "\x1b[0m"
_MARK = "\x1b[41;97;1m"
CONTEXT_CHARS = 70  # characters shown on each side of a divergence


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "inspect",
        help="what the cache inspector (kvserve serve --ui) shows, in the terminal",
        description="Reads a running server's cache inspector (`kvserve serve --ui`): with no argument the sessions "
        "you may see; with a SESSION its requests (prompt tokens, cached tokens per tier, TTFT, output, finish), "
        "its hit rate, and for each request whose prompt left the previous one, the first differing token, the miss "
        "cause and both prompts around it.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("session", nargs="?", help="a session: the client's id (prompt_cache_key, Claude Code's "
                        "session id, X-Session-Id) or the inspector's (s12)")
    parser.add_argument("--request", metavar="ID", help="show one request's prompt, coloured by what the cache served")
    parser.add_argument("--cache", action="store_true", help="show the cache: blocks per tier, evictions, largest "
                        "cached prefixes")
    parser.add_argument("--url", default=os.environ.get("KVSERVE_URL", "http://127.0.0.1:8000"),
                        help="the server (default: $KVSERVE_URL or %(default)s)")
    parser.add_argument("--api-key", default=os.environ.get("KVSERVE_API_KEY"),
                        help="the key to read with (default: $KVSERVE_API_KEY); an operator key sees every tenant")
    parser.add_argument("--color", choices=["auto", "always", "never"], default="auto",
                        help="colour the prompt (default: when the output is a terminal)")
    parser.set_defaults(func=run_inspect)


class _Error(Exception):
    pass


def run_inspect(args: argparse.Namespace) -> int:
    color = args.color == "always" or (args.color == "auto" and sys.stdout.isatty())
    client = _Client(args.url.rstrip("/"), args.api_key)
    try:
        if args.request:
            print(format_request(client.get(f"requests/{_quote(args.request)}"), color))
        elif args.cache:
            print(format_cache(client.get("cache")))
        elif args.session:
            print(format_session(client, _find_session(client, args.session)))
        else:
            print(format_sessions(client.get("sessions")))
    except _Error as exc:
        print(f"kvserve inspect: {exc}", file=sys.stderr)
        return 1
    return 0


class _Client:
    def __init__(self, url: str, key: str | None) -> None:
        self.url = url
        self.headers = {"Authorization": f"Bearer {key}"} if key else {}

    def get(self, path: str) -> dict[str, Any]:
        request = urllib.request.Request(f"{self.url}/ui/api/{path}", headers=self.headers)
        try:
            with urllib.request.urlopen(request, timeout=60) as response:
                return json.loads(response.read())
        except urllib.error.HTTPError as exc:
            if exc.code == 401:
                raise _Error("the server wants an API key: --api-key KEY (or KVSERVE_API_KEY)") from None
            if exc.code == 404 and path == "sessions":
                raise _Error(f"{self.url} serves no inspector: start it with `kvserve serve --ui`") from None
            try:
                message = json.loads(exc.read())["error"]["message"]
            except (ValueError, KeyError, TypeError):
                message = str(exc)
            raise _Error(message) from None
        except (urllib.error.URLError, OSError) as exc:
            raise _Error(f"cannot reach {self.url}: {getattr(exc, 'reason', exc)}") from None


def _quote(value: str) -> str:
    return urllib.parse.quote(value, safe="")


def _find_session(client: _Client, name: str) -> dict[str, Any]:
    sessions = client.get("sessions")["sessions"]
    found = [s for s in sessions if name in (s["id"], s["client_id"])]
    if not found:
        raise _Error(f"no session '{name}' among the {len(sessions)} you may see (run `kvserve inspect` to list them)")
    return client.get(f"sessions/{_quote(found[0]['id'])}")


def sparkline(values: list[float]) -> str:
    return "".join(SPARK[min(len(SPARK) - 1, int(v * len(SPARK)))] for v in values)


def _table(headers: list[str], rows: list[list[Any]], left: int = 1) -> str:
    """A plain text table; the first ``left`` columns are left-aligned, the rest right-aligned."""
    cells = [headers, *[[str(c) for c in row] for row in rows]]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]

    def line(row: list[str]) -> str:
        return "  ".join(c.ljust(w) if i < left else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths)))

    return "\n".join([line(headers), line(["-" * w for w in widths]), *map(line, cells[1:])])


def _pct(x: float) -> str:
    return f"{100 * x:.0f}%"


def _secs(s: float | None) -> str:
    return "-" if s is None else f"{1000 * s:.0f} ms" if s < 1 else f"{s:.2f} s"


def _ago(t: float) -> str:
    s = time.time() - t
    return f"{s:.0f} s ago" if s < 60 else f"{s / 60:.0f} min ago" if s < 3600 else f"{s / 3600:.1f} h ago"


def format_sessions(view: dict[str, Any]) -> str:
    viewer = view["viewer"]
    who = "operator (every tenant)" if viewer["operator"] else f"tenant {viewer['tenant']}" if viewer["tenant"] \
        else "no API keys (one tenant)"
    head = (f"{view['model']}: {len(view['sessions'])} session(s), {view['requests_kept']} of {view['max_requests']} "
            f"requests kept; you are {who}")
    rows = [[s["id"], s["client_id"] or "(by shared prefix)", s["tenant"] or "-", s["requests"], _pct(s["hit_rate"]),
             s["divergences"], sparkline(s["hit_rates"][-30:]), _ago(s["last_time"])] for s in view["sessions"]]
    table = _table(["session", "client id", "tenant", "requests", "hit rate", "changed", "hit rate per request",
                    "last"], rows, left=3) if rows else "no sessions yet"
    return f"{head}\n\n{table}"


def format_session(client: _Client, view: dict[str, Any]) -> str:
    s = view["session"]
    out = [f"session {s['client_id'] or s['id']} ({s['id']}), tenant {s['tenant'] or '-'}, {view['model']}: "
           f"{s['requests']} requests, {s['cached_tokens']:,} of {s['prompt_tokens']:,} prompt tokens cached "
           f"({_pct(s['hit_rate'])})",
           f"hit rate per request: {sparkline(s['hit_rates'])}", ""]
    rows = []
    for i, r in enumerate(view["requests"], 1):
        d = r["divergence"]
        share = r["cached_tokens"] / r["prompt_tokens"] if r["prompt_tokens"] else 0.0
        rows.append([i, r["id"], r["endpoint"], f"{r['prompt_tokens']:,}", f"{r['cached']['device']:,}",
                     f"{r['cached']['host']:,}", f"{r['cached']['disk']:,}", _pct(share), _secs(r["ttft_s"]),
                     r["output_tokens"], r["finish_reason"], f"{d['cause']} @ {d['index']:,}" if d else ""])
    out.append(_table(["#", "request", "API", "prompt", "device", "host", "disk", "cached", "TTFT", "output", "finish",
                       "first change"], rows, left=3))
    for i, r in enumerate(view["requests"], 1):
        if r["divergence"] is not None:
            out += ["", _divergence_text(i, client.get(f"requests/{_quote(r['id'])}"))]
    return "\n".join(out)


def _divergence_text(number: int, view: dict[str, Any]) -> str:
    d = view["request"]["divergence"]
    where = "reply" if d["in_reply"] else "prompt"
    lines = [f"#{number} {view['request']['id']}: token {d['index']:,} differs from the previous request's {where}: "
             f"{d['cause']} ({d['description']})"]
    sides = view["side_by_side"]
    if sides is not None:
        for label, side in (("previous", sides["previous"]), ("this    ", sides["current"])):
            cut = d["index"] - side["start"]
            before, after = "".join(side["pieces"][:cut]), "".join(side["pieces"][cut:])
            lines.append(f"  {label} …{_visible(before)[-CONTEXT_CHARS:]}│{_visible(after)[:CONTEXT_CHARS]}…")
    return "\n".join(lines)


def _visible(text: str) -> str:
    return text.replace("\r", "␍").replace("\n", "⏎").replace("\t", "⇥")


def format_request(view: dict[str, Any], color: bool) -> str:
    r = view["request"]
    ranges = view["cached_ranges"]
    computed = r["prompt_tokens"] - r["cached_tokens"]
    out = [f"request {r['id']} in session {view['session']['client_id'] or view['session']['id']}: "
           f"{r['prompt_tokens']:,} prompt tokens: {r['cached']['device']:,} from device, {r['cached']['host']:,} from "
           f"host, {r['cached']['disk']:,} from disk, {computed:,} computed; TTFT {_secs(r['ttft_s'])}, "
           f"{r['output_tokens']} output tokens, finish {r['finish_reason']}"]
    if r["misses"]:
        out.append("computed because: " + ", ".join(f"{cause} {n:,}" for cause, n in r["misses"].items()))
    d = r["divergence"]
    if d:
        out.append(f"first change: token {d['index']:,}, {d['cause']} ({d['description']})")
    legend = ("legend: " + " ".join(f"{_TIER_COLORS[t]} {t} {_RESET}" for t in _TIER_COLORS) + f" {_MARK} change "
              f"{_RESET}") if color else "legend: ⟦cached → computed⟧ ⟦!cause⟧ first change, ⟦bp⟧ breakpoint"
    snapshots = set(view["snapshot_points"])
    if snapshots:
        legend += ", ⟦snap⟧ recurrent-state snapshot (can resume here)"
    out += [legend, ""]
    breakpoints = {b["tokens"] for b in r["breakpoints"]}
    text, current = [], None
    for i, piece in enumerate(view["pieces"]):
        tier = ("device" if i < ranges["device"][1] else "host" if i < ranges["host"][1]
                else "disk" if i < ranges["disk"][1] else "computed")
        if i in breakpoints:
            text.append("⟦bp⟧")
        if i in snapshots:
            text.append("⟦snap⟧")
        if d and i == d["index"]:
            text.append(f"{_MARK}{piece}{_RESET}" if color else f"⟦!{d['cause']}⟧{piece}")
            continue
        if color:
            text.append(f"{_TIER_COLORS[tier]}{piece}{_RESET}")
        else:
            if tier != current and current is not None:
                text.append(f"⟦{current} → {tier}⟧")
            text.append(piece)
        current = tier
    if len(view["pieces"]) in snapshots:
        text.append("⟦snap⟧")
    return "\n".join(out) + "".join(text)


def format_cache(view: dict[str, Any]) -> str:
    t = view["timeline"]
    now = {k: v[-1] for k, v in t.items() if v}
    out = []
    if now and view.get("cache_wide", True):
        out.append(f"device: {now['device_total']:,} blocks, {now['device_used']:,} held by running requests, "
                   f"{now['device_cached']:,} cached, {now['device_pinned']:,} pinned or held, {now['device_free']:,} "
                   f"free (cached blocks nobody holds count as free)")
        out.append(f"host tier: {now['host_cached']:,} of {now['host_total']:,}; disk tier: {now['disk_cached']:,} of "
                   f"{now['disk_total']:,}")
        out.append("blocks that left a tier: " + ", ".join(f"{k} {v:,}" for k, v in view["evictions"].items()))
    elif pool := view.get("pool"):
        out.append(f"device: {pool['device_total']:,} blocks; host tier: {pool['host_total']:,}; disk tier: "
                   f"{pool['disk_total']:,} (the cache-wide figures depend on other tenants' requests: an operator's "
                   "key shows them)")
    rows = [[p["tokens"], p["blocks"], (p["holder"] or {}).get("client_id") or (p["holder"] or {}).get("session") or
             "(not in the inspector's window)", (p["holder"] or {}).get("tenant") or "-", p["referenced_blocks"],
             p["retained_blocks"]] for p in view["largest_prefixes"]]
    if rows:
        out += ["", "largest cached prefixes:", _table(["tokens", "blocks", "session", "tenant", "held by running",
                                                        "pinned or held"], rows, left=0)]
    kept = view["inspector"]
    size = f", {kept['memory_bytes'] / 2**20:.1f} MiB" if "memory_bytes" in kept else ""
    blocks = f" ({kept['trie_blocks']:,} distinct blocks{size})" if "trie_blocks" in kept else ""
    out.append(f"\nthe inspector keeps {kept['requests']} of {kept['max_requests']} requests in {kept['sessions']} "
               f"sessions{blocks}")
    return "\n".join(out)
