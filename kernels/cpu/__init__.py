"""Native CPU paths: the decode-attention kernel in C (`kernels/cpu/attention.c`, built on first use) and linear layers with their weights packed once for oneDNN."""
