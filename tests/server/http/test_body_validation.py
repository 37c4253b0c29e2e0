"""A request body's validation errors name the field, and unknown fields are ignored."""
from __future__ import annotations

import pytest

from server.api.protocol import APIError, ChatCompletionRequest
from server.http.http_io import parse_body


def test_validation_errors_name_the_field() -> None:
    with pytest.raises(APIError) as err:
        parse_body(ChatCompletionRequest, {"messages": [{"role": "user", "content": "x"}], "top_p": 2})
    assert err.value.status == 400 and err.value.param == "top_p"
    with pytest.raises(APIError) as err:
        parse_body(ChatCompletionRequest, {"messages": [1]})
    assert err.value.param == "messages.0"
    # Unknown fields are ignored: agents send OpenAI options the server does not use.
    req = parse_body(ChatCompletionRequest, {"messages": [{"role": "user"}], "parallel_tool_calls": True})
    assert req.n == 1
