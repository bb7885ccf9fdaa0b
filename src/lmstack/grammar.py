"""Constrained decoding: the tokens a JSON Schema, a regex or a Lark grammar allows next, as a logits mask.

    constraint = grammar.compile(tokenizer, lm.vocab_size, json_schema={...})   # or regex=..., lark=...
    lm.generate(ids, 64, constraint=constraint)      # or generate_text(..., json_schema=...), Engine.add(...)

The interface is ours and small, so another backend (xgrammar) could fill it: `compile` gives a `Grammar`;
a Grammar gives a `Matcher` per generated row (`accept(token)`, `allowed()` as a (vocab,) bool tensor,
`stopped`); `GrammarMask` is the decoding.Decoder processor over one matcher per row. llguidance fills it
here. Its matcher computes the mask for step t+1 as soon as token t is accepted, in a side thread (llguidance
releases the GIL) while the model's forward for step t+1 runs; the processor then waits for it (it is usually
ready) and applies it with one masked_fill.

Refusals are errors, never approximations: a schema feature llguidance cannot enforce (`not`, `uniqueItems`,
look-around in a pattern, ...) is a GrammarError naming it, and a grammar that takes longer than
COMPILE_SECONDS to compile is refused too (its compile runs on a side thread, so nothing else waits for it).
The vocabulary is the model's embedding rows: ids the tokenizer lacks are never allowed.
"""

import json
import math
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

    def allowed(self) -> np.ndarray:
        """(vocab,) bool: the tokens the grammar allows next. NumPy only: it runs in a side thread beside the
        model's forward, whose OpenMP team a torch op here would contend with."""
        bits = np.frombuffer(self._matcher.compute_bitmask(), dtype=np.uint8)
        allowed = np.zeros(self.vocab, dtype=bool)  # ids past the tokenizer's, up to the embedding rows: never
        known = np.unpackbits(bits, bitorder="little")[:self.vocab].astype(bool)
        allowed[:len(known)] = known
        if not allowed.any():
            raise GrammarError(f"the grammar allows no token: {self._matcher.get_error() or 'it is stuck'}")
        return allowed


class Grammar:
    """A compiled grammar for one tokenizer and vocabulary; `matcher()` starts a row at its beginning."""

    def __init__(self, matcher, vocab: int, source: str):
        self._template, self.vocab, self.source = matcher, vocab, source

    def matcher(self) -> Matcher:
        return Matcher(self._template.deep_copy(), self.vocab)

    def mask(self, batch: int) -> "GrammarMask":
        return GrammarMask([self.matcher() for _ in range(batch)])


class GrammarMask:
    """The decoding processor: -inf for the tokens a row's grammar forbids; a row ends when its grammar does."""

    def __init__(self, matchers: list):
        self.matchers = matchers
        self.ended = torch.zeros(len(matchers), dtype=torch.bool)
        self._next = [_MASKS.submit(m.allowed) for m in matchers]  # the first masks, while the prompt runs

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        allowed = np.ones(logits.shape, dtype=bool)
        for row, pending in enumerate(self._next):
            if pending is not None:
                allowed[row] = pending.result()
        return logits.masked_fill(~torch.from_numpy(allowed).to(logits.device), -math.inf)

    def accept(self, tokens: torch.Tensor):
        for row, token in enumerate(tokens.tolist()):
            matcher = self.matchers[row]
            if token < 0 or self.ended[row]:
                self._next[row] = None
                continue
            matcher.accept(token)
            if matcher.stopped:
                self.ended[row] = True
                self._next[row] = None
            else:
                self._next[row] = _MASKS.submit(matcher.allowed)


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
