"""Tool calls: the model's own call syntax parsed into OpenAI's `tool_calls`, and grammars that make it valid.

One parser per syntax the families lmstack runs write:

    hermes       <tool_call>{"name": ..., "arguments": {...}}</tool_call>, one block per call (Qwen 2/2.5/3,
                 Hermes, SmolLM3 and most fine-tunes; the default)
    llama3_json  {"name": ..., "parameters": {...}}, alone or after <|python_tag|>, several joined by ";"
                 (Llama 3.1/3.2/3.3)
    mistral      [TOOL_CALLS][{"name": ..., "arguments": {...}}, ...] (Mistral, Mixtral, Ministral)

`parser_for` picks one from the chat template's text (or `lmstack serve --tool-call-parser`). A parser gives
three things: `parse(text)` -> (content, calls); `required(tools, parallel)`, a Lark grammar for
llguidance that admits only valid calls of those tools (tool_choice "required" or a named function); and
`auto(tools, parallel)`, a grammar whose call part is lazy: free text until the call's trigger, then only
a valid call (tool_choice "auto"). In both, each call's arguments follow its function's `parameters` schema.
`ToolStream` parses a streamed answer as it comes: content deltas until a trigger, then each call as one
delta once it is complete.
"""

import json
import re
import uuid

ANY_OBJECT = {"type": "object"}


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _call_schema(tools, arguments_key: str) -> dict:
    """One call of any of `tools` (dicts as OpenAI sends them): its name, and arguments valid for it."""
    options = [{"type": "object", "properties": {"name": {"const": tool["function"]["name"]},
                                                 arguments_key: tool["function"].get("parameters") or ANY_OBJECT},
                "required": ["name", arguments_key], "additionalProperties": False} for tool in tools]
    return options[0] if len(options) == 1 else {"anyOf": options}


def _lark(text: str) -> str:
    return json.dumps(text)


def _json(schema: dict) -> str:
    """A Lark %json rule: compact (a weak model cannot pad it with whitespace forever), and strict (a keyword
    llguidance cannot enforce is an error, as in grammar.compile)."""
    return f"%json {json.dumps({**schema, 'x-guidance': {'whitespace_flexible': False, 'lenient': False}})}"


class Parser:
    name = ""
    trigger = ""  # the text that starts a call
    arguments_key = "arguments"

    def parse(self, text: str, final: bool = True) -> tuple[str | None, list[tuple[str, str]]]:
        """(content, [(name, arguments as JSON text)]); not final: only the calls already complete."""
        raise NotImplementedError

    def required(self, tools, parallel: bool) -> str:
        raise NotImplementedError

    def auto(self, tools, parallel: bool) -> str:
        raise NotImplementedError

    def _call(self, value) -> tuple[str, str] | None:
        if not isinstance(value, dict) or not isinstance(value.get("name"), str):
            return None
        arguments = value.get(self.arguments_key, value.get("arguments", value.get("parameters", {})))
        if isinstance(arguments, str):  # some models write the arguments as JSON text
            try:
                arguments = json.loads(arguments)
            except ValueError:
                return None
        if not isinstance(arguments, dict):
            return None
        return value["name"], json.dumps(arguments, ensure_ascii=False)


class Hermes(Parser):
    name, trigger = "hermes", "<tool_call>"
    end = "</tool_call>"
    BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)

    def parse(self, text, final=True):
        calls, content, last = [], [], 0
        for match in self.BLOCK.finditer(text):
            call = self._call(_loads(match.group(1)))
            if call is None:
                return text, []
            calls.append(call)
            content.append(text[last:match.start()])
            last = match.end()
        rest = text[last:]
        if final and self.trigger in rest:  # an unclosed last block (the answer ran out of tokens, or the end
            start = rest.index(self.trigger)    # tag was left off): a call if what follows parses
            call = self._call(_loads(rest[start + len(self.trigger):].strip()))
            if call is not None:
                calls.append(call)
                rest = rest[:start]
        content.append(rest)
        return _content("".join(content)) if calls else text, calls

    def _block(self, tools) -> str:
        return f'{_lark(self.trigger + chr(10))} {_json(_call_schema(tools, "arguments"))} ' \
               f'{_lark(chr(10) + self.end)}'

    def required(self, tools, parallel):
        more = ' ("\\n" call)*' if parallel else ""
        return f"start: call{more}\ncall: {self._block(tools)}\n"

    def auto(self, tools, parallel):
        body = self._block(tools).split(" ", 1)[1]  # what follows the trigger
        return ("%llguidance {}\n"
                f"start: call{'*' if parallel else '?'} TEXT\n"
                f"trigger[lazy]: TEXT {_lark(self.trigger)}\n"
                f'call: trigger {_lark(chr(10))} {body}\n'
                "TEXT: /(.|\\n)*/\n")


class Llama3JSON(Parser):
    name, trigger = "llama3_json", "<|python_tag|>"
    arguments_key = "parameters"

    def parse(self, text, final=True):
        body = text.strip()
        body = body.removeprefix(self.trigger).lstrip()
        if not body.startswith("{"):
            return text, []
        values = _json_values(body, separator=";")
        calls = [self._call(value) for value in values or ()]
        if not calls or None in calls:
            return text, []
        return None, calls

    def required(self, tools, parallel):
        more = ' ("; " call)*' if parallel else ""
        return f"start: call{more}\ncall: {_json(_call_schema(tools, 'parameters'))}\n"

    def auto(self, tools, parallel):
        more = ' ("; " call)*' if parallel else ""
        return (f"start: TEXT | {_lark(self.trigger)}? call{more}\ncall: {_json(_call_schema(tools, 'parameters'))}\n"
                "TEXT: /[^{](.|\\n)*/\n")  # text that does not open with a call


class Mistral(Parser):
    name, trigger = "mistral", "[TOOL_CALLS]"

    def parse(self, text, final=True):
        if self.trigger not in text:
            return text, []
        before, after = text.split(self.trigger, 1)
        values = _json_values(after.strip(), separator="")
        if values is None or len(values) != 1 or not isinstance(values[0], list):
            return text, []
        calls = [self._call(value) for value in values[0]]
        if not calls or None in calls:
            return text, []
        return _content(before), calls

    def _array(self, tools, parallel) -> str:
        array = {"type": "array", "items": _call_schema(tools, "arguments"), "minItems": 1}
        if not parallel:
            array["maxItems"] = 1
        return _json(array)

    def required(self, tools, parallel):
        return f"start: {_lark(self.trigger)} {self._array(tools, parallel)}\n"

    def auto(self, tools, parallel):
        return ("%llguidance {}\n"
                "start: call? TEXT\n"
                f"trigger[lazy]: TEXT {_lark(self.trigger)}\n"
                f"call: trigger {self._array(tools, parallel)}\n"
                "TEXT: /(.|\\n)*/\n")


PARSERS = {parser.name: parser for parser in (Hermes(), Llama3JSON(), Mistral())}


def parser_for(template: str | None, name: str | None = None) -> Parser:
    """The parser named, else the one whose syntax the chat template writes (hermes when it shows none)."""
    if name is not None:
        if name not in PARSERS:
            raise ValueError(f"tool call parser {name!r} is not one of {sorted(PARSERS)}")
        return PARSERS[name]
    text = template if isinstance(template, str) else "\n".join((template or {}).values())
    if "[TOOL_CALLS]" in text:
        return PARSERS["mistral"]
    if "<tool_call>" not in text and ("<|python_tag|>" in text or '"parameters": ' in text):
        return PARSERS["llama3_json"]
    return PARSERS["hermes"]


class ToolStream:
    """A streamed answer split into content and calls: `feed(text)` and `finish()` return
    (content delta, [new complete calls])."""

    def __init__(self, parser: Parser):
        self.parser = parser
        self.text = ""
        self.sent = 0  # characters of text sent as content
        self.calls = 0  # calls sent
        self.triggered = False

    def feed(self, piece: str) -> tuple[str, list]:
        self.text += piece
        if not self.triggered:
            start = self._trigger_start()
            if start is None:  # no call begins: content, less what could be the start of a trigger
                end = len(self.text) - _held(self.text, self._triggers())
                return self._send(end), []
            self.triggered = True
            content = self._send(start)
            return content, self._new_calls(final=False)
        return "", self._new_calls(final=False)

    def finish(self) -> tuple[str, list]:
        content, calls = self.parser.parse(self.text, final=True)
        if not calls:
            return self._send(len(self.text)), []
        new = calls[self.calls:]
        self.calls = len(calls)
        streamed, content = self.text[:self.sent].strip(), content or ""  # parse strips the content's ends
        return (content[len(streamed):] if content.startswith(streamed) else ""), new

    def _triggers(self) -> tuple:
        return (self.parser.trigger, "{") if isinstance(self.parser, Llama3JSON) else (self.parser.trigger,)

    def _trigger_start(self) -> int | None:
        if isinstance(self.parser, Llama3JSON):  # a call is the whole answer: it starts at its first character
            stripped = self.text.lstrip()
            if stripped.startswith(self.parser.trigger) or stripped.startswith("{"):
                return 0 if self.sent == 0 else None
            return None
        index = self.text.find(self.parser.trigger, max(0, self.sent - len(self.parser.trigger)))
        return None if index < 0 else index

    def _send(self, end: int) -> str:
        if end <= self.sent:
            return ""
        piece, self.sent = self.text[self.sent:end], end
        return piece

    def _new_calls(self, final: bool) -> list:
        _, calls = self.parser.parse(self.text, final=final)
        new = calls[self.calls:]
        self.calls = len(calls)
        return new


def _held(text: str, triggers) -> int:
    """How many characters at the end of text could start one of the triggers."""
    if not text.strip() and any(t == "{" for t in triggers):
        return len(text)  # leading whitespace before a JSON call
    return max((n for t in triggers for n in range(1, len(t)) if text.endswith(t[:n])), default=0)


def _loads(text: str):
    try:
        return json.loads(text)
    except ValueError:
        return None


def _json_values(text: str, separator: str) -> list | None:
    """The JSON values text holds one after another (separated by `separator` and whitespace), or None."""
    decoder, values, i = json.JSONDecoder(), [], 0
    while i < len(text):
        try:
            value, i = decoder.raw_decode(text, i)
        except ValueError:
            return None
        values.append(value)
        while i < len(text) and (text[i].isspace() or (separator and text[i] == separator)):
            i += 1
    return values


def _content(text: str) -> str | None:
    return text.strip() or None
