"""The neutral path every API shares: the turn, the served context and its prepare lanes, submitting to the engine, engine outputs to deltas, usage, logprobs, the recorder."""
