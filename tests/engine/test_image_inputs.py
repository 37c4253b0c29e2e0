"""Images before the model: decoding with its limits (corrupt, truncated, bombs: refused before expansion), the
content hash (what the model sees), placeholders expanded, the block hashes over image spans, mRoPE positions and
the encoder cache's LRU budget."""
from __future__ import annotations

import io
import struct
import zlib

import numpy as np
import pytest
import torch

from engine.kv.block_hashing import BlockHasher
from engine.models.vision.encoder_cache import EncoderCache
from engine.models.vision.preprocess import ImageError, ImagePreprocessor
from engine.multimodal import ImageInput, check_layout, expand_placeholders, image_positions, position_shift
from tests.models.checkpoints.vision_models import PREPROCESSOR, png

PAD = 9  # a placeholder token id for the unit tests


@pytest.fixture(scope="module")
def preprocessor(tmp_path_factory) -> ImagePreprocessor:
    import json

    path = tmp_path_factory.mktemp("processor")
    (path / "preprocessor_config.json").write_text(json.dumps(PREPROCESSOR))
    return ImagePreprocessor.from_model_dir(path)


def _png_header_only(width: int, height: int) -> bytes:
    """A PNG whose header claims ``width`` x ``height`` and whose data is a few bytes: a decompression bomb's
    shape (nothing is expanded if the size is checked first)."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(b"\0" * 16)) + chunk(b"IEND", b"")


def test_an_image_becomes_patches_and_a_hash_of_what_the_model_sees(preprocessor):
    image = preprocessor.preprocess(png(70, 50, seed=1))
    t, h, w = image.grid_thw
    assert (t, h % 2, w % 2) == (1, 0, 0)
    assert image.pixel_values.shape == (t * h * w, 3 * 2 * 16 * 16)
    assert image.num_tokens == t * h * w // 4
    # the same pixels in another encoding: the same hash; other pixels: another
    from PIL import Image

    buf = io.BytesIO()
    Image.open(io.BytesIO(png(70, 50, seed=1))).save(buf, format="BMP")
    assert preprocessor.preprocess(buf.getvalue()).content_hash == image.content_hash
    assert preprocessor.preprocess(png(70, 50, seed=2)).content_hash != image.content_hash


@pytest.mark.parametrize("data, match", [
    (b"not an image at all", "cannot be read"),
    (png(64, 64, seed=3)[:200], "cannot be read"),  # truncated
    (_png_header_only(40_000, 40_000), "pixels"),  # a bomb: refused from its header
    (b"", "cannot be read"),
])
def test_bad_images_are_refused(preprocessor, data, match):
    with pytest.raises(ImageError, match=match):
        preprocessor.preprocess(data)


def test_too_many_bytes_are_refused_before_decoding(preprocessor):
    small = ImagePreprocessor(preprocessor.processor, 2, max_image_bytes=100)
    with pytest.raises(ImageError, match="bytes"):
        small.preprocess(png(64, 64, seed=4))


def _image(offset: int, h: int, w: int, key: bytes = b"a" * 16) -> ImageInput:
    return ImageInput(key, (1, 2 * h, 2 * w), 2, offset, np.zeros((4 * h * w, 4), dtype=np.float32))


def test_placeholders_expand_to_each_images_tokens():
    images = [_image(0, 2, 3), _image(0, 1, 1, b"b" * 16)]
    prompt = expand_placeholders([1, PAD, 2, 3, PAD, 4], images, PAD)
    assert prompt.token_ids == [1] + [PAD] * 6 + [2, 3, PAD, 4]
    assert [i.offset for i in prompt.images] == [1, 9]
    assert check_layout(prompt.images, prompt.token_ids, PAD) is None
    assert "placeholder" in check_layout(prompt.images[:1], prompt.token_ids, PAD)
    with pytest.raises(ValueError, match="2 image placeholders for 1 images"):
        expand_placeholders([PAD, PAD], images[:1], PAD)


def test_positions_match_transformers_rope_index():
    """A 2x3 image then a 1x1 image inside text: transformers' Qwen3.5 get_rope_index, token by token."""
    from transformers import Qwen3_5Config
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5Model

    images = [_image(2, 2, 3), _image(10, 1, 1, b"b" * 16)]
    ids = [1, 2] + [PAD] * 6 + [3, 4] + [PAD] + [5, 6, 7]
    index = np.arange(len(ids))
    mask, image_pos = image_positions(images, index)
    ours = np.stack([index + position_shift(images, index)] * 3)
    ours[:, mask] = image_pos
    holder = type("M", (), {"config": Qwen3_5Config(), "get_vision_position_ids": Qwen3_5Model.get_vision_position_ids})()
    types = torch.tensor([[int(t == PAD) for t in ids]])
    ref, _ = Qwen3_5Model.get_rope_index(holder, torch.tensor([ids]), types,
                                         image_grid_thw=torch.tensor([[1, 4, 6], [1, 2, 2]]))
    assert ours.tolist() == ref[:, 0].tolist()


def test_block_hashes_name_the_image_in_every_block_it_touches():
    hasher = BlockHasher(4, "m")
    ids = [1, 2] + [PAD] * 6 + [3, 4, 5, 6]
    a = hasher.hashes(ids, None, [_image(2, 2, 3, b"a" * 16)])
    b = hasher.hashes(ids, None, [_image(2, 2, 3, b"b" * 16)])
    assert a[0] != b[0] and len(a) == 3  # block 0 holds two of its tokens already
    assert hasher.hashes(ids, None) != a  # the placeholders alone are not the image
    shifted = [1, PAD, PAD, PAD, PAD, PAD, PAD, 2, 3, 4, 5, 6]  # the same image one token earlier
    assert hasher.hashes(shifted, None, [_image(1, 2, 3)])[0] != a[0]


def test_encoder_cache_keeps_the_recent_within_its_budget():
    cache = EncoderCache(budget_bytes=3 * 16)  # three 4-float entries
    calls = []

    def encode(key):
        return lambda: calls.append(key) or torch.full((4,), float(len(calls)))

    for key in (b"a", b"b", b"c", b"a", b"d"):  # "a" used again before "d" arrives: "b" leaves
        cache.get(key, encode(key))
    assert calls == [b"a", b"b", b"c", b"d"]
    assert b"b" not in cache and len(cache) == 3 and cache.used_bytes == 48
    cache.get(b"b", encode(b"b"))
    assert calls[-1] == b"b" and b"c" not in cache
    EncoderCache(8).get(b"big", encode(b"big"))  # larger than the budget: encoded, never kept


def test_images_cross_to_a_core_process_whole():
    from engine.core.wire import decode_request, encode_request, pack, unpack
    from engine.requests import EngineRequest
    from engine.sampling_params import SamplingParams

    image = ImageInput(b"h" * 16, (1, 4, 6), 2, 2, np.random.RandomState(0).rand(24, 8).astype(np.float32))
    request = EngineRequest("r", [1, 2] + [PAD] * 6, SamplingParams(max_tokens=2), images=(image,))
    back = decode_request(unpack(pack(encode_request(request))))
    assert back == request and np.array_equal(back.images[0].pixel_values, image.pixel_values)
