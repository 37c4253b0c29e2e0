"""The cache inspector (`kvserve serve --ui`, `kvserve inspect`): what the model saw on each call of an agent
session, and what of it came from the cache.

- store.py: the last N finished requests in sessions, their tokens in prompt_trie.py (once per shared prefix), the
  cache's gauges over time;
- attribution.py: where a request's prompt leaves its session's previous context, and each missed token's cause
  (the names and rules of server/cache/miss_causes.py, shared with the prefix benchmark);
- hook.py: what server/pipeline/generation.py hands over when a request finishes;
- views.py: the JSON the page and the CLI read, cut to the caller's tenant; routes.py: /ui and /ui/api/*;
- static/: the page (HTML, CSS, one script; no build step, nothing from a CDN).
"""
