"""`kvserve bench structured`: the same batch decoded with 0%, 50% and 100% of its rows constrained, in one run."""
from __future__ import annotations

import json

import pytest

from server.cli import build_parser


@pytest.mark.slow
def test_bench_structured_reports_every_fraction(tmp_path, capsys):
    out = tmp_path / "out"
    args = build_parser().parse_args(["bench", "structured", "--batch", "4", "--max-tokens", "6", "--prompt-tokens",
                                      "4", "--repeats", "1", "--out-dir", str(out), "--json", str(tmp_path / "f.json")])
    assert args.func(args) == 0
    figures = json.loads((tmp_path / "f.json").read_text())
    runs = figures["runs"]
    assert [r["constrained_rows"] for r in runs] == [0, 2, 4]
    assert all(r["tokens_per_s"] > 0 for r in runs)
    assert runs[2]["mask_ms_per_step"]["fill_s"] > 0 and runs[0]["mask_ms_per_step"]["fill_s"] == 0
    printed = capsys.readouterr().out
    assert "| 50% (2/4) |" in printed and (out / "structured.md").read_text() in printed
