"""Decode batches at fixed batch sizes: padded to a captured size and replayed as CUDA graphs (eager on CPU).

A decode step launches a few hundred small kernels whose launch overhead dominates at small batch sizes, so on CUDA
the model forward of a pure-decode batch (one new token per sequence) is captured once per *capture size* and
replayed. Graphs have static shapes and addresses, so every input lives in a static buffer sized for the largest
capture size, and a batch of ``n`` sequences runs the graph of the smallest capture size ``>= n``. The extra rows
are padding:

- ``slot_mapping`` -1: the store op writes nothing for them (no KV page is ever touched);
- context length 1 on page 0 (any valid page): attention reads one finite value, never an empty context (0/0);
- their hidden states are sliced off before logits.

Everything that sizes a kernel launch is fixed at capture: ``max_query_len=1``, ``max_context_len=max_model_len``
(every context stays within it; programs past a sequence's context exit at once), and with them the attention
kernel's split-K choice and partition size. The same padded static-shape forward runs without graphs when
``use_graphs`` is False, which is how CPU tests check the padding against the unpadded path.
"""
from __future__ import annotations

import bisect
from typing import TYPE_CHECKING

import torch

from engine.kv_cache_spec import KVCaches
from engine.models.llama import AttentionMetadata, LlamaForCausalLM

if TYPE_CHECKING:  # the runner imports this module
    from engine.model_runner import FlatBatch


def capture_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, then every multiple of 8 below ``max_num_seqs``, then ``max_num_seqs``: at most 7 padding rows
    (beyond the small sizes) for a few dozen graphs."""
    small = [s for s in (1, 2, 4) if s < max_num_seqs]
    return small + list(range(8, max_num_seqs, 8)) + [max_num_seqs]


class DecodeGraphRunner:
    """Owns the static input buffers and one graph (or, eagerly, one static-shape forward) per capture size."""

    def __init__(
        self,
        model: LlamaForCausalLM,
        kv_caches: KVCaches,
        max_num_seqs: int,
        max_model_len: int,
        block_size: int,
        use_graphs: bool,
    ) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.sizes = capture_sizes(max_num_seqs)
        self.max_model_len = max_model_len
        self.use_graphs = use_graphs
        device = kv_caches[0][0].device
        rows = self.sizes[-1]
        self.max_blocks = -(-max_model_len // block_size)
        # Initialized as padding rows: warm-up and capture run on them and write no page.
        self.input_ids = torch.zeros(rows, dtype=torch.long, device=device)
        self.positions = torch.zeros(rows, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((rows,), -1, dtype=torch.long, device=device)
        self.context_lens = torch.ones(rows, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(rows, self.max_blocks, dtype=torch.int32, device=device)
        # One query row per sequence: the start offsets never change.
        self.query_start_loc = torch.arange(rows + 1, dtype=torch.int32, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}  # each graph's hidden states, overwritten by its replays

    def fits(self, batch: FlatBatch) -> bool:
        """Whether ``batch`` can run here: decode-only, within the largest size, tables within the static width."""
        return (
            batch.max_query_len == 1
            and batch.num_seqs <= self.sizes[-1]
            and len(batch.block_tables[0]) <= self.max_blocks
        )

    def padded_size(self, num_seqs: int) -> int:
        return self.sizes[bisect.bisect_left(self.sizes, num_seqs)]

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

    def forward(self, batch: FlatBatch) -> torch.Tensor:
        """Hidden states ``[num_seqs, hidden]`` of a decode batch (see `fits`). Under graphs the result is a view
        of a static output: use it before the next call."""
        n = batch.num_seqs
        size = self.padded_size(n)
        pad = size - n
        width = len(batch.block_tables[0])
        self.input_ids[:size].copy_(torch.tensor(batch.input_ids + [0] * pad))
        self.positions[:size].copy_(torch.tensor(batch.positions + [0] * pad))
        self.slot_mapping[:size].copy_(torch.tensor(batch.slots + [-1] * pad))
        self.context_lens[:size].copy_(torch.tensor(batch.context_lens + [1] * pad, dtype=torch.int32))
        # Columns past ``width`` keep older page ids: valid pages, and never read (past every context).
        tables = batch.block_tables + [[0] * width] * pad
        self.block_tables[:size, :width].copy_(torch.tensor(tables, dtype=torch.int32))
        if self.use_graphs:
            self.graphs[size].replay()
            return self.outputs[size][:n]
        return self._forward_static(size)[:n]

    @torch.inference_mode()
    def forward_padding(self, size: int) -> torch.Tensor:
        """An eager forward of ``size`` padding rows (no page written): the warm-up before a capture, and what the
        runner's memory profile measures as the graphs' pool."""
        self.slot_mapping[:size].fill_(-1)
        self.context_lens[:size].fill_(1)
        self.block_tables[:size, 0].fill_(0)
        return self._forward_static(size)

    def _forward_static(self, size: int) -> torch.Tensor:
        meta = AttentionMetadata(
            slot_mapping=self.slot_mapping[:size],
            block_tables=self.block_tables[:size],
            context_lens=self.context_lens[:size],
            query_start_loc=self.query_start_loc[: size + 1],
            max_query_len=1,
            max_context_len=self.max_model_len,
        )
        return self.model(self.input_ids[:size], self.positions[:size], self.kv_caches, meta)
