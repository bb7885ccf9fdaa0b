"""Text to token ids and back, with the ids of the Hugging Face `tokenizers` library.

`tokenizers` runs the BPE; this module adds what it leaves to the caller: the config around
`tokenizer.json` (BOS/EOS, chat template), a byte-level BPE built from parts (as a GGUF carries it),
ids checked against the vocabulary, and text the vocabulary cannot encode refused by name rather
than silently dropped.
"""

import json
import re
from datetime import datetime
from functools import cached_property
from pathlib import Path

import jinja2
import jinja2.ext
import tokenizers
from jinja2.sandbox import ImmutableSandboxedEnvironment

from .config import MAX_VOCAB, parse_json, read_json, read_text

GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
         r"|\s*[\r\n]+|\s+(?!\S)|\s+")
LLAMA3 = QWEN2.replace(r"|\p{N}|", r"|\p{N}{1,3}|")
DIGIT = r"\p{N}"

# A byte-level pre-tokenization is a sequence of regexes, each one isolating its matches
# (`Split(..., "isolated")`); the text between matches stays a piece too.
PATTERNS = {
    "gpt2": (GPT2,),
    "smollm": (DIGIT, GPT2),  # Digits(individual_digits) before GPT-2, as SmolLM and StarCoder
    "llama3": (LLAMA3,),
    "qwen2": (QWEN2,),
}
NORMALIZERS = ("NFC", "NFD", "NFKC", "NFKD")
MODELS = ("BPE", "WordPiece", "WordLevel", "Unigram")


class TokenizerError(ValueError):
    """tokenizer.json, tokenizer_config.json or a chat template is malformed, or the template fails."""


def _byte_chars() -> list[str]:
    """GPT-2's printable stand-in for each byte value: byte-level vocabularies spell tokens with them."""
    printable = {*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)}
    spare = iter(range(256, 512))
    return [chr(b) if b in printable else chr(next(spare)) for b in range(256)]


BYTE_CHARS = _byte_chars()
_TO_LATIN1 = str.maketrans({c: chr(b) for b, c in enumerate(BYTE_CHARS)})  # then .encode("latin-1") gives the bytes
_FROM_LATIN1 = str.maketrans({chr(b): c for b, c in enumerate(BYTE_CHARS)})


def _spell(token: bytes) -> str:
    """A token's bytes as a byte-level vocabulary writes them."""
    return bytes(token).decode("latin-1").translate(_FROM_LATIN1)


class Tokenizer:
    """Token ids for text, exactly as `tokenizers` computes them for the same tokenizer, and text for ids.

    Ids are lists of ints; decode also takes a 1-d tensor. Text the vocabulary cannot encode is an error:
    where a byte-level BPE has no token for one of the text's bytes (SmolLM2 lacks 0x04, 0x06, 0xF1, ...)
    and no unk token, `tokenizers` drops the character silently; encode raises ValueError naming the
    character and its position (in the normalized text) instead. Remove or replace such characters
    before encoding if dropping them is what you want.
    """

    def __init__(self, tokens, merges, *, pattern, added=None, normalizer=None, bos_ids=(), eos_ids=(),
                 add_bos=False, add_eos=False, ignore_merges=False, chat_template=None, source="<tokens>"):
        """A byte-level BPE from its parts, as a GGUF's `tokenizer.ggml.*` metadata carries them.

        `tokens`: each id's bytes, in id order; `merges`: (left, right) byte pairs, in rank order;
        `pattern`: a name in PATTERNS, a regex, or a sequence of regexes; `added`: {text: id} of the
        special tokens; `normalizer`: a name in NORMALIZERS. `bos_ids`/`eos_ids`: the tokens that
        begin/end a sequence; the first one is what `add_bos`/`add_eos` adds and what a chat template
        sees as bos_token/eos_token, and a generation may stop at any of `eos_ids`.
        """
        if isinstance(pattern, str) and pattern not in PATTERNS and re.fullmatch(r"\w+", pattern):
            raise ValueError(f"{source}: pattern {pattern!r} is not a name in PATTERNS {sorted(PATTERNS)}")
        regexes = PATTERNS.get(pattern) or ((pattern,) if isinstance(pattern, str) else tuple(pattern))
        vocab = {}
        for i, token in enumerate(tokens):
            if (first := vocab.setdefault(_spell(token), i)) != i:
                raise TokenizerError(f"{source}: token {i} {bytes(token)!r} repeats token {first}")
        if normalizer is not None and normalizer not in NORMALIZERS:
            raise ValueError(f"{source}: normalizer {normalizer!r} is not one of {NORMALIZERS}")
        spec = {
            "version": "1.0",
            "added_tokens": [{"id": i, "content": text, "single_word": False, "lstrip": False, "rstrip": False,
                              "normalized": False, "special": True} for text, i in (added or {}).items()],
            "normalizer": normalizer and {"type": normalizer},
            "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
                *({"type": "Split", "pattern": {"Regex": r}, "behavior": "Isolated", "invert": False} for r in regexes),
                {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}]},
            "decoder": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False},
            "model": {"type": "BPE", "vocab": vocab, "merges": [[_spell(a), _spell(b)] for a, b in merges],
                      "ignore_merges": ignore_merges, "unk_token": None, "byte_fallback": False},
        }
        bos_ids, eos_ids = tuple(bos_ids), tuple(eos_ids)
        self._bind(json.dumps(spec), spec, source, bos_ids, eos_ids, list(bos_ids[:1]) if add_bos else [],
                   list(eos_ids[:1]) if add_eos else [], chat_template)

    @classmethod
    def from_pretrained(cls, path) -> "Tokenizer":
        """Load a directory with `tokenizer.json`, the `tokenizer.json` itself, or a GGUF file (its metadata).

        Beside it, `tokenizer_config.json` gives bos_token/eos_token, add_bos_token/add_eos_token and
        chat_template (`chat_template.jinja` takes precedence); without add_*_token, encode adds what the
        file's TemplateProcessing post-processor adds.
        """
        from .gguf import GGUFFile, is_gguf

        path = Path(path)
        if is_gguf(path):
            with GGUFFile(path) as source:
                return source.tokenizer()
        file = path / "tokenizer.json" if path.is_dir() else path
        if not file.is_file():
            raise FileNotFoundError(f"{file}: no such tokenizer.json")
        text = read_text(file, TokenizerError)
        spec = parse_json(text, file, TokenizerError)
        model = spec.get("model")
        if not isinstance(model, dict):
            raise TokenizerError(f"{file}: field 'model' is missing or not an object")
        if model.get("type", "BPE") not in MODELS:
            raise TokenizerError(f"{file}: model.type {model.get('type')!r} is not one of {MODELS}")
        config_file = file.parent / "tokenizer_config.json"
        config = read_json(config_file, TokenizerError) if config_file.is_file() else {}
        template_file = file.parent / "chat_template.jinja"
        if template_file.is_file():
            template = read_text(template_file, TokenizerError)
        else:
            template = _chat_template(config.get("chat_template"), config_file)

        try:
            backend = tokenizers.Tokenizer.from_str(text)
        except BaseException as e:  # pyo3 panics derive from BaseException
            if isinstance(e, (KeyboardInterrupt, SystemExit)):
                raise
            raise TokenizerError(f"{file}: tokenizers cannot load it: {e}") from None

        def ids_of(key):
            token = config.get(key)
            content = token.get("content") if isinstance(token, dict) else token
            if content is None:
                return ()
            if not isinstance(content, str):
                raise TokenizerError(f"{config_file}: {key} = {content!r}, expected a token's text")
            if (i := backend.token_to_id(content)) is None:
                raise TokenizerError(f"{config_file}: {key} {content!r} is not in the vocabulary of {file}")
            return (i,)

        bos_ids, eos_ids = ids_of("bos_token"), ids_of("eos_token")
        before, after = _template_ends(spec.get("post_processor"))
        for key in ("add_bos_token", "add_eos_token"):
            if config.get(key) not in (None, True, False):
                raise TokenizerError(f"{config_file}: {key} = {config[key]!r}, expected true or false")
        if config.get("add_bos_token") is not None:
            before = list(bos_ids) if config["add_bos_token"] else []
        if config.get("add_eos_token") is not None:
            after = list(eos_ids) if config["add_eos_token"] else []
        tok = cls.__new__(cls)
        tok._bind(text, spec, str(file), bos_ids, eos_ids, before, after, template, backend)
        return tok

    def _bind(self, text, spec, source, bos_ids, eos_ids, prefix, suffix, chat_template, backend=None):
        try:
            self._special = backend or tokenizers.Tokenizer.from_str(text)
        except Exception as e:
            raise TokenizerError(f"{source}: tokenizers cannot build it: {e}") from None
        vocab = self._special.get_vocab(with_added_tokens=True)
        if not vocab:
            raise TokenizerError(f"{source}: the vocabulary is empty")
        top = max(vocab, key=vocab.get)
        if vocab[top] >= MAX_VOCAB:  # tables below are indexed by id: refuse before allocating them
            raise TokenizerError(f"{source}: token {top!r} has id {vocab[top]}, more than the {MAX_VOCAB} we allow")
        self._plain = tokenizers.Tokenizer.from_str(text)
        self._plain.encode_special_tokens = True  # special tokens' text is ordinary text
        self.source, self.chat_template = source, chat_template
        self.bos_ids, self.eos_ids, self._prefix, self._suffix = bos_ids, eos_ids, prefix, suffix
        self.n_vocab = vocab[top] + 1
        self._kind = type(self._special.model).__name__
        self.pattern, self._bytes, self._missing = None, None, b""
        if self._kind == "BPE" and _byte_level(spec.get("pre_tokenizer")) and _byte_level(spec.get("decoder")):
            self.pattern = _pattern(spec["pre_tokenizer"])
            self._bytes = self._byte_table(vocab)
            if self._special.model.unk_token is None:
                self._missing = bytes(b for b, c in enumerate(BYTE_CHARS) if self._plain.token_to_id(c) is None)

    def _byte_table(self, vocab) -> list:
        table = [None] * self.n_vocab
        for token, i in vocab.items():
            try:
                table[i] = token.translate(_TO_LATIN1).encode("latin-1")
            except UnicodeEncodeError:
                raise TokenizerError(f"{self.source}: token {i} {token!r} is not in byte-level spelling") from None
        for i, token in self._special.get_added_tokens_decoder().items():
            table[i] = token.content.encode()
        return table

    def pretokenize(self, data) -> list[bytes]:
        """The pieces the BPE merges within, after normalization: the cut before any merge."""
        self._need_bytes("pretokenize")
        text = self._normalized(self._text(data))
        return [piece.translate(_TO_LATIN1).encode("latin-1")
                for piece, _ in self._plain.pre_tokenizer.pre_tokenize_str(text)]

    def encode_bytes(self, data, *, allow_special=False) -> list[int]:
        """The ids of UTF-8 bytes, with no BOS/EOS added."""
        return self.encode(data, add_special_tokens=False, allow_special=allow_special)

    def encode(self, text, *, add_special_tokens=True, allow_special=False) -> list[int]:
        """The ids of a str or of UTF-8 bytes; BOS/EOS around them as the tokenizer says, with add_special_tokens.

        With allow_special, the text of a special token is that token; otherwise it is ordinary text
        (non-special added tokens always match, as in `tokenizers`).
        """
        text = self._text(text)
        self._check_encodable(text)
        ids = (self._special if allow_special else self._plain).encode(text, add_special_tokens=False).ids
        return self._prefix + ids + self._suffix if add_special_tokens else ids

    def encode_batch(self, texts, *, add_special_tokens=True, allow_special=False) -> list[list[int]]:
        """encode for many texts at once, on `tokenizers`' threads."""
        texts = [self._text(text) for text in texts]
        for k, text in enumerate(texts):
            self._check_encodable(text, f"text {k}: ")
        encodings = (self._special if allow_special else self._plain).encode_batch(texts, add_special_tokens=False)
        if add_special_tokens:
            return [self._prefix + e.ids + self._suffix for e in encodings]
        return [e.ids for e in encodings]

    def decode_bytes(self, ids) -> bytes:
        """The bytes of the ids, special tokens included; a stream can decode token by token with it."""
        self._need_bytes("decode_bytes")
        ids = self._ids(ids)
        try:
            return b"".join([self._bytes[i] for i in ids])
        except TypeError:  # an id without a token
            self._refuse(ids)

    def to_json(self) -> str:
        """The `tokenizer.json` text of this tokenizer, as `tokenizers` writes it."""
        return self._special.to_str()

    def decode(self, ids) -> str:
        """The text of the ids, special tokens included; invalid UTF-8 becomes U+FFFD."""
        if self._bytes is not None:
            return self.decode_bytes(ids).decode("utf-8", errors="replace")
        return self._plain.decode(self._ids(ids), skip_special_tokens=False)

    def apply_chat_template(self, messages, *, add_generation_prompt=True, **variables) -> str:
        """The prompt for a conversation, rendered as transformers renders it (`tokenize=False`).

        The template runs in jinja2's immutable sandbox with the variables transformers passes:
        messages, bos_token, eos_token, add_generation_prompt, raise_exception, strftime_now, and
        `variables` (tools, documents, enable_thinking, ...). The sandbox keeps the template from Python's
        internals, files and the network; it does not bound the template's time or memory.
        """
        if self.chat_template is None:
            raise TokenizerError(f"{self.source}: no chat_template (tokenizer_config.json or chat_template.jinja)")
        variables = {"tools": None, "documents": None, "bos_token": self._token_text(self.bos_ids),
                     "eos_token": self._token_text(self.eos_ids), **variables}
        try:
            return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt, **variables)
        except Exception as e:  # the template is the checkpoint's code: any failure is its own
            raise TokenizerError(f"{self.source}: chat template: {e}") from e

    @cached_property
    def _template(self) -> jinja2.Template:
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = lambda format: datetime.now().strftime(format)
        return env.from_string(self.chat_template)

    def _token_text(self, ids):
        return self.decode(ids[:1]) if ids else None

    def _text(self, text) -> str:
        if isinstance(text, str):
            return text
        if not isinstance(text, (bytes, bytearray, memoryview)):
            raise TypeError(f"{self.source}: expected str or UTF-8 bytes, got {type(text).__name__}")
        try:
            return bytes(text).decode("utf-8")
        except UnicodeDecodeError as e:
            byte = e.object[e.start]
            raise ValueError(f"{self.source}: not UTF-8: byte 0x{byte:02X} at position {e.start}") from None

    def _normalized(self, text: str) -> str:
        return self._plain.normalizer.normalize_str(text) if self._plain.normalizer else text

    def _check_encodable(self, text: str, where=""):
        """Refuse a character with a byte that has no token, which `tokenizers` would drop silently."""
        if not self._missing:
            return
        text = self._normalized(text)
        data = text.encode()
        if len(data.translate(None, self._missing)) == len(data):
            return
        pos, char = next((pos, c) for pos, c in enumerate(text) if any(b in self._missing for b in c.encode()))
        lacking = ", ".join(f"0x{b:02X}" for b in char.encode() if b in self._missing)
        raise ValueError(f"{self.source}: {where}character {char!r} (U+{ord(char):04X}) at position {pos} cannot be "
                         f"encoded: the vocabulary has no token for byte {lacking}")

    def _need_bytes(self, what: str):
        if self._bytes is None:
            raise ValueError(f"{self.source}: {what} needs a byte-level BPE, not a {self._kind} tokenizer "
                             f"without ByteLevel pre-tokenizer and decoder")

    def _ids(self, ids) -> list[int]:
        ids = ids.tolist() if hasattr(ids, "tolist") else list(ids)
        if ids and (min(ids) < 0 or max(ids) >= self.n_vocab):
            self._refuse(ids)
        return ids

    def _refuse(self, ids):
        for pos, i in enumerate(ids):
            if not (isinstance(i, int) and 0 <= i < self.n_vocab) or (self._bytes and self._bytes[i] is None):
                raise ValueError(f"{self.source}: id {i!r} at position {pos} is not in the vocabulary "
                                 f"(0..{self.n_vocab - 1})")


def _chat_template(template, config_file: Path) -> str | None:
    """tokenizer_config.json's chat_template: a string, or a list of named ones of which we take "default"."""
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    if template is not None and not isinstance(template, str):
        raise TokenizerError(f"{config_file}: chat_template is a {type(template).__name__}, expected a string "
                             f"or a list of {{name, template}} with a 'default'")
    return template


def _steps(component) -> list[dict]:
    if not isinstance(component, dict):
        return []
    inner = component.get("pretokenizers") or component.get("decoders") or component.get("processors") or []
    return [s for c in inner for s in _steps(c)] if component.get("type") == "Sequence" else [component]


def _byte_level(component) -> bool:
    return any(step.get("type") == "ByteLevel" for step in _steps(component))


def _pattern(pre_tokenizer):
    """The PATTERNS name of a byte-level pre-tokenizer, or its regex(es); None when not regex splits."""
    regexes = []
    for step in _steps(pre_tokenizer):
        kind = step.get("type")
        if kind == "Digits" and step.get("individual_digits"):
            regexes.append(DIGIT)
        elif kind == "Split" and "Regex" in step["pattern"] and step["behavior"] == "Isolated" and not step["invert"]:
            regexes.append(step["pattern"]["Regex"])
        elif kind == "ByteLevel" and not step.get("add_prefix_space"):
            if step.get("use_regex", True):
                regexes.append(GPT2)
        else:
            return None
    regexes = tuple(regexes)
    name = next((name for name, value in PATTERNS.items() if value == regexes), None)
    return name or (regexes[0] if len(regexes) == 1 else regexes)


def _template_ends(post_processor) -> tuple[list[int], list[int]]:
    """The ids a TemplateProcessing post-processor puts before and after a single text."""
    for step in _steps(post_processor):
        if step.get("type") == "TemplateProcessing":
            pieces, specials = step["single"], step["special_tokens"]
            cut = next((k for k, piece in enumerate(pieces) if "Sequence" in piece), len(pieces))
            ids = [[i for p in part if "SpecialToken" in p for i in specials[p["SpecialToken"]["id"]]["ids"]]
                   for part in (pieces[:cut], pieces[cut + 1:])]
            return ids[0], ids[1]
    return [], []


def _raise_exception(message):
    raise jinja2.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    """transformers' tojson: no HTML escaping, and json.dumps' options."""
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)
