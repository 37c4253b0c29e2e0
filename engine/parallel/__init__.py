"""Tensor and expert parallelism over torch.distributed: one process per rank, rank 0 schedules (docs/PARALLEL.md)."""
