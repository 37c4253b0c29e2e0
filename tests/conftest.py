"""Test-wide setup. Without a GPU, Triton kernels run under the Triton interpreter (set before triton is imported)."""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
