"""OpenAI request models (strict) and response/error builders.

Validation policy, as the OpenAI API does it: types are strict (``"5"`` is not an integer),
and an unknown field is a 400 ``Unrecognized request argument supplied: NAME``, so a typo never
silently changes a request. Besides OpenAI's fields we accept the common serving extensions
``ignore_eos`` and ``stop_token_ids`` (SGLang, vLLM). Unsupported values of known fields (``n > 1``,
non-zero penalties) are 400s too, and so is every value out of range (seed beyond int64,
temperature, top_p, max_tokens, token ids, logit_bias, stop, NaN/Infinity, nesting deeper than
``MAX_DEPTH``): the engine only ever sees requests it can serve.
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from marconi.engine.request import SamplingParams


class APIError(Exception):
    """An error answered as ``{"error": {...}}`` with an HTTP status (and extra ``headers``,
    e.g. ``Retry-After`` on a 503)."""

    def __init__(
        self,
        message: str,
        status: int = 400,
        code: str | None = None,
        param: str | None = None,
        type: str = "invalid_request_error",
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message, self.status, self.code, self.param = message, status, code, param
        self.type, self.headers = type, headers

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


#: Nesting deeper than this is a 400 (the deepest valid body, chat content parts, has 5 levels).
MAX_DEPTH = 16
#: OpenAI's seed is an int64; torch's generator takes any of these.
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
_TOKEN_LIMIT = 2**31 - 1  # token ids and token counts: int32, far beyond any vocab/context

TokenId = Annotated[int, Field(ge=0, le=_TOKEN_LIMIT)]
TokenCount = Annotated[int, Field(ge=1, le=_TOKEN_LIMIT)]
NonEmptyStr = Annotated[str, Field(min_length=1)]
BiasKey = Annotated[str, Field(pattern=r"^[0-9]{1,10}$")]  # a token id, as OpenAI's JSON keys
BiasValue = Annotated[float, Field(ge=-100.0, le=100.0)]


def json_depth(value: Any) -> int:
    """Nesting depth of a decoded JSON value (scalars 0), iteratively (no recursion limit)."""
    deepest, todo = 0, [(value, 1)]
    while todo:
        v, d = todo.pop()
        children = v.values() if isinstance(v, dict) else v if isinstance(v, list) else None
        if children is None:
            continue
        deepest = max(deepest, d)
        if d <= MAX_DEPTH:  # deeper is already an error: stop walking
            todo.extend((c, d + 1) for c in children)
    return deepest


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class StreamOptions(_Strict):
    include_usage: bool = False


class _Common(_Strict):
    """Every range is checked here, before the engine sees a request (``SamplingParams``
    re-checks its own invariants)."""

    model: str | None = None
    max_tokens: TokenCount | None = None
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    n: int | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)
    logit_bias: dict[BiasKey, BiasValue] | None = Field(None, max_length=2048)
    user: str | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    ignore_eos: bool = False
    stop_token_ids: list[TokenId] | None = Field(None, max_length=256)

    @model_validator(mode="before")
    @classmethod
    def _not_too_deep(cls, body: Any) -> Any:
        if json_depth(body) > MAX_DEPTH:
            raise ValueError(f"the body is nested more than {MAX_DEPTH} levels deep")
        return body

    @field_validator("stop")
    @classmethod
    def _stops(cls, v: str | list[str] | None) -> str | list[str] | None:
        stops = [v] if isinstance(v, str) else v or []
        if len(stops) > 4 or any(not s for s in stops):
            raise ValueError("up to 4 non-empty strings")
        return v

    def sampling_params(self, max_tokens: int | None) -> SamplingParams:
        if self.n not in (None, 1):
            raise APIError("only n=1 is supported", param="n", code="unsupported_value")
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name) not in (None, 0, 0.0):
                raise APIError(f"{name} is not supported", param=name, code="unsupported_value")
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            stop=tuple(stop),
            stop_token_ids=tuple(self.stop_token_ids or ()),
            ignore_eos=self.ignore_eos,
            seed=self.seed,
            logit_bias=tuple((int(k), float(v)) for k, v in (self.logit_bias or {}).items()),
        )

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_Common):
    prompt: str | list[str] | list[TokenId] | list[list[TokenId]]
    max_tokens: TokenCount | None = 16  # OpenAI's default for completions

    def single_prompt(self) -> str | list[int]:
        p = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], str | list):
            if len(p) != 1:
                raise APIError("only one prompt per request is supported", param="prompt")
            p = p[0]
        if len(p) == 0:
            raise APIError("the prompt is empty", param="prompt", code="empty_prompt")
        return p  # type: ignore[return-value]


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    """OpenAI allows ``content: null`` only on assistant messages that carry ``tool_calls``,
    which this server does not support: content is always text or text parts."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart]
    name: str | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage]
    max_completion_tokens: TokenCount | None = None

    def effective_max_tokens(self) -> int | None:
        return (
            self.max_completion_tokens
            if self.max_completion_tokens is not None
            else (self.max_tokens)
        )


#: pydantic error types that mean "right type, value out of range" (the rest: wrong type).
_VALUE_ERRORS = (
    "greater_than",
    "less_than",
    "too_long",
    "too_short",
    "string_too_short",
    "string_pattern_mismatch",
    "value_error",
    "finite_number",
    "literal_error",
)


def parse(model: type[_Strict], body: Any) -> Any:
    """Validate a decoded JSON body; the first problem becomes a 400 naming the field."""
    if not isinstance(body, dict):
        raise APIError("the request body must be a JSON object")
    try:
        return model.model_validate(body)
    except ValidationError as e:
        errors = e.errors(include_url=False)
        # a range error says more than the type mismatches of a union's other members
        err = next((x for x in errors if x["type"].startswith(_VALUE_ERRORS)), errors[0])
        loc = ".".join(str(x) for x in err["loc"]) or "body"
        if err["type"] == "extra_forbidden":
            raise APIError(
                f"Unrecognized request argument supplied: {loc}",
                param=loc,
                code="unrecognized_argument",
            ) from None
        if err["type"] == "missing":
            raise APIError(f"missing required field: {loc}", param=loc, code="missing") from None
        code = "invalid_value" if err["type"].startswith(_VALUE_ERRORS) else "invalid_type"
        raise APIError(f"invalid {loc}: {err['msg']}", param=loc, code=code) from None


# ---------------------------------------------------------------------- responses
def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def usage(prompt: int, completion: int, cached: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def completion_body(
    rid: str, model: str, choice: dict[str, Any], chat: bool, chunk: bool, use: dict | None
) -> dict[str, Any]:
    obj = "chat.completion" if chat else "text_completion"
    body: dict[str, Any] = {
        "id": rid,
        "object": obj + (".chunk" if chunk and chat else ""),
        "created": int(time.time()),
        "model": model,
        "choices": [choice] if choice else [],
    }
    if use is not None or not chunk:
        body["usage"] = use
    return body


def choice(text: str, finish: str | None, chat: bool, chunk: bool, role: bool = False) -> dict:
    if not chat:
        return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
    if chunk:
        delta: dict[str, Any] = {"role": "assistant"} if role else {}
        if text or role:
            delta["content"] = text
        return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
    msg = {"role": "assistant", "content": text}
    return {"index": 0, "message": msg, "logprobs": None, "finish_reason": finish}
