"""CPU-throughput guard: `kvserve bench throughput` (smollm2-135m, real weights) against HF transformers in the same
run must keep a clear lead. A small workload (16 sequences, lengths 32-128, torch on one thread for both sides, so
that a preempted partner thread cannot stall either) gave 2.05x in 64 s on a busy two-core machine (2026-12-02,
load 8-10); the bound, 1.2x, is far enough below it that noise cannot fail the test, and a large regression (the
native decode attention or the packed linears lost, per-step work growing with the batch) still does."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

# With the CPU kernels turned off (KVSERVE_CPU_KERNELS=0: the native decode attention and packed linears this lead
# comes from) kvserve must still not fall behind: 1.20x measured that way (2026-12-03, the whole suite on two workers).
MIN_RATIO = 1.2 if os.environ.get("KVSERVE_CPU_KERNELS", "1") != "0" else 1.0


@pytest.mark.slow
@pytest.mark.slow
def test_kvserve_keeps_its_lead_over_hf_on_cpu(tmp_path: Path) -> None:
    out = tmp_path / "throughput.json"
    subprocess.run([sys.executable, "-m", "server.cli", "bench", "throughput", "--num-seqs", "16", "--min-len", "32",
                    "--max-len", "128", "--threads", "1", "--json", str(out), "--out-dir", str(tmp_path)],
                   check=True, timeout=1200)
    result = json.loads(out.read_text())
    print(f"\nkvserve {result['kvserve_tokens_per_s']:.1f} tok/s, HF {result['hf_tokens_per_s']:.1f} tok/s: "
          f"{result['ratio']:.2f}x")
    assert result["ratio"] >= MIN_RATIO, result
