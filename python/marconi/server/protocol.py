"""OpenAI request models (strict) and response/error builders.

Validation policy, as the OpenAI API does it: types are strict (``"5"`` is not an integer),
and an unknown field is a 400 ``Unrecognized request argument supplied: NAME``, so a typo never
silently changes a request. Besides OpenAI's fields we accept the common serving extensions
``ignore_eos`` and ``stop_token_ids`` (SGLang, vLLM). Unsupported values of known fields (``n > 1``,
non-zero penalties) are 400s too.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from marconi.engine.request import SamplingParams


class APIError(Exception):
    """An error answered as ``{"error": {...}}`` with an HTTP status."""

    def __init__(
        self,
        message: str,
        status: int = 400,
        code: str | None = None,
        param: str | None = None,
        type: str = "invalid_request_error",
    ) -> None:
        super().__init__(message)
        self.message, self.status, self.code, self.param, self.type = (
            message,
            status,
            code,
            param,
            type,
        )

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Strict):
    include_usage: bool = False


class _Common(_Strict):
    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    n: int | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None

    def sampling_params(self, max_tokens: int | None) -> SamplingParams:
        if self.n not in (None, 1):
            raise APIError("only n=1 is supported", param="n", code="unsupported_value")
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name) not in (None, 0, 0.0):
                raise APIError(f"{name} is not supported", param=name, code="unsupported_value")
        if max_tokens is not None and max_tokens < 1:
            raise APIError(
                f"max_tokens must be at least 1, got {max_tokens}",
                param="max_tokens",
                code="invalid_value",
            )
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stop) > 4 or any(not s for s in stop):
            raise APIError("stop: up to 4 non-empty strings", param="stop", code="invalid_value")
        bias = []
        for k, v in (self.logit_bias or {}).items():
            if not k.isdigit() or not -100 <= v <= 100:
                raise APIError(
                    "logit_bias maps token ids to values in [-100, 100]", param="logit_bias"
                )
            bias.append((int(k), float(v)))
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            stop=tuple(stop),
            stop_token_ids=tuple(self.stop_token_ids or ()),
            ignore_eos=self.ignore_eos,
            seed=self.seed,
            logit_bias=tuple(bias),
        )

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_Common):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16  # OpenAI's default for completions

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
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None

    def effective_max_tokens(self) -> int | None:
        return (
            self.max_completion_tokens
            if self.max_completion_tokens is not None
            else (self.max_tokens)
        )


def parse(model: type[_Strict], body: Any) -> Any:
    """Validate a decoded JSON body; the first problem becomes a 400 naming the field."""
    if not isinstance(body, dict):
        raise APIError("the request body must be a JSON object")
    try:
        return model.model_validate(body)
    except ValidationError as e:
        err = e.errors()[0]
        loc = ".".join(str(x) for x in err["loc"])
        if err["type"] == "extra_forbidden":
            raise APIError(
                f"Unrecognized request argument supplied: {loc}",
                param=loc,
                code="unrecognized_argument",
            ) from None
        if err["type"] == "missing":
            raise APIError(f"missing required field: {loc}", param=loc, code="missing") from None
        raise APIError(f"invalid {loc}: {err['msg']}", param=loc, code="invalid_type") from None


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
