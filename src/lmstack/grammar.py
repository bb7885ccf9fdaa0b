"""Constrained decoding: the tokens a JSON Schema, a regex or a Lark grammar allows next, as a logits mask.

    constraint = grammar.compile(tokenizer, lm.vocab_size, json_schema={...})   # or regex=..., lark=...
    lm.generate(ids, 64, constraint=constraint)      # or generate_text(..., json_schema=...), Engine.add(...)

The interface is ours and small, so another backend (xgrammar) could fill it: `compile` gives a `Grammar`;
a Grammar gives a `Matcher` per generated row (`accept(token)`, `allows(token)`, `allowed()` as a (vocab,) bool
array, `stopped`); `GrammarMask` is the decoding.Decoder processor over one matcher per row. llguidance fills it
here.

A mask is computed only where it can change the choice. A lazy GrammarMask (greedy rows, or sampling from the
tempered distribution uncut, without logprobs: decoding.Decoder decides) lets the sampler choose from the
unmasked logits and asks the matcher whether that token is allowed (well under a microsecond); only a row whose
token is refused gets its mask, computed there and then on the calling thread, and chooses again (`refused`,
`masked`). An eager GrammarMask (logprobs asked, or top-k/top-p/min-p sampling) masks every row every step: the
masks of step t+1 are computed on a side thread while the model's forward for step t+1 runs (`compute_ahead`:
the engine starts one job a step for all its eager requests, generate one for its rows; llguidance computes
them in parallel without the GIL); the processor then waits for them (they are usually ready) and adds them to
the logits (0 or -inf per token) in one op.

Why lazy first: on a 2-core CPU the side thread's job and its wake-ups compete with the forward's two OpenMP
threads, and with 16 rows a step the masks' NumPy work is ~0.4 ms of CPU; a refused row's inline mask is ~5 us
of llguidance plus one row's add.

Refusals are errors, never approximations: a schema feature llguidance cannot enforce (`not`, `uniqueItems`,
look-around in a pattern, ...) is a GrammarError naming it, and a grammar that takes longer than
COMPILE_SECONDS to compile is refused too (its compile runs on a side thread, so nothing else waits for it).
The vocabulary is the model's embedding rows: ids the tokenizer lacks are never allowed.
"""

import functools
import json
import threading
import weakref
from concurrent.futures import ThreadPoolExecutor, TimeoutError

import numpy as np
import torch

COMPILE_SECONDS = 2.0
JSON_DEFAULTS = {"whitespace_flexible": False}  # compact JSON: a weak model cannot pad it with whitespace forever
JSON_OVERRIDES = {"lenient": False}  # a schema's own "x-guidance" cannot make unenforced keywords pass silently
_MASKS = ThreadPoolExecutor(max_workers=2, thread_name_prefix="lmstack-grammar-mask")
_COMPILES = ThreadPoolExecutor(max_workers=2, thread_name_prefix="lmstack-grammar-compile")
_TOKENIZERS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_TOKENIZERS_LOCK = threading.Lock()


class GrammarError(ValueError):
    """A grammar or schema that cannot be compiled or enforced; the message names what is wrong."""


class Matcher:
    """One row's place in the grammar (llguidance's LLMatcher)."""

    def __init__(self, matcher, vocab: int):
        self._matcher, self.vocab = matcher, vocab

    @property
    def stopped(self) -> bool:
        """No token but the end may follow."""
        return self._matcher.is_stopped()

    def accept(self, token: int):
        if not self._matcher.consume_token(token):
            raise GrammarError(f"the grammar refused token {token}: {self._matcher.get_error()}")

    def allows(self, token: int) -> bool:
        """Whether the grammar allows token next (llguidance checks the one token: far cheaper than a mask)."""
        return self._matcher.validate_tokens([token]) == 1

    def allowed(self) -> np.ndarray:
        """(vocab,) bool: the tokens the grammar allows next."""
        bits = _bitmasks([self])[0].view(np.uint8)
        return np.unpackbits(bits, count=self.vocab, bitorder="little").view(bool)


class Grammar:
    """A compiled grammar for one tokenizer and vocabulary; `matcher()` starts a row at its beginning."""

    def __init__(self, matcher, vocab: int, source: str):
        self._template, self.vocab, self.source = matcher, vocab, source

    def matcher(self) -> Matcher:
        return Matcher(self._template.deep_copy(), self.vocab)

    def mask(self, batch: int, lazy: bool = False) -> "GrammarMask":
        return GrammarMask([self.matcher() for _ in range(batch)], lazy)


class GrammarMask:
    """The decoding processor: -inf added to the tokens a row's grammar forbids; a row ends when its grammar does.

    Eager (the default): `__call__` masks every row; its masks are those `compute_ahead` started (for the first
    call: at construction, while the prompt runs), else computed when the call comes. Lazy: the decoder chooses
    unmasked, then masks only the `refused` rows (`masked`), and compute_ahead leaves it alone."""

    def __init__(self, matchers: list, lazy: bool = False):
        self.matchers, self.vocab, self.lazy = matchers, matchers[0].vocab, lazy
        self.ended = torch.zeros(len(matchers), dtype=torch.bool)
        self._rows = list(range(len(matchers)))  # the rows that take a mask next (not ended, not done)
        self._ahead = None  # (future of _penalties' answer, where this mask's rows start in it)
        compute_ahead([self])

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        if not self._rows:
            return logits
        if self._ahead is None:
            penalties, nonempty = _penalties([self.matchers[row] for row in self._rows])
        else:
            (future, start), self._ahead = self._ahead, None
            penalties, nonempty = (a[start:start + len(self._rows)] for a in future.result())
        self._check(self._rows, nonempty)
        if len(self._rows) == len(self.matchers):
            penalty = penalties
        else:
            penalty = np.zeros((len(self.matchers), self.vocab), dtype=np.float32)
            penalty[self._rows] = penalties
        return _add(logits, penalty)

    def refused(self, tokens: torch.Tensor) -> list[int]:
        """The rows still under the grammar whose token (-1: a row that has stopped, skipped) it forbids."""
        tokens = tokens.tolist()
        return [row for row in self._rows if tokens[row] >= 0 and not self.matchers[row].allows(tokens[row])]

    def masked(self, logits: torch.Tensor, rows: list[int]) -> torch.Tensor:
        """logits (len(rows), vocab), those rows' own, with their masks added, computed now on this thread.

        For greedy rows the argmax of these is the argmax of the whole masked row whatever the unmasked choice
        was; the lazy decoder only asks for rows whose unmasked choice the grammar refused."""
        penalties, nonempty = _penalties([self.matchers[row] for row in rows], inline=True)
        self._check(rows, nonempty)
        return _add(logits, penalties)

    def _check(self, rows: list[int], nonempty: np.ndarray):
        for row, ok in zip(rows, nonempty.tolist()):
            if not ok:
                error = self.matchers[row]._matcher.get_error()
                raise GrammarError(f"the grammar allows no token: {error or 'it is stuck'}")

    def accept(self, tokens: torch.Tensor):
        rows = []
        for row in self._rows:
            token = int(tokens[row])
            if token < 0:
                continue
            matcher = self.matchers[row]
            matcher.accept(token)
            if matcher.stopped:
                self.ended[row] = True
            else:
                rows.append(row)
        self._rows = rows


def _add(logits: torch.Tensor, penalty: np.ndarray) -> torch.Tensor:
    if logits.device.type == "cpu":  # NumPy's add runs on this thread: no OpenMP team to wait for
        return torch.from_numpy(np.add(logits.numpy(), penalty, dtype=np.float32))
    return logits + torch.from_numpy(penalty).to(logits.device)


def compute_ahead(masks):
    """Start computing the next masks of these eager GrammarMasks' rows (other processors are left alone) on the side
    thread, all in one job, so they are ready when the model's next forward ends. llguidance computes them without
    the GIL, so the forward (and the Python driving it) goes on beside it; one job a step, not one a row, keeps the
    threads' handoffs to one."""
    masks = [mask for mask in masks
             if isinstance(mask, GrammarMask) and not mask.lazy and mask._ahead is None and mask._rows]
    if not masks:
        return
    future = _MASKS.submit(_penalties, [mask.matchers[row] for mask in masks for row in mask._rows])
    start = 0
    for mask in masks:
        mask._ahead = (future, start)
        start += len(mask._rows)


def _bitmasks(matchers: list, inline: bool = False) -> np.ndarray:
    """(n, words) int32: bit t of each row set where its matcher allows token t next (ids past the tokenizer's, up
    to the embedding rows, never), computed by llguidance in one call (inline: one row at a time on this thread,
    for the few rows a lazy mask refuses, where handing them to llguidance's pool would cost more)."""
    from llguidance.numpy import fill_next_token_bitmask, fill_next_token_bitmask_par

    vocab = matchers[0].vocab
    if any(m.vocab != vocab for m in matchers):
        raise ValueError("masks computed together must share one vocabulary")
    bits = np.zeros((len(matchers), (vocab + 31) // 32), dtype=np.int32)
    if inline:
        for i, m in enumerate(matchers):
            fill_next_token_bitmask(m._matcher, bits, i)
    else:
        fill_next_token_bitmask_par(_executor(), [(m._matcher, i) for i, m in enumerate(matchers)], bits)
    return bits


# the penalties of a mask byte's 8 tokens (bit j: token j of the 8): 0 where its bit is set, -inf where not
_BYTE_PENALTIES = np.where(np.unpackbits(np.arange(256, dtype=np.uint8)[:, None], axis=1, bitorder="little"),
                           np.float32(0), np.float32(-np.inf))


def _penalties(matchers: list, inline: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """(n, vocab) float32 to add to the logits, 0 where a token is allowed and -inf elsewhere, and (n,) bool,
    whether a row allows any token. NumPy only (it runs beside the model's forward, whose OpenMP team a torch op
    would contend with): one lookup of 8 penalties per mask byte, so that applying it is one add, not a select."""
    bits = _bitmasks(matchers, inline)
    penalties = np.take(_BYTE_PENALTIES, bits.view(np.uint8), axis=0).reshape(len(matchers), -1)
    return penalties[:, :matchers[0].vocab], bits.any(axis=1)


@functools.cache
def _executor():
    """llguidance's thread pool for computing masks, made on first use."""
    from llguidance import LLExecutor

    return LLExecutor()


def compile(tokenizer, vocab_size: int, *, json_schema=None, regex: str | None = None, lark: str | None = None,
            eos_ids=(), timeout: float = COMPILE_SECONDS) -> Grammar:
    """The Grammar of exactly one of json_schema (a dict or its JSON text), regex or lark, for the tokenizer and
    a model of vocab_size embedding rows; eos_ids: the tokens that may end it (default: the tokenizer's)."""
    given = {k: v for k, v in (("json_schema", json_schema), ("regex", regex), ("lark", lark)) if v is not None}
    if len(given) != 1:
        raise GrammarError(f"give exactly one of json_schema, regex, lark; got {sorted(given) or 'none'}")
    (kind, source), = given.items()
    from llguidance import LLMatcher

    if kind == "json_schema":
        if isinstance(source, (str, bytes)):
            try:
                source = json.loads(source)
            except ValueError as e:
                raise GrammarError(f"json_schema is not valid JSON: {e}") from None
        if not isinstance(source, dict):
            raise GrammarError(f"json_schema must be a JSON object (a schema), got {type(source).__name__}")
        try:
            text = LLMatcher.grammar_from_json_schema(source, defaults=JSON_DEFAULTS, overrides=JSON_OVERRIDES)
        except (ValueError, TypeError) as e:
            raise GrammarError(f"json_schema: {e}") from None
    elif not isinstance(source, str) or not source:
        raise GrammarError(f"{kind} must be a non-empty string, got {source!r}")
    else:
        text = LLMatcher.grammar_from_regex(source) if kind == "regex" else LLMatcher.grammar_from_lark(source)
    ll_tokenizer = _ll_tokenizer(tokenizer, vocab_size, tuple(eos_ids) or tuple(tokenizer.eos_ids))
    pending = _COMPILES.submit(LLMatcher, ll_tokenizer, text, log_level=0)
    try:
        matcher = pending.result(timeout=timeout)
    except TimeoutError:
        raise GrammarError(f"{kind} took longer than {timeout:g} s to compile; simplify it") from None
    if matcher.is_error():
        raise GrammarError(f"{kind}: {_explain(matcher.get_error())}")
    return Grammar(matcher, vocab_size, kind)


def _explain(error: str) -> str:
    if error.startswith("Unimplemented keys"):
        return f"uses schema features lmstack cannot enforce ({error})"
    return error


def _ll_tokenizer(tokenizer, vocab_size: int, eos_ids: tuple):
    """llguidance's view of the tokenizer (about a second to build for 50k tokens, so kept per tokenizer)."""
    from llguidance import LLTokenizer

    with _TOKENIZERS_LOCK:
        cache = _TOKENIZERS.setdefault(tokenizer, {})
        key = (vocab_size, eos_ids)
        if key not in cache:
            if not eos_ids:
                raise GrammarError("the tokenizer has no EOS token, which a grammar needs to end")
            try:
                cache[key] = LLTokenizer(tokenizer.to_json(), n_vocab=vocab_size, eos_token=list(eos_ids))
            except ValueError as e:
                raise GrammarError(f"llguidance cannot use this tokenizer with {vocab_size} embedding rows: {e}") \
                    from None
        return cache[key]
