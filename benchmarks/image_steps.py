"""A bystander's inter-token gap while another request sends several screenshots, with the vision tower inside the
step budget (engine/sched/image_encoding.py) and without it (``--max-image-tokens-per-step 0``: each image encoded
whole in the step whose prefill chunk first reaches it), side by side in one run.

The model is the registry's qwen3.6-tiny with the image processor's pixel bound of the released Qwen3.5 / 3.6
checkpoints (16,777,216 pixels, not the tiny model's 65,536), so a 1280 x 800 screenshot is 1,000 image tokens as
the real models read it. One text request decodes; then a request with ``--images`` screenshots arrives; every
token of the bystander's is timed on the engine's own step loop. Each setting runs ``--rounds`` times, alternating,
and each figure is the median over rounds.

    python -m benchmarks.image_steps --images 6 --rounds 2
"""
from __future__ import annotations

import argparse
import io
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from engine.config import EngineConfig
from engine.core.engine import LLMEngine
from engine.multimodal import expand_placeholders
from engine.registry import resolve_model
from engine.requests import EngineRequest
from engine.sampling_params import SamplingParams

RELEASED_MAX_PIXELS = 16_777_216  # Qwen3.5 / 3.6's preprocessor_config.json: longest_edge
SETTINGS = {"unbounded (before)": 0, "in the step budget": None}


def screenshot(width: int, height: int, seed: int) -> bytes:
    """A PNG of random pixels (noise: what the tower reads, not what it shows, sets its cost)."""
    from PIL import Image

    pixels = np.random.RandomState(seed).randint(0, 256, (height, width, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return buf.getvalue()


def model_dir(root: Path) -> Path:
    """qwen3.6-tiny with the released checkpoints' pixel bound."""
    out = root / "qwen3.6-tiny-released-pixels"
    shutil.copytree(resolve_model("qwen3.6-tiny"), out)
    config = json.loads((out / "preprocessor_config.json").read_text())
    config["size"]["longest_edge"] = RELEASED_MAX_PIXELS
    (out / "preprocessor_config.json").write_text(json.dumps(config))
    return out


def one_round(path: Path, bound: int | None, opts: argparse.Namespace) -> dict[str, float]:
    engine = LLMEngine(path, EngineConfig(device="cpu", max_num_batched_tokens=opts.budget, num_kv_blocks=4096,
                                          max_image_tokens_per_step=bound, encoder_cache_mb=1024),
                       model_id="bench-images")
    tokenizer, preprocessor = engine.tokenizer, engine.image_preprocessor
    pad = tokenizer.convert_tokens_to_ids("<|image_pad|>")
    images = [preprocessor.preprocess(screenshot(1280, 800, seed=i)) for i in range(opts.images)]
    text = "".join(f"Screenshot {i}: <|vision_start|><|image_pad|><|vision_end|>\n" for i in range(opts.images))
    prompt = expand_placeholders(tokenizer.encode(text + "What changed?", add_special_tokens=False), images, pad)
    greedy = SamplingParams(temperature=0, ignore_eos=True, max_tokens=opts.bystander_tokens)
    engine.add(engine.prepare(EngineRequest("bystander", tokenizer.encode("Tell me a story.") * 8, greedy)))
    stamps: list[float] = []
    first_token: float | None = None
    sent = None
    vision, most_encoded = engine.runner.vision, 0
    while engine.has_unfinished_requests():
        encoded = vision.num_encoded
        outs = engine.step()
        most_encoded = max(most_encoded, vision.num_encoded - encoded)
        for out in outs:
            now = time.perf_counter()
            if out.request_id == "bystander":
                stamps.append(now)
            elif first_token is None:
                first_token = now - sent
        if sent is None and len(stamps) == 8:  # the bystander is decoding: the screenshots arrive
            sent = time.perf_counter()
            engine.add(engine.prepare(EngineRequest("images", prompt.token_ids, SamplingParams(max_tokens=1),
                                                    images=prompt.images)))
    engine.close()
    gaps = np.diff([s for s in stamps if s >= sent])
    return {"worst_gap_s": float(gaps.max()), "p90_gap_s": float(np.percentile(gaps, 90)),
            "images_ttft_s": float(first_token), "most_images_in_a_step": most_encoded,
            "image_tokens": sum(i.num_tokens for i in images)}


def run(opts: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        path = model_dir(Path(tmp))
        runs: dict[str, list[dict[str, float]]] = {name: [] for name in SETTINGS}
        for _ in range(opts.rounds):
            for name, bound in SETTINGS.items():
                runs[name].append(one_round(path, bound, opts))
    return {name: {key: statistics.median(r[key] for r in rounds) for key in rounds[0]}
            for name, rounds in runs.items()}


def markdown(figures: dict[str, Any]) -> str:
    before, after = figures.values()
    rows = ["| | " + " | ".join(figures) + " | ratio |", "|---|---|---|---|"]
    for key, label in (("most_images_in_a_step", "most images the tower encoded in one step"),
                       ("worst_gap_s", "bystander's worst inter-token gap (s)"),
                       ("p90_gap_s", "bystander's p90 inter-token gap (s)"),
                       ("images_ttft_s", "the screenshots' request: first token (s)")):
        rows.append(f"| {label} | {before[key]:.3g} | {after[key]:.3g} | {after[key] / before[key]:.2f}x |")
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=6, help="1280 x 800 screenshots in the request")
    parser.add_argument("--budget", type=int, default=2048, help="--max-num-batched-tokens")
    parser.add_argument("--bystander-tokens", type=int, default=120, help="tokens the bystander decodes")
    parser.add_argument("--rounds", type=int, default=2, help="runs of each setting, alternating")
    figures = run(parser.parse_args())
    print(json.dumps(figures, indent=1))
    print(markdown(figures))


if __name__ == "__main__":
    main()
