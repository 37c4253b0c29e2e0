"""The building blocks the model families share: rotary embeddings, MLPs and mixtures of experts, MLA, the sparse
indexer and V4's compressor, hyper-connections and quantized linears. A family module (`engine/models/*.py`) composes
these; a block never imports a family other than Llama's norms and attention it extends."""
