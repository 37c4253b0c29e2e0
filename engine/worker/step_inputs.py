"""One step's model inputs: flattened on the host with numpy from the `InputBatch` rows, shipped to persistent device
buffers with one host-to-device copy, and read by the model (and by the CUDA graphs, which capture views of the
same buffers).

The flattened batch puts the rows' new tokens one after another: row r owns token rows
``query_start_loc[r]:query_start_loc[r+1]``, at positions ``num_computed[r] ...``; ``slot_mapping`` says where each
token's K/V goes (``block_id * block_size + offset``); ``context_lens[r]`` is the row's length after this step.
A sliding-window model with a window group has a second slot mapping, into its window layers' own pages
(``window_slot_mapping``, from the rows' window tables), and its window layers read a second view of the tables.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import torch

from engine.worker.input_batch import InputBatch
from kernels.attention_metadata import AttentionMetadata, StateBatch


@dataclass
class HostInputs:
    """The host side of one step (numpy int32), padded to ``num_rows`` rows when a CUDA graph will run it."""

    input_ids: np.ndarray
    positions: np.ndarray
    slot_mapping: np.ndarray
    query_start_loc: np.ndarray
    context_lens: np.ndarray
    sample_index: np.ndarray  # token rows whose hidden state is sampled, in row order
    sample_rows: np.ndarray  # the batch rows they belong to (intp: an index on the host)
    sample_counts: np.ndarray | None  # speculative decoding: per sampled row, its positions (1 + drafts); else None
    pending_dst: np.ndarray  # token rows whose id is still on the device (async scheduling) ...
    pending_src: np.ndarray  # ... and where it is in the previous step's sampled ids
    block_table_deltas: np.ndarray  # [3, D]
    state_rows: np.ndarray  # hybrid models: each row's recurrent-state row ...
    has_initial_state: np.ndarray  # ... and whether it continues the state there (tokens computed before)
    max_query_len: int
    max_context_len: int
    # hybrid models that verify drafts: per token, a slot for the state after it (-1: none); per row, its drafts and
    # the first of its slots (the state after its last known token, then after each draft but the last)
    token_state_rows: np.ndarray | None = None
    draft_counts: np.ndarray | None = None
    draft_states: np.ndarray | None = None
    window_slot_mapping: np.ndarray | None = None  # sliding-window models: the window pages' slot of each token

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)

    @property
    def num_rows(self) -> int:
        return len(self.context_lens)


def flatten(batch: InputBatch, block_size: int, pad_rows_to: int | None = None, draft_state_base: int = -1
            ) -> HostInputs:
    """Vectorized over the scheduled rows: O(tokens scheduled), whatever the rows' context lengths.
    ``draft_state_base``: hybrid models, the first of the state rows kept for verified positions (-1: none)."""
    rows = batch.num_rows
    n = batch.num_new[:rows]
    start = batch.num_computed[:rows]
    max_query_len = int(n.max()) if rows else 0
    if max_query_len == 1 and batch.samples[:rows].all():  # (so no drafts either)
        return _flatten_decodes(batch, block_size, pad_rows_to)
    ends = np.cumsum(n, dtype=np.int32)
    total = int(ends[-1]) if rows else 0
    drafts = batch.num_drafts[:rows]
    if max_query_len == 1:  # decode only (so no drafts): each row's one token at its next position
        row_of_token, positions = np.arange(rows, dtype=np.int32), start.copy()
        known = batch.num_known[:rows]
    else:
        row_of_token = np.repeat(np.arange(rows, dtype=np.int32), n)
        positions = np.arange(total, dtype=np.int32) - np.repeat(ends - n, n) + start[row_of_token]
        known = batch.num_known[row_of_token] + drafts[row_of_token]  # a row's drafts follow its known tokens
    input_ids = batch.token_ids[row_of_token, positions]
    block_index, offset = np.divmod(positions, block_size)
    slots = batch.block_table[row_of_token, block_index] * block_size + offset
    pending_dst = np.nonzero(positions >= known)[0].astype(np.int32)
    pending_src = batch.pending_src[row_of_token[pending_dst]]
    sample_rows = np.flatnonzero(batch.samples[:rows])
    sample_index, sample_counts = ends[sample_rows] - 1, None
    if drafts.any():  # a row with d drafts samples its last d + 1 positions: the last known token's and each draft's
        sample_counts = drafts[sample_rows] + 1
        firsts = np.cumsum(sample_counts) - sample_counts
        offsets = np.arange(int(sample_counts.sum()), dtype=np.int32) - np.repeat(firsts, sample_counts)
        sample_index = (np.repeat(ends[sample_rows] - sample_counts, sample_counts) + offsets).astype(np.int32)
    context_lens = start + n
    host = HostInputs(
        input_ids=input_ids, positions=positions, slot_mapping=slots,
        query_start_loc=np.concatenate([np.zeros(1, dtype=np.int32), ends]), context_lens=context_lens,
        sample_index=sample_index, sample_rows=sample_rows, sample_counts=sample_counts, pending_dst=pending_dst,
        pending_src=pending_src,
        block_table_deltas=batch.take_block_table_deltas(), state_rows=batch.state_rows[:rows].copy(),
        has_initial_state=start > 0,
        max_query_len=max_query_len, max_context_len=int(context_lens.max()) if rows else 0,
        window_slot_mapping=_window_slots(batch, row_of_token, block_index, offset, block_size),
    )
    if draft_state_base >= 0 and drafts.any():
        _keep_verified_states(host, drafts, ends, row_of_token, draft_state_base)
    if pad_rows_to is not None and pad_rows_to > rows:
        _pad_decode(host, pad_rows_to)
    return host


def _flatten_decodes(batch: InputBatch, block_size: int, pad_rows_to: int | None) -> HostInputs:
    """`flatten` for a step where every row computes one token and samples (a steady decode): row r is token r."""
    rows = batch.num_rows
    positions = batch.num_computed[:rows].copy()
    query_start_loc = batch.row_numbers[: rows + 1]
    row_of_token = query_start_loc[:rows]
    block_index, offset = np.divmod(positions, block_size)
    if batch.steps_unrecorded:  # (else every row's tokens are known: nothing is pending)
        pending_dst = np.flatnonzero(positions >= batch.num_known[:rows]).astype(np.int32)
    else:
        pending_dst = query_start_loc[:0]
    host = HostInputs(
        input_ids=batch.token_ids[row_of_token, positions], positions=positions,
        slot_mapping=batch.block_table[row_of_token, block_index] * block_size + offset,
        query_start_loc=query_start_loc, context_lens=positions + 1, sample_index=row_of_token,
        sample_rows=batch.row_index[:rows], sample_counts=None, pending_dst=pending_dst, pending_src=batch.pending_src[pending_dst],
        block_table_deltas=batch.take_block_table_deltas(), state_rows=batch.state_rows[:rows].copy(),
        has_initial_state=positions > 0, max_query_len=1, max_context_len=int(positions.max()) + 1,
        window_slot_mapping=_window_slots(batch, row_of_token, block_index, offset, block_size),
    )
    if pad_rows_to is not None and pad_rows_to > rows:
        _pad_decode(host, pad_rows_to)
    return host


def _window_slots(batch: InputBatch, row_of_token: np.ndarray, block_index: np.ndarray, offset: np.ndarray,
                  block_size: int) -> np.ndarray | None:
    """Each token's slot in the window layers' pages (None: no window table)."""
    if not batch.window_offset:
        return None
    return batch.block_table[row_of_token, batch.window_offset + block_index] * block_size + offset


def _keep_verified_states(host: HostInputs, drafts: np.ndarray, ends: np.ndarray, row_of_token: np.ndarray,
                          base: int) -> None:
    """A row verifying d drafts computes its last known token and the drafts, its last d + 1 tokens; the state after
    each of the first d of them goes to a slot of its own (after the last one it is the row's final state), so the
    state after the last accepted token exists whatever is accepted. Rows take consecutive slots from ``base``."""
    first = base + np.cumsum(drafts) - drafts
    index = np.arange(len(row_of_token)) - (ends - drafts - 1)[row_of_token]  # among the row's verified tokens
    kept = (index >= 0) & (index < drafts[row_of_token])
    host.token_state_rows = np.where(kept, first[row_of_token] + index, -1).astype(np.int32)
    host.draft_counts, host.draft_states = drafts.copy(), np.where(drafts > 0, first, -1).astype(np.int32)


def _pad_decode(host: HostInputs, size: int) -> None:
    """Padding rows for a decode graph: slot -1 (no block is written), context 1 (one finite value is read), state
    slot -1 (the recurrent kernels skip the row)."""
    pad = size - host.num_rows
    host.state_rows = np.concatenate([host.state_rows, np.full(pad, -1, dtype=host.state_rows.dtype)])
    host.has_initial_state = np.concatenate([host.has_initial_state, np.zeros(pad, dtype=bool)])
    host.input_ids = np.concatenate([host.input_ids, np.zeros(pad, dtype=np.int32)])
    host.positions = np.concatenate([host.positions, np.zeros(pad, dtype=np.int32)])
    host.slot_mapping = np.concatenate([host.slot_mapping, np.full(pad, -1, dtype=np.int32)])
    if host.window_slot_mapping is not None:
        host.window_slot_mapping = np.concatenate([host.window_slot_mapping, np.full(pad, -1, dtype=np.int32)])
    host.query_start_loc = np.arange(size + 1, dtype=np.int32)
    host.context_lens = np.concatenate([host.context_lens, np.ones(pad, dtype=np.int32)])


class DeviceInputs:
    """Persistent device buffers for the model's inputs, and the staging that fills them with one copy per step."""

    def __init__(self, max_tokens: int, max_rows: int, max_blocks_per_row: int, device: torch.device,
                 recurrent: bool = False, window_table: bool = False) -> None:
        """``window_table``: the rows' window tables follow their block tables (columns ``max_blocks_per_row`` on)."""
        self.device = device
        self.window_offset = max_blocks_per_row if window_table else 0
        self.recurrent = recurrent  # a hybrid model: ship each row's state row too
        self.input_ids = torch.zeros(max_tokens, dtype=torch.long, device=device)
        self.positions = torch.zeros(max_tokens, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((max_tokens,), -1, dtype=torch.long, device=device)
        self.query_start_loc = torch.arange(max_rows + 1, dtype=torch.int32, device=device)
        self.context_lens = torch.ones(max_rows, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(max_rows, max_blocks_per_row * (2 if window_table else 1), dtype=torch.int32,
                                        device=device)
        self.window_slot_mapping = torch.full((max_tokens,), -1, dtype=torch.long, device=device)
        self.state_rows = torch.zeros(max_rows, dtype=torch.long, device=device)
        self.has_initial_state = torch.zeros(max_rows, dtype=torch.bool, device=device)
        self.token_state_rows = torch.full((max_tokens,), -1, dtype=torch.long, device=device)
        self._host_states = (np.zeros(0, dtype=np.int32), np.zeros(0, dtype=bool))  # the last upload's, on the host
        self.tokens_from_device = 0  # input ids taken from the previous step's device output (async scheduling)
        self._pinned = device.type == "cuda"
        self._staging: list[torch.Tensor] = [torch.empty(0, dtype=torch.int32)] * 2  # alternate: one may be in flight
        self._turn = 0

    def upload(self, host: HostInputs, prev_sampled: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Ship the step's inputs; returns (input_ids, positions) views. Block tables are updated in place."""
        parts = [host.input_ids, host.positions, host.slot_mapping, host.query_start_loc, host.context_lens,
                 host.pending_dst, host.pending_src, host.block_table_deltas.reshape(-1)]
        if self.window_offset:
            parts.append(host.window_slot_mapping)
        if self.recurrent:
            parts += [host.state_rows, host.has_initial_state.astype(np.int32)]
            if host.token_state_rows is not None:
                parts.append(host.token_state_rows)
        sizes = [len(p) for p in parts]
        staged = self._stage(np.concatenate(parts))
        ids, pos, slots, qsl, ctx, pdst, psrc, deltas, *states = staged.split(sizes)
        t, b = host.num_tokens, host.num_rows
        if self.window_offset:
            self.window_slot_mapping[:t].copy_(states.pop(0))
        self.input_ids[:t].copy_(ids)
        self.positions[:t].copy_(pos)
        self.slot_mapping[:t].copy_(slots)
        self.query_start_loc[: b + 1].copy_(qsl)
        self.context_lens[:b].copy_(ctx)
        if len(pdst):
            assert prev_sampled is not None, "a token is pending but no step is in flight"
            self.input_ids[pdst.long()] = prev_sampled[psrc.long()]
            self.tokens_from_device += len(pdst)
        if deltas.numel():
            rows, cols, values = deltas.view(3, -1)
            self.block_tables[rows.long(), cols.long()] = values
        if states:
            self.state_rows[:b].copy_(states[0])
            self.has_initial_state[:b].copy_(states[1])
            if host.token_state_rows is not None:
                self.token_state_rows[:t].copy_(states[2])
            self._host_states = (host.state_rows, host.has_initial_state)
        return self.input_ids[:t], self.positions[:t]

    def _stage(self, values: np.ndarray) -> torch.Tensor:
        """``values`` on the device, through a pinned host buffer on CUDA (copied without blocking the host)."""
        if not self._pinned:
            return torch.from_numpy(values).to(self.device)
        self._turn ^= 1
        buf = self._staging[self._turn]
        if buf.numel() < len(values):
            buf = torch.empty(max(len(values), 2 * buf.numel()), dtype=torch.int32, pin_memory=True)
            self._staging[self._turn] = buf
        buf[: len(values)].numpy()[:] = values
        return buf[: len(values)].to(self.device, non_blocking=True)

    def metadata(self, host: HostInputs, max_context_len: int | None = None) -> AttentionMetadata:
        t, b = host.num_tokens, host.num_rows
        return self.with_window(AttentionMetadata(
            slot_mapping=self.slot_mapping[:t],
            block_tables=self.block_tables[:b],
            context_lens=self.context_lens[:b],
            query_start_loc=self.query_start_loc[: b + 1],
            max_query_len=host.max_query_len,
            max_context_len=max_context_len or host.max_context_len,
            states=self._state_batch(host) if self.recurrent else None,
        ))

    def narrow_to_read_rows(self, meta: AttentionMetadata, host: HostInputs) -> None:
        """``meta.read_rows`` / ``meta.read``: the sampled token rows alone, each sampling sequence's last rows its
        queries, with its tables and lengths (a model whose last layers store no K/V runs them on these rows only)."""
        counts = np.ones(len(host.sample_rows), dtype=np.int32) if host.sample_counts is None else host.sample_counts
        seqs = torch.from_numpy(host.sample_rows.astype(np.int64)).to(self.device)
        rows = torch.from_numpy(host.sample_index.astype(np.int64)).to(self.device)
        starts = torch.from_numpy(np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)).to(self.device)

        def narrowed(view: AttentionMetadata) -> AttentionMetadata:
            return replace(view, slot_mapping=view.slot_mapping[rows], block_tables=view.block_tables[seqs],
                           context_lens=view.context_lens[seqs], query_start_loc=starts,
                           max_query_len=int(counts.max(initial=0)), states=None, window=None)

        meta.read = narrowed(meta)
        meta.read.window = None if meta.window is None else narrowed(meta.window)
        meta.read_rows = rows

    def with_window(self, meta: AttentionMetadata) -> AttentionMetadata:
        """Sliding-window models with a window table: ``meta`` (whose block tables are the rows' whole tables)
        split into the full-attention layers' view and the window layers' (``meta.window``). On a CPU each view is
        made contiguous once per step (its native kernel would copy it for every layer); elsewhere they stay views
        of the persistent buffers (a CUDA graph's static inputs; the Triton kernels read the row stride)."""
        offset = self.window_offset
        if not offset:
            return meta
        tables, t = meta.block_tables, len(meta.slot_mapping)
        full, window = tables[:, :offset], tables[:, offset:]
        if self.device.type == "cpu":
            full, window = full.contiguous(), window.contiguous()
        meta.block_tables = full
        meta.window = replace(meta, slot_mapping=self.window_slot_mapping[:t], block_tables=window)
        return meta

    def _state_batch(self, host: HostInputs) -> StateBatch:
        b, verifies = host.num_rows, host.token_state_rows is not None
        return StateBatch(self.query_start_loc[: b + 1], self.state_rows[:b], self.has_initial_state[:b],
                          host.query_start_loc, host.state_rows, host.has_initial_state,
                          self.token_state_rows[: host.num_tokens] if verifies else None, host.token_state_rows)

    def decode_states(self, size: int) -> StateBatch:
        """The recurrent ops' view of a padded decode batch of ``size`` rows, one token each (a decode graph's static
        inputs; the Triton kernels read only the device side). The host side is the last upload's when it was this
        batch (the eager padded path on CPU), else all padding (a warm-up or capture)."""
        slots, initial = self._host_states
        if len(slots) != size:
            slots, initial = np.full(size, -1, dtype=np.int32), np.zeros(size, dtype=bool)
        return StateBatch(self.query_start_loc[: size + 1], self.state_rows[:size], self.has_initial_state[:size],
                          np.arange(size + 1, dtype=np.int32), slots, initial)

    def pad_states(self, size: int) -> None:
        """Every row of a ``size``-row decode batch padding (state row -1): graph warm-ups and captures."""
        self.state_rows[:size].fill_(-1)
        self._host_states = (np.full(size, -1, dtype=np.int32), np.zeros(size, dtype=bool))
