"""The vision towers of engine/models/vision/, against transformers."""
