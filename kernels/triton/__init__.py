"""The Triton kernels, one module per op family, each with its pure-torch twin in `kernels.reference`; `kernels/triton/ops.py` gathers them into the Triton op set."""
