"""Vision towers: what turns an image's patches into the embeddings its placeholder tokens stand for
(`engine.models.vision.qwen3_vl`), the image processor that makes those patches (`engine.models.vision.preprocess`)
and the cache of encoded images (`engine.models.vision.encoder_cache`). docs/IMAGES.md."""
