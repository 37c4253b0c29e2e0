"""Decode batches at fixed batch sizes: padded to a captured size and replayed as CUDA graphs (eager on CPU).

A decode step launches a few hundred small kernels whose launch overhead dominates at small batch sizes, so on CUDA
the model forward of a pure-decode batch (one new token per sequence) is captured once per *capture size* and
replayed. Graphs have static shapes and addresses: they capture views of the runner's persistent input buffers
(`engine.worker.step_inputs.DeviceInputs`), which every step fills in place, and a batch of ``n`` sequences runs the graph
of the smallest capture size ``>= n``. The extra rows are padding (see `step_inputs._pad_decode`):

- ``slot_mapping`` -1: the store op writes nothing for them (no KV block is ever touched);
- context length 1 on whatever block id the row's table holds (always a valid id): attention reads one finite
  value, never an empty context (0/0);
- state row -1 (hybrid models): the recurrent kernels neither read nor write a state for them;
- their hidden states are sliced off before logits.

Everything that sizes a kernel launch is fixed at capture: ``max_query_len=1``, ``max_context_len=max_model_len``
(every context stays within it; programs past a sequence's context exit at once), and with them the attention
kernel's split-K choice and partition size. The same padded static-shape forward runs without graphs when
``use_graphs`` is False, which is how CPU tests check the padding against the unpadded path.
"""
from __future__ import annotations

import bisect

import torch

from engine.models.kv_cache_spec import KVCaches
from engine.models.llama import LlamaForCausalLM
from engine.worker.step_inputs import DeviceInputs
from kernels.attention_metadata import AttentionMetadata


def capture_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, then every multiple of 8 below ``max_num_seqs``, then ``max_num_seqs``: at most 7 padding rows
    (beyond the small sizes) for a few dozen graphs."""
    small = [s for s in (1, 2, 4) if s < max_num_seqs]
    return small + list(range(8, max_num_seqs, 8)) + [max_num_seqs]


class DecodeGraphRunner:
    """One graph (or, eagerly, one static-shape forward) per capture size over the runner's input buffers."""

    def __init__(
        self, model: LlamaForCausalLM, kv_caches: KVCaches, inputs: DeviceInputs, max_num_seqs: int,
        max_model_len: int, use_graphs: bool,
    ) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.inputs = inputs
        self.sizes = capture_sizes(max_num_seqs)
        self.max_model_len = max_model_len
        self.use_graphs = use_graphs
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}  # each graph's hidden states, overwritten by its replays

    def fits(self, num_rows: int, max_query_len: int) -> bool:
        """Whether a step can run here: decode-only and within the largest size."""
        return max_query_len == 1 and num_rows <= self.sizes[-1]

    def padded_size(self, num_rows: int) -> int:
        return self.sizes[bisect.bisect_left(self.sizes, num_rows)]

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every size, largest first, into one shared memory pool.

        Capturing the largest first sizes the pool once; smaller graphs reuse its blocks (graphs in one pool may
        alias each other's intermediates, which is safe because replays never overlap). Each size is warmed up
        eagerly first so that Triton compilation and cuBLAS workspace allocation happen outside the capture.
        """
        pool = None
        for size in reversed(self.sizes):
            self.forward_padding(size)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[size] = self._forward_static(size)
            pool = graph.pool()
            self.graphs[size] = graph
        torch.cuda.synchronize()

    def run(self, size: int) -> torch.Tensor:
        """Hidden states ``[size, hidden]`` of the padded decode batch already in the input buffers. Under graphs
        the result is a view of a static output: use it before the next call."""
        if self.use_graphs:
            self.graphs[size].replay()
            return self.outputs[size]
        return self._forward_static(size)

    @torch.inference_mode()
    def forward_padding(self, size: int) -> torch.Tensor:
        """An eager forward of ``size`` padding rows (no block written): the warm-up before a capture, and what the
        runner's memory profile measures as the graphs' pool."""
        inputs = self.inputs
        inputs.slot_mapping[:size].fill_(-1)
        inputs.window_slot_mapping[:size].fill_(-1)
        inputs.context_lens[:size].fill_(1)
        inputs.query_start_loc[: size + 1].copy_(torch.arange(size + 1, dtype=torch.int32))
        if inputs.recurrent:
            inputs.pad_states(size)
        return self._forward_static(size)

    def _forward_static(self, size: int) -> torch.Tensor:
        inputs = self.inputs
        meta = inputs.with_window(AttentionMetadata(
            slot_mapping=inputs.slot_mapping[:size],
            block_tables=inputs.block_tables[:size],
            context_lens=inputs.context_lens[:size],
            query_start_loc=inputs.query_start_loc[: size + 1],
            max_query_len=1,
            max_context_len=self.max_model_len,
            states=inputs.decode_states(size) if inputs.recurrent else None,
        ))
        return self.model(inputs.input_ids[:size], inputs.positions[:size], self.kv_caches, meta)
