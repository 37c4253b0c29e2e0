"""Chained block hashes: the identity of a full block of tokens in the prefix cache.

Block i's hash is ``blake2b-128(hash_{i-1}, tokens of block i, extra)``, where ``extra`` (block 0 only) carries the
model identity and the request's cache salt, so different models or tenants never share blocks. A block that holds
part of an image (a run of placeholder tokens, engine/multimodal.py) mixes in that image's content hash and where the
block cuts it, so the same image hits and a different one at the same place misses from that block on. A request
computes each hash once, when its block fills (`BlockHasher.extend`); lookup, commit, admission order and the prefix-cache
simulator all reuse the request's list instead of hashing a prompt again.
"""
from __future__ import annotations

from array import array
from hashlib import blake2b
from typing import Sequence

from engine.multimodal import ImageInput

BlockHash = bytes  # 16 bytes: 128 bits make an accidental collision practically impossible; tokens are checked anyway


def hash_block(parent: BlockHash | None, token_ids: Sequence[int], extra: bytes = b"") -> BlockHash:
    """Chained hash of one full block: depends on every token before it, and on ``extra`` (only used for block 0)."""
    h = blake2b(digest_size=16)
    h.update(parent if parent is not None else b"root")
    h.update(len(extra).to_bytes(4, "little"))
    h.update(extra)
    h.update(array("q", token_ids).tobytes())
    return h.digest()


def block_extra(model_id: str, cache_salt: str | None) -> bytes:
    """What block 0 mixes in: the model identity and the tenant's salt, so neither ever shares blocks across."""
    return f"{model_id}\0{cache_salt or ''}".encode()


def image_extra(images: Sequence[ImageInput], start: int, end: int) -> bytes:
    """What a block of tokens ``[start, end)`` mixes in for the images it overlaps: each one's content hash and
    offset relative to the block (empty for a block without images)."""
    return b"".join(b"img" + image.content_hash + (image.offset - start).to_bytes(8, "little", signed=True)
                    for image in images if image.offset < end and image.end > start)


class BlockHasher:
    """Extends a sequence's hash list as its blocks fill: O(new tokens) per call, whatever the context length."""

    def __init__(self, block_size: int, model_id: str = "") -> None:
        self.block_size = block_size
        self.model_id = model_id

    def extend(self, hashes: list[BlockHash], token_ids: Sequence[int], cache_salt: str | None,
               images: Sequence[ImageInput] = ()) -> None:
        """Append the hashes of the full blocks of ``token_ids`` that ``hashes`` does not cover yet; ``images``: the
        prompt's (engine/multimodal.py)."""
        bs = self.block_size
        for i in range(len(hashes), len(token_ids) // bs):
            extra = block_extra(self.model_id, cache_salt) if i == 0 else b""
            if images:
                extra += image_extra(images, i * bs, (i + 1) * bs)
            hashes.append(hash_block(hashes[-1] if i else None, token_ids[i * bs : (i + 1) * bs], extra))

    def hashes(self, token_ids: Sequence[int], cache_salt: str | None,
               images: Sequence[ImageInput] = ()) -> list[BlockHash]:
        """Every full block's hash of ``token_ids`` (for one-off lookups: /tokenize, the simulator)."""
        out: list[BlockHash] = []
        self.extend(out, token_ids, cache_salt, images)
        return out
