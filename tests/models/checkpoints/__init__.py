"""Tiny checkpoints in the released layouts, written by transformers' own classes for the parity tests beside this
package (hybrid, gpt-oss, vision-language, FP8), and the logprob-drift measure."""
