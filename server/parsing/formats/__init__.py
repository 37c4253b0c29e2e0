"""Each model family's tool-call format, one module a dialect: the tags and tokens that open and close a call and how
its name and arguments are written. They share the state machine in `server/parsing/tool_stream.py` and the JSON
call parser in `server/parsing/json_call.py`; `server/parsing/registry.py` says which family speaks which."""
