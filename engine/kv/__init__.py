"""Cache groups beyond full-attention blocks (engine/kv/manager.py keeps those): the recurrent-state rows of hybrid
models and their snapshots. Torch-free, like the rest of the KV manager."""
