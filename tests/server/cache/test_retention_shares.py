"""Issue 41, item 15: what a breakpoint pin really retains, and each tenant's share of the retention cap.

On a small server (a cap of 32 blocks, 16 per tenant): `cache_creation_input_tokens` on /v1/messages counts only
what the engine retained for the request (before, a pin that the cap or the tenant's share refused was still
reported as written), and one tenant's pins cannot take the whole cap from the other (before, the first tenant
took all 32 blocks and the second's pin was refused)."""
from __future__ import annotations

from collections.abc import Iterator

import pytest

from engine.config import EngineConfig
from server.pipeline.context import ServerSettings
from tests.server.conftest import KEY_A, KEY_B, LiveServer, _live_server

BLOCK = 4
CAP = 32  # blocks: 256 * 0.125
SHARE = 16  # blocks: half the cap


@pytest.fixture(scope="module")
def capped_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    yield from _live_server(tmp_path_factory, "qwen3-tiny",
                            EngineConfig(block_size=BLOCK, num_kv_blocks=256, max_model_len=512,
                                         max_retained_fraction=CAP / 256, max_retained_share_per_tenant=0.5),
                            ServerSettings(api_keys=(KEY_A, KEY_B)), api_key=KEY_A)


def _pinned_message(server: LiveServer, key: str, name: str, words: int, stream: bool = False) -> dict[str, int]:
    """A message whose system prompt (``words`` distinct words) is a 1 h breakpoint; returns its usage."""
    system = [{"type": "text", "text": " ".join(f"{name}{i}" for i in range(words)),
               "cache_control": {"type": "ephemeral", "ttl": "1h"}}]
    args = dict(model=server.ctx.model_name, max_tokens=2, system=system,
                messages=[{"role": "user", "content": "hi"}])
    client = server.anthropic(key)
    if stream:
        with client.messages.stream(**args) as events:
            usage = events.get_final_message().usage
    else:
        usage = client.messages.create(**args).usage
    return {"input": usage.input_tokens, "created": usage.cache_creation_input_tokens or 0,
            "read": usage.cache_read_input_tokens or 0}


def _retained(server: LiveServer) -> int:
    return server.stats().kv_blocks_retained


def test_only_what_the_engine_retained_is_reported_as_written(capped_server: LiveServer) -> None:
    # A: a system prompt of more than its share: 16 blocks retained, reported as 64 tokens written (before: all)
    a1 = _pinned_message(capped_server, KEY_A, "alpha", 60)
    assert a1["created"] == SHARE * BLOCK and a1["read"] == 0 and a1["input"] > 0
    assert _retained(capped_server) == SHARE
    # B: a short breakpoint fits in its own share, whatever A holds (before: A held the whole cap, B got nothing)
    b1 = _pinned_message(capped_server, KEY_B, "beta", 10)
    b1_blocks = b1["created"] // BLOCK
    assert 0 < b1_blocks < SHARE
    assert _retained(capped_server) == SHARE + b1_blocks
    # B again, past its share: only the rest of its share is written
    b2 = _pinned_message(capped_server, KEY_B, "gamma", 60, stream=True)
    assert b2["created"] == (SHARE - b1_blocks) * BLOCK
    assert _retained(capped_server) == CAP
    # A once more: its share (and the cap) is full, so its pin writes nothing; the prompt is all input
    a2 = _pinned_message(capped_server, KEY_A, "delta", 30, stream=True)
    assert a2["created"] == 0 and a2["read"] == 0 and a2["input"] > 30
    assert _retained(capped_server) == CAP
