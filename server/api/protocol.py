"""The OpenAI wire format: request bodies (pydantic, validated before anything reaches the engine) and error bodies.

Unknown fields are ignored (agents send many OpenAI options we have no use for, such as `user` or `store`), but a
known field of the wrong type or out of range is a 400 naming the field, and so is a field that would change the
result if it were ignored (server/api/request_fields.py lists every field of each API). `response_format` and `tool_choice` are
checked in depth by server.parsing (they become the grammar the output must match). Responses are plain dicts built
by the handlers: their optional keys must be absent rather than null.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from engine.sampling_params import SEED_MAX, SEED_MIN


TokenId = Annotated[int, Field(ge=0, lt=2**31)]  # out-of-vocabulary ids are the engine's 400


class APIError(Exception):
    """An error answered with the OpenAI shape `{"error": {"message", "type", "param", "code"}}`."""

    def __init__(
        self, status: int, message: str, *, type: str = "invalid_request_error", param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def renamed(self, names: Mapping[str, str]) -> APIError:
        """The same error for an API that calls the field `names[param]` (Responses' `text.format.schema` is chat's
        `response_format.json_schema.schema`); unchanged when its field has no other name."""
        new = names.get(self.param or "")
        if new is None:
            return self
        return APIError(self.status, self.message.replace(self.param, new), type=self.type, param=new, code=self.code)


def validation_error(exc: ValidationError) -> APIError:
    """A pydantic failure as a 400 naming the first offending field (`messages.0.role`, `temperature`)."""
    first = exc.errors()[0]
    param = ".".join(str(part) for part in first["loc"]) or None
    where = f"'{param}': " if param else ""
    return APIError(400, f"{where}{first['msg']}", param=param, code="invalid_value")


class RequestModel(BaseModel):
    """A request body (or part of one): unknown fields are ignored here; server/api/request_fields.py says which of the
    APIs' fields are honoured, refused with a 400, or ignored."""

    model_config = ConfigDict(extra="ignore")


class StreamOptions(RequestModel):
    include_usage: bool = False


class SamplingFields(RequestModel):
    """Fields shared by chat and text completions. Ranges follow the OpenAI API where it defines them."""

    model: str | None = None
    n: int = Field(1, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    seed: int | None = Field(None, ge=SEED_MIN, le=SEED_MAX)
    stop: str | list[str] | None = None
    max_tokens: int | None = Field(None, ge=1)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(None, gt=0.0)
    ignore_eos: bool = False
    stop_token_ids: list[TokenId] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    cache_salt: str | None = Field(None, min_length=1, max_length=256)
    response_format: dict[str, Any] | None = None  # {"type": "text" | "json_object" | "json_schema", ...}
    prompt_logprobs: int | None = Field(None, ge=0, le=20)  # vLLM's extension: each prompt token's logprob
    structured_outputs: dict[str, Any] | None = None  # vLLM's extension: {"regex" | "grammar" | "json" | "choice": ...}
    speculative: Literal["off", "ngram", "suffix", "mtp"] | None = None  # kvserve's: the proposer (--speculative)

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class ChatCompletionRequest(SamplingFields):
    api: ClassVar[str] = "chat"  # its fields in server/api/request_fields.py
    # Messages and tools stay dicts: the renderer validates them precisely, and their key order is prompt bytes.
    messages: list[dict[str, Any]] = Field(min_length=1)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None  # validated against `tools` by server.parsing
    parallel_tool_calls: bool | None = None  # false: at most one tool call (enforced by the grammar)
    prompt_cache_key: str | None = Field(None, max_length=1024)  # the client's session id (recorded, not a salt)
    cached_content: str | None = Field(None, max_length=128)  # a named cache this request continues (/v1/caches)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    # OpenAI's effort for reasoning models: `none`/`minimal` turn thinking off, others on (server.pipeline.plan.effort_kwargs)
    reasoning_effort: str | None = Field(None, max_length=32)

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class CompletionRequest(SamplingFields):
    api: ClassVar[str] = "completions"
    # One prompt (text or token ids) or a batch of them; each becomes its own engine request.
    prompt: str | list[TokenId] | list[str] | list[list[TokenId]]
    max_tokens: int | None = Field(16, ge=0)  # the OpenAI default for text completions; 0: scoring only
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False


class TokenizeRequest(RequestModel):
    model: str | None = None
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True


class DetokenizeRequest(RequestModel):
    model: str | None = None
    tokens: list[int]
