"""Pydantic models of the OpenAI API's requests and answers, as far as lmstack serves them.

Every request model forbids unknown fields: a field the server does not know, or knows but does not
honor, is a 400 naming it rather than a silent drop. Every field is strict, as OpenAI's are: a string is never a
boolean or a number ("stream": "yes", "max_tokens": "16") and a float never an integer ("n": 1.0); only an
integer stands for a float. Fields of the API that only some values of are served (`suffix`, `best_of`) accept
those values and refuse the others by name. `top_k`, `min_p` and `repetition_penalty` are lmstack's own sampling
fields (`Sampler`'s); `ignore_eos` (as vLLM and llama-server name it) makes exactly max_tokens tokens, for
benchmarks.
"""

import json
import time
import uuid
from typing import Any, Literal

from pydantic import (BaseModel, ConfigDict, Field, ValidationError, field_validator, model_serializer,
                      model_validator)


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(Strict):
    include_usage: bool = False


class TextPart(Strict):
    type: Literal["text"]  # image, audio and file parts need a model that reads them
    text: str


FUNCTION_NAME = r"^[A-Za-z0-9_-]{1,64}$"
MAX_N = 16


class CalledFunction(Strict):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class MessageToolCall(Strict):
    id: str
    type: Literal["function"] = "function"
    function: CalledFunction


class Message(Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None
    tool_call_id: str | None = None

    def for_template(self) -> dict:
        """The message as chat templates read it: text parts joined by newlines, as vLLM joins them; with tool
        calls, null content as "" and a call's arguments as a dict (what transformers' templates expect) when they
        are a JSON object."""
        content = self.content
        if isinstance(content, list):
            content = "\n".join(part.text for part in content)
        if content is None and self.tool_calls:  # templates read a call's content; OpenAI sends null
            content = ""
        message = {"role": self.role, "content": content,
                   **self.model_dump(include={"name", "tool_call_id"}, exclude_none=True)}
        if self.tool_calls is not None:
            message["tool_calls"] = [{"id": call.id, "type": "function", "function": {
                "name": call.function.name, "arguments": _json_object(call.function.arguments)}}
                for call in self.tool_calls]
        return message


def _json_object(text: str):
    try:
        value = json.loads(text)
    except ValueError:
        return text
    return value if isinstance(value, dict) else text


class FunctionDefinition(Strict):
    name: str = Field(pattern=FUNCTION_NAME)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(Strict):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(Strict):
    name: str


class NamedToolChoice(Strict):
    type: Literal["function"]
    function: FunctionName


class JSONSchemaFormat(Strict):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    name: str = Field(pattern=FUNCTION_NAME)
    description: str | None = None
    schema_: dict[str, Any] = Field(default_factory=dict, alias="schema")  # OpenAI's default: any JSON object
    strict: bool | None = None


class ResponseFormat(Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self):
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("json_schema is given with type 'json_schema', and only then")
        return self


NEUTRAL = dict(suffix=(None,), best_of=(None, 1))


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
    n: int | None = Field(None, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    logit_bias: dict[str, float] | None = None
    ignore_eos: bool = False

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

    @field_validator("logit_bias")
    @classmethod
    def _token_ids(cls, bias):
        """OpenAI's keys are token ids written as JSON strings; the engine checks their range and the values'."""
        if bias is None:
            return None
        wrong = [key for key in bias if not (key.isascii() and key.isdigit())]
        if wrong:
            raise ValueError(f"keys must be token ids (decimal integers), got {wrong}")
        return bias

    @field_validator("suffix", "best_of", check_fields=False)
    @classmethod
    def _unsupported(cls, value, info):
        """Fields of the API served only at their neutral values; any other value is refused by name."""
        name = info.field_name
        if any(type(value) is type(v) and value == v for v in NEUTRAL[name]):
            return value
        raise ValueError(f"{value!r} is not supported")

    def engine_options(self) -> dict:
        """Engine.add's sampling keywords: OpenAI's defaults for what the request leaves out."""
        values = dict(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, min_p=self.min_p,
                      repetition_penalty=self.repetition_penalty, presence_penalty=self.presence_penalty,
                      frequency_penalty=self.frequency_penalty, seed=self.seed,
                      logit_bias={int(k): v for k, v in self.logit_bias.items()} if self.logit_bias else None)
        defaults = dict(temperature=1.0, top_p=1.0, top_k=0, min_p=0.0, repetition_penalty=1.0,
                        presence_penalty=0.0, frequency_penalty=0.0, seed=None, logit_bias=None)
        options = {k: defaults[k] if v is None else v for k, v in values.items()} | {"stop": tuple(self.stop or ())}
        return {**options, "eos_ids": ()} if self.ignore_eos else options

    @property
    def choices(self) -> int:
        return 1 if self.n is None else self.n

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class ChatCompletionRequest(Sampling):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)
    response_format: ResponseFormat | None = None

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
        """The tools the chat template is shown, as dicts; tool_choice "none" shows none."""
        if self.tool_choice == "none" or self.tools is None:
            return None
        return [tool.model_dump(exclude_none=True) for tool in self.tools]

    @property
    def top(self) -> int | None:
        """Engine.add's logprobs: how many alternatives per token (None: no log-probabilities)."""
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(Sampling):
    prompt: str | list[int] | list[str] = Field(union_mode="left_to_right")
    logprobs: int | None = Field(None, ge=0, le=5)
    echo: bool = False
    suffix: Any = None
    best_of: Any = None

    @property
    def top(self) -> int | None:
        return self.logprobs

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
    tools: list[Tool] | None = None
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
    def of(cls, *handles) -> "Usage":
        """The usage of the choices of one prompt: its tokens once, every choice's completion."""
        prompt, completion = handles[0].prompt_tokens, sum(h.completion_tokens for h in handles)
        return cls(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)


class FunctionCall(BaseModel):
    name: str
    arguments: str


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCall] | None = None

    @model_serializer(mode="wrap")
    def _calls_only_when_made(self, handler):
        return {k: v for k, v in handler(self).items() if k != "tool_calls" or v is not None}


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChoiceLogprobs(BaseModel):
    content: list[TokenLogprob] | None
    refusal: None = None


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: str


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class DeltaFunction(BaseModel):
    name: str | None = None
    arguments: str | None = None

    @model_serializer(mode="wrap")
    def _set_fields_only(self, handler):
        return {k: v for k, v in handler(self).items() if v is not None}


class DeltaToolCall(BaseModel):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunction

    @model_serializer(mode="wrap")
    def _set_fields_only(self, handler):
        return {k: v for k, v in handler(self).items() if v is not None}


class Delta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None

    @model_serializer(mode="wrap")
    def _set_fields_only(self, handler):  # {"content": "..."}, and {} in the last chunk, as OpenAI sends them
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: Delta
    logprobs: ChoiceLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float | None]  # None: the prompt's first token, which nothing predicts
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
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
