"""`kvserve bench spec`: every method on the same requests in one run, outputs compared, decode rate apart."""
from __future__ import annotations

import json

import torch

from server.cli import build_parser


def test_bench_spec_reports_every_method_with_identical_outputs(tmp_path, capsys):
    threads = torch.get_num_threads()
    args = build_parser().parse_args(["bench", "spec", "--model", "qwen3-tiny", "--workload", "edit", "--requests",
                                      "1", "--max-tokens", "6", "--code-lines", "4", "--json",
                                      str(tmp_path / "f.json")])
    try:
        assert args.func(args) == 0
    finally:
        torch.set_num_threads(threads)
    figures = json.loads((tmp_path / "f.json").read_text())["workloads"]["edit"]
    assert list(figures) == ["off", "ngram", "suffix"]
    for f in figures.values():
        assert f["identical_outputs"] and f["tokens"] == 6 and f["decode_tokens_per_s"] > 0 and f["cpu_seconds"] > 0
    assert figures["off"]["decode_speedup"] == 1.0
    printed = capsys.readouterr().out
    assert "| edit | ngram | 6 |" in printed and "torch threads: 1" in printed
