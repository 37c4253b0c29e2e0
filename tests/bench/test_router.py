"""Two kvserve replicas behind a real router on 127.0.0.1 (vLLM's router, `kv_aware`: it finds the replicas' KV
events through /kv_event_sources, reads them, and scores requests with their /render token ids), and Dynamo's KV
indexer on the same events: each agent session's later turns land on the replica that holds its first."""
from __future__ import annotations

from contextlib import ExitStack

import httpx
import pytest

from benchmarks.prefix.workloads import WorkloadParams, projects
from benchmarks.router_bench import POLICIES, sessions_of
from benchmarks.router_procs import DynamoIndexerRouter, ReplicaConfig, start_replicas, start_router


def chat(url: str, request, model: str) -> dict:
    body = {"model": model, "messages": request.messages, "tools": request.tools, "max_tokens": 1}
    response = httpx.post(url + "/v1/chat/completions", json=body, timeout=300)
    assert response.status_code == 200, response.text
    return response.json()


@pytest.mark.slow
@pytest.mark.slow
def test_later_turns_land_where_their_prefix_is(tmp_path):
    config = ReplicaConfig(num_kv_blocks=1024, max_model_len=8192)
    # two sessions on two projects: no block in common
    workload = projects(WorkloadParams(sessions=2, projects=2, session_steps=2, head_words=300,
                                       result_words=(20, 60)))
    (a0, a1, a2), (b0, b1, b2) = sessions_of(workload.requests)
    with ExitStack() as stack:
        replicas = start_replicas(stack, 2, config, tmp_path)
        ids = [r.instance_id() for r in replicas]
        router = start_router(stack, POLICIES["kv_aware"], replicas, config, tmp_path)
        dynamo = start_router(stack, POLICIES["dynamo_indexer"], replicas, config, tmp_path)
        assert isinstance(dynamo, DynamoIndexerRouter)
        # Each session's first turn runs on a replica of the test's choosing, past the router: only the replicas'
        # KV events can tell the router where the prefixes are.
        first = {"a": chat(replicas[0].url, a0, config.model), "b": chat(replicas[1].url, b0, config.model)}
        # In this order no rotation of the two replicas sends every turn home.
        for name, later, home in (("b", b1, 1), ("a", a1, 0), ("a", a2, 0), ("b", b2, 1)):
            reply = chat(router.url, later, config.model)
            cached = reply["usage"]["prompt_tokens_details"]["cached_tokens"]
            assert reply["system_fingerprint"] == ids[home], f"session {name} left the replica with its prefix"
            # everything of the first turn's prompt but its last partial block is cached, at least
            assert cached >= first[name]["usage"]["prompt_tokens"] - config.block_size, (name, cached)
        # Dynamo's indexer read the same events: it places each session's prefix on its replica alone.
        with httpx.Client(timeout=60) as client:
            for request, home in ((a1, 0), (b1, 1)):
                body = {"model": config.model, "messages": request.messages, "tools": request.tools}
                token_ids = client.post(replicas[home].url + "/v1/chat/completions/render", json=body).json()
                scores = client.post(dynamo.url + "/query", json={"model_name": config.model,
                                                                  "token_ids": token_ids["token_ids"]}).json()
                matched = {int(w) - 1: info["gpu"] for w, info in scores["instances"].items()}
                assert matched.get(1 - home, 0) == 0 and matched[home] >= len(token_ids["token_ids"]) // 2
