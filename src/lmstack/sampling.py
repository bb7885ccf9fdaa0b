"""Choosing the next token, and the text a generation shows as it goes.

`Sampler` turns processed logits into tokens (greedy by default; temperature, top-k, top-p, min-p applied
in the order transformers applies them; decoding.Decoder applies the penalties before it). `TextStream` turns
a growing list of tokens into text pieces that never split a UTF-8 character and never show the start of a stop
string before it is known not to be one. `stream_text` and `generate_text` put them around
`CausalLM.stream` for prompts given as text.
"""

import codecs
import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from .tokenizer import Tokenizer


MIN_SCALE, MAX_SCALE = 1e-30, 1e30
ARGMAX_BLOCK = 128  # logits a row's maxima are first taken over (argmax_rows)


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """logits.argmax(-1) of (rows, vocab) logits, the same index (the first maximum, NaN above all), found through
    the maxima of blocks of ARGMAX_BLOCK logits: PyTorch's CPU argmax over a row is scalar, 7x slower than its
    amax, and took 0.5 ms of a 12 ms engine step of 16 rows over SmolLM2's 49152 logits (one row: the plain argmax,
    which is then the faster). The first block holding the row's maximum (or a NaN) is the argmax of the blocks'
    maxima, and the index is the first in that block."""
    rows, vocab = logits.shape
    if rows == 1 or vocab <= ARGMAX_BLOCK:
        return logits.argmax(-1)
    whole = vocab // ARGMAX_BLOCK * ARGMAX_BLOCK
    maxima = logits[:, :whole].view(rows, -1, ARGMAX_BLOCK).amax(-1)
    if whole < vocab:  # the last, shorter block
        maxima = torch.cat([maxima, logits[:, whole:].amax(-1, keepdim=True)], 1)
    start = maxima.argmax(-1) * ARGMAX_BLOCK
    columns = (start[:, None] + torch.arange(ARGMAX_BLOCK, device=logits.device)).clamp_(max=vocab - 1)
    return start + logits.gather(1, columns).argmax(-1)


@dataclass(frozen=True)
class Sampler:
    """How the next token is chosen; the defaults are greedy, and `temperature=0` or `top_k=1` is exact argmax.

    `seed` makes a sampled generation reproducible (same seed, batch and device: same tokens).
    """

    temperature: float = 0.0
    top_k: int = 0  # 0: off
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None

    def __post_init__(self):
        def number(name, ok, expected):
            value = getattr(self, name)
            is_number = isinstance(value, (int, float)) and not isinstance(value, bool)
            if not is_number or not math.isfinite(value) or not ok(value):
                raise ValueError(f"{name} must be {expected}, got {value!r}")

        # logits divided or multiplied by these stay finite in float32 (|logits| up to 1e4): 1e-45 made them inf
        number("temperature", lambda t: t == 0 or MIN_SCALE <= t <= MAX_SCALE,
               f"a number >= 0: 0 (greedy), else in [{MIN_SCALE:g}, {MAX_SCALE:g}]")
        number("top_p", lambda p: 0 < p <= 1, "a number in (0, 1]")
        number("min_p", lambda p: 0 <= p <= 1, "a number in [0, 1]")
        number("repetition_penalty", lambda p: MIN_SCALE <= p <= MAX_SCALE,
               f"a positive number in [{MIN_SCALE:g}, {MAX_SCALE:g}]")
        for name, limit in (("top_k", 1 << 63), ("seed", 1 << 64)):  # what torch takes
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < limit):
                raise ValueError(f"{name} must be an integer in [0, 2**{limit.bit_length() - 1}), got {value!r}")
        if self.top_k is None:
            raise ValueError("top_k must be a non-negative integer, got None")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1

    @property
    def truncates(self) -> bool:
        """Whether sampling cuts the tempered distribution (top-k, top-p, min-p), by ranks a mask would change."""
        return not self.greedy and bool(self.top_k or self.top_p < 1 or self.min_p)

    def generator(self, device) -> torch.Generator | None:
        """The random stream of one generation: seeded when asked, else from fresh entropy."""
        if self.greedy:
            return None
        generator = torch.Generator(device)
        if self.seed is None:
            generator.seed()
        else:
            generator.manual_seed(self.seed)
        return generator

    def draw(self, logits: torch.Tensor, generator) -> torch.Tensor:
        """Next tokens (B,) from processed float32 logits (B, vocab) (decoding.Decoder applies the penalties)."""
        if self.greedy:
            return logits.argmax(-1)
        return torch.multinomial(self.warp(logits).softmax(-1), 1, generator=generator)[:, 0]

    def warp(self, logits: torch.Tensor) -> torch.Tensor:
        """The logits sampling draws from: tempered, and -inf outside top-k/top-p/min-p."""
        logits = logits / self.temperature
        if self.top_k:
            kth = logits.topk(min(self.top_k, logits.shape[-1]), dim=-1).values[:, -1:]
            logits = logits.masked_fill(logits < kth, -math.inf)
        if self.top_p < 1:
            ranked, order = logits.sort(dim=-1, descending=True)
            probs = ranked.softmax(-1)
            drop = probs.cumsum(-1) - probs >= self.top_p  # the mass before a token already reaches top_p
            drop[:, 0] = False
            logits = logits.scatter(-1, order, ranked.masked_fill(drop, -math.inf))
        if self.min_p:
            probs = logits.softmax(-1)
            logits = logits.masked_fill(probs < self.min_p * probs.max(-1, keepdim=True).values, -math.inf)
        return logits


class TextStream:
    """The text of one row's tokens, released piece by piece as they come.

    A piece never ends inside a UTF-8 character (decoded text ending in U+FFFD waits for the next
    token), and never shows text that could be the start of a stop string. When a stop string
    appears, the text ends just before it and `stopped` is set.

    A byte-level tokenizer's text is decoded a token at a time (the whole text's decode is the text of the
    characters completed so far and of the bytes still pending): decoding every token's whole text again took
    a time that grew with the stream, 44 us a token on average over 2000 tokens of SmolLM2's.
    """

    def __init__(self, tokenizer, stop=()):
        if isinstance(stop, str):
            stop = (stop,)
        if any(not isinstance(s, str) or not s for s in stop):
            raise ValueError(f"stop must be non-empty strings, got {stop!r}")
        self.tokenizer, self.stop = tokenizer, tuple(stop)
        self.ids: list[int] = []
        self.text = ""  # released so far
        self.stopped = False
        self._utf8 = codecs.getincrementaldecoder("utf-8")("replace") if _byte_level(tokenizer) else None
        self._completed = ""  # with a byte-level tokenizer: the text of the whole characters of ids

    def _decoded(self, token: int) -> str:
        """tokenizer.decode(self.ids), self.ids ending in token."""
        if self._utf8 is None:
            return self.tokenizer.decode(self.ids)
        self._completed += self._utf8.decode(self.tokenizer.decode_bytes([token]))
        return self._completed + self._utf8.getstate()[0].decode("utf-8", errors="replace")

    def push(self, token: int) -> str:
        """Add a token; the text it releases (maybe empty)."""
        if self.stopped:
            return ""
        self.ids.append(int(token))
        full = self._decoded(self.ids[-1])
        cut = min((i for i in (full.find(s, max(0, len(self.text) - len(s))) for s in self.stop) if i >= 0),
                  default=-1)
        if cut >= 0:
            self.stopped = True
            return self._release(full[:cut])
        end = len(full.rstrip("\ufffd"))
        held = max((n for s in self.stop for n in range(1, len(s)) if full[:end].endswith(s[:n])), default=0)
        return self._release(full[:end - held])

    def finish(self) -> str:
        """The text still held back, at the end of the generation."""
        if self.stopped:
            return ""
        return self._release(self.tokenizer.decode(self.ids))

    def _release(self, text: str) -> str:
        if len(text) <= len(self.text):
            return ""
        piece, self.text = text[len(self.text):], text
        return piece


def _byte_level(tokenizer) -> bool:
    """Whether tokenizer.decode(ids) is the UTF-8 decoding (invalid bytes replaced) of decode_bytes(ids), the
    concatenation of each id's bytes: lmstack's Tokenizer of a byte-level BPE."""
    if not isinstance(tokenizer, Tokenizer):
        return False
    try:
        tokenizer.decode_bytes([])
    except ValueError:  # not a byte-level BPE
        return False
    return True


def _eos(lm, tokenizer, eos_ids) -> tuple:
    return tuple(dict.fromkeys((*lm.eos_ids, *tokenizer.eos_ids))) if eos_ids is None else tuple(eos_ids)


def text_steps(lm, tokenizer, prompts, max_new_tokens: int = 64, *, stop=(), eos_ids=None, json_schema=None,
               regex=None, grammar=None, **sampling) -> Iterator[list[str]]:
    """Each step's text pieces, one per prompt (maybe empty), and last the text still held back.

    Rows stop as `stream_text` says; prompts are text or token ids, of any lengths. `json_schema` (a dict or
    its JSON text), `regex` or `grammar` (Lark, llguidance's dialect) constrain the text: a row ends when it is
    complete (grammar.py; a schema feature that cannot be enforced is a GrammarError).
    """
    ids = [tokenizer.encode(p) if isinstance(p, (str, bytes)) else list(p) for p in prompts]
    streams = [TextStream(tokenizer, stop) for _ in ids]
    eos = _eos(lm, tokenizer, eos_ids)
    if json_schema is not None or regex is not None or grammar is not None:
        from .grammar import compile as compile_grammar

        sampling["constraint"] = compile_grammar(tokenizer, lm.vocab_size, json_schema=json_schema, regex=regex,
                                         lark=grammar, eos_ids=_eos(lm, tokenizer, None))
    pieces = []

    def until(tokens):
        pieces[:] = [s.push(t) if t >= 0 and t not in eos else "" for s, t in zip(streams, tokens.tolist())]
        return torch.tensor([s.stopped for s in streams], device=tokens.device)

    for _ in lm.stream(ids, max_new_tokens, eos_ids=eos, until=until, **sampling):
        yield pieces
    yield [s.finish() for s in streams]


def stream_text(lm, tokenizer, prompt, max_new_tokens: int = 64, *, stop=(), eos_ids=None, **sampling) -> Iterator[str]:
    """The continuation of one prompt (text, or token ids) in pieces, as they are made.

    It ends at one of `eos_ids` (default: the model's and the tokenizer's EOS ids; the EOS text is not
    shown), just before a `stop` string, or after `max_new_tokens`. `sampling`: Sampler's fields, and
    json_schema, regex or grammar (see text_steps).
    """
    for (piece,) in text_steps(lm, tokenizer, [prompt], max_new_tokens, stop=stop, eos_ids=eos_ids, **sampling):
        if piece:
            yield piece


def generate_text(lm, tokenizer, prompts, max_new_tokens: int = 64, *, stop=(), eos_ids=None,
                  **sampling) -> list[str]:
    """The continuation of each prompt, as `stream_text` ends it; prompts of any lengths share one batch."""
    texts = [""] * len(prompts)
    for pieces in text_steps(lm, tokenizer, prompts, max_new_tokens, stop=stop, eos_ids=eos_ids, **sampling):
        texts = [text + piece for text, piece in zip(texts, pieces)]
    return texts
