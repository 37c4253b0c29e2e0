"""Prefix-cache benchmark: agent workloads, trace replay, a KV-manager simulator, miss attribution and reports."""
