"""Where model directories come from: deterministic tiny random models, GGUF conversion, the HF hub."""
