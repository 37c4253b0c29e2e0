"""Pure-torch reference ops of DeepSeek-V4's attention: gated pooling of token windows into compressed entries, with
the pooling state carried in the KV pages, and attention with sinks over gathered slots.

**Pooling** (`pool_windows`). A compressed entry is, per channel, the softmax-over-tokens (of gate + position bias)
weighted sum of the tokens' ``kv``: over each window of ``rate`` tokens (heavily compressed attention), or
(``overlap``, compressed sparse attention) over the ``2 x rate`` slots of the previous window's first half ``Ca`` and
this window's second half ``Cb``. It is computed online (running max, sum and weighted sum per channel: an
*accumulator*), so a window split across steps, chunks or block boundaries pools exactly like a whole one, and the
accumulators of the windows still open after a sequence's last token are its **pooling state**: ``Cb`` of the open
window, plus for ``overlap`` its ``Ca`` and the last closed window's ``Ca``. That state lives in a per-block row of
the pages: the block holding token t keeps the state after t. Blocks end on window boundaries (the block size is a
multiple of every rate), so a full block's row holds the state at its end (empty for plain windows, the last
window's ``Ca`` with ``overlap``), and a prefix hit on a block resumes from it with nothing recomputed.

**Attention** (`sink_attention`): each query row attends to the keys at its slots in several flat caches (the
sliding window's tokens, compressed entries) and to a per-head sink logit that takes probability mass but adds no
value. V4's keys are its values.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

_ROWS_PER_CHUNK = 256


@dataclass
class Accumulator:
    """Per-channel online softmax of one window ``[windows, D]`` each: max, sum of exp, exp-weighted sum of kv."""

    m: torch.Tensor
    l: torch.Tensor
    acc: torch.Tensor

    @classmethod
    def of(cls, kv: torch.Tensor, gate: torch.Tensor) -> "Accumulator":
        """Windows ``[W, rate, D]`` of kv and gate logits (``-inf`` for tokens not in this step) -> ``[W, D]``."""
        m = gate.amax(dim=1)
        e = torch.exp(gate - _finite(m).unsqueeze(1))
        return cls(m, e.sum(dim=1), (e * kv).sum(dim=1))

    @classmethod
    def unpack(cls, row: torch.Tensor) -> "Accumulator":
        m, l, acc = row.view(3, -1)
        return cls(m, l, acc)

    @classmethod
    def empty(cls, dim: int, device: torch.device) -> "Accumulator":
        return cls(torch.full((dim,), float("-inf"), device=device), torch.zeros(dim, device=device),
                   torch.zeros(dim, device=device))

    def __getitem__(self, i) -> "Accumulator":
        return Accumulator(self.m[i], self.l[i], self.acc[i])

    def merge(self, other: "Accumulator") -> "Accumulator":
        m = torch.maximum(self.m, other.m)
        a, b = torch.exp(self.m - _finite(m)), torch.exp(other.m - _finite(m))
        return Accumulator(m, self.l * a + other.l * b, self.acc * a + other.acc * b)

    def pack(self) -> torch.Tensor:
        return torch.cat([self.m, self.l, self.acc])

    def pooled(self) -> torch.Tensor:
        return self.acc / self.l


def _finite(m: torch.Tensor) -> torch.Tensor:
    return torch.where(torch.isinf(m), torch.zeros_like(m), m)  # an empty accumulator's -inf max: weigh nothing


def pooling_state_size(dim: int, overlap: bool) -> int:
    """Floats of one block's pooling-state row: 3 accumulators (last closed ``Ca``, open ``Ca``, open ``Cb``) with
    ``overlap``, else 1 (open window), of ``3 x dim`` each."""
    return (9 if overlap else 3) * dim


def pool_windows(
    kv: torch.Tensor,
    gate: torch.Tensor,
    position_bias: torch.Tensor,
    state: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    rate: int,
    overlap: bool,
    block_size: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Pool each sequence's new tokens into the windows they close; carry the open windows in ``state``.

    ``kv`` / ``gate`` ``[T, C]`` for the flattened batch's new tokens (``C = 2D`` with ``overlap``: ``Ca`` then
    ``Cb``, else ``D``), ``position_bias`` ``[rate, C]`` (added to the gate of a window's i-th token), ``state``
    ``[num_blocks, pooling_state_size(D, overlap)]`` fp32, read from the block of each sequence's last cached token
    and written into every block that receives new tokens. Returns the closed windows' pooled values ``[E, D]``
    (before V4's norm and RoPE), with each one's sequence and window index ``[E]``."""
    dim = kv.shape[1] // (2 if overlap else 1)
    starts, lens = query_start_loc.tolist(), context_lens.tolist()
    pooled, seqs, windows = [], [], []
    for b, ctx in enumerate(lens):
        first, last = starts[b], starts[b + 1]
        if first == last:
            continue
        p0 = ctx - (last - first)
        first_block = max(p0 - 1, 0) // block_size  # from the block of the last cached token (its state)
        pages = block_tables[b, first_block : (ctx - 1) // block_size + 1].tolist()  # not the whole table: O(step)
        w0 = p0 // rate
        n_windows = (ctx - 1) // rate - w0 + 1
        pad = (p0 - w0 * rate, (w0 + n_windows) * rate - ctx)
        bias = position_bias[torch.arange(p0, ctx, device=kv.device) % rate]
        kv_w = F.pad(kv[first:last].float(), (0, 0, *pad)).view(n_windows, rate, -1)
        gate_w = F.pad((gate[first:last].float() + bias), (0, 0, *pad), value=float("-inf")).view(n_windows, rate, -1)
        b_acc = Accumulator.of(kv_w[..., -dim:], gate_w[..., -dim:])  # Cb: this window's own entry
        a_acc = Accumulator.of(kv_w[..., :dim], gate_w[..., :dim]) if overlap else None  # Ca: the next window's
        empty = Accumulator.empty(dim, kv.device)
        before = empty  # Ca of the window before the first one touched (overlap)
        if p0 > 0:  # resume from the state after the last cached token
            saved = [Accumulator.unpack(r) for r in state[pages[(p0 - 1) // block_size - first_block]].view(-1, 3 * dim)]
            if overlap:
                before, open_a, open_b = saved
            else:
                (open_b,) = saved
            if p0 % rate:  # the first window was opened by earlier tokens
                b_acc = _replace_first(b_acc, b_acc[0].merge(open_b))
                if overlap:
                    a_acc = _replace_first(a_acc, a_acc[0].merge(open_a))
        closed = n_windows if ctx % rate == 0 else n_windows - 1
        if closed:
            own = b_acc[:closed]
            if overlap:
                previous = Accumulator(*(torch.cat([getattr(before, f)[None], getattr(a_acc, f)[: closed - 1]])
                                         for f in ("m", "l", "acc")))
                own = own.merge(previous)
            pooled.append(own.pooled())
            seqs += [b] * closed
            windows += range(w0, w0 + closed)
        # The pooling state after the last token of every block that got new tokens.
        for block in range(p0 // block_size, (ctx - 1) // block_size + 1):
            end = min(ctx, (block + 1) * block_size) - 1  # the block's last token in this step
            i = end // rate - w0  # its window among those touched
            if (end + 1) % rate == 0:  # the window closed: nothing open
                last_a = a_acc[i] if overlap else None
                open_a, open_b = empty, empty
            else:
                last_a = (a_acc[i - 1] if i > 0 else before) if overlap else None
                open_a, open_b = (a_acc[i] if overlap else None), b_acc[i]
            parts = [last_a, open_a, open_b] if overlap else [open_b]
            state[pages[block - first_block]] = torch.cat([p.pack() for p in parts])
    if not pooled:
        empty_out = kv.new_zeros(0, dim)
        return empty_out, torch.zeros(0, dtype=torch.long, device=kv.device), torch.zeros(0, dtype=torch.long,
                                                                                        device=kv.device)
    device = kv.device
    return (torch.cat(pooled).to(kv.dtype), torch.tensor(seqs, device=device), torch.tensor(windows, device=device))


def _replace_first(acc: Accumulator, first: Accumulator) -> Accumulator:
    return Accumulator(*(torch.cat([getattr(first, f)[None], getattr(acc, f)[1:]]) for f in ("m", "l", "acc")))


def sink_attention(
    query: torch.Tensor,
    sources: list[tuple[torch.Tensor, torch.Tensor]],
    sinks: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Each query row ``[T, H, D]`` attends to the rows of every ``(flat cache [S, D], slots [T, n])`` source at
    its slots (``-1``: none) and to a per-head sink logit ``sinks`` ``[H]`` that takes probability but adds no
    value. The cached rows are both keys and values. Returns ``[T, H, D]``."""
    num_rows = query.shape[0]
    out = torch.empty_like(query)
    for start in range(0, num_rows, _ROWS_PER_CHUNK):
        rows = slice(start, start + _ROWS_PER_CHUNK)
        keys, chosen = [], []
        for flat, slots in sources:
            picked = slots[rows]
            keys.append(flat.index_select(0, picked.clamp(min=0).flatten().long()).view(*picked.shape, -1))
            chosen.append(picked >= 0)
        mask = torch.cat(chosen, dim=1)
        # a slot of -1 gathered row 0: zeroed, so whatever that page holds adds nothing (0 x NaN would)
        k = torch.cat(keys, dim=1).to(query.dtype).masked_fill(~mask[..., None], 0)  # [n, K, D]
        logits = torch.einsum("thd,tkd->thk", query[rows], k) * scale
        logits = logits.masked_fill(~mask[:, None, :], float("-inf"))
        logits = torch.cat([logits, sinks.to(logits.dtype)[None, :, None].expand(logits.shape[0], -1, 1)], dim=-1)
        probs = torch.softmax(logits - logits.amax(dim=-1, keepdim=True), dim=-1)[..., :-1]
        out[rows] = torch.einsum("thk,tkd->thd", probs, k)
    return out
