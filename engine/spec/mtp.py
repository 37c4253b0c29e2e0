"""The MTP proposer, the runner's side: after a step's forward and acceptance, the model's multi-token-prediction
layer (`engine/models/mtp.py`: Qwen3.5 / 3.6 / Next or DeepSeek-V3 / V3.2, one interface) drafts the next step's
tokens.

1. **Catch up.** The MTP layer runs over every position the step computed and kept (a verification row's rejected
   drafts excluded), position i paired with token i + 1: the next prompt token, an accepted draft, or the token the
   step emitted. Its K/V pages (the last layer's, under the sequence's block ids) so always hold what its attention
   needs at every computed position, and a block committed to the prefix cache carries correct MTP K/V too.
2. **Draft.** Each sampled row's last kept position gives the first draft (greedy: the argmax of the model's head);
   each further draft chains the MTP layer's own output state in place of the target's hidden state, one position
   on, as the released models were trained (vLLM's qwen3_next_mtp and deepseek_mtp draft the same way). Those
   chained positions write K/V that the next step's catch-up overwrites with the real tokens'; the scheduler
   reserves their blocks. Under tensor parallelism every rank runs its shard of the layer, and each chained draft
   is rank 0's argmax, broadcast.

Drafts are the MTP layer's argmax, deterministic given the context, so the exact acceptance rules of `acceptance.py`
apply unchanged (greedy by equality, sampled rows by the rejection rule with a one-hot draft distribution).
"""
from __future__ import annotations

import numpy as np
import torch

from engine.worker.input_batch import InputBatch
from engine.worker.step_inputs import DeviceInputs, HostInputs
from kernels.attention_metadata import AttentionMetadata


class MTPDrafter:
    def __init__(self, model: torch.nn.Module, num_tokens: int, block_size: int, max_model_len: int) -> None:
        self.model = model
        self.num_tokens = num_tokens  # drafts per sampled row and step
        self.block_size = block_size
        self.max_model_len = max_model_len

    def __call__(self, hidden: torch.Tensor, kv_caches: list, host: HostInputs, inputs: DeviceInputs,
                 batch: InputBatch, sampled: torch.Tensor | None, emitted: list[list[int]] | None
                 ) -> list[list[int]]:
        """``hidden``: the target's output for every token row of the step; ``sampled`` / ``emitted``: the sampled
        rows' tokens (on the device) or, when rows drafted, their emitted lists. Returns each sampled row's drafts
        (in `host.sample_rows` order)."""
        rows = batch.num_rows  # the batch's real rows (a decode graph pads the host inputs beyond them)
        starts = host.query_start_loc[: rows + 1].astype(np.int64)
        drafts = batch.num_drafts[:rows].astype(np.int64)
        accepted = np.zeros(rows, dtype=np.int64)
        if emitted is not None:
            accepted[host.sample_rows] = [len(tokens) - 1 for tokens in emitted]
        kept = np.diff(starts) - drafts + accepted  # positions whose next token is known now
        first = np.concatenate([[0], np.cumsum(kept)])
        index = np.arange(int(first[-1])) - np.repeat(first[:-1] - starts[:-1], kept)  # into the step's token rows
        last = first[1:] - 1  # each row's last kept position, in `index`
        # the token after each row's last kept position: the one the step emitted, or the next prompt token
        computed = batch.num_computed[:rows].astype(np.int64)
        following = batch.token_ids[np.arange(rows), np.minimum(computed + kept, batch.token_ids.shape[1] - 1)]
        if emitted is not None:
            following[host.sample_rows] = [tokens[-1] for tokens in emitted]
        device = hidden.device
        index_t, last_t = torch.from_numpy(index).to(device), torch.from_numpy(last).to(device)
        input_ids = inputs.input_ids[: host.num_tokens]
        next_ids = input_ids[torch.clamp(index_t + 1, max=host.num_tokens - 1)]
        next_ids[last_t] = torch.from_numpy(following.astype(np.int64)).to(device)
        if emitted is None and sampled is not None:
            next_ids[last_t[torch.from_numpy(host.sample_rows).to(device).long()]] = sampled
        context = computed + kept
        meta = AttentionMetadata(
            slot_mapping=inputs.slot_mapping[index_t], block_tables=inputs.block_tables[:rows],
            context_lens=torch.from_numpy(context.astype(np.int32)).to(device),
            query_start_loc=torch.from_numpy(first.astype(np.int32)).to(device),
            max_query_len=int(kept.max()), max_context_len=int(context.max()))
        positions = inputs.positions[index_t]
        out = self._forward(next_ids, hidden[index_t], positions, kv_caches, meta)
        samples = host.sample_rows.astype(np.int64)
        if not len(samples):
            return []
        pick = last_t[torch.from_numpy(samples).to(device)]
        return self._chain(out[pick], positions[pick], samples, batch, inputs, kv_caches)

    def _forward(self, token_ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor, kv_caches: list,
                 meta: AttentionMetadata) -> torch.Tensor:
        model = self.model
        embeddings = model.tp.all_reduce(model.embed_tokens(token_ids))  # this rank's part of the vocabulary
        return model.mtp(model.ops, model.tp, embeddings, hidden, positions, model.cos_sin_cache,
                         kv_caches[model.cfg.num_layers], meta)

    def _chain(self, hidden: torch.Tensor, positions: torch.Tensor, rows: np.ndarray, batch: InputBatch,
               inputs: DeviceInputs, kv_caches: list) -> list[list[int]]:
        """``num_tokens`` drafts per row from the MTP output at each row's last kept position, chaining the MTP
        layer's own hidden state one position on; all rows stop where the first one's reserved blocks end."""
        device, bs = hidden.device, self.block_size
        pos = positions.cpu().numpy().astype(np.int64)
        room = np.minimum(batch.num_blocks[rows].astype(np.int64) * bs, self.max_model_len) - pos - 1
        tables = inputs.block_tables[torch.from_numpy(rows).to(device)]
        tokens = [self._argmax(hidden)]
        for step in range(1, int(min(self.num_tokens - 1, room.min())) + 1):
            p = pos + step  # the position of the token drafted last: its K/V goes there
            slots = batch.block_table[rows, p // bs].astype(np.int64) * bs + p % bs
            meta = AttentionMetadata(
                slot_mapping=torch.from_numpy(slots).to(device), block_tables=tables,
                context_lens=torch.from_numpy((p + 1).astype(np.int32)).to(device),
                query_start_loc=torch.arange(len(rows) + 1, dtype=torch.int32, device=device),
                max_query_len=1, max_context_len=int(p.max()) + 1)
            hidden = self._forward(tokens[-1], hidden, torch.from_numpy(p).to(device), kv_caches, meta)
            tokens.append(self._argmax(hidden))
        return torch.stack(tokens, dim=1).tolist()

    def _argmax(self, state: torch.Tensor) -> torch.Tensor:
        """The greedy drafts; under tensor parallelism rank 0's (it alone has the logits), on every rank, which
        embeds them for the next chained step."""
        model = self.model
        logits = model.compute_logits(model.mtp.head_input(model.ops, state))
        if logits is None:
            return model.tp.broadcast_from_first(torch.empty(len(state), dtype=torch.long, device=state.device))
        return model.tp.broadcast_from_first(logits.argmax(dim=-1))
