"""The scheduler (the only owner of the KV manager and the request queues) and the running sequences' per-step state."""
