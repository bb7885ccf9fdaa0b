"""The engine: requests in, tokens out, every running request stepped together (see the package docstring)."""

import asyncio
import math
import os
import threading
import time

import torch

from .. import grammar, memory
from ..decoding import Decoder
from ..sampling import Sampler, TextStream, argmax_rows
from ..threads import Threads, release_team
from .kv_cache import BlockPool
from .runner import Runner
from .scheduler import Scheduler, Seq

FINISH_REASONS = ("stop", "length", "abort", "error")


class EngineError(RuntimeError):
    """A request ended by a failure of the engine (a failed step, or the engine closed under it)."""


def available_memory(device: torch.device) -> int:
    """Bytes free for new tensors on device now (CUDA: the driver's count; CPU: MemAvailable)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def default_kv_memory(model, max_running: int, block_size: int) -> int:
    """Enough blocks for max_running sequences of the whole context, but at most a quarter of the free memory."""
    per_sequence = -(-model.max_positions // block_size) * model.page_bytes(block_size)
    return min(max_running * per_sequence, available_memory(model.device) // 4)


def _positive_int(name: str, value):
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


class Handle:
    """One request: iterate it (sync or async) for its token ids as they are made."""

    def __init__(self, engine, seq: Seq, max_tokens: int, decoder: Decoder, eos: frozenset, text: TextStream | None,
                 logprobs: int | None = None):
        self._engine, self._seq = engine, seq
        self.prompt_tokens, self.max_tokens = seq.n_prompt, max_tokens
        self.tokens: list[int] = []  # the completion's token ids
        self.pieces: list[str] = []  # with a tokenizer: the text each token released (EOS and stop strings held)
        self.finish_reason: str | None = None
        self.error: EngineError | None = None
        self.created = time.monotonic()
        self.token_times: list[float] = []  # time.monotonic() at each token
        self.logprobs: list[tuple] | None = [] if logprobs is not None else None  # per token: (logprob, top)
        self._decoder, self._top = decoder, logprobs
        self.eos, self._text = eos, text  # eos: the ids that end it (never shown as text)
        self._cond = threading.Condition()
        self._waiters: list = []  # (loop, future) of async iterators waiting for the next token

    @property
    def completion_tokens(self) -> int:
        return len(self.tokens)

    @property
    def time_to_first_token(self) -> float | None:
        return self.token_times[0] - self.created if self.token_times else None

    @property
    def time_between_tokens(self) -> list[float]:
        return [b - a for a, b in zip(self.token_times, self.token_times[1:])]

    @property
    def text(self) -> str:
        return "".join(self.pieces)

    def abort(self):
        """Stop the request within one engine step; its blocks are freed and finish_reason becomes "abort"."""
        self._engine._abort(self)

    # ---- iteration ---------------------------------------------------------------------

    def _item(self, i: int, items: list):
        """items[i] when made; None when the request ended before it; inline engines step meanwhile."""
        while True:
            with self._cond:
                if i < len(items):
                    return items[i]
                if self.finish_reason is not None:
                    if self.error is not None:
                        raise self.error
                    return None
                if self._engine.started:
                    self._cond.wait()
                    continue
            self._engine.step()

    def _iterate(self, items: list):
        i = 0
        while (item := self._item(i, items)) is not None:
            yield item
            i += 1

    def __iter__(self):
        return self._iterate(self.tokens)

    def text_pieces(self):
        """The completion's text, piece by piece (needs the engine's tokenizer)."""
        yield from (piece for piece in self._iterate(self.pieces) if piece)

    async def _aiterate(self, items: list, together: bool = False):
        """items as they are made; together: lists of every item made since the last yield."""
        loop, i = asyncio.get_running_loop(), 0
        while True:
            ready = future = None
            with self._cond:
                if i < len(items):
                    ready, i = (items[i:], len(items)) if together else (items[i], i + 1)
                elif self.finish_reason is not None:
                    if self.error is not None:
                        raise self.error
                    return
                elif self._engine.started:
                    future = loop.create_future()
                    self._waiters.append((loop, future))
            if ready is not None:
                yield ready
            elif future is not None:
                await future
            else:
                self._engine.step()

    def __aiter__(self):
        return self._aiterate(self.tokens)

    async def atoken_ranges(self):
        """For async for: (start, end) of the tokens made since the last range (all made meanwhile, if behind);
        tokens[start:end], pieces[start:end] and logprobs[start:end] are theirs."""
        start = 0
        async for pieces in self._aiterate(self.pieces, together=True):
            yield start, start + len(pieces)
            start += len(pieces)

    async def atext_chunks(self):
        """For async for: the text released since the last chunk, so a caller that falls behind the engine (a
        server streaming to many clients) gets the pieces made meanwhile as one."""
        async for pieces in self._aiterate(self.pieces, together=True):
            if text := "".join(pieces):
                yield text

    # ---- engine side -------------------------------------------------------------------

    @property
    def _argmax_only(self) -> bool:
        """Its next token is its logits' argmax (greedy, no processor, no logprobs): taken for every such request of
        a step at once."""
        return self.logprobs is None and self._decoder.argmax_only

    def _sample(self, logits: torch.Tensor) -> tuple[int, bool]:
        """The next token through the request's decoder, and whether its constraint is now complete."""
        token = int(self._decoder.choose(logits[None])[0])
        if self.logprobs is not None:
            logprobs = self._decoder.logprobs()[0]
            top = logprobs.topk(self._top) if self._top else None
            self.logprobs.append((float(logprobs[token]), [] if top is None else  # a masked-out token is no option
                                  [(i, v) for i, v in zip(top.indices.tolist(), top.values.tolist()) if v > -math.inf]))
        ended = self._decoder.ended
        return token, bool(ended is not None and ended[0])

    def _push(self, token: int, ended: bool = False) -> str | None:
        """Record a token (ended: its constraint is complete); the finish reason it brings, if any."""
        reason = None
        piece = ""
        if token in self.eos:
            reason = "stop"
        elif ended:
            piece = self._text.push(token) if self._text is not None else ""
            reason = "stop"
        elif self._text is not None:
            piece = self._text.push(token)
            reason = "stop" if self._text.stopped else None
        if reason is None and len(self.tokens) + 1 >= self.max_tokens:
            reason = "length"
        if reason is not None and self._text is not None:
            piece += self._text.finish()
        with self._cond:
            self.tokens.append(token)
            self.pieces.append(piece)
            self.token_times.append(time.monotonic())
        return reason

    def _finish(self, reason: str, error: EngineError | None = None):
        with self._cond:
            if self.finish_reason is None:
                self.finish_reason, self.error = reason, error
        _wake([self])


def _wake(handles):
    """Wake whatever waits on these handles: threads through each one's condition, and each event loop by one
    callback for all its waiters, so that a step's tokens cost a loop one wake-up, not one per request."""
    futures = {}
    for handle in handles:
        with handle._cond:
            handle._cond.notify_all()
            waiters, handle._waiters = handle._waiters, []
        for loop, future in waiters:
            futures.setdefault(loop, []).append(future)
    for loop, waiting in futures.items():
        try:
            loop.call_soon_threadsafe(_resolve, waiting)
        except RuntimeError:  # its event loop has closed since: nobody is left to wake
            pass


def _resolve(futures):
    for future in futures:
        if not future.done():
            future.set_result(None)


class Engine:
    """Serves many requests at once on one model (see the package docstring)."""

    def __init__(self, model, tokenizer=None, *, max_running: int = 16, kv_cache_memory: int | None = None,
                 block_size: int = 16, max_prefill_tokens: int = 512, short_slots: int | None = None,
                 short_tokens: int = 8):
        for name, value in (("max_running", max_running), ("block_size", block_size),
                            ("max_prefill_tokens", max_prefill_tokens), ("short_tokens", short_tokens)):
            _positive_int(name, value)
        if short_slots is None:
            short_slots = max_running // 8
        if isinstance(short_slots, bool) or not isinstance(short_slots, int) or not 0 <= short_slots < max_running:
            raise ValueError(f"short_slots must be an integer in [0, max_running {max_running}), got {short_slots!r}")
        if any(d != model.device for d in model.layer_devices):
            raise ValueError("the engine runs a model whose layers are all on one device")
        self.model, self.tokenizer = model, tokenizer
        self.block_size = block_size
        self.n_blocks = 0
        if model.rotary is not None:
            if kv_cache_memory is None:
                kv_cache_memory = default_kv_memory(model, max_running, block_size)
            _positive_int("kv_cache_memory", kv_cache_memory)
            self.n_blocks = kv_cache_memory // model.page_bytes(block_size)
            if self.n_blocks < 1:
                raise ValueError(f"kv_cache_memory {kv_cache_memory} bytes holds no KV block: one block of "
                                 f"{block_size} tokens takes {model.page_bytes(block_size)} bytes")
        self.kv_cache_memory = self.n_blocks * (model.page_bytes(block_size) if self.n_blocks else 0)
        memory.ensure(self.kv_cache_memory, model.device, f"a KV pool of {self.n_blocks} blocks (kv_cache_memory)")
        self.pool = BlockPool(self.n_blocks, block_size) if self.n_blocks else None
        self.runner = Runner(model, self.n_blocks, block_size, max_running)
        self.scheduler = Scheduler(self.pool, max_running, max_prefill_tokens, self.runner.chunk_align,
                                   short_slots, short_tokens)
        self._lock = threading.Lock()  # guards what add, abort and the stepping thread hand each other
        self._wake = threading.Condition(self._lock)
        self._step_lock = threading.Lock()
        self._incoming: list[Handle] = []
        self._aborts: list[Handle] = []
        self._handles: dict[Seq, Handle] = {}
        self._arrivals = 0
        self._thread: threading.Thread | None = None
        self._closed = False
        self._stats = {}
        self._publish()

    # ---- lifetime ----------------------------------------------------------------------

    @property
    def started(self) -> bool:
        return self._thread is not None

    @property
    def closed(self) -> bool:
        return self._closed

    def start(self):
        """Step in a background thread from now on (without it, iterating a handle steps in the caller's thread).

        The caller's OpenMP threads (those that loaded the model) are let go, so that the stepping thread's are
        the only ones (threads.release_team).
        """
        if self._closed:
            raise EngineError("the engine is closed")
        if self._thread is None:
            if self.model.device.type == "cpu":
                release_team()
            self._thread = threading.Thread(target=self._loop, name="lmstack-engine", daemon=True)
            self._thread.start()
        return self

    def close(self):
        """Stop the background thread; requests still running or waiting end with an EngineError."""
        with self._lock:
            self._closed = True
            self._wake.notify_all()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()
        with self._step_lock, self._lock:
            handles = list(self._handles.values()) + self._incoming
            self._incoming.clear()
            self._handles.clear()
        for handle in handles:
            handle._finish("error", EngineError("the engine was closed"))

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.close()

    def _loop(self):
        threads = Threads() if self.model.device.type == "cpu" else None  # sized to the cores left free
        while True:
            with self._lock:
                if threads is not None and not (self._incoming or self._aborts or self._handles):
                    release_team()  # idle: another thread of the process (a generate) computes on its own team
                while not self._closed and not (self._incoming or self._aborts or self._handles):
                    self._wake.wait()
                if self._closed:
                    return
            if threads is not None:
                threads.adapt()
            self.step()

    # ---- requests ----------------------------------------------------------------------

    def add(self, prompt_ids, *, max_tokens: int, temperature=0.0, top_k=0, top_p=1.0, min_p=0.0,
            repetition_penalty=1.0, presence_penalty=0.0, frequency_penalty=0.0, seed=None, stop=(),
            eos_ids=None, logit_bias=None, constraint=None, logprobs: int | None = None,
            sample_of: Handle | None = None) -> Handle:
        """Queue a request; ValueError naming the field if it is bad (nothing else is disturbed).

        `logit_bias`: {token id: number in [-100, 100]} added to those logits, as OpenAI's field.
        `constraint`: a grammar.Grammar its tokens must follow (it ends, "stop", when the grammar is complete).
        `logprobs`: record each token's log-probability and that many top alternatives (handle.logprobs).
        `sample_of`: the handle of another sample of the same prompt_ids (OpenAI's n): this one starts once that
        one's prompt is computed, and shares its KV blocks.
        """
        if self._closed:
            raise EngineError("the engine is closed")
        prompt = self._check_prompt(prompt_ids)
        _positive_int("max_tokens", max_tokens)
        limit = self.model.paged_positions
        if limit is not None and len(prompt) + max_tokens > limit:
            why = "" if limit == self.model.max_positions else " in KV pages (LongRoPE's original context)"
            raise ValueError(f"prompt_ids ({len(prompt)} tokens) + max_tokens ({max_tokens}) exceed the model's "
                             f"context of {limit} tokens{why}")
        if self.pool is not None:
            need = self.pool.blocks_for(len(prompt) + max_tokens - 1)
            if need > self.n_blocks:
                raise ValueError(
                    f"prompt_ids ({len(prompt)} tokens) + max_tokens ({max_tokens}) need {need} KV blocks of "
                    f"{self.block_size} tokens; the pool holds {self.n_blocks} (kv_cache_memory "
                    f"{self.kv_cache_memory} bytes)")
        sampler = Sampler(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                          repetition_penalty=repetition_penalty, seed=seed)
        for name, value in (("presence_penalty", presence_penalty), ("frequency_penalty", frequency_penalty)):
            if (isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value)
                    or not -2 <= value <= 2):
                raise ValueError(f"{name} must be a number in [-2, 2], got {value!r}")
        stop = (stop,) if isinstance(stop, str) else tuple(stop)
        if stop and self.tokenizer is None:
            raise ValueError("stop strings need the engine's tokenizer (Engine(model, tokenizer))")
        if logprobs is not None and (isinstance(logprobs, bool) or not isinstance(logprobs, int)
                                     or not 0 <= logprobs <= self.model.vocab_size):
            raise ValueError(f"logprobs must be an integer in [0, {self.model.vocab_size}], got {logprobs!r}")
        for token, value in (logit_bias or {}).items():
            if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token < self.model.vocab_size:
                raise ValueError(f"logit_bias holds {token!r}, not a token id in [0, {self.model.vocab_size})")
            if (isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value)
                    or not -100 <= value <= 100):
                raise ValueError(f"logit_bias of token {token} must be a number in [-100, 100], got {value!r}")
        text = TextStream(self.tokenizer, stop) if self.tokenizer is not None else None
        eos = frozenset(self._eos_ids(eos_ids))
        decoder = Decoder.build(sampler, [prompt], self.model.vocab_size, self.model.device,
                                presence=presence_penalty, frequency=frequency_penalty, logit_bias=logit_bias,
                                constraint=constraint, logprobs=logprobs is not None)
        with self._lock:
            if self._closed:
                raise EngineError("the engine is closed")
            seq = Seq(self._arrivals, prompt, len(prompt), max_tokens)
            if sample_of is not None:
                if sample_of._seq.tokens[:sample_of._seq.n_prompt] != prompt:
                    raise ValueError("sample_of is a request of other prompt_ids")
                seq.leader = sample_of._seq
            self._arrivals += 1
            handle = Handle(self, seq, max_tokens, decoder, eos, text, logprobs)
            self._incoming.append(handle)
            self._wake.notify_all()
        return handle

    def _check_prompt(self, prompt_ids) -> list[int]:
        if isinstance(prompt_ids, torch.Tensor):
            if prompt_ids.dim() != 1 or prompt_ids.dtype.is_floating_point or prompt_ids.dtype == torch.bool:
                raise ValueError(f"prompt_ids must be a 1-D integer tensor, got {prompt_ids.dtype} "
                                 f"{tuple(prompt_ids.shape)}")
            prompt_ids = prompt_ids.tolist()
        if isinstance(prompt_ids, (str, bytes)) or not hasattr(prompt_ids, "__iter__"):
            raise ValueError(f"prompt_ids must be a sequence of token ids, got {type(prompt_ids).__name__}")
        prompt = list(prompt_ids)
        if not prompt:
            raise ValueError("prompt_ids is empty: a request needs at least one token")
        vocab = self.model.vocab_size
        for token in prompt:
            if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token < vocab:
                raise ValueError(f"prompt_ids holds {token!r}, not a token id in [0, {vocab})")
        return prompt

    def _eos_ids(self, eos_ids) -> tuple:
        if eos_ids is None:
            tokenizer_eos = getattr(self.tokenizer, "eos_ids", ()) if self.tokenizer is not None else ()
            return tuple(dict.fromkeys((*self.model.eos_ids, *tokenizer_eos)))
        eos_ids = (eos_ids,) if isinstance(eos_ids, int) else tuple(eos_ids)
        for token in eos_ids:
            if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token < self.model.vocab_size:
                raise ValueError(f"eos_ids holds {token!r}, not a token id in [0, {self.model.vocab_size})")
        return eos_ids

    def _abort(self, handle: Handle):
        with self._lock:
            self._aborts.append(handle)
            self._wake.notify_all()

    # ---- stepping ----------------------------------------------------------------------

    def step(self):
        """One scheduled step: admit new requests, drop aborted ones, one forward, one token per sampled request."""
        with self._step_lock:
            with self._lock:
                incoming, self._incoming = self._incoming, []
                aborts, self._aborts = self._aborts, []
            for handle in incoming:
                self._handles[handle._seq] = handle
                self.scheduler.add(handle._seq)
            for handle in aborts:
                if handle._seq in self._handles:
                    self._end(handle, "abort")
            try:
                self._run(self.scheduler.schedule())
            except Exception as error:  # the model failed: every request in flight ends with it
                handles = list(self._handles.values())
                for handle in handles:
                    self._end(handle, "error", EngineError(f"engine step failed: {error!r}"))
            self._publish()

    def _run(self, batch):
        if not batch:
            return
        seqs, logits = self.runner.run(batch)
        for seq, n in batch:
            seq.n_computed += n
            if self.pool is not None:
                self.pool.seal(seq.kv, seq.tokens, seq.n_computed)
        handles = [self._handles[seq] for seq in seqs]
        # argmax of every row at once (exact, so each row's token is what its own decoder would choose)
        argmax_only = [h._argmax_only for h in handles]
        argmax = argmax_rows(logits).tolist() if any(argmax_only) else None
        try:
            for i, (seq, handle) in enumerate(zip(seqs, handles)):
                try:
                    token, ended = (argmax[i], False) if argmax_only[i] else handle._sample(logits[i])
                except Exception as error:  # its own constraint failed: that request ends, the others go on
                    self._end(handle, "error", EngineError(f"choosing the next token failed: {error}"))
                    continue
                seq.tokens.append(token)
                reason = handle._push(token, ended)
                if reason is not None:
                    self._end(handle, reason)
        finally:
            _wake(handles)
        grammar.compute_ahead([h._decoder.mask for h in self._handles.values()])

    def _end(self, handle: Handle, reason: str, error: EngineError | None = None):
        """Drop a request; the stats count it gone before its caller can see it finish."""
        self._handles.pop(handle._seq, None)
        self.scheduler.remove(handle._seq)
        self._publish()
        handle._finish(reason, error)

    def _publish(self):
        s, pool = self.scheduler, self.pool
        stats = dict(running=len(s.running), waiting=len(s.waiting), preemptions=s.preemptions,
                     kv_blocks_total=self.n_blocks, kv_blocks_free=pool.n_free if pool else 0,
                     kv_blocks_used=self.n_blocks - pool.n_free if pool else 0,
                     kv_blocks_cached=len(pool.cached) if pool else 0,
                     prefix_queries=pool.queries if pool else 0, prefix_hits=pool.hits if pool else 0)
        stats["prefix_hit_rate"] = stats["prefix_hits"] / stats["prefix_queries"] if stats["prefix_queries"] else 0.0
        with self._lock:
            self._stats = stats

    def stats(self) -> dict:
        """Counts as of the last step or the last request to end (requests added since are counted as waiting)."""
        with self._lock:
            return {**self._stats, "waiting": self._stats["waiting"] + len(self._incoming)}
