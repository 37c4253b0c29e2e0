"""The disk KV tier's files: one file per block, named by its block hash, checksummed, under a directory per KV
layout, so that a restart of the same model with the same settings finds its blocks again.

    DIR/<layout id>/layout.json          what the layout id stands for (model, block size, dtype, tensor shapes)
    DIR/<layout id>/<h[:2]>/<hash>.kvb   header length (4 bytes, little-endian), header (JSON), payload

The header records the block's parent hash and token ids (a restart rebuilds the chain index from them, and a hit
checks the tokens as the device tree does), the payload size and its blake2b-128 checksum. Files are written to a
temporary name and renamed, so a crash never leaves half a block under a real name. The block hash already
carries the model identity and the cache salt (engine/block_hashing.py); the layout id keeps a different dtype or
block size from reading the bytes wrongly. Bytes only: the model runner turns tensors into payloads.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
from dataclasses import dataclass
from hashlib import blake2b
from pathlib import Path
from typing import Any

from engine.block_hashing import BlockHash

log = logging.getLogger(__name__)
SUFFIX = ".kvb"


class DiskBlockError(RuntimeError):
    """A block file is missing or does not match its checksum."""


@dataclass(frozen=True)
class DiskBlock:
    block_hash: BlockHash
    token_ids: tuple[int, ...]
    parent_hash: BlockHash | None
    mtime: float


def _checksum(payload: bytes) -> str:
    return blake2b(payload, digest_size=16).hexdigest()


class DiskStore:
    def __init__(self, root: str | Path, layout: dict[str, Any]) -> None:
        described = json.dumps(layout, sort_keys=True)
        self.dir = Path(root) / blake2b(described.encode(), digest_size=8).hexdigest()
        self.dir.mkdir(parents=True, exist_ok=True)
        (self.dir / "layout.json").write_text(described + "\n")

    def path(self, block_hash: BlockHash) -> Path:
        name = block_hash.hex()
        return self.dir / name[:2] / f"{name}{SUFFIX}"

    def write(self, block_hash: BlockHash, parent_hash: BlockHash | None, token_ids: tuple[int, ...],
              payload: bytes) -> None:
        header = json.dumps({
            "hash": block_hash.hex(), "parent": parent_hash.hex() if parent_hash else None,
            "tokens": list(token_ids), "size": len(payload), "blake2b": _checksum(payload),
        }).encode()
        path = self.path(block_hash)
        path.parent.mkdir(exist_ok=True)
        tmp = path.with_suffix(".tmp")
        with open(tmp, "wb") as f:
            f.write(len(header).to_bytes(4, "little"))
            f.write(header)
            f.write(payload)
        os.replace(tmp, path)

    def read(self, block_hash: BlockHash) -> bytes:
        try:
            header, payload = self._read(self.path(block_hash))
        except (OSError, ValueError) as exc:
            raise DiskBlockError(f"KV block file for {block_hash.hex()} is unreadable: {exc}") from None
        if _checksum(payload) != header["blake2b"] or len(payload) != header["size"]:
            raise DiskBlockError(f"KV block file {self.path(block_hash)} does not match its checksum")
        return payload

    def delete(self, block_hash: BlockHash) -> None:
        self.path(block_hash).unlink(missing_ok=True)

    def clear(self) -> None:
        for sub in self.dir.iterdir():
            if sub.is_dir():
                shutil.rmtree(sub, ignore_errors=True)

    def scan(self) -> list[DiskBlock]:
        """Every intact block file, oldest first; files that fail their checksum are deleted (and logged)."""
        blocks = []
        for path in self.dir.glob(f"*/*{SUFFIX}"):
            try:
                header, payload = self._read(path)
                if _checksum(payload) != header["blake2b"] or path.stem != header["hash"]:
                    raise ValueError("checksum or name mismatch")
                parent = bytes.fromhex(header["parent"]) if header["parent"] else None
                blocks.append(DiskBlock(bytes.fromhex(header["hash"]), tuple(header["tokens"]), parent,
                                        path.stat().st_mtime))
            except (OSError, ValueError, KeyError, TypeError) as exc:
                log.warning("dropping corrupt KV block file %s: %s", path, exc)
                path.unlink(missing_ok=True)
        blocks.sort(key=lambda b: b.mtime)
        return blocks

    @staticmethod
    def _read(path: Path) -> tuple[dict[str, Any], bytes]:
        data = path.read_bytes()
        size = int.from_bytes(data[:4], "little")
        if len(data) < 4 + size:
            raise ValueError("truncated header")
        return json.loads(data[4 : 4 + size]), data[4 + size :]
