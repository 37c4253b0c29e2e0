"""Owns the model weights and the K/V page tensors; turns a scheduled batch into one flattened forward pass."""
from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.config import EngineConfig, ModelConfig
from engine.models.llama import AttentionMetadata, LlamaForCausalLM
from engine.request import Request
from engine.weights import load_weights
from kernels.ops import get_ops

log = logging.getLogger(__name__)


@dataclass
class ScheduledBatch:
    """What one step computes: ``num_new_tokens[i]`` tokens of ``requests[i]``, from its ``num_computed_tokens``."""

    requests: list[Request]
    num_new_tokens: list[int]

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)

    def sampling_mask(self) -> list[bool]:
        """A request samples when this step's chunk reaches its last token (a chunked prefill mid-way does not)."""
        return [r.num_computed_tokens + n == r.num_tokens for r, n in zip(self.requests, self.num_new_tokens)]


def kv_bytes_per_block(cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    return 2 * cfg.num_layers * block_size * cfg.num_kv_heads * cfg.head_dim * dtype.itemsize


class ModelRunner:
    def __init__(self, model_dir: Path, model_cfg: ModelConfig, cfg: EngineConfig, max_model_len: int) -> None:
        self.cfg = cfg
        self.model_cfg = model_cfg
        self.device = torch.device(cfg.device)
        self.dtype = cfg.torch_dtype
        torch.manual_seed(cfg.seed)
        with torch.device("meta"):
            model = LlamaForCausalLM(model_cfg, get_ops(cfg.attention_backend))
        model = model.to_empty(device=self.device).to(self.dtype)
        model.tie_weights()
        model.init_rope(max_model_len, self.device)
        load_weights(model, model_dir)
        self.model = model.eval()
        self.num_blocks = cfg.num_kv_blocks or self._blocks_from_memory_budget()
        shape = (self.num_blocks, cfg.block_size, model_cfg.num_kv_heads, model_cfg.head_dim)
        self.kv_caches = [
            (torch.zeros(shape, dtype=self.dtype, device=self.device), torch.zeros(shape, dtype=self.dtype, device=self.device))
            for _ in range(model_cfg.num_layers)
        ]

    def _blocks_from_memory_budget(self) -> int:
        per_block = kv_bytes_per_block(self.model_cfg, self.cfg.block_size, self.dtype)
        if self.device.type != "cuda":
            return max(1, int(self.cfg.kv_cache_memory_gb * 2**30) // per_block)
        # CUDA: what is left of the utilization budget after weights and the activation peak of a full-size step.
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        self._profile_run()
        free, total = torch.cuda.mem_get_info(self.device)
        peak = torch.cuda.max_memory_allocated(self.device)
        budget = total * self.cfg.gpu_memory_utilization - peak - (total - free - torch.cuda.memory_reserved(self.device))
        blocks = int(budget) // per_block
        if blocks < 1:
            raise ValueError("no GPU memory left for the KV cache; raise --gpu-memory-utilization or use a smaller model")
        log.info("KV cache: %d blocks of %d tokens (%.1f GiB)", blocks, self.cfg.block_size, blocks * per_block / 2**30)
        return blocks

    @torch.inference_mode()
    def _profile_run(self) -> None:
        """One forward pass of ``max_num_batched_tokens`` prompt tokens over a scratch one-sequence KV cache."""
        n = min(self.cfg.max_num_batched_tokens, self.model_cfg.max_position_embeddings)
        bs = self.cfg.block_size
        blocks = -(-n // bs)
        shape = (blocks, bs, self.model_cfg.num_kv_heads, self.model_cfg.head_dim)
        caches = [(torch.empty(shape, dtype=self.dtype, device=self.device),) * 2 for _ in range(self.model_cfg.num_layers)]
        meta = AttentionMetadata(
            slot_mapping=torch.arange(n, device=self.device),
            block_tables=torch.arange(blocks, dtype=torch.int32, device=self.device)[None],
            context_lens=torch.tensor([n], dtype=torch.int32, device=self.device),
            query_start_loc=torch.tensor([0, n], dtype=torch.int32, device=self.device),
        )
        ids = torch.zeros(n, dtype=torch.long, device=self.device)
        hidden = self.model(ids, torch.arange(n, device=self.device), caches, meta)
        self.model.compute_logits(hidden[-self.cfg.max_num_seqs :])
        torch.cuda.synchronize(self.device)

    def copy_pages(self, pairs: list[tuple[int, int]]) -> None:
        """Copy whole pages (src -> dst) in every layer: a forked sequence's private partial block."""
        if not pairs:
            return
        src = torch.tensor([s for s, _ in pairs], device=self.device)
        dst = torch.tensor([d for _, d in pairs], device=self.device)
        for k_cache, v_cache in self.kv_caches:
            k_cache[dst] = k_cache[src]
            v_cache[dst] = v_cache[src]

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch, block_tables: list[list[int]]) -> torch.Tensor:
        """Run the batch; returns float32 logits ``[num_sampling_requests, vocab]`` in batch order."""
        bs = self.cfg.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_start = [0]
        context_lens: list[int] = []
        sample_rows: list[int] = []
        for req, n, table, samples in zip(batch.requests, batch.num_new_tokens, block_tables, batch.sampling_mask()):
            start = req.num_computed_tokens
            input_ids.extend(req.token_ids[start : start + n])
            span = range(start, start + n)
            positions.extend(span)
            slots.extend(table[p // bs] * bs + p % bs for p in span)
            query_start.append(query_start[-1] + n)
            context_lens.append(start + n)
            if samples:
                sample_rows.append(query_start[-1] - 1)
        width = max(len(t) for t in block_tables)
        padded = [t + [0] * (width - len(t)) for t in block_tables]
        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=dev),
            block_tables=torch.tensor(padded, dtype=torch.int32, device=dev),
            context_lens=torch.tensor(context_lens, dtype=torch.int32, device=dev),
            query_start_loc=torch.tensor(query_start, dtype=torch.int32, device=dev),
        )
        hidden = self.model(
            torch.tensor(input_ids, dtype=torch.long, device=dev),
            torch.tensor(positions, dtype=torch.long, device=dev),
            self.kv_caches,
            meta,
        )
        return self.model.compute_logits(hidden[torch.tensor(sample_rows, dtype=torch.long, device=dev)])

