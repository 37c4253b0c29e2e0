"""What one token occupies in the KV blocks of every layer, by attention kind; the runner allocates and budgets by it.

Block ids, block hashing and the prefix cache never look inside a block, so they work unchanged for every kind.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

KVCaches = list[tuple[torch.Tensor, ...]]  # per layer, its block tensors (GQA: K and V; MLA: one latent tensor;
# DeepSeek-V3.2: the latent and the index keys) or, for a recurrent layer of a hybrid model, its state tensors indexed
# by state row


@dataclass(frozen=True)
class RecurrentStateSpec:
    """What one sequence's state takes in each recurrent layer (Gated DeltaNet): one tensor per entry of
    ``shapes``, shaped ``[num_rows, *shape]``; those marked ``fp32`` stay fp32 whatever the model dtype (the delta
    rule's state), the others take the model dtype (the conv window)."""

    num_layers: int
    shapes: tuple[tuple[int, ...], ...]
    fp32: tuple[bool, ...]

    def dtypes(self, dtype: torch.dtype) -> list[torch.dtype]:
        return [torch.float32 if f else dtype for f in self.fp32]

    def bytes_per_state(self, dtype: torch.dtype) -> int:
        """One slot over every recurrent layer: what a running sequence's state, or one snapshot, costs."""
        return self.num_layers * sum(math.prod(s) * d.itemsize for s, d in zip(self.shapes, self.dtypes(dtype)))


@dataclass(frozen=True)
class BlockTensor:
    """One block tensor of a layer whose layers differ (DeepSeek-V4): ``[num_blocks, block_size / tokens_per_row,
    *shape]``, a row per token or per ``tokens_per_row`` tokens (a compressed entry pools that many), or
    ``[num_blocks, *shape]`` with ``per_block`` (state kept once per block); fp32 whatever the KV dtype with
    ``fp32``. In a layer with a sliding window a tensor lives in the window group's pages, unless ``whole_context``:
    read over the whole context (V4's compressed entries and their pooling state), it stays in the full-attention
    blocks."""

    shape: tuple[int, ...]
    per_block: bool = False
    fp32: bool = False
    tokens_per_row: int = 1
    whole_context: bool = False

    def rows(self, block_size: int) -> tuple[int, ...]:
        return () if self.per_block else (block_size // self.tokens_per_row,)

    def bytes_per_block(self, block_size: int, dtype: torch.dtype) -> int:
        return math.prod(self.rows(block_size)) * math.prod(self.shape) * (4 if self.fp32 else dtype.itemsize)

    def allocate(self, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.zeros(num_blocks, *self.rows(block_size), *self.shape, dtype=torch.float32 if self.fp32 else dtype,
                           device=device)


@dataclass(frozen=True)
class KVCacheSpec:
    """Each layer with blocks owns one block tensor per entry of ``token_shapes``, shaped
    ``[num_blocks, block_size, *shape]``. A hybrid model's recurrent layers (``layer_is_recurrent``) own state
    tensors instead (``recurrent``), one row per state row; ``num_layers`` counts the layers with blocks."""

    kind: str  # "gqa", "mla", "sparse_mla" or "compressed", for logs
    num_layers: int
    token_shapes: tuple[tuple[int, ...], ...]
    layers: tuple[tuple[BlockTensor, ...], ...] = ()  # per layer, when layers differ (then token_shapes is unused)
    block_multiple: int = 1  # the block size must be a multiple of this (V4: its largest compression rate)
    recurrent: RecurrentStateSpec | None = None
    layer_is_recurrent: tuple[bool, ...] = ()  # per model layer (empty: every layer has blocks)
    # per layer with blocks, its sliding window (None: full attention; empty: no layer has one). With a window
    # group those layers keep their blocks in a pool of their own (`engine.kv.window_pool`)
    layer_windows: tuple[int | None, ...] = ()

    @classmethod
    def gqa(cls, num_layers: int, num_kv_heads: int, head_dim: int,
            windows: tuple[int | None, ...] = ()) -> KVCacheSpec:
        """Separate K and V of ``num_kv_heads x head_dim`` per token; ``windows``: each layer's sliding window."""
        windows = windows if any(w is not None for w in windows) else ()
        return cls("gqa", num_layers, ((num_kv_heads, head_dim), (num_kv_heads, head_dim)), layer_windows=windows)

    @classmethod
    def gqa_per_layer(cls, shapes: list[tuple[int, int]], windows: tuple[int | None, ...]) -> KVCacheSpec:
        """GQA whose layers differ in ``(KV heads, head_dim)`` (Gemma 4's global layers), each with its window."""
        if len(set(shapes)) == 1:
            return cls.gqa(len(shapes), *shapes[0], windows)
        layers = tuple((BlockTensor(shape), BlockTensor(shape)) for shape in shapes)
        windows = windows if any(w is not None for w in windows) else ()
        return cls("gqa", len(shapes), (), layers, layer_windows=windows)

    @property
    def window(self) -> int:
        """The widest sliding window of the layers (0: none has one): what the window group keeps per sequence."""
        return max((w for w in self.layer_windows if w is not None), default=0)

    @property
    def num_window_layers(self) -> int:
        return sum(w is not None for w in self.layer_windows)

    def layer_tensors(self) -> list[tuple[BlockTensor, ...]]:
        """Per layer with blocks, its block tensors."""
        if self.layers:
            return list(self.layers)
        return [tuple(BlockTensor(shape) for shape in self.token_shapes)] * self.num_layers

    def in_window_group(self) -> list[tuple[bool, ...]]:
        """Per layer with blocks, which of its tensors the window group keeps: a window layer's, but those read over
        the whole context (`BlockTensor.whole_context`)."""
        windows = self.layer_windows or (None,) * self.num_layers
        return [tuple(window is not None and not t.whole_context for t in layer)
                for layer, window in zip(self.layer_tensors(), windows)]

    def window_bytes_per_block(self, block_size: int, dtype: torch.dtype) -> int:
        """What one page of the window group takes (every window-group tensor's share of a block)."""
        return sum(t.bytes_per_block(block_size, dtype) for layer, grouped in zip(self.layer_tensors(),
                                                                                  self.in_window_group())
                   for t, in_window in zip(layer, grouped) if in_window)

    @classmethod
    def mla(cls, num_layers: int, kv_lora_rank: int, rope_dim: int) -> KVCacheSpec:
        """One row per token: the compressed latent then the rotary key shared by every head (576 values for
        DeepSeek-V3, about 1/7 of a same-size GQA cache)."""
        return cls("mla", num_layers, ((1, kv_lora_rank + rope_dim),))

    @classmethod
    def sparse_mla(cls, num_layers: int, kv_lora_rank: int, rope_dim: int, index_head_dim: int) -> KVCacheSpec:
        """MLA's latent row plus DeepSeek-V3.2's index key (``index_head_dim`` values) per token, in a block tensor of
        its own under the same block ids: whatever holds, shares, offloads or evicts a block's latents does the
        same to its index keys (the "index-key cache group" of DeepSeek's design, allocated per token like the
        latent it sits beside)."""
        return cls("sparse_mla", num_layers, ((1, kv_lora_rank + rope_dim), (1, index_head_dim)))

    @classmethod
    def per_layer(cls, kind: str, layers: list[tuple[BlockTensor, ...]], block_multiple: int,
                  windows: tuple[int | None, ...] = ()) -> KVCacheSpec:
        return cls(kind, len(layers), (), tuple(layers), block_multiple, layer_windows=windows)

    def bytes_per_token(self, dtype: torch.dtype, block_size: int = 1) -> int:
        """Per token; per-block tensors count a ``block_size``-th of theirs."""
        if self.layers:
            return self.bytes_per_block(block_size, dtype) // block_size
        return self.num_layers * sum(math.prod(shape) for shape in self.token_shapes) * dtype.itemsize

    def bytes_per_block(self, block_size: int, dtype: torch.dtype) -> int:
        if self.layers:
            return sum(t.bytes_per_block(block_size, dtype) for layer in self.layers for t in layer)
        return block_size * self.bytes_per_token(dtype)

    def allocate(self, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device,
                 num_state_rows: int = 0, state_dtype: torch.dtype | None = None,
                 num_window_blocks: int = 0) -> KVCaches:
        """Per model layer: its blocks (``dtype``), or a hybrid model's recurrent states (``num_state_rows`` rows;
        ``state_dtype``, the model dtype, for the non-fp32 ones). ``num_window_blocks`` > 0: the window group's pages,
        as many for each window-group tensor (`in_window_group`; 0: those keep ``num_blocks`` like the others)."""
        if block_size % self.block_multiple:
            raise ValueError(f"this model's KV cache needs a block size that is a multiple of {self.block_multiple} "
                             f"(its compressed entries and pooling state are kept per block); got {block_size}: "
                             f"pass --block-size {self.block_multiple}")
        blocks = [tuple(t.allocate(num_window_blocks if in_window and num_window_blocks else num_blocks, block_size,
                                   dtype, device) for t, in_window in zip(layer, grouped))
                  for layer, grouped in zip(self.layer_tensors(), self.in_window_group())]
        if self.recurrent is None:
            return blocks
        dtypes = self.recurrent.dtypes(state_dtype or dtype)
        states = [tuple(torch.zeros(num_state_rows, *shape, dtype=d, device=device)
                        for shape, d in zip(self.recurrent.shapes, dtypes)) for _ in range(self.recurrent.num_layers)]
        blocks_left, states_left = iter(blocks), iter(states)
        return [next(states_left) if recurrent else next(blocks_left) for recurrent in self.layer_is_recurrent]

    def block_layers(self, kv_caches: KVCaches, window_group: bool = False) -> KVCaches:
        """The layers with block tensors (what the KV tiers copy by block; with a ``window_group``, their
        full-attention tensors alone: the window pages are numbered apart, and tiers carry them as retained windows)."""
        if window_group:
            return self._group_tensors(kv_caches, window=False)
        if not self.layer_is_recurrent:
            return kv_caches
        return [layer for layer, recurrent in zip(kv_caches, self.layer_is_recurrent) if not recurrent]

    def window_layers(self, kv_caches: KVCaches) -> KVCaches:
        """Of the layers with window-group tensors, those tensors (what a window page indexes)."""
        return self._group_tensors(kv_caches, window=True)

    def _group_tensors(self, kv_caches: KVCaches, window: bool) -> KVCaches:
        layers = [tuple(t for t, in_window in zip(layer, grouped) if in_window == window)
                  for layer, grouped in zip(kv_caches, self.in_window_group())]
        return [layer for layer in layers if layer]

    def state_layers(self, kv_caches: KVCaches) -> KVCaches:
        """The recurrent layers' state tensors (what a snapshot copies by slot)."""
        return [layer for layer, recurrent in zip(kv_caches, self.layer_is_recurrent) if recurrent]
