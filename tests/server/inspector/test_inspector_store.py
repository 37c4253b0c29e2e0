"""The inspector's store without a server: prompts stored once per shared prefix under the engine's block hashes,
sessions, the ring's bound, and where and why a request left its session's previous context."""
from __future__ import annotations

from engine.kv.block_hashing import BlockHasher
from server.inspector.attribution import Conversation
from server.inspector.prompt_trie import PromptTrie, common_prefix_packed, pack, unpack
from server.inspector.store import Inspector, Observation
from server.cache.miss_causes import (
    CHANGE_HISTORY,
    CHANGE_IMAGE,
    CHANGE_PROMPT,
    CHANGE_REPLY,
    CHANGE_SYSTEM,
    CHANGE_TOOLS,
)

BS = 4
HASHER = BlockHasher(BS, "model-x")


WORDS = {70: "I will", 71: " run the", 72: " tests"}  # what a few token ids decode to; the rest is "tN"


def make(max_requests: int = 100) -> Inspector:
    return Inspector(HASHER, "model-x", max_requests, lambda ids: "".join(WORDS.get(i, f" t{i}") for i in ids))


def observe(ins: Inspector, rid: str, prompt: list[int], output: list[int], cached: int = 0, *, session=None,
            salt=None, conversation=Conversation(), tenant=None, images=()):
    return ins.observe(Observation(rid, "chat", salt, session, prompt, output, cached, 0, 0, None, None, None, "stop",
                                   conversation=conversation, images=images), tenant)


def test_trie_shares_prefixes_under_the_engines_block_hashes_and_frees_them():
    trie = PromptTrie(HASHER)
    a, b = list(range(1, 14)), [*range(1, 9), 50, 51, 52, 53, 54]
    end_a = trie.insert("salt", pack(a), trie.known_path("salt", pack(a)), "A")
    known = trie.known_path("salt", pack(b))
    assert known == end_a.path()[:2]
    end_b = trie.insert("salt", pack(b), known, "B")
    assert len(trie.by_hash) == 3 + 1  # two shared blocks, then one of each
    assert [n.block_hash for n in end_a.path()] == HASHER.hashes(a, "salt")
    assert [n.block_hash for n in end_b.path()] == HASHER.hashes(b, "salt")
    assert unpack(trie.sequence(end_a, trie.tail(pack(a)))) == a and unpack(pack(a), 2, 5) == [3, 4, 5]
    assert trie.match("salt", pack(b), 10) == (3, end_b) and trie.match(None, pack(b), 10)[0] == 0
    assert trie.best_match_other_salts(None, pack(b), 10) == 3 and trie.best_match_other_salts("salt", pack(b), 10) == 0
    assert common_prefix_packed(pack(a), pack(b)) == 8 and common_prefix_packed(pack(a), pack(a[:5])) == 5
    assert end_a.path()[0].owner == "B"  # the newest sequence through a block owns it
    trie.release(end_b, "salt")
    assert len(trie.by_hash) == 3
    trie.release(end_a, "salt")
    assert not trie.by_hash and not trie.roots


def test_sessions_by_client_id_and_by_shared_prefix():
    ins = make()
    first = observe(ins, "r1", list(range(20)), [7, 7], session="cc-1")
    second = observe(ins, "r2", list(range(20)) + [7, 7, 1, 2, 3], [8], cached=20, session="cc-1")
    assert second.session is first.session and second.parent_id == "r1" and second.divergence is None
    anon_a = observe(ins, "r3", list(range(100, 120)), [5])
    anon_b = observe(ins, "r4", list(range(100, 120)) + [5, 9, 9], [6], cached=16)
    unrelated = observe(ins, "r5", list(range(200, 220)), [1])
    assert anon_b.session is anon_a.session and anon_b.parent_id == "r3"
    assert unrelated.session is not anon_a.session and unrelated.parent_id is None
    assert first.misses == {"first_request": 20}
    # r2: 20 of its 25 tokens cached; the previous context (20 + 2) had 2 more: a partial block; 3 are new
    assert second.misses == {"new_tokens": 3, "block_granularity": 2}
    assert sum(second.misses.values()) == second.prompt_tokens - second.cached_tokens


def test_the_ring_keeps_the_last_n_and_their_blocks_only():
    ins = make(max_requests=3)
    for i in range(10):
        observe(ins, f"r{i}", [1000 * i + k for k in range(12)], [1], session=f"s{i}")
    assert [r.request_id for r in ins.ring] == ["r7", "r8", "r9"]
    assert set(ins.by_id) == {"r7", "r8", "r9"} and len(ins.sessions) == 3
    assert len(ins.trie.by_hash) == 3 * 3  # only the kept requests' blocks
    seq, updated = ins.updated_sessions(after=9)  # requests are numbered from 1
    assert seq == 10 and [s.client_id for s in updated] == ["s9"]


def test_divergence_index_and_cause():
    ins = make()
    system = {"role": "system", "content": "rules v1"}
    user = {"role": "user", "content": "go"}
    tools = [{"type": "function", "function": {"name": "f"}}]
    base = Conversation([system, user], tools)
    observe(ins, "r1", list(range(40)), [90, 91, 92], session="s", conversation=base)

    def next_request(rid, prompt, conversation, cached=0):
        return observe(ins, rid, prompt, [1], cached=cached, session="s", conversation=conversation)

    edited = Conversation([{"role": "system", "content": "rules v2"}, user, {"role": "assistant", "content": "x"}],
                          tools)
    r2 = next_request("r2", [*range(10), 555, *range(11, 40), 90, 91, 92, 5], edited, cached=8)
    assert (r2.divergence.index, r2.divergence.cause, r2.divergence.in_reply) == (10, CHANGE_SYSTEM, False)
    # Blocks 0-1 (8 tokens) hit; the rest of the 43-token old context is lost to the system prompt; 1 is new.
    assert r2.misses == {CHANGE_SYSTEM: 35, "new_tokens": 1}
    r3 = next_request("r3", [*range(10), 556], Conversation(edited.messages, []))
    assert r3.divergence.cause == CHANGE_TOOLS
    r4 = next_request("r4", [*range(10), 557], Conversation([{"role": "system", "content": "rules v2"},
                                                           {"role": "user", "content": "summary"}], []))
    assert r4.divergence.cause == CHANGE_HISTORY
    kept = r4.session.last_conversation  # a digest: roles and hashes, no text
    assert [m["role"] for m in kept.messages] == ["system", "user"] and "rules" not in repr(kept)


def test_a_history_without_the_models_reply_is_named():
    ins = make()
    conv = Conversation([{"role": "user", "content": "go"}])
    observe(ins, "r1", list(range(12)), [40, 41, 42, 43, 44], session="s", conversation=conv)
    edited = Conversation([*conv.messages, {"role": "assistant", "content": "something else"},
                           {"role": "user", "content": "next"}])
    r2 = observe(ins, "r2", [*range(12), 40, 99, 98, 97], [70, 71, 72], session="s", conversation=edited)
    assert (r2.divergence.index, r2.divergence.cause, r2.divergence.in_reply) == (13, CHANGE_REPLY, True)
    faithful = Conversation([*edited.messages, {"role": "assistant", "content": "I will run the tests"}])
    r3 = observe(ins, "r3", [*range(12), 40, 99, 98, 97, 70, 88, 60, 61], [2], session="s", conversation=faithful)
    assert r3.divergence.index == 17 and r3.divergence.cause == "template"  # the same reply, rendered differently
    raw_a = observe(ins, "r4", list(range(300, 312)), [1], session="raw")
    raw_b = observe(ins, "r5", [300, 301, 999], [1], session="raw")
    assert raw_a.divergence is None and raw_b.divergence.cause == CHANGE_PROMPT


def test_ideal_evicted_and_different_salt():
    ins = make()
    observe(ins, "a", list(range(16)), [1], salt="tenant-a", tenant="tenant-a")
    # Same prompt, same salt, nothing cached (say it was evicted): the ideal would have served 12 tokens.
    again = observe(ins, "b", list(range(16)), [1], salt="tenant-a", tenant="tenant-a")
    assert again.ideal_tokens == 12 and again.misses["evicted"] == 12
    # The same tenant under another salt (a request's cache_salt scoped inside it): kept apart by the salt.
    scoped = observe(ins, "c", list(range(16)), [1], salt="tenant-a/scoped", tenant="tenant-a")
    assert scoped.misses["different_salt"] == 12


def test_another_tenants_prompts_never_show_in_a_tenants_misses():
    """Issue 41, item 3: tenant B resending tenant A's system prompt saw `different_salt` 12 (0 for a wrong guess),
    which told B that A's prompt was exactly that. Now B's misses are the same either way."""
    ins = make()
    observe(ins, "a", list(range(16)), [1], salt="tenant-a", tenant="tenant-a")
    right = observe(ins, "b-right", list(range(16)), [1], salt="tenant-b", tenant="tenant-b")
    wrong = observe(ins, "b-wrong", list(range(500, 516)), [1], salt="tenant-b2", tenant="tenant-c")
    assert right.misses == wrong.misses == {"first_request": 16}
    assert right.ideal_tokens == 0 and right.session.tenant == "tenant-b"
    for i in range(120):  # the per-tenant salt counts leave with the ring's requests
        observe(ins, f"r{i}", [i] * 8, [1], salt=f"salt-{i}", tenant=f"tenant-{i}")
    assert len(ins._tenant_salts) <= ins.max_requests


def test_memory_stays_bounded():
    ins = make(max_requests=50)
    sizes = []
    for i in range(200):
        observe(ins, f"r{i}", [*range(64), *range(1000 * i, 1000 * i + 64)], list(range(8)), session=f"s{i % 7}")
        sizes.append(ins.memory_bytes())
    assert len(ins.ring) == 50 and sizes[-1] < 1.2 * sizes[60]


def test_the_timeline_samples_changes_and_stays_bounded():
    from engine.outputs import SchedulerStats
    from server.inspector.store import TIMELINE_SAMPLES

    ins = make()
    ins.sample(SchedulerStats())  # the engine has not stepped yet: nothing to draw
    stats = SchedulerStats(kv_blocks_total=64, kv_blocks_free=60, kv_blocks_cached=4)
    ins.sample(stats, now=100.0)
    ins.sample(stats, now=101.0)  # unchanged and recent: skipped
    ins.sample(stats, now=140.0)  # unchanged but quiet for long: kept, so the chart's time axis moves on
    ins.sample(SchedulerStats(kv_blocks_total=64, kv_blocks_free=50, kv_blocks_cached=14), now=141.0)
    assert [s.time for s in ins.timeline] == [100.0, 140.0, 141.0] and ins.latest_stats.kv_blocks_cached == 14
    for i in range(TIMELINE_SAMPLES + 10):
        ins.sample(SchedulerStats(kv_blocks_total=64, kv_blocks_cached=i % 7), now=200.0 + i)
    assert len(ins.timeline) == TIMELINE_SAMPLES


def test_an_image_changed_at_the_same_place_is_named_from_its_first_block():
    """Two screenshots of one size: the same placeholder tokens, another content hash. The engine misses from the
    image's first block; the inspector names the break "image_changed" there, not an eviction."""
    pad = [9] * 12  # an image's run of placeholder tokens, at offset 6
    prompt = [1, 2, 3, 4, 5, 6, *pad, 30, 31, 32]
    first = observe(ins := make(), "r1", prompt, [40, 41], session="s", images=((6, b"shot-a"),))
    same = observe(ins, "r2", [*prompt, 40, 41, 33, 34], [42], cached=20, session="s", images=((6, b"shot-a"),))
    assert same.divergence is None and "image_changed" not in same.misses
    changed = observe(ins, "r3", [*prompt, 40, 41, 33, 34], [43], cached=4, session="s", images=((6, b"shot-b"),))
    assert first.divergence is None
    assert (changed.divergence.index, changed.divergence.cause) == (6, CHANGE_IMAGE)
    assert changed.ideal_tokens == 4 and "evicted" not in changed.misses
    assert changed.misses == {CHANGE_IMAGE: 25 - 4}  # all of it was the previous context: lost after block 1
