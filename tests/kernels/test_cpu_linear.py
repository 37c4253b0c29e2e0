"""Packed CPU linears (kernels/cpu/linear.py): every plain linear layer of a model becomes a `PackedLinear` that
computes what ``F.linear`` does, keeping the dense parameters (tied weights stay tied); other layers are left alone.
What is packed follows what the machine reports (bf16 needs AVX-512 BF16 / AMX; ``KVSERVE_CPU_KERNELS=0`` turns
packing off), and both branches run on every machine: the unsupported one by a patched capability."""
from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from kernels.cpu import linear as cpu_linear


class QuantLinear(nn.Linear):
    """Stands for an FP8 / quantized subclass: it computes differently, so packing must skip it."""


KERNELS_ON = os.environ.get("KVSERVE_CPU_KERNELS", "1") != "0"


def test_onednn_is_available_unless_turned_off() -> None:
    """The project's torch builds have oneDNN: the CPU op set must not silently run unpacked."""
    assert cpu_linear.available() == KERNELS_ON


@pytest.mark.parametrize("bf16", ["as this machine reports", "unsupported"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_model_matches_the_dense_one(dtype: torch.dtype, bf16: str, monkeypatch: pytest.MonkeyPatch) -> None:
    if bf16 == "unsupported":  # an AVX2-only CPU
        monkeypatch.setattr(cpu_linear, "bf16_supported", lambda: False)
    packs = KERNELS_ON and (dtype == torch.float32 or cpu_linear.bf16_supported())
    torch.manual_seed(0)
    embed = nn.Embedding(97, 48)
    model = nn.ModuleDict({"proj": nn.Linear(48, 80, bias=True), "head": nn.Linear(48, 97, bias=False),
                           "quant": QuantLinear(48, 16), "embed": embed}).to(dtype)
    model["head"].weight = model["embed"].weight  # tied, as in SmolLM2
    x = torch.randn(5, 3, 48, dtype=dtype)
    expected = {name: F.linear(x, model[name].weight, model[name].bias) for name in ("proj", "head")}

    assert cpu_linear.pack_linears(model) == (2 if packs else 0)
    kind = cpu_linear.PackedLinear if packs else nn.Linear
    assert type(model["proj"]) is kind and type(model["head"]) is kind
    assert type(model["quant"]) is QuantLinear
    assert model["head"].weight is model["embed"].weight
    tol = {torch.float32: 1e-5, torch.bfloat16: 2e-2}[dtype]
    with torch.inference_mode():
        for name, want in expected.items():
            got = model[name](x)
            assert got.shape == want.shape and got.dtype == dtype
            torch.testing.assert_close(got, want, rtol=tol, atol=tol)
        assert model["proj"](x[:0, 0]).shape == (0, 80)  # an empty batch (a step with no sampling rows)


def test_kernels_off_leave_the_layers_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVSERVE_CPU_KERNELS", "0")
    model = nn.Sequential(nn.Linear(8, 8))
    assert cpu_linear.pack_linears(model) == 0 and type(model[0]) is nn.Linear
