"""The engine thread's hand-off to the event loop: a step's outputs cross in one hop, however many requests ran."""
from __future__ import annotations

import asyncio

from engine import LLM, SamplingParams
from engine.core.loop import EngineLoop
from server.pipeline.async_engine import AsyncEngine, EngineRequest
from tests.hf_oracle import random_prompts


class CountingLoop(asyncio.SelectorEventLoop):
    """An event loop that counts the callbacks other threads hand it."""

    hops = 0

    def call_soon_threadsafe(self, *args, **kwargs):
        self.hops += 1
        return super().call_soon_threadsafe(*args, **kwargs)


def test_one_hop_per_step_for_every_request_submitted_from_a_loop():
    llm = LLM("qwen3-tiny", block_size=4, num_kv_blocks=128, max_num_seqs=8, max_model_len=64)
    engine = llm.engine
    steps_with_outputs = 0
    step = engine.step

    def counted_step():
        nonlocal steps_with_outputs
        outputs = step()
        steps_with_outputs += bool(outputs)
        return outputs

    engine.step = counted_step
    async_engine = AsyncEngine(EngineLoop(engine), llm.tokenizer)
    max_tokens = 6
    prompts = random_prompts(50_000, [5, 7, 9, 4, 6, 8, 3, 10], seed=3)

    async def serve_all() -> list[list[int]]:
        params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
        streams = [await async_engine.submit([EngineRequest(f"r{i}", p, params)]) for i, p in enumerate(prompts)]

        async def tokens(stream) -> list[int]:
            return [t async for batch in stream for out in batch for t in out.new_token_ids]

        return await asyncio.gather(*(tokens(s) for s in streams))

    async_engine.start()
    try:
        with asyncio.Runner(loop_factory=CountingLoop) as runner:
            streamed = runner.run(serve_all())
            hops = runner.get_loop().hops
    finally:
        async_engine.shutdown()
    steps = steps_with_outputs
    assert streamed == [o.token_ids for o in llm.generate(prompts, SamplingParams(max_tokens=max_tokens,
                                                                                  temperature=0, ignore_eos=True))]
    # One hop per submission (its acceptance) and one per step that produced outputs, none per request per step.
    assert steps >= max_tokens
    assert hops == len(prompts) + steps
