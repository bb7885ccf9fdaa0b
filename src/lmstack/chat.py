"""Chat prompts rendered as transformers' `apply_chat_template(..., tokenize=False)` renders them.

A chat template is the checkpoint's code, so it runs in jinja2's immutable sandbox, seeing what
transformers shows it and nothing more: the same globals, filters and `{% generation %}` tag, and its
inputs rebuilt from plain JSON types (messages without their None-valued keys, reasoning also offered
as `thinking`, special tokens only where the tokenizer defines them).

It is also bounded: a render that runs past SECONDS is stopped (an exception raised in its thread), its
output may not pass MAX_OUTPUT characters, and what one operation could allocate at once (`'a' * n`,
`10 ** n`, `'%*d'`, a filter's or method's size argument such as `tojson(indent=n)`) is refused beyond
MAX_OUTPUT characters or MAX_INT_BITS bits before it runs.
"""

import ctypes
import dataclasses
import json
import threading
from collections.abc import Mapping
from datetime import datetime
from functools import lru_cache, wraps

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.utils
import numpy as np
from jinja2.sandbox import ImmutableSandboxedEnvironment

# The tokenizer's named special tokens a template may read, as transformers passes them
SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
REASONING = ("reasoning_content", "thinking", "reasoning")  # names a message's reasoning comes under
SECONDS = 5.0  # one render's time; a real template takes milliseconds
MAX_OUTPUT = 1 << 22  # characters of a render, and of any one string or list it builds at once
MAX_INT_BITS = 1 << 12  # integers a template computes


def select(templates, name=None, tools=None) -> str:
    """The template to render: `name`'s, else "tool_use" when tools are given and it exists, else "default"."""
    if templates is None:
        raise ValueError("no chat_template (tokenizer_config.json or chat_template.jinja)")
    named = templates if isinstance(templates, dict) else {"default": templates}
    if name is None:
        name = "tool_use" if tools is not None and "tool_use" in named else "default"
    if name not in named:
        raise ValueError(f"no chat_template named {name!r} (it has: {', '.join(sorted(named))})")
    return named[name]


def render(template: str, messages, *, special_tokens: dict, add_generation_prompt: bool, tools=None,
           documents=None, **variables) -> str:
    """The template's text for one conversation; `special_tokens` {bos_token: text, ...}, `variables` override them."""
    if isinstance(messages, (list, tuple)) and not messages:
        raise ValueError("cannot apply a chat template to an empty conversation")
    if "continue_final_message" in variables:
        raise ValueError("continue_final_message is not supported")
    if tools is not None:
        for k, tool in enumerate(tools):
            if not isinstance(tool, dict):
                raise ValueError(f"tools[{k}] is a {type(tool).__name__}, expected a JSON schema (a dict)")
    if documents is not None:
        for k, document in enumerate(documents):
            if not isinstance(document, dict):
                raise ValueError(f"documents[{k}] is a {type(document).__name__}, expected a dict")
    chat = _plain([_message(m, k) for k, m in enumerate(_as_data(messages))])
    variables = _plain({**{k: v for k, v in special_tokens.items() if v is not None}, **variables})
    return _bounded(_compile(template), messages=_alias_reasoning(chat), tools=_plain(tools),
                    documents=_plain(documents), add_generation_prompt=add_generation_prompt, **variables)


class _Expired(BaseException):
    """Raised in a rendering thread whose time is up (a BaseException, so the template cannot catch it)."""


def _bounded(template: jinja2.Template, **context) -> str:
    """Render within SECONDS and MAX_OUTPUT characters; a watchdog interrupts the rendering thread."""
    thread, lock, state = threading.get_ident(), threading.Lock(), {"rendering": True, "fired": False}

    def expire():
        with lock:
            if state["rendering"]:
                state["fired"] = True
                ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread), ctypes.py_object(_Expired))

    watchdog = threading.Timer(SECONDS, expire)
    watchdog.daemon = True
    try:
        watchdog.start()
        try:
            pieces, size = [], 0
            for piece in template.generate(**context):
                size += len(piece)
                if size > MAX_OUTPUT:
                    raise jinja2.TemplateError(f"the rendered prompt passes {MAX_OUTPUT} characters")
                pieces.append(piece)
            return "".join(pieces)
        finally:
            with lock:
                state["rendering"] = False
                if state["fired"]:  # clear it, if it has not been raised yet
                    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread), None)
            watchdog.cancel()
    except _Expired:
        raise jinja2.TemplateError(f"rendering took more than {SECONDS} s") from None


def _too_big(value) -> bool:
    return type(value) is int and abs(value) > MAX_OUTPUT


def _check_sizes(what: str, args):
    for value in args:
        if _too_big(value):
            raise jinja2.exceptions.SecurityError(f"{what} with size argument {value} (at most {MAX_OUTPUT})")


def _sized(function):
    """A filter whose arguments after its value are checked as sizes (tojson's indent, center's width, ...)."""
    skip = 2 if hasattr(function, "jinja_pass_arg") else 1

    @wraps(function)
    def checked(*args, **kwargs):
        _check_sizes(f"filter {function.__name__}", (*args[skip:], *kwargs.values()))
        return function(*args, **kwargs)
    return checked


def _message(message, k) -> dict:
    if not isinstance(message, dict):
        raise ValueError(f"message {k} is a {type(message).__name__}, expected a dict")
    return {key: value for key, value in message.items() if value is not None}


def _alias_reasoning(chat: list) -> list:
    """A message's reasoning under every name templates read it by: `reasoning_content` and `thinking`."""
    aliased = []
    for message in chat:
        reasoning = next((message[key] for key in REASONING if message.get(key) is not None), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        aliased.append(message)
    return aliased


def _as_data(value):
    """Message objects (dataclasses, pydantic models, as API clients return them) as dicts and lists."""
    if isinstance(value, Mapping):
        return {key: _as_data(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_as_data(item) for item in value] if isinstance(value, list) else tuple(map(_as_data, value))
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _as_data(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if callable(getattr(value, "model_dump", None)):
        return _as_data(value.model_dump())
    return value


def _plain(value):
    """The value rebuilt from JSON types, so the sandbox sees no object's methods; anything else is "<its type>"."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    for base in (str, int, float):  # subclasses (enums, numpy scalars) carry extra methods
        if isinstance(value, base):
            return base(value) if base is not str else str.__str__(value)
    if isinstance(value, Mapping):
        return {_plain(key): _plain(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_plain(item) for item in value]
    if isinstance(value, tuple):
        return tuple(_plain(item) for item in value)
    if isinstance(value, np.generic):
        return _plain(value.item())
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if callable(getattr(value, "model_dump", None)):
        return _plain(value.model_dump())
    return f"<{type(value).__name__}>"


class _Generation(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}`: transformers marks assistant text with it; the text renders as is."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    @staticmethod
    def _body(caller):
        return caller()


class _Dict:
    """The template's `dict`: builds dicts, without exposing the dict type itself."""

    def __call__(self, *args, **kwargs):
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
        return dict.fromkeys(*args, **kwargs)


class _Namespace(jinja2.utils.Namespace):
    """jinja2's namespace, refusing underscore-prefixed attribute names as transformers does."""

    def __init__(*args, **kwargs):  # jinja2's signature, so that namespace(self=...) works
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name):
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"a namespace attribute may not start with '_': {name!r}")


def _raise_exception(message):
    raise jinja2.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    """transformers' tojson: no HTML escaping, and json.dumps' options."""
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


class _Environment(ImmutableSandboxedEnvironment):
    """The sandbox, refusing an operation or call that would allocate beyond MAX_OUTPUT or MAX_INT_BITS at once."""

    intercepted_binops = frozenset(["*", "**", "%"])

    def call_binop(self, context, operator, left, right):
        if operator == "**" and type(left) is int and type(right) is int and right > 0 and abs(left) > 1:
            if right * abs(left).bit_length() > MAX_INT_BITS:
                raise jinja2.exceptions.SecurityError(f"{left} ** {right} has more than {MAX_INT_BITS} bits")
        if operator == "*":
            for sequence, n in ((left, right), (right, left)):
                if isinstance(sequence, (str, list, tuple)) and type(n) is int and len(sequence) * n > MAX_OUTPUT:
                    raise jinja2.exceptions.SecurityError(f"a sequence of {len(sequence)} times {n} passes "
                                                          f"{MAX_OUTPUT} items")
            if type(left) is int and type(right) is int and left.bit_length() + right.bit_length() > MAX_INT_BITS:
                raise jinja2.exceptions.SecurityError(f"a product of more than {MAX_INT_BITS} bits")
        if operator == "%" and isinstance(left, str):
            _check_sizes("'%' formatting", right if isinstance(right, tuple) else (right,))
        return super().call_binop(context, operator, left, right)

    def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 (jinja2's own signature)
        if __obj is not jinja2.sandbox.safe_range:  # range has its own limit
            _check_sizes(f"call of {getattr(__obj, '__name__', type(__obj).__name__)}", (*args, *kwargs.values()))
        return super().call(__context, __obj, *args, **kwargs)


@lru_cache(maxsize=16)
def _compile(template: str) -> jinja2.Template:
    env = _Environment(trim_blocks=True, lstrip_blocks=True, extensions=[_Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.filters = {name: _sized(f) for name, f in env.filters.items()}
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda format: datetime.now().strftime(format)
    env.globals["dict"] = _Dict()
    env.globals["namespace"] = _Namespace
    return env.from_string(template)
