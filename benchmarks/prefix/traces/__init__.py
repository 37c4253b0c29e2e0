"""Requests as tokens: workloads rendered through a model's template and tokenizer (render), the token requests the
simulator and the engine runs replay (trace), and recorded or published traces read as such (replay, mooncake)."""
