"""The disk KV tier's files: one file per block, named by its block hash, checksummed, under a directory per KV
layout, so that a restart of the same model with the same settings finds its blocks again.

    DIR/<layout id>/layout.json          what the layout id stands for (model, block size, dtype, tensor shapes)
    DIR/<layout id>/<h[:2]>/<hash>.kvb   header length (4 bytes, little-endian), header (JSON), payload

The header records the block's parent hash and token ids (a restart rebuilds the chain index from them, and a hit
checks the tokens as the device tree does), the payload size and its blake2b-128 checksum, and how many bytes at the
payload's end are a hybrid model's recurrent-state snapshot at the block's end (0: none). Files are written to a
temporary name and renamed, so a crash never leaves half a block under a real name. The block hash already
carries the model identity and the cache salt (engine/kv/block_hashing.py); the layout id keeps a different dtype or
block size from reading the bytes wrongly. Bytes only: the model runner turns tensors into payloads.

Every tenant's token ids are in these files: directories are created 0700 and files 0600. Whatever else is found
under the directory is skipped at start-up without blocking (a directory or a FIFO named like a block is never
opened), and a block that fails its checksum is deleted if it can be, skipped either way.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import stat
import time
from dataclasses import dataclass
from hashlib import blake2b
from pathlib import Path
from typing import Any

from engine.kv.block_hashing import BlockHash

log = logging.getLogger(__name__)
SUFFIX = ".kvb"
STALE_TMP_S = 600.0  # a write's .tmp file older than this at a scan was left by a process that died mid-write


class DiskBlockError(RuntimeError):
    """A block file is missing or does not match its checksum."""


@dataclass(frozen=True)
class DiskBlock:
    block_hash: BlockHash
    token_ids: tuple[int, ...]
    parent_hash: BlockHash | None
    mtime: float
    has_state: bool = False  # the file carries the snapshot at the block's end


def _checksum(payload: bytes) -> str:
    return blake2b(payload, digest_size=16).hexdigest()


def _write_private(path: Path, chunks: list[bytes]) -> None:
    """Write ``path`` readable by its owner only."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "wb") as f:
        for chunk in chunks:
            f.write(chunk)


def _read_regular(path: Path, max_bytes: int | None = None) -> bytes:
    """The bytes of a regular file; OSError for anything else, never blocking on a FIFO or following a link, and
    for a file over ``max_bytes`` before reading any of it (an oversized file was read and hashed whole)."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW)
    with os.fdopen(fd, "rb") as f:
        info = os.fstat(f.fileno())
        if not stat.S_ISREG(info.st_mode):
            raise OSError(f"{path} is not a regular file")
        if max_bytes is not None and info.st_size > max_bytes:
            raise OSError(f"{path} is {info.st_size} bytes, more than a block file can be ({max_bytes})")
        return f.read()


HEADER_BYTES = 64 * 1024  # room for a block file's header (hashes, the block's token ids) beyond its payload


class DiskStore:
    """``max_payload_bytes``: the most a block's payload (its pages and snapshot) can be; a file larger than that
    and a header is refused before it is read (None: unchecked)."""

    def __init__(self, root: str | Path, layout: dict[str, Any], max_payload_bytes: int | None = None) -> None:
        self.max_file_bytes = None if max_payload_bytes is None else 4 + HEADER_BYTES + max_payload_bytes
        described = json.dumps(layout, sort_keys=True)
        self.dir = Path(root) / blake2b(described.encode(), digest_size=8).hexdigest()
        self.dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        _write_private(self.dir / "layout.json", [described.encode() + b"\n"])

    def path(self, block_hash: BlockHash) -> Path:
        name = block_hash.hex()
        return self.dir / name[:2] / f"{name}{SUFFIX}"

    def write(self, block_hash: BlockHash, parent_hash: BlockHash | None, token_ids: tuple[int, ...],
              payload: bytes, state_bytes: int = 0) -> None:
        """``state_bytes``: the payload ends with that many bytes of snapshot."""
        header = json.dumps({
            "hash": block_hash.hex(), "parent": parent_hash.hex() if parent_hash else None,
            "tokens": list(token_ids), "size": len(payload), "blake2b": _checksum(payload),
            "state_bytes": state_bytes,
        }).encode()
        path = self.path(block_hash)
        path.parent.mkdir(exist_ok=True, mode=0o700)
        tmp = path.with_suffix(".tmp")
        try:
            _write_private(tmp, [len(header).to_bytes(4, "little"), header, payload])
            os.replace(tmp, path)
        except BaseException:
            self._remove(tmp)  # a failed write (a full disk) leaves no .tmp behind
            raise

    def read(self, block_hash: BlockHash) -> bytes:
        """The block's payload; `DiskBlockError` when its file is missing, unreadable or fails its checksum."""
        try:
            header, payload = self._read(self.path(block_hash))
            intact = _checksum(payload) == header["blake2b"] and len(payload) == header["size"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise DiskBlockError(f"KV block file for {block_hash.hex()} is unreadable: {exc}") from None
        if not intact:
            raise DiskBlockError(f"KV block file {self.path(block_hash)} does not match its checksum")
        return payload

    def delete(self, block_hash: BlockHash) -> None:
        self._remove(self.path(block_hash))

    def clear(self) -> None:
        for sub in self.dir.iterdir():
            if sub.is_dir():
                shutil.rmtree(sub, ignore_errors=True)

    def scan(self) -> list[DiskBlock]:
        """Every intact block file, oldest first. Entries that are not regular files are skipped; files that fail
        their checksum are deleted where possible; both are logged."""
        blocks = []
        for path in self._entries():
            try:
                header, payload = self._read(path)
                if _checksum(payload) != header["blake2b"] or path.stem != header["hash"]:
                    raise ValueError("checksum or name mismatch")
                parent = bytes.fromhex(header["parent"]) if header["parent"] else None
                blocks.append(DiskBlock(bytes.fromhex(header["hash"]), tuple(header["tokens"]), parent,
                                        path.lstat().st_mtime, header.get("state_bytes", 0) > 0))
            except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
                log.warning("dropping unusable KV block file %s: %s", path, exc)
                self._remove(path)
        blocks.sort(key=lambda b: b.mtime)
        return blocks

    def _entries(self) -> list[Path]:
        """The regular files named like blocks, one directory level down; anything else there is logged and left."""
        found = []
        for sub in self.dir.iterdir():
            if not sub.is_dir() or sub.is_symlink():
                continue
            for entry in os.scandir(sub):
                if entry.name.endswith(".tmp"):
                    self._remove_stale_tmp(Path(entry.path))
                if not entry.name.endswith(SUFFIX):
                    continue
                if entry.is_file(follow_symlinks=False):
                    found.append(Path(entry.path))
                else:
                    log.warning("skipping %s in the KV disk tier: not a regular file", entry.path)
        return found

    def _remove_stale_tmp(self, path: Path) -> None:
        """A write's temporary file that no write can still be making (a process killed mid-write left it)."""
        try:
            stale = time.time() - path.lstat().st_mtime > STALE_TMP_S
        except OSError:
            return
        if stale:
            self._remove(path)

    @staticmethod
    def _remove(path: Path) -> None:
        try:
            path.unlink(missing_ok=True)
        except OSError as exc:
            log.warning("cannot delete KV block file %s (%s); it stays unused", path, exc)

    def _read(self, path: Path) -> tuple[dict[str, Any], bytes]:
        data = _read_regular(path, self.max_file_bytes)
        size = int.from_bytes(data[:4], "little")
        if len(data) < 4 + size:
            raise ValueError("truncated header")
        return json.loads(data[4 : 4 + size]), data[4 + size :]
