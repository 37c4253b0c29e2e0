"""Speculative decoding: proposers that draft tokens without a model (the request's own text, the session's earlier
prompts and replies) and the exact acceptance rules that verify drafts against the target model's distribution.

- `ngram.py`     prompt lookup: the latest earlier occurrence of the request's last n tokens, and what followed it
- `suffix.py`    a bounded-depth suffix tree over a session's finished prompts and replies, with counts
- `acceptance.py` greedy acceptance by equality and the rejection-sampling rule that keeps the target distribution
"""
