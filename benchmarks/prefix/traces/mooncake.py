"""Mooncake block-hash traces: ``{timestamp, input_length, output_length, hash_ids}`` per line, 512-token blocks."""
from __future__ import annotations

from dataclasses import dataclass
from itertools import islice
from pathlib import Path
from typing import Iterable

from benchmarks.prefix.traces.trace import TokenRequest, read_jsonl

MOONCAKE_BLOCK_TOKENS = 512


@dataclass(frozen=True)
class MooncakeRecord:
    timestamp: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


def _parse_record(row: dict) -> MooncakeRecord:
    record = MooncakeRecord(
        float(row["timestamp"]), int(row["input_length"]), int(row["output_length"]),
        tuple(int(h) for h in row["hash_ids"]),
    )
    if record.input_length <= 0 or any(h < 0 for h in record.hash_ids):
        raise ValueError("input_length must be positive and hash ids non-negative")
    return record


def read_mooncake(path: str | Path, limit: int | None = None) -> list[MooncakeRecord]:
    return list(islice(read_jsonl(path, _parse_record, "a Mooncake record"), limit))


def mooncake_requests(records: Iterable[MooncakeRecord], block_tokens: int = MOONCAKE_BLOCK_TOKENS) -> list[TokenRequest]:
    """One request per record; run with ``block_size=1`` so that each hash id is one cache block.

    Each prompt ends with a sentinel id unique to the request (negative, so it never equals a hash id): the KV
    manager always recomputes a prompt's last block, and the sentinel makes that block the one to recompute, so
    every real block can hit. The sentinel is never committed, so it never occupies cache capacity.
    """
    requests = []
    for i, record in enumerate(records):
        requests.append(
            TokenRequest(
                request_id=f"mc{i}",
                session=f"mc{i}",
                prompt=[*record.hash_ids, -(i + 1)],
                tokens_per_id=block_tokens,
                num_tokens=record.input_length,
                num_committed=len(record.hash_ids),
            )
        )
    return requests
