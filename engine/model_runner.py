"""Owns the model weights and the K/V page tensors; turns a scheduled batch into one flattened forward pass."""
from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

import torch

from engine.config import EngineConfig, ModelConfig
from engine.cuda_graphs import DecodeGraphRunner, KVCaches
from engine.models.architectures import build_model, random_weights_
from engine.models.llama import AttentionMetadata
from engine.request import Request
from engine.sampler import sample
from engine.sampling_params import SamplingParams
from engine.weights import load_weights
from kernels.ops import get_ops

log = logging.getLogger(__name__)


@dataclass
class ScheduledBatch:
    """What one step computes: ``num_new_tokens[i]`` tokens of ``requests[i]``, from its ``num_computed_tokens``."""

    requests: list[Request]
    num_new_tokens: list[int]

    def sampling_mask(self) -> list[bool]:
        """A request samples when this step's chunk reaches its last token (a chunked prefill mid-way does not)."""
        return [r.num_computed_tokens + n == r.num_tokens for r, n in zip(self.requests, self.num_new_tokens)]


class SeqChunk(NamedTuple):
    """The part of one sequence a step computes: tokens ``[start, start + num_new)`` of ``token_ids``."""

    token_ids: Sequence[int]
    start: int
    num_new: int
    block_table: list[int]
    samples: bool


@dataclass
class FlatBatch:
    """One step's flattened inputs as host lists: the model's input tensors and `AttentionMetadata` come from here,
    and the bounds the attention kernel needs are read off the lists instead of synced back from the device."""

    input_ids: list[int]
    positions: list[int]
    slots: list[int]
    query_start: list[int]
    context_lens: list[int]
    block_tables: list[list[int]]  # padded to one width with page 0 (never read: past every context)
    sample_rows: list[int]

    @classmethod
    def build(cls, chunks: Sequence[SeqChunk], block_size: int) -> FlatBatch:
        flat = cls([], [], [], [0], [], [], [])
        for chunk in chunks:
            span = range(chunk.start, chunk.start + chunk.num_new)
            flat.input_ids.extend(chunk.token_ids[chunk.start : chunk.start + chunk.num_new])
            flat.positions.extend(span)
            flat.slots.extend(chunk.block_table[p // block_size] * block_size + p % block_size for p in span)
            flat.query_start.append(flat.query_start[-1] + chunk.num_new)
            flat.context_lens.append(span.stop)
            if chunk.samples:
                flat.sample_rows.append(flat.query_start[-1] - 1)
        width = max(len(c.block_table) for c in chunks)
        flat.block_tables = [c.block_table + [0] * (width - len(c.block_table)) for c in chunks]
        return flat

    @property
    def num_seqs(self) -> int:
        return len(self.context_lens)

    @property
    def max_query_len(self) -> int:
        return max(b - a for a, b in zip(self.query_start, self.query_start[1:]))

    def metadata(self, device: torch.device) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=torch.tensor(self.slots, dtype=torch.long, device=device),
            block_tables=torch.tensor(self.block_tables, dtype=torch.int32, device=device),
            context_lens=torch.tensor(self.context_lens, dtype=torch.int32, device=device),
            query_start_loc=torch.tensor(self.query_start, dtype=torch.int32, device=device),
            max_query_len=self.max_query_len,
            max_context_len=max(self.context_lens),
        )


@dataclass
class _ProfileRow:
    """A sampler row with every transform on (penalties, top-p over the full vocabulary, min-p, logprobs): the
    memory profile samples with the most expensive path."""

    params: SamplingParams = field(default_factory=lambda: SamplingParams(
        temperature=1.0, top_p=0.9, min_p=0.05, repetition_penalty=1.1, presence_penalty=0.5,
        frequency_penalty=0.5, logprobs=20,
    ))
    prompt_token_ids: list[int] = field(default_factory=lambda: [0])
    output_token_ids: list[int] = field(default_factory=lambda: [0])
    generator: torch.Generator | None = None


class ModelRunner:
    def __init__(self, model_dir: Path, model_cfg: ModelConfig, cfg: EngineConfig, max_model_len: int) -> None:
        self.cfg = cfg
        self.model_cfg = model_cfg
        self.max_model_len = max_model_len
        self.device = torch.device(cfg.device)
        self.dtype = cfg.torch_dtype
        torch.manual_seed(cfg.seed)
        model = build_model(model_cfg, get_ops(cfg.attention_backend), self.device, self.dtype, max_model_len)
        if cfg.load_format == "dummy":
            random_weights_(model, cfg.seed)
        else:
            load_weights(model, model_dir)
        self.model = model.eval()
        self.kv_spec = model.kv_cache_spec()
        # Graphs need kernels without host syncs: the Triton ops (the torch reference reads lengths on the host).
        use_graphs = self.device.type == "cuda" and cfg.attention_backend == "triton" and not cfg.enforce_eager
        self.num_blocks = cfg.num_kv_blocks or self._blocks_from_memory_budget(use_graphs)
        self.kv_caches = self._new_caches(self.num_blocks)
        self.decode_graphs: DecodeGraphRunner | None = None
        if use_graphs:
            self.decode_graphs = self._capture_decode_graphs()

    def _new_caches(self, num_blocks: int) -> KVCaches:
        return self.kv_spec.allocate(num_blocks, self.cfg.block_size, self.dtype, self.device)

    def make_decode_graphs(self, kv_caches: KVCaches, use_graphs: bool) -> DecodeGraphRunner:
        """The padded decode path over ``kv_caches``; ``use_graphs=False`` runs it eagerly (CPU tests, profiling)."""
        return DecodeGraphRunner(
            self.model, kv_caches, self.cfg.max_num_seqs, self.max_model_len, self.cfg.block_size, use_graphs
        )

    def _capture_decode_graphs(self) -> DecodeGraphRunner:
        start = time.perf_counter()
        torch.cuda.empty_cache()  # capture empties the cache too; release it first so the free-memory delta is real
        free_before = torch.cuda.mem_get_info(self.device)[0]
        graphs = self.make_decode_graphs(self.kv_caches, use_graphs=True)
        graphs.capture()
        used = free_before - torch.cuda.mem_get_info(self.device)[0]
        log.info("captured %d decode CUDA graphs (batch sizes up to %d) in %.1fs, using %.2f GiB",
                 len(graphs.sizes), graphs.sizes[-1], time.perf_counter() - start, used / 2**30)
        return graphs

    def _blocks_from_memory_budget(self, use_graphs: bool) -> int:
        """KV pages that fit the budget. On CUDA: ``total * gpu_memory_utilization`` minus the peak of tensors
        (weights plus a profiled full-size step), minus memory outside torch's allocator (CUDA context, other
        processes), minus the decode graphs' pool.

        The graphs bake in the KV tensors' addresses, so they can only be captured after the cache is allocated;
        their pool is therefore reserved up front as the measured peak of the largest padded decode forward (the
        pool holds exactly that forward's intermediates, which smaller graphs reuse, plus the small outputs). What
        the graph executables themselves take is left to the utilization headroom; the capture logs its real cost.
        """
        per_block = self.kv_spec.bytes_per_block(self.cfg.block_size, self.dtype)
        if self.device.type != "cuda":
            return max(1, int(self.cfg.kv_cache_memory_gb * 2**30) // per_block)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        self._profile_run()
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device)
        graph_pool = self._profile_decode_graphs() if use_graphs else 0
        free, total = torch.cuda.mem_get_info(self.device)
        outside_torch = total - free - torch.cuda.memory_reserved(self.device)
        budget = total * self.cfg.gpu_memory_utilization - peak - graph_pool - outside_torch
        blocks = int(budget) // per_block
        if blocks < 1:
            raise ValueError("no GPU memory left for the KV cache; raise --gpu-memory-utilization or use a smaller model")
        log.info("KV cache: %d blocks of %d tokens (%.1f GiB); reserved %.2f GiB for decode graphs",
                 blocks, self.cfg.block_size, blocks * per_block / 2**30, graph_pool / 2**30)
        return blocks

    @torch.inference_mode()
    def _profile_run(self) -> None:
        """The largest step the scheduler can build: ``max_num_batched_tokens`` prompt tokens (in sequences of at most
        ``max_model_len``, the positions RoPE covers), then logits and sampling for ``max_num_seqs`` rows on the
        sampler's most expensive path.

        Every block table points at page 0 of a one-page scratch cache: what the pages hold does not change the
        activations, and a real-size scratch cache would count KV memory as activation peak.
        """
        n, longest, bs = self.cfg.max_num_batched_tokens, self.max_model_len, self.cfg.block_size
        chunks = [
            SeqChunk([0] * length, 0, length, [0] * -(-length // bs), True)
            for length in (min(longest, n - first) for first in range(0, n, longest))
        ]
        hidden = self._forward_eager(FlatBatch.build(chunks, bs), self._new_caches(1))
        rows = min(self.cfg.max_num_seqs, n)
        sample(self.model.compute_logits(hidden[-rows:]), [_ProfileRow()] * rows)

    def _profile_decode_graphs(self) -> int:
        """Bytes the decode graphs' pool will hold: the allocation peak of the largest padded decode forward (with
        its static buffers), measured eagerly over a one-page scratch cache (padding rows read page 0 only)."""
        caches = self._new_caches(1)
        torch.cuda.reset_peak_memory_stats(self.device)
        baseline = torch.cuda.memory_allocated(self.device)
        graphs = self.make_decode_graphs(caches, use_graphs=False)
        graphs.forward_padding(graphs.sizes[-1])
        torch.cuda.synchronize(self.device)
        return torch.cuda.max_memory_allocated(self.device) - baseline

    def copy_pages(self, pairs: list[tuple[int, int]]) -> None:
        """Copy whole pages (src -> dst) in every layer: a forked sequence's private partial block."""
        if not pairs:
            return
        src = torch.tensor([s for s, _ in pairs], device=self.device)
        dst = torch.tensor([d for _, d in pairs], device=self.device)
        for layer in self.kv_caches:
            for pages in layer:
                pages[dst] = pages[src]

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch, block_tables: list[list[int]]) -> torch.Tensor:
        """Run the batch; returns float32 logits ``[num_sampling_requests, vocab]`` in batch order."""
        chunks = [
            SeqChunk(req.token_ids, req.num_computed_tokens, n, table, samples)
            for req, n, table, samples in zip(batch.requests, batch.num_new_tokens, block_tables, batch.sampling_mask())
        ]
        flat = FlatBatch.build(chunks, self.cfg.block_size)
        graphs = self.decode_graphs
        if graphs is not None and graphs.fits(flat):
            hidden = graphs.forward(flat)
        else:
            hidden = self._forward_eager(flat, self.kv_caches)
        return self.model.compute_logits(hidden[torch.tensor(flat.sample_rows, dtype=torch.long, device=self.device)])

    def _forward_eager(self, flat: FlatBatch, kv_caches: KVCaches) -> torch.Tensor:
        dev = self.device
        input_ids = torch.tensor(flat.input_ids, dtype=torch.long, device=dev)
        positions = torch.tensor(flat.positions, dtype=torch.long, device=dev)
        return self.model(input_ids, positions, kv_caches, flat.metadata(dev))
