"""Pure-torch reference ops. Each Triton kernel in `kernels.triton.ops` has the same signature.

Shapes (T = tokens in the flattened batch, B = sequences):
- K/V pages: ``[num_blocks, block_size, num_kv_heads, head_dim]``; a slot is ``page * block_size + offset``. Pages are
  in the model's dtype or in float8_e4m3fn (``--kv-cache-dtype fp8``: stored saturated, read back with scale 1.0).
  MLA pages are ``[num_blocks, block_size, 1, kv_lora_rank + qk_rope_head_dim]`` (see `mla_decode`).
- ``query_start_loc`` ``[B + 1]`` int32: sequence b owns query rows ``query_start_loc[b]:query_start_loc[b+1]``.
- ``context_lens`` ``[B]`` int32: tokens of sequence b in pages after this step's store (cached prefix + new tokens).
  The new tokens are the last ``q_len`` positions of that context, so query i of b sits at position
  ``context_lens[b] - q_len + i`` and attends causally to positions ``<=`` it.
- ``window`` (sliding-window layers: Gemma 3's local layers, gpt-oss' even ones): a query at position p attends only
  to positions in ``(p - window, p]``, its own included (transformers' ``sliding_window``); None attends to all.
  Keys outside the window are never read: their slots may hold anything, NaN included.
- ``sinks`` (gpt-oss: learned attention sinks, a per-layer property): ``[Hq]`` logits, one per query head, that join
  each row's softmax as one more key whose value is zero: they take probability mass and add nothing, so
  ``out = sum_j e^{s_j} v_j / (sum_j e^{s_j} + e^{sink})`` (transformers' ``GptOssAttention``). None: no sink.
- ``block_tables`` ``[B, max_blocks]`` int32, rows padded with any valid page id (never read past the context).
"""
from __future__ import annotations

import functools
import math
import threading
from dataclasses import dataclass, field
from typing import Callable, Generic, TypeVar

import numpy as np
import torch
import torch.nn.functional as F

E4M3_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max: FP8 values (weights, activations, KV pages) saturate here
_MIN_AMAX = 1e-12  # an all-zero FP8 block gets a tiny scale instead of 0 (no 0/0); its values stay 0


T = TypeVar("T")


class _LastStepMemo(threading.local, Generic[T]):
    """The value last built from one step's metadata tensors (per thread: engines on two threads never share it).

    Every layer of a step passes the very same tensors, unchanged: the same objects with the same version counters.
    Whatever the reference derives from them (host copies of the lengths, gather indices, masks) is therefore built
    on the first layer and reused by the others, instead of once per layer. Other tensors, an in-place change to
    them, or inference tensors (which keep no version counter) build anew.
    """

    def __init__(self) -> None:
        self._tensors: tuple[torch.Tensor, ...] = ()
        self._versions: tuple[int, ...] = ()
        self._extra: object = None
        self._value: T | None = None

    def get(self, tensors: tuple[torch.Tensor, ...], extra: object, build: Callable[[], T]) -> T:
        if any(t.is_inference() for t in tensors):
            return build()
        versions = tuple(t._version for t in tensors)
        same = (len(tensors) == len(self._tensors) and all(a is b for a, b in zip(tensors, self._tensors))
                and versions == self._versions and extra == self._extra)
        if not same:
            self._value = build()
            self._tensors, self._versions, self._extra = tensors, versions, extra
        return self._value


_ALL_SLOTS_REAL: _LastStepMemo[bool] = _LastStepMemo()  # store_kv: no padding slot (< 0) this step


def store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write ``key`` ``[T, Hkv, Dk]`` / ``value`` ``[T, Hkv, Dv]`` into the pages at ``slot_mapping`` ``[T]``; slots
    < 0 are padding. ``Dk`` may differ from ``Dv``: MLA stores its latent and rotary key in two views of one page."""
    if not _ALL_SLOTS_REAL.get((slot_mapping,), None, lambda: bool((slot_mapping >= 0).all())):
        valid = slot_mapping >= 0
        key, value, slot_mapping = key[valid], value[valid], slot_mapping[valid]
    for new, cache in ((key, k_cache), (value, v_cache)):
        if cache.dtype == torch.float8_e4m3fn:
            # FP8 pages (scale 1.0): saturate rather than rely on the cast's overflow rule, and copy the bytes
            # (index_copy_ has no fp8 kernel on CPU).
            new = new.float().clamp(-E4M3_MAX, E4M3_MAX).to(cache.dtype).view(torch.uint8)
            cache = cache.view(torch.uint8)
        cache.view(-1, *cache.shape[2:]).index_copy_(0, slot_mapping, new.to(cache.dtype))


def gather_context(cache: torch.Tensor, block_table: torch.Tensor, length: int, start: int = 0) -> torch.Tensor:
    """Tokens ``[start, length)`` of one sequence's pages as ``[length - start, Hkv, D]`` (only the pages holding
    them are read)."""
    block_size = cache.shape[1]
    first, num_blocks = start // block_size, (length + block_size - 1) // block_size
    pages = cache.index_select(0, block_table[first:num_blocks].long())
    return pages.reshape(-1, *cache.shape[2:])[start - first * block_size : length - first * block_size]


DecodeRows = Callable[[torch.Tensor, "_AttentionPlan"], torch.Tensor]  # (decode query rows [n, Hq, D], plan) -> out


def paged_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    *,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
    max_query_len: int | None = None,
    max_context_len: int | None = None,
    split_k: bool | None = None,
    partition_size: int | None = None,
) -> torch.Tensor:
    """Causal attention of each sequence's new query rows ``[T, Hq, D]`` over its paged context (GQA aware), or over
    the last ``window`` positions of it (sliding-window layers), with per-head ``sinks`` where given.

    Decode rows (one query per sequence) are attended in one batched call over a padded gather of their contexts
    (of the pages their windows overlap); prefill chunks one sequence at a time. The other keyword-only arguments
    are the Triton kernel's launch hints, accepted so that both backends share one call site; the reference has no
    launch to size and reads exact lengths anyway.
    """
    return attend(query, k_cache, v_cache, block_tables, context_lens, query_start_loc, scale,
                  lambda q, plan: _batched_decode(q, k_cache, v_cache, plan.padded_contexts(window), scale, sinks),
                  window=window, sinks=sinks)


def attend(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    decode_rows: DecodeRows,
    max_decode_rows: int = 1,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """`paged_attention` with the decode rows attended by ``decode_rows`` (the reference's padded gather, or a native
    kernel that reads the pages in place; either applies ``window`` and ``sinks`` to them itself); prefill chunks go through SDPA
    one sequence at a time, each reading only the pages its rows' windows overlap. A sequence with up to
    ``max_decode_rows`` query rows after its cached context (speculative drafts being verified) is decode rows too,
    each row with its own causal length (`_AttentionPlan.decode_row_lens`), for kernels that take them."""
    plan = _ATTENTION_PLANS.get((block_tables, context_lens, query_start_loc), (k_cache.shape[1], max_decode_rows),
                                lambda: _AttentionPlan(block_tables, context_lens, query_start_loc, k_cache.shape[1],
                                                       max_decode_rows))
    if plan.decode_seqs and plan.query_rows is None:  # a decode-only step: every query row, in order
        return decode_rows(query, plan)
    out = torch.empty_like(query)
    if plan.decode_seqs:
        out[plan.query_rows] = decode_rows(query[plan.query_rows], plan)
    for b in plan.one_by_one:
        ctx_len, q_start, q_len = plan.lens[b], plan.starts[b], plan.starts[b + 1] - plan.starts[b]
        windowed = window is not None and ctx_len > window  # some row cannot see position 0
        # the first position any row of the chunk sees: 0, or the first row's window start
        lo = max(0, ctx_len - q_len - window + 1) if windowed else 0
        # [1, H, L, D]: SDPA's fused CPU kernels take 4-D inputs only (3-D ones fall back to the math path, which
        # materializes every score: ~8x slower for a chunk over a long cached context)
        k = gather_context(k_cache, block_tables[b], ctx_len, lo).transpose(0, 1)[None].to(query.dtype)
        v = gather_context(v_cache, block_tables[b], ctx_len, lo).transpose(0, 1)[None].to(query.dtype)
        q = query[q_start : q_start + q_len].transpose(0, 1)[None]
        o = _prefill_chunk(q, k, v, scale, window if windowed else None, sinks)
        out[q_start : q_start + q_len] = o[0].transpose(0, 1)
    return out


def _prefill_chunk(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, window: int | None,
                   sinks: torch.Tensor | None) -> torch.Tensor:
    """One sequence's chunk: query rows ``q`` ``[1, Hq, n, D]`` at the last ``n`` positions of keys ``k`` / ``v``
    ``[1, Hkv, L, D]``, causal (within ``window`` where given) -> ``[1, Hq, n, D]``."""
    n, length = q.shape[2], k.shape[2]
    if window is None and (n < length or sinks is not None) and _splits_by_lse(q, k, v):
        return _prefix_then_diagonal(q, k, v, scale, sinks)
    mask = None
    if n < length or window is not None:  # a chunk after a cached prefix, or a window: causal, offset by the prefix
        q_pos = torch.arange(length - n, length, device=q.device)[:, None]
        k_pos = torch.arange(length, device=q.device)[None, :]
        mask = q_pos >= k_pos
        if window is not None:
            mask &= k_pos > q_pos - window
    if sinks is not None:
        if mask is None:
            mask = torch.ones(n, length, dtype=torch.bool, device=q.device).tril()
        k, v, mask = _with_sink_key(k, v, _additive(mask, q.dtype).expand(1, q.shape[1], -1, -1), sinks[:, None])
    # mask None: a whole prompt, plain causal (SDPA's fast path)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, scale=scale,
                                          enable_gqa=True)


_FLASH_CPU = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu  # (out, logsumexp): SDPA's CPU flash kernel


def _splits_by_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    return (q.device.type == "cpu" and q.dtype in (torch.float32, torch.bfloat16)
            and q.shape[-1] == k.shape[-1] == v.shape[-1])


def _prefix_then_diagonal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                          sinks: torch.Tensor | None) -> torch.Tensor:
    """`_prefill_chunk` without a mask: every row sees the whole cached prefix (unmasked) and the chunk's own
    square causally, two flash calls merged by their log-sum-exps; a sink joins as one more log-sum-exp whose value
    is zero. A boolean mask over the prefix would make the kernel read an ``n x L`` mask and skip no tile (2.5x the
    unmasked time at 2,048 rows over 32k keys)."""
    prefix = k.shape[2] - q.shape[2]
    parts = [_FLASH_CPU(q, k[:, :, prefix:], v[:, :, prefix:], is_causal=True, scale=scale)]
    if prefix:
        parts.append(_FLASH_CPU(q, k[:, :, :prefix], v[:, :, :prefix], scale=scale))
    lses = [lse for _, lse in parts]  # [1, Hq, n], fp32
    if sinks is not None:
        lses.append(sinks.float()[None, :, None].expand_as(lses[0]))
    total = torch.logsumexp(torch.stack(lses), dim=0)
    out = sum(o.float() * (lse - total).exp()[..., None] for o, lse in parts)
    return out.to(q.dtype)


@dataclass
class _PaddedContexts:
    """Sequences' contexts padded to the longest (``length``), as whole pages: ``pages`` ``[B * width]`` page ids
    (a row copy per page, not per token), the ``padding`` positions past each sequence's length (indices into the
    gathered ``[B * width * block_size]`` token rows; None when all have the same length), and the matching additive
    ``[B, 1, 1, length]`` attention mask. Both are derived on the host from the lengths the plan already holds.

    The gathered copy's padding is zeroed: a stale or never-written slot (the rest of a last page, table padding)
    cannot reach the output, not even as a NaN times a zero attention weight. Pages are gathered into scratch memory
    kept per thread (`_scratch`), not into a fresh tensor per layer.
    """

    pages: torch.Tensor
    padding: torch.Tensor | None
    mask: torch.Tensor | None
    length: int
    num_seqs: int
    _cast_masks: dict[torch.dtype, torch.Tensor] = field(default_factory=dict, repr=False)

    def mask_as(self, dtype: torch.dtype) -> torch.Tensor | None:
        """``mask`` in the query's ``dtype`` (0 and -inf are exact in each), cast once per dtype. CUDA's
        memory-efficient SDPA, the one that takes a mask, refuses one in another dtype ("invalid dtype for bias -
        should match query's dtype"); CPU's flash kernel takes float32 for any query."""
        if self.mask is None or self.mask.dtype == dtype:
            return self.mask
        if dtype not in self._cast_masks:
            self._cast_masks[dtype] = self.mask.to(dtype)
        return self._cast_masks[dtype]

    @classmethod
    def build(cls, block_tables: torch.Tensor, lens: list[int], rows: list[int], block_size: int,
              window: int | None = None) -> _PaddedContexts:
        """With ``window``, each sequence's gather starts at the page holding its window's first position
        (``len - window``), and the positions before that one count as padding too."""
        dev = block_tables.device
        ctx = np.array([lens[b] for b in rows])
        lo = np.zeros_like(ctx) if window is None else np.maximum(ctx - window, 0)  # each one's first visible position
        first = lo // block_size  # each one's first page
        length = int((ctx - first * block_size).max())
        width = -(-length // block_size)
        row_ids = torch.tensor(rows, device=dev)
        if window is None:
            pages = block_tables[row_ids, :width].flatten().long()
        else:  # columns past a table's end are padding (clamped to a real column, then zeroed and masked)
            cols = torch.from_numpy(first[:, None] + np.arange(width)[None, :]).clamp(max=block_tables.shape[1] - 1)
            pages = block_tables[row_ids[:, None], cols.to(dev)].flatten().long()
        position = first[:, None] * block_size + np.arange(length)[None, :]  # [B, L]: each gathered row's position
        past = (position >= ctx[:, None]) | (position < lo[:, None])
        if not past.any():
            return cls(pages, None, None, length, len(rows))
        row, position = np.nonzero(past)
        padding = torch.from_numpy(row * (width * block_size) + position).to(dev)
        mask = torch.from_numpy(np.where(past, -np.inf, 0.0).astype(np.float32)).to(dev)[:, None, None, :]
        return cls(pages, padding, mask, length, len(rows))

    def gather(self, cache: torch.Tensor, dtype: torch.dtype, buffer: int = 0) -> torch.Tensor:
        """``cache``'s contexts as ``[B, H, L, D]`` in ``dtype``; in the cache's dtype, a view of scratch ``buffer``
        (0 or 1: a layer's keys and values), valid until the next gather into it."""
        shape = (len(self.pages), *cache.shape[1:])
        pages = torch.index_select(cache, 0, self.pages, out=_scratch(buffer, shape, cache))
        rows = pages.view(self.num_seqs, -1, *cache.shape[2:]).to(dtype)
        if self.padding is not None:
            rows.view(-1, *cache.shape[2:]).index_fill_(0, self.padding, 0)
        return rows[:, : self.length].transpose(1, 2)


class _AttentionPlan:
    """What attention derives from a step's metadata, once per step (see `_LastStepMemo`): the sequences' query
    starts and context lengths, which sequences decode (one query row, or up to ``max_decode_rows`` after a cached
    context: attended together) and which prefill (more rows: one by one), and, built on first use, what a decode
    kernel needs of the decode rows."""

    def __init__(self, block_tables: torch.Tensor, context_lens: torch.Tensor, query_start_loc: torch.Tensor,
                 block_size: int, max_decode_rows: int = 1) -> None:
        self.block_tables, self.block_size = block_tables, block_size
        self.starts, self.lens = query_start_loc.tolist(), context_lens.tolist()
        q_lens = [self.starts[b + 1] - self.starts[b] for b in range(len(self.lens))]
        self.decode_seqs = [b for b, n in enumerate(q_lens)
                            if n == 1 or 1 < n <= max_decode_rows and n < self.lens[b]]
        decoding = set(self.decode_seqs)
        self.one_by_one = [b for b, n in enumerate(q_lens) if n > 0 and b not in decoding]
        self._padded: dict[int | None, _PaddedContexts] = {}
        # The decode rows in the flattened query; None when every row decodes, in order.
        self.query_rows: torch.Tensor | None = None
        if self.decode_seqs and self.one_by_one:
            rows = [r for b in self.decode_seqs for r in range(self.starts[b], self.starts[b + 1])]
            self.query_rows = torch.tensor(rows, device=block_tables.device)

    def padded_contexts(self, window: int | None = None) -> _PaddedContexts:
        """The decode rows' contexts (their last ``window`` positions) as the reference gathers them (one row per
        sequence); built once per window size (a model's local and global layers share a step's plan)."""
        if window not in self._padded:
            self._padded[window] = _PaddedContexts.build(self.block_tables, self.lens, self.decode_seqs,
                                                         self.block_size, window)
        return self._padded[window]

    @functools.cached_property
    def decode_seq_ids(self) -> torch.Tensor:
        """Each decode row's sequence (row of the block tables), int32."""
        return torch.tensor([b for b in self.decode_seqs for _ in range(self.starts[b + 1] - self.starts[b])],
                            dtype=torch.int32)

    @functools.cached_property
    def decode_row_lens(self) -> torch.Tensor:
        """Each decode row's context length, int32: a sequence's last row sees its whole context, the one before it
        one token less, and so on (causal)."""
        return torch.tensor([self.lens[b] - (self.starts[b + 1] - r) + 1 for b in self.decode_seqs
                             for r in range(self.starts[b], self.starts[b + 1])], dtype=torch.int32)


_ATTENTION_PLANS: _LastStepMemo[_AttentionPlan] = _LastStepMemo()
_MLA_CONTEXTS: _LastStepMemo[_PaddedContexts] = _LastStepMemo()


class _ScratchBuffers(threading.local):
    """Per thread, flat buffers by (buffer number, dtype, device, inference mode), grown as needed and kept."""

    def __init__(self) -> None:
        self.flat: dict[tuple, torch.Tensor] = {}


_SCRATCH = _ScratchBuffers()


def _scratch(buffer: int, shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
    """A ``shape`` view of this thread's scratch ``buffer``. A fresh multi-megabyte tensor per layer would not be
    free: the allocator hands large blocks back to the OS and the next one page-faults in (measured on CPU: the same
    step 1.5-2x slower, depending on what else was allocated in between)."""
    numel = math.prod(shape)
    key = (buffer, like.dtype, like.device, torch.is_inference_mode_enabled())  # inference tensors stay inside it
    flat = _SCRATCH.flat.get(key)
    if flat is None or flat.numel() < numel:
        flat = _SCRATCH.flat[key] = like.new_empty(numel)
    return flat[:numel].view(shape)


def _batched_decode(
    query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, contexts: _PaddedContexts, scale: float,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """One query row ``[B, Hq, D]`` per sequence over its padded context, the padding masked -> ``[B, Hq, D]``."""
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    # The query heads of one KV group all sit at the same position: fold them into the query-length dimension,
    # so each KV head is read once instead of being repeated per query head.
    q = query.reshape(contexts.num_seqs, num_kv_heads, -1, head_dim)  # [B, Hkv, group, D]
    k, v = contexts.gather(k_cache, query.dtype, 0), contexts.gather(v_cache, query.dtype, 1)
    mask = contexts.mask_as(q.dtype)
    if sinks is not None:
        mask = q.new_zeros(1, 1, 1, k.shape[2]) if mask is None else mask
        k, v, mask = _with_sink_key(k, v, mask.expand(*q.shape[:3], -1), sinks.view(num_kv_heads, -1))
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    return o.reshape(query.shape)


def _additive(visible: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A boolean visibility mask as SDPA's additive one (0 where visible, -inf elsewhere)."""
    return torch.zeros(visible.shape, dtype=dtype, device=visible.device).masked_fill_(~visible, float("-inf"))


def _with_sink_key(k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                   sinks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Attention sinks as one more key: a zero key and value after the context (``k`` / ``v`` ``[..., keys, D]``),
    whose score is the head's sink through the additive ``mask`` ``[..., rows, keys]`` (``sinks`` broadcasts to
    ``mask.shape[:-1]``). Softmax over it gives the sink its share of probability, and its value adds nothing."""
    k = torch.cat([k, k.new_zeros(*k.shape[:-2], 1, k.shape[-1])], dim=-2)
    v = torch.cat([v, v.new_zeros(*v.shape[:-2], 1, v.shape[-1])], dim=-2)
    sink = sinks.to(mask.dtype).expand(mask.shape[:-1])[..., None]
    return k, v, torch.cat([mask, sink], dim=-1)


def mla_decode(
    query: torch.Tensor,
    latent_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    kv_lora_rank: int,
    *,
    max_context_len: int | None = None,
    split_k: bool | None = None,
    partition_size: int | None = None,
) -> torch.Tensor:
    """Multi-head latent attention of one query per sequence, in the absorbed form.

    ``query`` ``[B, H, L + R]`` is each head's query already multiplied into the latent space (``L`` =
    ``kv_lora_rank``) followed by its rotary part (``R``); ``latent_cache`` ``[num_blocks, block_size, 1, L + R]``
    holds per token the normalized latent then the rotary key. Every head attends to the same keys (the whole
    cached row) and reads the latent part as its value: returns ``[B, H, L]``, still in the latent space. The
    keyword-only arguments are the Triton kernel's launch hints, unused here.
    """
    num_seqs = context_lens.shape[0]
    out = query.new_empty(num_seqs, query.shape[1], kv_lora_rank)
    if num_seqs == 0:
        return out
    block_size = latent_cache.shape[1]
    contexts = _MLA_CONTEXTS.get((block_tables, context_lens), block_size, lambda: _PaddedContexts.build(
        block_tables, context_lens.tolist(), list(range(num_seqs)), block_size))
    keys = contexts.gather(latent_cache, query.dtype)  # [B, 1, L, L + R]: the heads fold into the query length
    o = F.scaled_dot_product_attention(query[:, None], keys, keys[..., :kv_lora_rank],
                                       attn_mask=contexts.mask_as(query.dtype), scale=scale)
    out.copy_(o[:, 0])
    return out


def fused_moe(
    hidden: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    swiglu_limit: float | None = None,
    gate_up_bias: torch.Tensor | None = None,
    down_bias: torch.Tensor | None = None,
    swiglu_alpha: float | None = None,
) -> torch.Tensor:
    """The routed experts' weighted sum: ``sum_k topk_weights[t, k] * expert_{topk_ids[t, k]}(hidden[t])``.

    ``hidden`` ``[T, H]``; ``gate_up_proj`` ``[E, 2I, H]`` (gate rows, then up rows); ``down_proj`` ``[E, H, I]``;
    ``topk_weights`` ``[T, K]`` (float32) and ``topk_ids`` ``[T, K]``. An expert is
    ``down @ silu_and_mul(gate_up @ x)``, computed in the activation dtype; the weighted sum accumulates in fp32.
    An id of -1 marks a pair whose expert this rank does not hold (expert parallelism): it adds nothing.
    ``swiglu_limit`` (DeepSeek-V4): `clamp_swiglu` before the activation. gpt-oss: ``gate_up_bias`` ``[E, 2I]`` and
    ``down_bias`` ``[E, H]`` added to each projection, and the activation is `swiglu_oai` with ``swiglu_alpha``.
    """
    return routed_experts(hidden, lambda expert: (gate_up_proj[expert], down_proj[expert]), gate_up_proj.shape[0],
                          topk_weights, topk_ids, swiglu_limit, gate_up_bias, down_bias, swiglu_alpha)


def routed_experts(
    hidden: torch.Tensor,
    expert_weights: Callable[[int], tuple[torch.Tensor, torch.Tensor]],
    num_experts: int,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    swiglu_limit: float | None,
    gate_up_bias: torch.Tensor | None,
    down_bias: torch.Tensor | None,
    swiglu_alpha: float | None,
) -> torch.Tensor:
    """`fused_moe` with each expert's ``(gate_up, down)`` weights in the activation dtype from ``expert_weights``
    (asked only for the experts some token routes to: packed experts are unpacked one at a time)."""
    num_tokens, top_k = topk_ids.shape
    out = torch.zeros(num_tokens, hidden.shape[1], dtype=torch.float32, device=hidden.device)
    flat_ids = topk_ids.flatten()
    order = flat_ids.argsort(stable=True)  # (token, k) pairs grouped by expert, the skipped (-1) ones first
    skipped, *counts = torch.bincount(flat_ids + 1, minlength=num_experts + 1).tolist()
    weights = topk_weights.flatten().float()
    start = skipped
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        pairs = order[start : start + count]
        start += count
        tokens = pairs // top_k
        gate_up_proj, down_proj = expert_weights(expert)
        gate_up = F.linear(hidden[tokens], gate_up_proj, None if gate_up_bias is None else gate_up_bias[expert])
        y = F.linear(expert_activation(gate_up, swiglu_limit, swiglu_alpha), down_proj,
                     None if down_bias is None else down_bias[expert])
        out.index_add_(0, tokens, y.float() * weights[pairs, None])
    return out.to(hidden.dtype)


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
    zero_centered: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm over the last dim, in fp32. With ``residual``: returns ``(norm(x + residual), x + residual)``.

    ``zero_centered`` (Qwen3-Next / 3.5, Gemma): the gain is ``1 + weight``, applied in fp32 before one rounding."""
    if residual is not None:
        x = x + residual
        residual = x
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if zero_centered:
        out = (normed * (1.0 + weight.float())).to(x.dtype)
    else:
        out = normed.to(x.dtype) * weight
    return out if residual is None else (out, residual)


def rotary_embedding(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    cos_sin_cache: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Neox-style RoPE on ``query`` ``[T, Hq, D]`` and ``key`` ``[T, Hkv, D]``.

    ``cos_sin_cache`` is ``[max_positions, D]``: cos in the first half, sin in the second (see
    ``engine.models.layers.rope``), so every scaling variant is only a different cache.
    """
    cos_sin = cos_sin_cache.index_select(0, positions.long())
    half = cos_sin.shape[-1] // 2
    cos = cos_sin[:, None, :half]
    sin = cos_sin[:, None, half:]

    def rotate(x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        x1, x2 = xf[..., :half], xf[..., half:]
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)

    return rotate(query), rotate(key)


def clamp_swiglu(gate_up: torch.Tensor, limit: float | None) -> torch.Tensor:
    """DeepSeek-V4's clamped SwiGLU inputs: the gate half at most ``limit``, the up half within ``[-limit, limit]``
    (``gate_up`` ``[..., 2I]``; unchanged when ``limit`` is None)."""
    if limit is None:
        return gate_up
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.cat([gate.clamp(max=limit), up.clamp(-limit, limit)], dim=-1)


def swiglu_oai(gate_up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """gpt-oss' clamped SwiGLU of ``gate_up`` ``[..., 2I]`` (gate half, then up half): with the inputs clamped as in
    `clamp_swiglu`, ``(up + 1) * gate * sigmoid(alpha * gate)``."""
    gate, up = clamp_swiglu(gate_up, limit).chunk(2, dim=-1)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


def expert_activation(gate_up: torch.Tensor, swiglu_limit: float | None, swiglu_alpha: float | None,
                      silu_mul: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
    """An expert's activation of its gate/up projection: gpt-oss' `swiglu_oai` when ``swiglu_alpha`` is given, else
    SiLU-and-mul (``silu_mul``: an op set's own) of the inputs clamped by ``swiglu_limit`` (DeepSeek-V4; None: as
    they are)."""
    if swiglu_alpha is not None:
        return swiglu_oai(gate_up, swiglu_alpha, swiglu_limit)
    return (silu_mul or silu_and_mul)(clamp_swiglu(gate_up, swiglu_limit))


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``silu(x[..., :I]) * x[..., I:]`` for ``x`` ``[..., 2I]``."""
    half = x.shape[-1] // 2
    return F.silu(x[..., :half]) * x[..., half:]


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``gelu(x[..., :I]) * x[..., I:]`` for ``x`` ``[..., 2I]``, GELU in its tanh approximation (Gemma's
    ``gelu_pytorch_tanh``)."""
    half = x.shape[-1] // 2
    return F.gelu(x[..., :half], approximate="tanh") * x[..., half:]


# ------------------------------------------------------------------------------------------- FP8 (e4m3) block scaling
# The DeepSeek-V3 format: a weight ``[N, K]`` is stored as e4m3 with one float32 ``scale_inv`` per block of
# ``block_n x block_k`` values (``[ceil(N / block_n), ceil(K / block_k)]``, edge blocks may be partial), and its value
# is ``fp8 * scale_inv``. Activations are quantized the same way on the fly, per token and group of ``block_k``.


def quantize_fp8_blocks(x: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` ``[R, C]`` -> (e4m3 values ``[R, C]``, float32 ``scale_inv`` ``[ceil(R/br), ceil(C/bc)]``).

    Each block's scale maps its largest magnitude onto 448 (``scale_inv = amax / 448``); values are multiplied by
    its reciprocal (one IEEE multiply per value, which the Triton GEMM repeats bit for bit), clamped to the e4m3
    range and rounded to nearest even.
    """
    rows, cols = x.shape
    block_rows, block_cols = block
    grid_rows, grid_cols = -(-rows // block_rows), -(-cols // block_cols)
    padded = F.pad(x.float(), (0, grid_cols * block_cols - cols, 0, grid_rows * block_rows - rows))
    tiles = padded.view(grid_rows, block_rows, grid_cols, block_cols)
    scale_inv = tiles.abs().amax(dim=(1, 3)).clamp(min=_MIN_AMAX) / E4M3_MAX
    scaled = (tiles * (1.0 / scale_inv)[:, None, :, None]).clamp(-E4M3_MAX, E4M3_MAX)
    values = scaled.to(torch.float8_e4m3fn).view(grid_rows * block_rows, grid_cols * block_cols)
    return values[:rows, :cols].contiguous(), scale_inv


def dequantize_fp8_blocks(values: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int],
                          offset: tuple[int, int] = (0, 0)) -> torch.Tensor:
    """float32 ``values * scale_inv`` with each scale spread over its ``block`` (partial edge blocks cropped).
    ``values`` may be a slice of a blocked tensor starting ``offset`` (rows, columns) into the first block that
    ``scale_inv`` covers (a tensor-parallel rank's part)."""
    rows, cols = values.shape
    (r0, c0), (bn, bk) = offset, block
    scale = scale_inv.float().repeat_interleave(bn, dim=0)[r0 : r0 + rows]
    scale = scale.repeat_interleave(bk, dim=1)[:, c0 : c0 + cols]
    return values.float() * scale


# FP4 (e2m1) values of a nibble, as DeepSeek-V4's MoE experts store them: two a byte, the first in the low nibble.
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def scales_as_float(scales: torch.Tensor) -> torch.Tensor:
    """Block scales as float32: float ones as they are, UE8M0 exponents (``float8_e8m0fnu``, or raw bytes as
    ``uint8``) as the powers of two they stand for."""
    if scales.dtype == torch.uint8:
        return (scales.float() - 127.0).exp2()
    return scales.float()


def dequantize_fp4_blocks(packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """float32 values of an FP4 weight: ``packed`` int8 ``[rows, cols / 2]`` (two e2m1 values a byte) times
    ``scales`` ``[rows / block_rows, cols / block_cols]`` (DeepSeek-V4's experts: one scale per row and 32 columns),
    each scale spread over its block."""
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=packed.device)
    nibbles = packed.contiguous().view(torch.uint8)
    values = torch.stack([table[(nibbles & 0xF).long()], table[(nibbles >> 4).long()]], dim=-1).flatten(-2)
    rows, cols = values.shape
    grid_rows, grid_cols = scales.shape
    if rows % grid_rows or cols % grid_cols:
        raise ValueError(f"an FP4 weight of ({rows}, {cols}) values is not blocked by a {tuple(scales.shape)} scale grid")
    scale = scales_as_float(scales).repeat_interleave(rows // grid_rows, 0).repeat_interleave(cols // grid_cols, 1)
    return values * scale


def fp8_block_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale_inv: torch.Tensor,
    block_size: tuple[int, int],
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """``x @ W.T + bias`` in ``x``'s dtype for an e4m3 weight ``[N, K]`` with block scales over ``block_size``
    (rows, columns). ``x`` ``[..., K]`` is quantized per token and group of ``block_size[1]`` columns first, as the
    Triton kernel does, and the product of the dequantized operands is accumulated in fp32."""
    num_out, width = weight.shape
    rows = x.reshape(-1, width)
    x_values, x_scale_inv = quantize_fp8_blocks(rows, (1, block_size[1]))
    x_deq = dequantize_fp8_blocks(x_values, x_scale_inv, (1, block_size[1]))
    out = x_deq @ dequantize_fp8_blocks(weight, weight_scale_inv, block_size).T
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype).view(*x.shape[:-1], num_out)
