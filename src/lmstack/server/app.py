"""The OpenAI-compatible HTTP routes (a Starlette app) over one Engine.

`Service` holds what the routes serve: the engine once the model is loaded (until then /health and every
model route answer 503), the settings that guard it (API key, body and max_tokens caps, queue bound) and
the Prometheus metrics. `create_app(service)` is the ASGI app; `lmstack serve` (cli.py) runs it under
uvicorn. A client that goes away, streaming or not, running or still queued, has its request aborted at
once: the engine drops it at its next step and frees its KV blocks.
"""

import asyncio
import hmac
import json
import logging
import socket
import struct
import sys
import threading
import time
import uuid
from collections import OrderedDict
from pathlib import Path

import anyio
import torch
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from .. import grammar
from ..engine import Engine, EngineError
from ..tokenizer import TokenizerError
from . import protocol as p
from . import tools

log = logging.getLogger("lmstack.server")

MAX_BODY_BYTES = 1 << 20
MAX_TOKENS_LIMIT = 4096
MAX_WAITING = 64
SHORT_WAITING_PER_SLOT = 4  # short requests taken past a full queue, per slot the engine keeps for them
SEND_BUFFER = 1 << 16  # bytes of a stream the server holds for a client that is not reading: socket and uvicorn each
SEND_TIMEOUT = 5.0  # seconds a stream waits for room in a full send buffer before it cuts the client off
GRAMMARS_KEPT = 64  # compiled grammars a server keeps for requests that send the same source again
PROMPT_CHUNK = 256  # prompt tokens per forward when scoring a prompt (echo with logprobs)
TOKEN_TIME_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1, 2.5, 5, 10)


class Service:
    """The engine behind the routes, the limits in front of it, and its metrics."""

    def __init__(self, name: str, *, api_key: str | None = None, max_body_bytes: int = MAX_BODY_BYTES,
                 max_tokens_limit: int = MAX_TOKENS_LIMIT, max_waiting: int = MAX_WAITING,
                 cors_origins: tuple = (), tool_call_parser: str | None = None,
                 allow_special_in_messages: bool = False, send_buffer: int = SEND_BUFFER,
                 send_timeout: float = SEND_TIMEOUT):
        if tool_call_parser is not None:
            tools.parser_for(None, tool_call_parser)  # refuse an unknown name before the model loads
        self.name, self.api_key, self.tool_call_parser = name, api_key, tool_call_parser
        self.max_body_bytes, self.max_tokens_limit, self.max_waiting = max_body_bytes, max_tokens_limit, max_waiting
        self.cors_origins = tuple(cors_origins)
        self.allow_special_in_messages = allow_special_in_messages
        self.send_buffer, self.send_timeout = send_buffer, send_timeout
        self.engine: Engine | None = None
        self.tokenizer = None
        self.max_running = 0
        self.in_flight = 0  # requests handed to the engine and not yet finished
        self.short_in_flight: set = set()  # the handles of those that take the engine's kept slots (short requests)
        self._forward_lock = threading.Lock()
        self._grammars: OrderedDict = OrderedDict()  # the last GRAMMARS_KEPT compiled, by their source
        self.created = p.now()
        self.registry = CollectorRegistry()
        self.requests = Counter("lmstack_requests", "HTTP requests answered", ["route", "status"],
                                registry=self.registry)
        self.prompt_tokens = Counter("lmstack_prompt_tokens", "prompt tokens of finished requests",
                                     registry=self.registry)
        self.completion_tokens = Counter("lmstack_completion_tokens", "tokens generated", registry=self.registry)
        self.ttft = Histogram("lmstack_time_to_first_token_seconds", "from a request's arrival at the engine to "
                              "its first token", buckets=TOKEN_TIME_BUCKETS, registry=self.registry)
        self.tbt = Histogram("lmstack_time_between_tokens_seconds", "gaps between a request's tokens",
                             buckets=TOKEN_TIME_BUCKETS, registry=self.registry)
        self.cut_off = Counter("lmstack_clients_cut_off", "streams cut off (and their requests aborted) because the "
                               "client did not read them", registry=self.registry)
        self.registry.register(_EngineCollector(self))

    def load(self, model, tokenizer, *, max_running: int = 16, **engine_options):
        """Start an engine on the loaded model (engine_options: Engine's); the routes serve from now on."""
        engine = Engine(model, tokenizer, max_running=max_running, **engine_options)
        engine.start()
        self.parser = tools.parser_for(tokenizer.chat_template, self.tool_call_parser)
        self.eos_ids = tuple(dict.fromkeys((*model.eos_ids, *tokenizer.eos_ids)))
        self.max_running, self.tokenizer, self.engine = max_running, tokenizer, engine

    def public(self, message: str) -> str:
        """`message` fit for a client: the tokenizer's file named by the served model, other server paths hidden."""
        source = getattr(self.tokenizer, "source", None)
        if source:
            message = message.replace(source, f"model {self.name!r}")
            if (directory := str(Path(source).parent)) not in (".", "/"):
                message = message.replace(directory, "<model directory>")
        for path in _SERVER_PATHS:
            message = message.replace(path, "<server path>")
        return message

    def failure(self, error: EngineError) -> p.APIError:
        """A request's engine failure as the client sees it; what failed goes to the log only."""
        if self.engine is not None and self.engine.closed:
            return p.APIError(503, "the request failed: the server is shutting down (the engine was closed)")
        log.error("a request failed in the engine: %s", error)
        return p.APIError(500, "the request failed in the engine (the server log says why)")

    def close(self):
        """Stop the engine: requests in flight end with an error (an error event for streams)."""
        if self.engine is not None:
            self.engine.close()

    @property
    def context(self) -> int | None:
        return self.engine.model.max_positions

    def submit(self, ids: list[int], request, param: str, **options) -> list:
        """Hand a tokenized request to the engine, one handle per choice (n), or an APIError saying why not.
        options: Engine.add's (constraint, logprobs)."""
        context, limit = self.context, request.token_limit
        field = "max_completion_tokens" if getattr(request, "max_completion_tokens", None) else "max_tokens"
        if context is not None and len(ids) >= context:
            raise p.APIError(400, f"the prompt is {len(ids)} tokens; the model's context is {context} tokens, "
                                  "and the answer needs at least one more", param=param,
                             code="context_length_exceeded")
        if limit is not None and limit > self.max_tokens_limit:
            raise p.APIError(400, f"{field} {limit} is over this server's limit of {self.max_tokens_limit} "
                                  "(lmstack serve --max-tokens-limit)", param=field)
        if limit is None:  # until EOS or the context (or the KV pool) is full, within the server's limit
            limit = self.max_tokens_limit if context is None else min(self.max_tokens_limit, context - len(ids))
            if self.engine.n_blocks:
                limit = max(1, min(limit, self.engine.n_blocks * self.engine.block_size + 1 - len(ids)))
        elif context is not None and len(ids) + limit > context:
            raise p.APIError(400, f"the prompt is {len(ids)} tokens and {field} is {limit}: {len(ids) + limit} in "
                                  f"all, over the model's context of {context} tokens", param=field,
                             code="context_length_exceeded")
        n = request.choices
        scheduler = self.engine.scheduler
        short = n == 1 and scheduler.short(len(ids), limit)
        short_room = len(self.short_in_flight) < scheduler.short_slots * SHORT_WAITING_PER_SLOT
        if self.in_flight + n > self.max_running + self.max_waiting and not (short and short_room):
            raise p.APIError(429, f"the queue is full: {self.in_flight} requests in flight (lmstack serve "
                                  f"--max-running {self.max_running} --max-waiting {self.max_waiting})",
                             code="queue_full", headers={"Retry-After": "1"})
        sampling = request.engine_options()
        handles = []
        try:
            for i in range(n):  # each choice its own random stream; a seed gives seed, seed + 1, ...
                seed = sampling["seed"] if sampling["seed"] is None else (sampling["seed"] + i) % (1 << 64)
                handles.append(self.engine.add(ids, max_tokens=limit, **{**sampling, "seed": seed}, **options,
                                               sample_of=handles[0] if handles else None))
        except ValueError as e:
            for handle in handles:
                handle.abort()
            raise p.APIError(400, str(e)) from None
        except EngineError as e:
            raise p.APIError(503, f"the server is shutting down ({e})") from None
        self.in_flight += n
        if short:
            self.short_in_flight.update(handles)
        return handles

    async def constraint(self, param: str, **grammar_source):
        """The compiled grammar.Grammar of a json_schema, regex or lark, compiled off the event loop, or kept from
        an earlier request with the same source (apps send one schema again and again); a grammar that cannot be
        enforced or compiled in time is a 400 naming `param`."""
        key = json.dumps(grammar_source)  # the schema's key order kept: it is the order of the answer's keys
        if (compiled := self._grammars.get(key)) is not None:
            self._grammars.move_to_end(key)
            return compiled
        try:
            compiled = await asyncio.to_thread(grammar.compile, self.tokenizer, self.engine.model.vocab_size,
                                               eos_ids=self.eos_ids, **grammar_source)
        except grammar.GrammarError as e:
            raise p.APIError(400, f"{param}: {e}", param=param, code="invalid_grammar") from None
        self._grammars[key] = compiled
        if len(self._grammars) > GRAMMARS_KEPT:
            self._grammars.popitem(last=False)
        return compiled

    async def prompt_logprobs(self, ids: list[int], top: int) -> list:
        """[(logprob, top)] of each prompt token after the first, given the ones before it (one forward, off the
        event loop, one prompt at a time)."""
        def run():
            model, out = self.engine.model, []
            with self._forward_lock, torch.no_grad():
                state = model.allocate_state(1, len(ids))
                for start in range(0, len(ids) - 1, PROMPT_CHUNK):  # (chunk, vocab) logits at a time
                    chunk = ids[start:min(start + PROMPT_CHUNK, len(ids) - 1)]
                    logits = model.forward(torch.tensor([chunk]), state)[0].float().log_softmax(-1)
                    nexts = torch.tensor(ids[start + 1:start + 1 + len(chunk)])
                    chosen = logits.gather(1, nexts[:, None])[:, 0].tolist()
                    best = logits.topk(top) if top else None
                    out += [(lp, [] if best is None else list(zip(best.indices[j].tolist(), best.values[j].tolist())))
                            for j, lp in enumerate(chosen)]
            return out

        return await asyncio.to_thread(run)

    def finished(self, handle):
        self.in_flight -= 1
        self.short_in_flight.discard(handle)
        self.prompt_tokens.inc(handle.prompt_tokens)
        self.completion_tokens.inc(handle.completion_tokens)
        if handle.time_to_first_token is not None:
            self.ttft.observe(handle.time_to_first_token)
        for gap in handle.time_between_tokens:
            self.tbt.observe(gap)


_SERVER_PATHS = tuple(sorted({path for path in (str(Path(__file__).parents[1]), sys.prefix, sys.base_prefix,
                                               str(Path.home())) if len(path) > 1}, key=len, reverse=True))


class _EngineCollector:
    """The engine's own counts, read when /metrics is scraped."""

    def __init__(self, service: Service):
        self.service = service

    def collect(self):
        engine = self.service.engine
        if engine is None:
            return
        s = engine.stats()
        yield GaugeMetricFamily("lmstack_requests_running", "requests being decoded", value=s["running"])
        yield GaugeMetricFamily("lmstack_requests_waiting", "requests queued for the engine", value=s["waiting"])
        yield GaugeMetricFamily("lmstack_kv_cache_blocks_used", "KV cache blocks in use", value=s["kv_blocks_used"])
        yield GaugeMetricFamily("lmstack_kv_cache_blocks_total", "KV cache blocks in the pool",
                                value=s["kv_blocks_total"])
        yield GaugeMetricFamily("lmstack_kv_cache_usage", "fraction of the KV cache blocks in use",
                                value=s["kv_blocks_used"] / s["kv_blocks_total"] if s["kv_blocks_total"] else 0.0)
        yield GaugeMetricFamily("lmstack_prefix_cache_hit_rate", "prompt blocks found in the prefix cache / "
                                "looked up", value=s["prefix_hit_rate"])
        yield CounterMetricFamily("lmstack_prefix_cache_queries", "prompt blocks looked up in the prefix cache",
                                  value=s["prefix_queries"])
        yield CounterMetricFamily("lmstack_prefix_cache_hits", "prompt blocks found in the prefix cache",
                                  value=s["prefix_hits"])
        yield CounterMetricFamily("lmstack_preemptions", "sequences preempted for KV blocks (recomputed later)",
                                  value=s["preemptions"])


class _Record:
    """What the one log line of a request says."""

    def __init__(self, request: Request):
        self.start = time.perf_counter()
        client = request.client
        self.client = f"{client.host}:{client.port}" if client else "-"
        self.route = request.url.path
        self.method = request.method
        self.status = 200
        self.handles = []


def _finish(service: Service, record: _Record):
    tokens = ""
    for handle in record.handles:
        service.finished(handle)
    if record.handles:
        handle = record.handles[0]
        ttft = handle.time_to_first_token
        tokens = (f" prompt={handle.prompt_tokens} completion={sum(h.completion_tokens for h in record.handles)} "
                  f"ttft={'-' if ttft is None else f'{ttft:.3f}s'} "
                  f"finish={','.join(str(h.finish_reason) for h in record.handles)}")
    service.requests.labels(record.route, str(record.status)).inc()
    log.info('%s "%s %s" %d%s %.3fs', record.client, record.method, record.route, record.status, tokens,
             time.perf_counter() - record.start)


def _error(e: p.APIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


def create_app(service: Service) -> Starlette:
    """The ASGI app serving `service`."""

    def route(path, handler, methods, *, guarded=True, needs_engine=True):
        async def endpoint(request: Request):
            record = _Record(request)
            try:
                if guarded and service.api_key is not None:
                    _authorize(request, service.api_key)
                if needs_engine and service.engine is None:
                    raise p.APIError(503, "the model is still loading", code="loading")
                response = await handler(request, record)
            except p.APIError as e:
                e.message = service.public(e.message)
                response = _error(e)
            except Exception:  # a bug must still answer, never leave the client hanging
                log.exception("%s %s failed", record.method, record.route)
                response = _error(p.APIError(500, "internal error (the server log says why)"))
            record.status = response.status_code
            if not isinstance(response, _EventStream):  # a stream logs when it ends
                _finish(service, record)
            return response

        return Route(path, endpoint, methods=methods)

    async def chat(request: Request, record: _Record):
        req = p.parse(p.ChatCompletionRequest, await _body(request, service.max_body_bytes))
        _check_model(service, req.model)
        parser, lark = _tool_plan(service, req)
        ids = _chat_ids(service, req.messages, req.template_tools())
        top = req.top
        constraint = None
        if lark is not None:
            constraint = await service.constraint("tools", lark=lark)
        elif req.response_format is not None and req.response_format.type != "text":
            schema = (req.response_format.json_schema.schema_ if req.response_format.type == "json_schema"
                      else {"type": "object"})
            constraint = await service.constraint("response_format", json_schema=schema)
        record.handles = handles = service.submit(ids, req, "messages", constraint=constraint, logprobs=top)
        ident, created = p.new_id("chatcmpl"), p.now()

        def chunk(index: int, delta: p.Delta | None, finish=None, usage=None, logprobs=None) -> str:
            choices = [] if delta is None else [p.ChatChunkChoice(index=index, delta=delta, finish_reason=finish,
                                                                  logprobs=logprobs)]
            c = p.ChatCompletionChunk(id=ident, created=created, model=service.name, usage=usage, choices=choices)
            return c.model_dump_json(exclude=None if req.include_usage else {"usage"})

        def logprobs(handle, start, end):
            return None if top is None else p.ChoiceLogprobs(content=_token_logprobs(service, handle, start, end))

        if req.stream:
            plain = _TextChunks(lambda i, content: chunk(i, p.Delta(content=content)))

            async def chunks():
                streams = [tools.ToolStream(parser) if parser else None for _ in handles]
                made = [0] * len(handles)  # tool calls sent, per choice
                for i in range(len(handles)):
                    yield chunk(i, p.Delta(role="assistant", content=""))
                async for i, span in _merged(handles):
                    handle, stream = handles[i], streams[i]
                    if span is not None:
                        text = "".join(handle.pieces[span[0]:span[1]])
                        content, calls = stream.feed(text) if stream else (text, [])
                    else:
                        content, calls = stream.finish() if stream else ("", [])
                    if content and not calls and top is None:
                        yield plain(i, content)
                    elif content or calls or (span is not None and top is not None):
                        deltas = [p.DeltaToolCall(index=made[i] + k, id=tools.call_id(), type="function",
                                                  function=p.DeltaFunction(name=name, arguments=arguments))
                                  for k, (name, arguments) in enumerate(calls)]
                        made[i] += len(calls)
                        yield chunk(i, p.Delta(content=content or None, tool_calls=deltas or None),
                                    logprobs=None if span is None else logprobs(handle, *span))
                    if span is None:
                        yield chunk(i, p.Delta(), finish="tool_calls" if made[i] else handle.finish_reason)
                if req.include_usage:
                    yield chunk(0, None, usage=p.Usage.of(*handles))

            return _EventStream(service, record, chunks())
        texts = await _collect(service, request, handles)
        choices = []
        for i, (handle, text) in enumerate(zip(handles, texts)):
            content, calls = parser.parse(text) if parser else (text, [])
            message = p.AssistantMessage(content=content, tool_calls=[
                p.ToolCall(id=tools.call_id(), function=p.FunctionCall(name=name, arguments=arguments))
                for name, arguments in calls] or None)
            choices.append(p.ChatChoice(index=i, message=message, logprobs=logprobs(handle, 0, len(handle.tokens)),
                                        finish_reason="tool_calls" if calls else handle.finish_reason))
        return JSONResponse(p.ChatCompletion(id=ident, created=created, model=service.name,
                                             usage=p.Usage.of(*handles), choices=choices).model_dump())

    async def completions(request: Request, record: _Record):
        req = p.parse(p.CompletionRequest, await _body(request, service.max_body_bytes))
        _check_model(service, req.model)
        ids = req.prompt if isinstance(req.prompt, list) else _encode(service, req.prompt, "prompt")
        top = req.top
        record.handles = handles = service.submit(ids, req, "prompt", logprobs=top)  # the lengths checked
        echoed = None  # with echo: the prompt's text and, with logprobs, its tokens' log-probabilities
        if req.echo:
            try:
                echoed = (service.tokenizer.decode(ids),
                          None if top is None else await service.prompt_logprobs(ids, top))
            except BaseException:
                for handle in handles:
                    handle.abort()
                raise
        ident, created = p.new_id("cmpl"), p.now()

        def chunk(index: int, text: str | None, finish=None, usage=None, logprobs=None) -> str:
            choices = [] if text is None else [p.CompletionChoice(index=index, text=text, finish_reason=finish,
                                                                  logprobs=logprobs)]
            c = p.Completion(id=ident, created=created, model=service.name, usage=usage, choices=choices)
            return c.model_dump_json(exclude=None if req.include_usage else {"usage"})

        def logprobs(handle, start, end, offset, with_prompt=False):
            if top is None:
                return None
            entries = _completion_entries(service, handle, start, end)
            if with_prompt:
                entries = _prompt_entries(service, ids, echoed[1]) + entries
            return _completion_logprobs(entries, offset)

        if req.stream:
            plain = _TextChunks(chunk)

            async def chunks():
                sent = [0] * len(handles)  # characters sent per choice, for text_offset
                if echoed is not None:
                    for i in range(len(handles)):
                        yield chunk(i, echoed[0], logprobs=None if top is None else _completion_logprobs(
                            _prompt_entries(service, ids, echoed[1]), 0))
                        sent[i] = len(echoed[0])
                async for i, span in _merged(handles):
                    handle = handles[i]
                    if span is None:
                        yield chunk(i, "", finish=handle.finish_reason)
                        continue
                    text = "".join(handle.pieces[span[0]:span[1]])
                    if text or top is not None:
                        yield (plain(i, text) if top is None else
                               chunk(i, text, logprobs=logprobs(handle, *span, sent[i])))
                        sent[i] += len(text)
                if req.include_usage:
                    yield chunk(0, None, usage=p.Usage.of(*handles))

            return _EventStream(service, record, chunks())
        texts = await _collect(service, request, handles)
        prefix = echoed[0] if echoed is not None else ""
        choices = [p.CompletionChoice(index=i, text=prefix + text, finish_reason=handle.finish_reason,
                                      logprobs=logprobs(handle, 0, len(handle.tokens), 0, with_prompt=req.echo))
                   for i, (handle, text) in enumerate(zip(handles, texts))]
        return JSONResponse(p.Completion(id=ident, created=created, model=service.name,
                                         usage=p.Usage.of(*handles), choices=choices).model_dump())

    async def models(request: Request, record: _Record):
        card = p.ModelCard(id=service.name, created=service.created, max_model_len=service.context)
        return JSONResponse(p.ModelList(data=[card]).model_dump())

    async def tokenize(request: Request, record: _Record):
        req = p.parse(p.TokenizeRequest, await _body(request, service.max_body_bytes))
        if req.model is not None:
            _check_model(service, req.model)
        if (req.prompt is None) == (req.messages is None):
            raise p.APIError(400, "give exactly one of prompt and messages", param="prompt")
        if req.messages is not None:
            listed = None if req.tools is None else [tool.model_dump(exclude_none=True) for tool in req.tools]
            ids = _chat_ids(service, req.messages, listed, add_generation_prompt=req.add_generation_prompt)
        else:
            ids = _encode(service, req.prompt, "prompt", add_special_tokens=req.add_special_tokens)
        return JSONResponse({"tokens": ids, "count": len(ids), "max_model_len": service.context})

    async def detokenize(request: Request, record: _Record):
        req = p.parse(p.DetokenizeRequest, await _body(request, service.max_body_bytes))
        if req.model is not None:
            _check_model(service, req.model)
        try:
            return JSONResponse({"prompt": service.tokenizer.decode(req.tokens)})
        except ValueError as e:
            raise p.APIError(400, str(e), param="tokens") from None

    async def health(request: Request, record: _Record):
        if service.engine is None:
            return JSONResponse({"status": "loading"}, status_code=503)
        return JSONResponse({"status": "ok"})

    async def metrics(request: Request, record: _Record):
        return Response(generate_latest(service.registry), media_type=CONTENT_TYPE_LATEST)

    async def http_error(request: Request, exc: HTTPException):
        status = exc.status_code
        message = f"no route {request.method} {request.url.path}" if status in (404, 405) else exc.detail
        return _error(p.APIError(status, message))

    middleware = [Middleware(CORSMiddleware, allow_origins=list(service.cors_origins), allow_methods=["*"],
                             allow_headers=["*"])] if service.cors_origins else []
    return _App(routes=[
        route("/v1/chat/completions", chat, ["POST"]),
        route("/v1/completions", completions, ["POST"]),
        route("/v1/models", models, ["GET"]),
        route("/tokenize", tokenize, ["POST"]),
        route("/detokenize", detokenize, ["POST"]),
        route("/health", health, ["GET"], guarded=False, needs_engine=False),
        route("/metrics", metrics, ["GET"], guarded=False, needs_engine=False),
    ], middleware=middleware, exception_handlers={HTTPException: http_error})


def _authorize(request: Request, key: str):
    given = request.headers.get("authorization", "").encode()
    if not hmac.compare_digest(given, f"Bearer {key}".encode()):
        raise p.APIError(401, "missing or wrong API key: send the header 'Authorization: Bearer KEY'",
                         code="invalid_api_key")


async def _body(request: Request, limit: int) -> bytes:
    """The request body, refused with 413 past `limit` bytes (before reading it when Content-Length says so)."""
    too_big = p.APIError(413, f"the request body is over this server's limit of {limit} bytes "
                              "(lmstack serve --max-body-bytes)", code="body_too_large")
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > limit:
        raise too_big
    body = bytearray()
    async for part in request.stream():
        body += part
        if len(body) > limit:
            raise too_big
    return bytes(body)


def _check_model(service: Service, model: str):
    if model != service.name:
        raise p.APIError(404, f"model {model!r} does not exist: this server serves {service.name!r}", param="model",
                         code="model_not_found")


def _encode(service: Service, text: str, param: str, *, add_special_tokens=True) -> list[int]:
    try:
        return service.tokenizer.encode(text, add_special_tokens=add_special_tokens)
    except ValueError as e:
        raise p.APIError(400, str(e), param=param) from None


def _chat_ids(service: Service, messages, tools, *, add_generation_prompt=True) -> list[int]:
    """The conversation through the model's own chat template, tokenized as `lmstack chat` does: the text of
    the messages and tools is ordinary text, unless the service allows special tokens in it (Tokenizer.encode_chat)."""
    tokenizer = service.tokenizer
    if tokenizer.chat_template is None:
        raise p.APIError(400, f"the model {service.name!r} has no chat template: use /v1/completions",
                         param="messages")
    try:
        return tokenizer.encode_chat([m.for_template() for m in messages], add_generation_prompt=add_generation_prompt,
                                     tools=tools, allow_special_in_messages=service.allow_special_in_messages)
    except (TokenizerError, ValueError) as e:
        raise p.APIError(400, str(e), param="messages") from None


async def _until_disconnect(request: Request):
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _collect(service: Service, request: Request, handles) -> list[str]:
    """The whole text of each choice of a request, aborting them if the client leaves first."""
    async def text(handle):
        return "".join([piece async for piece in handle.atext_chunks()])

    collect = asyncio.ensure_future(asyncio.gather(*(text(handle) for handle in handles)))
    gone = asyncio.ensure_future(_until_disconnect(request))
    try:
        await asyncio.wait((collect, gone), return_when=asyncio.FIRST_COMPLETED)
        if not collect.done():
            raise p.APIError(499, "the client closed the connection")
        return collect.result()
    except EngineError as e:
        raise service.failure(e) from None
    finally:
        for task in (collect, gone):
            task.cancel()
        for handle in handles:
            if handle.finish_reason is None:
                handle.abort()


class _TextChunks:
    """A stream's chunks of plain text, as render(index, text) writes them, without building its models for each:
    rendered once per choice around a marker, a chunk is the text's JSON string between the two halves, the same
    bytes (json.dumps without ensure_ascii escapes every character as pydantic does)."""

    def __init__(self, render):
        self.render, self.halves = render, {}

    def __call__(self, index: int, text: str) -> str:
        halves = self.halves.get(index)
        if halves is None:
            marker = uuid.uuid4().hex
            halves = self.halves[index] = self.render(index, marker).split(json.dumps(marker))
        return json.dumps(text, ensure_ascii=False).join(halves)


async def _merged(handles):
    """(choice index, (start, end)) for the tokens each choice makes, as they come; (index, None) when it ends."""
    if len(handles) == 1:  # one choice (most requests): its ranges as they come, without a task and a queue
        async for span in handles[0].atoken_ranges():
            yield 0, span
        yield 0, None
        return
    queue = asyncio.Queue()

    async def follow(i, handle):
        try:
            async for span in handle.atoken_ranges():
                await queue.put((i, span, None))
            await queue.put((i, None, None))
        except EngineError as e:
            await queue.put((i, None, e))

    tasks = [asyncio.ensure_future(follow(i, handle)) for i, handle in enumerate(handles)]
    try:
        for _ in range(len(handles)):
            while True:
                i, span, error = await queue.get()
                if error is not None:
                    raise error
                yield i, span
                if span is None:
                    break
    finally:
        for task in tasks:
            task.cancel()


def _tool_plan(service: Service, req) -> tuple:
    """(the parser of the answer's tool calls or None, the Lark grammar its calls must follow or None), after
    checking tool_choice against tools."""
    choice, offered = req.tool_choice, req.tools
    if choice is not None and not offered:
        raise p.APIError(400, "tool_choice is only allowed when tools are given", param="tool_choice")
    if not offered or choice == "none":
        return None, None
    names = [tool.function.name for tool in offered]
    if len(set(names)) != len(names):
        raise p.APIError(400, f"tools: function names must be unique, got {names}", param="tools")
    if req.response_format is not None and req.response_format.type != "text":
        raise p.APIError(400, "response_format and tools both constrain the answer: give one of them (or "
                              "tool_choice 'none')", param="response_format")
    parallel = req.parallel_tool_calls is not False
    listed = req.template_tools()
    if isinstance(choice, p.NamedToolChoice):
        if choice.function.name not in names:
            raise p.APIError(400, f"tool_choice names function {choice.function.name!r}, which is not among the "
                                  f"tools ({', '.join(names)})", param="tool_choice")
        wanted = [tool for tool in listed if tool["function"]["name"] == choice.function.name]
        return service.parser, service.parser.required(wanted, parallel=False)
    if choice == "required":
        return service.parser, service.parser.required(listed, parallel)
    return service.parser, service.parser.auto(listed, parallel)


def _token_text(service: Service, token: int) -> tuple[str, list[int]]:
    data = service.tokenizer.decode_bytes([token]) if hasattr(service.tokenizer, "decode_bytes") else None
    return service.tokenizer.decode([token]), list(data) if data is not None else []


def _token_logprobs(service: Service, handle, start: int, end: int) -> list:
    """Chat's logprobs content of the tokens start:end (EOS, never shown, left out)."""
    out = []
    for token, (logprob, top) in zip(handle.tokens[start:end], handle.logprobs[start:end]):
        if token in handle.eos:
            continue
        text, data = _token_text(service, token)
        alternatives = []
        for other, other_logprob in top:
            other_text, other_data = _token_text(service, other)
            alternatives.append(p.TopLogprob(token=other_text, logprob=other_logprob, bytes=other_data))
        out.append(p.TokenLogprob(token=text, logprob=logprob, bytes=data, top_logprobs=alternatives))
    return out


def _completion_entries(service: Service, handle, start: int, end: int) -> list:
    """(text, logprob, [(text, logprob)] alternatives) of the tokens start:end (EOS left out)."""
    return [_entry(service, token, logprob, top)
            for token, (logprob, top) in zip(handle.tokens[start:end], handle.logprobs[start:end])
            if token not in handle.eos]


def _prompt_entries(service: Service, ids: list[int], scored: list) -> list:
    """The prompt's tokens: the first predicted by nothing (None), then each given the ones before."""
    return [(service.tokenizer.decode([ids[0]]), None, None)] + [
        _entry(service, token, logprob, top) for token, (logprob, top) in zip(ids[1:], scored)]


def _entry(service: Service, token: int, logprob: float, top: list) -> tuple:
    decode = service.tokenizer.decode
    return decode([token]), logprob, [(decode([other]), other_logprob) for other, other_logprob in top]


def _completion_logprobs(entries: list, offset: int) -> p.CompletionLogprobs:
    """Completions' logprobs: tokens, their log-probabilities, top alternatives as {text: logprob}, offsets."""
    tokens, logprobs, tops, offsets = [], [], [], []
    for text, logprob, top in entries:
        tokens.append(text)
        logprobs.append(logprob)
        tops.append(None if top is None else dict(top))
        offsets.append(offset)
        offset += len(text)
    return p.CompletionLogprobs(tokens=tokens, token_logprobs=logprobs, top_logprobs=tops, text_offset=offsets)


class _Stalled(Exception):
    """The client has not read its stream for the service's send_timeout, with the send buffer full."""


class _EventStream(StreamingResponse):
    """Server-sent events (`data: {json}` ... `data: [DONE]`) that end the request when the client leaves.

    The disconnect is watched all along, not only when a write fails, so a request still queued or between
    tokens is aborted too. An engine failure mid-stream is sent as an error event, which OpenAI's clients raise.
    A client that stops reading is cut off: the connection's send buffers are bounded (service.send_buffer
    bytes in the socket and as many in uvicorn), and a write that finds them full for service.send_timeout
    seconds drops the connection and aborts the request, so that it frees its KV blocks.
    """

    def __init__(self, service: Service, record: _Record, chunks):
        self.service, self.record, self.chunks = service, record, chunks
        super().__init__(self._events(), media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def _events(self):
        try:
            async for data in self.chunks:
                yield f"data: {data}\n\n"
        except EngineError as e:
            error = self.service.failure(e)
            self.record.status = error.status
            yield f"data: {json.dumps(error.body())}\n\n"
        yield "data: [DONE]\n\n"

    async def _send_within(self, send, message, transport):
        if transport is not None and transport.get_write_buffer_size() == 0:  # nothing queued: no write waits
            await send(message)
            return
        with anyio.move_on_after(self.service.send_timeout) as waited:
            await send(message)
        if waited.cancelled_caught:
            raise _Stalled

    async def __call__(self, scope, receive, send):
        handles = self.record.handles
        transport = scope.get("lmstack.transport")
        if transport is not None:
            _bound_buffers(transport, self.service.send_buffer)
        try:
            async with anyio.create_task_group() as group:
                async def stream():
                    try:
                        await self.stream_response(lambda message: self._send_within(send, message, transport))
                    except OSError:  # the client left while we wrote
                        self.record.status = 499
                    except _Stalled:
                        self.record.status = 499
                        self.service.cut_off.inc()
                        log.warning("%s: cut off, its stream unread for %g s with the send buffer full",
                                    self.record.client, self.service.send_timeout)
                        if transport is not None:
                            _reset(transport)
                    group.cancel_scope.cancel()

                group.start_soon(stream)
                await self.listen_for_disconnect(receive)
                if any(handle.finish_reason is None for handle in handles):
                    self.record.status = 499
                group.cancel_scope.cancel()
        finally:
            for handle in handles:
                if handle.finish_reason is None:
                    handle.abort()
            _finish(self.service, self.record)


class _App(Starlette):
    """The routes, each request's scope also holding its connection's asyncio transport ("lmstack.transport"):
    uvicorn's `send` is bound to it (None under another server), and a stream needs it to cut a client off."""

    async def __call__(self, scope, receive, send):
        scope["lmstack.transport"] = getattr(getattr(send, "__self__", None), "transport", None)
        await super().__call__(scope, receive, send)


def _reset(transport):
    """Drop the connection at once: a reset, so the kernel does not keep sending the unread buffer either."""
    sock = transport.get_extra_info("socket")
    if sock is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    transport.abort()


def _bound_buffers(transport, size: int):
    """At most `size` bytes queued in uvicorn's transport before a write waits, and as many in the socket."""
    transport.set_write_buffer_limits(high=size)
    sock = transport.get_extra_info("socket")
    if sock is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, size)
