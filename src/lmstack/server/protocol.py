"""Pydantic models of the OpenAI API's requests and answers, as far as lmstack serves them.

Every request model forbids unknown fields: a field the server does not know, or knows but does not
honor, is a 400 naming it rather than a silent drop. Every field is strict, as OpenAI's are: a string is never a
boolean or a number ("stream": "yes", "max_tokens": "16") and a float never an integer ("n": 1.0); only an
integer stands for a float. Fields of the API that only some values of are
served (`n`, `logprobs`, `response_format`, `tool_choice`, ...) accept those values and refuse the others
by name. `top_k`, `min_p` and `repetition_penalty` are lmstack's own sampling fields (`Sampler`'s);
`ignore_eos` (as vLLM and llama-server name it) makes exactly max_tokens tokens, for benchmarks.
"""

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_serializer


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(Strict):
    include_usage: bool = False


class TextPart(Strict):
    type: Literal["text"]  # image, audio and file parts need a model that reads them
    text: str


class Message(Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None

    def for_template(self) -> dict:
        """The message as chat templates read it: text parts joined by newlines, as vLLM joins them."""
        content = self.content
        if isinstance(content, list):
            content = "\n".join(part.text for part in content)
        return {"role": self.role, "content": content,
                **self.model_dump(include={"name", "tool_calls", "tool_call_id"}, exclude_none=True)}


NEUTRAL = dict(logit_bias=(None, {}), logprobs=(None, False), top_logprobs=(None,), echo=(None, False), suffix=(None,),
               best_of=(None, 1), response_format=(None, {"type": "text"}), tool_choice=(None, "auto", "none"))
WHY = dict(response_format=" (only 'text': lmstack has no constrained decoding)",
           tool_choice=" (only 'auto' and 'none': lmstack has no constrained decoding)")


class Sampling(Strict):
    """The generation fields chat and completions share."""

    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=0)
    min_p: float | None = Field(None, ge=0, le=1)
    repetition_penalty: float | None = Field(None, gt=0)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    logit_bias: dict[str, float] | None = None
    ignore_eos: bool = False

    @field_validator("n")
    @classmethod
    def _one_choice(cls, n):
        if n is not None and n != 1:
            raise ValueError("only n=1 is supported (send one request per choice)")
        return n

    @field_validator("stream_options")
    @classmethod
    def _only_streaming(cls, options, info):
        if options is not None and not info.data.get("stream"):
            raise ValueError("stream_options is only for stream: true")
        return options

    @field_validator("stop")
    @classmethod
    def _stops(cls, stop):
        stops = [stop] if isinstance(stop, str) else stop or []
        if any(not s for s in stops):
            raise ValueError("stop strings must not be empty")
        if len(stops) > 4:
            raise ValueError(f"at most 4 stop strings, got {len(stops)}")
        return stops

    @field_validator("logit_bias", "logprobs", "top_logprobs", "echo", "suffix", "best_of", "response_format",
                     "tool_choice", check_fields=False)
    @classmethod
    def _unsupported(cls, value, info):
        """Fields of the API served only at their neutral values; any other value is refused by name."""
        name = info.field_name
        if any(type(value) is type(v) and value == v for v in NEUTRAL[name]):
            return value
        shown = value.get("type") if name == "response_format" and isinstance(value, dict) else value
        raise ValueError(f"{shown!r} is not supported{WHY.get(name, '')}")

    def engine_options(self) -> dict:
        """Engine.add's sampling keywords: OpenAI's defaults for what the request leaves out."""
        values = dict(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, min_p=self.min_p,
                      repetition_penalty=self.repetition_penalty, presence_penalty=self.presence_penalty,
                      frequency_penalty=self.frequency_penalty, seed=self.seed)
        defaults = dict(temperature=1.0, top_p=1.0, top_k=0, min_p=0.0, repetition_penalty=1.0,
                        presence_penalty=0.0, frequency_penalty=0.0, seed=None)
        options = {k: defaults[k] if v is None else v for k, v in values.items()} | {"stop": tuple(self.stop or ())}
        return {**options, "eos_ids": ()} if self.ignore_eos else options

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class ChatCompletionRequest(Sampling):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    logprobs: Any = None
    top_logprobs: Any = None
    response_format: Any = None

    @field_validator("max_completion_tokens")
    @classmethod
    def _one_limit(cls, limit, info):
        other = info.data.get("max_tokens")
        if limit is not None and other is not None and other != limit:
            raise ValueError(f"{limit} differs from max_tokens {other}: give one of them")
        return limit

    @property
    def token_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def template_tools(self) -> list | None:
        """The tools the chat template is shown; tool_choice "none" shows none."""
        return None if self.tool_choice == "none" else self.tools


class CompletionRequest(Sampling):
    prompt: str | list[int] | list[str] = Field(union_mode="left_to_right")
    logprobs: Any = None
    echo: Any = None
    suffix: Any = None
    best_of: Any = None

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, prompt):
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            if len(prompt) != 1:
                raise ValueError(f"one prompt per request, got {len(prompt)}")
            prompt = prompt[0]
        if not prompt:
            raise ValueError("the prompt is empty")
        return prompt

    @property
    def token_limit(self) -> int | None:
        return self.max_tokens


class TokenizeRequest(Strict):
    model: str | None = None
    prompt: str | None = None
    messages: list[Message] | None = None
    tools: list[dict[str, Any]] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(Strict):
    model: str | None = None
    tokens: list[int]


# ---- answers -------------------------------------------------------------------------------------


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int

    @classmethod
    def of(cls, handle) -> "Usage":
        return cls(prompt_tokens=handle.prompt_tokens, completion_tokens=handle.completion_tokens,
                   total_tokens=handle.prompt_tokens + handle.completion_tokens)


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    logprobs: None = None
    finish_reason: str


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class Delta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None

    @model_serializer(mode="wrap")
    def _set_fields_only(self, handler):  # {"content": "..."}, and {} in the last chunk, as OpenAI sends them
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: Delta
    logprobs: None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: None = None
    finish_reason: str | None = None


class Completion(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "lmstack"
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


# ---- errors --------------------------------------------------------------------------------------


class APIError(Exception):
    """An answer in OpenAI's error shape: {"error": {"message", "type", "param", "code"}}."""

    TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
             413: "invalid_request_error", 429: "rate_limit_error", 503: "service_unavailable"}

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.TYPES.get(self.status, "server_error"),
                          "param": self.param, "code": self.code}}


def parse(model: type[BaseModel], body: bytes):
    """The request body as `model`, or an APIError naming the first field that is wrong."""
    try:
        return model.model_validate_json(body)
    except ValidationError as e:
        # the deepest error first: of a union's branches, the one that got furthest says most
        errors = sorted(e.errors(include_url=False), key=lambda x: (-len(x["loc"]), x["type"] == "extra_forbidden"))
        first = errors[0]
        if first["type"] == "json_invalid":
            raise APIError(400, f"the body is not valid JSON: {first['msg']}", code="invalid_json") from None
        if first["type"] == "model_type":
            raise APIError(400, "the body must be a JSON object", code="invalid_json") from None
        param = _path(first["loc"])
        if first["type"] == "extra_forbidden":
            message = f"{param}: unknown or unsupported field (lmstack does not ignore fields it does not honor)"
        else:
            message = f"{param}: {first['msg'].removeprefix('Value error, ')}"
        if len(errors) > 1:
            message += f" (and {len(errors) - 1} more: {', '.join(_path(x['loc']) for x in errors[1:])})"
        raise APIError(400, message, param=param) from None


def _path(loc) -> str:
    """messages.0.content -> messages[0].content; union branch names (str, list[...]) dropped."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif "[" in part or part in ("str", "int", "float", "bool", "function-after", "list"):
            continue
        else:
            out += f".{part}" if out else part
    return out
