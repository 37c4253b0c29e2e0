"""Kernels: pure-torch references and Triton twins with the same signatures, chosen through `kernels.ops`."""
