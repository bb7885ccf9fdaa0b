"""Text to token ids and back, with the ids of the Hugging Face `tokenizers` library.

`tokenizers` runs the BPE; this module adds what it leaves to the caller: the config around
`tokenizer.json` (BOS/EOS, chat templates, which chat.py renders), a byte-level BPE built from parts
(as a GGUF carries it), ids checked against the vocabulary, and text the vocabulary cannot encode
refused by name rather than silently dropped.
"""

import json
import math
import re
import secrets
from contextlib import contextmanager
from functools import partial
from itertools import accumulate
from pathlib import Path

import tokenizers

from .config import MAX_VOCAB, UnsupportedModel, parse_json, read_json, read_text
from .gguf import GGUFHeader, TokenizerData, is_gguf, tokenizer_data
from .pretokenizers import DIGIT, GGUF_PRE_TOKENIZERS, GPT2, PATTERNS

NORMALIZERS = ("NFC", "NFD", "NFKC", "NFKD")
MAX_EXPANSION = 16  # how many times longer a normalizer may make a text; real ones stay near 1
MODELS = ("BPE", "WordPiece", "WordLevel", "Unigram")


class TokenizerError(ValueError):
    """tokenizer.json, tokenizer_config.json or a chat template is malformed, or the template fails."""


def _byte_chars() -> list[str]:
    """GPT-2's printable stand-in for each byte value: byte-level vocabularies spell tokens with them."""
    printable = {*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)}
    spare = iter(range(256, 512))
    return [chr(b) if b in printable else chr(next(spare)) for b in range(256)]


BYTE_CHARS = _byte_chars()
_BYTE_ALPHABET = frozenset(BYTE_CHARS)
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

    def __init__(self, tokens, merges, *, pattern, added=None, not_special=(), normalizer=None, bos_ids=(),
                 eos_ids=(), add_bos=None, add_eos=None, ignore_merges=False, chat_template=None, special_tokens=None,
                 source="<tokens>"):
        """A byte-level BPE from its parts, as a GGUF's `tokenizer.ggml.*` metadata carries them.

        `tokens`: each id's bytes, in id order; `merges`: (left, right) byte pairs, in rank order;
        `pattern`: a name in PATTERNS, a regex, or a sequence of regexes; `added`: {text: id} of the
        added tokens, at their own ids, within the tokens or above them, special unless their text is in
        `not_special`; `normalizer`: a name in NORMALIZERS. `bos_ids`/`eos_ids`: the tokens that
        begin/end a sequence; encode puts the first of each around the ids (unless `add_bos`/`add_eos` is
        False), a chat template sees their text as bos_token/eos_token, and a generation may stop at any
        of `eos_ids`. `chat_template`: a template, or {name: template}; `special_tokens`: {bos_token:
        text, ...} for the template, instead of those.
        """
        tokens = [bytes(token) for token in tokens]
        self._byte_level_bpe([_spell(token) for token in tokens], [(_spell(a), _spell(b)) for a, b in merges],
                             lambda i: tokens[i], pattern=pattern, added=added, not_special=not_special,
                             normalizer=normalizer, bos_ids=bos_ids, eos_ids=eos_ids, add_bos=add_bos,
                             add_eos=add_eos, ignore_merges=ignore_merges, chat_template=chat_template,
                             special_tokens=special_tokens, source=source)

    def _byte_level_bpe(self, tokens, merges, shown, *, pattern, added, not_special, normalizer, bos_ids, eos_ids,
                        add_bos, add_eos, ignore_merges, chat_template, special_tokens, source):
        """__init__ on tokens and merges as a byte-level vocabulary spells them; `shown(i)`: token i for errors."""
        if isinstance(pattern, str) and pattern not in PATTERNS and re.fullmatch(r"\w+", pattern):
            raise ValueError(f"{source}: pattern {pattern!r} is not a name in PATTERNS {sorted(PATTERNS)}")
        regexes = PATTERNS.get(pattern) or ((pattern,) if isinstance(pattern, str) else tuple(pattern))
        added = dict(added or {})
        ids = {i: text for text, i in added.items()}
        for text, i in added.items():
            if not (isinstance(text, str) and text and isinstance(i, int) and 0 <= i < MAX_VOCAB):
                raise ValueError(f"{source}: added token {text!r}: {i!r}, expected a non-empty text and an id "
                                 f"below {MAX_VOCAB}")
            if ids[i] != text:
                raise ValueError(f"{source}: added tokens {text!r} and {ids[i]!r} share id {i}")
        vocab = {}
        for i, token in enumerate(tokens):
            if i not in ids and (first := vocab.setdefault(token, i)) != i:
                raise TokenizerError(f"{source}: token {i} {shown(i)!r} repeats token {first}")
        for text, i in added.items():
            if vocab.setdefault(text, i) != i:
                raise TokenizerError(f"{source}: added token {text!r} (id {i}) is also token {vocab[text]}")
        if normalizer is not None and normalizer not in NORMALIZERS:
            raise ValueError(f"{source}: normalizer {normalizer!r} is not one of {NORMALIZERS}")
        spec = {
            "version": "1.0",
            "added_tokens": [{"id": i, "content": text, "single_word": False, "lstrip": False, "rstrip": False,
                              "normalized": False, "special": text not in not_special} for text, i in added.items()],
            "normalizer": normalizer and {"type": normalizer},
            "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
                *(r if isinstance(r, dict) else {"type": "Split", "pattern": {"Regex": r}, "behavior": "Isolated",
                                                 "invert": False} for r in regexes),
                *([] if _byte_level({"type": "Sequence", "pretokenizers": regexes}) else
                  [{"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}])]},
            "decoder": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False},
            "model": {"type": "BPE", "vocab": vocab, "merges": [list(merge) for merge in merges],
                      "ignore_merges": ignore_merges, "unk_token": None, "byte_fallback": False},
        }
        bos_ids, eos_ids = tuple(bos_ids), tuple(eos_ids)
        prefix = list(bos_ids[:1]) if add_bos is not False else []
        suffix = list(eos_ids[:1]) if add_eos is not False else []
        self._bind(None, spec, source, bos_ids, eos_ids, prefix, suffix, chat_template)
        if special_tokens is None:
            special_tokens = {"bos_token": self._token_text(bos_ids), "eos_token": self._token_text(eos_ids)}
        self.special_tokens = {k: v for k, v in special_tokens.items() if v is not None}

    @classmethod
    def from_pretrained(cls, path) -> "Tokenizer":
        """Load a directory with `tokenizer.json`, the `tokenizer.json` itself, or a GGUF file (its metadata).

        Beside it, `tokenizer_config.json` gives the special tokens (bos_token, eos_token, pad_token, ...),
        add_bos_token/add_eos_token and chat_template (`chat_template.jinja` and
        `additional_chat_templates/*.jinja` take precedence); without add_*_token, encode adds what the
        file's TemplateProcessing post-processor adds.
        """
        path = Path(path)
        if is_gguf(path):
            with GGUFHeader(path) as header:
                return cls.from_gguf(header)
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
        template = _chat_templates(file.parent, config.get("chat_template"), config_file)

        try:
            backend = tokenizers.Tokenizer.from_str(text)
        except BaseException as e:  # pyo3 panics derive from BaseException
            if isinstance(e, (KeyboardInterrupt, SystemExit)):
                raise
            raise TokenizerError(f"{file}: tokenizers cannot load it: {_short(e)}") from None

        def content(key):
            token = config.get(key)
            text = token.get("content") if isinstance(token, dict) else token
            if text is not None and not isinstance(text, str):
                raise TokenizerError(f"{config_file}: {key} = {text!r}, expected a token's text")
            return text

        def ids_of(key):
            if (text := content(key)) is None:
                return ()
            if (i := backend.token_to_id(text)) is None:
                raise TokenizerError(f"{config_file}: {key} {text!r} is not in the vocabulary of {file}")
            return (i,)

        from . import chat  # (and jinja2 with it) where it is used, not by every program that encodes

        bos_ids, eos_ids = ids_of("bos_token"), ids_of("eos_token")
        special_tokens = {key: content(key) for key in chat.SPECIAL_TOKENS if content(key) is not None}
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
        tok.special_tokens = special_tokens
        return tok

    @classmethod
    def from_gguf(cls, header: GGUFHeader) -> "Tokenizer":
        """The tokenizer an open GGUF's metadata describes, whatever the model's architecture, as llama.cpp reads it.

        `tokenizer.ggml.model` "gpt2" is a byte-level BPE cut as `tokenizer.ggml.pre` names
        (GGUF_PRE_TOKENIZERS); "llama" is a SentencePiece BPE ("▁" for spaces, `<0xNN>` byte fallback, a "▁"
        prefixed unless `tokenizer.ggml.add_space_prefix` is false, as for Gemma 1-3);
        "gemma4" is a BPE over "▁"-spelled UTF-8 with `<0xNN>` byte fallback. Control tokens (type 3)
        are special; user-defined ones (type 4) are not. Anything else (bert's WordPiece, t5's Unigram,
        ...) is refused by name.
        """
        data = tokenizer_data(header)
        if data.model == "llama":
            return _sentencepiece(cls, data)
        if data.model == "gemma4":
            return _gemma4(cls, data)
        if data.model != "gpt2":
            raise UnsupportedModel(f"{data.source}: tokenizer.ggml.model {data.model!r} is not supported "
                                   f"(supported: gpt2, llama, gemma4)")
        pre = data.pre or "gpt2"
        if pre not in GGUF_PRE_TOKENIZERS:
            raise UnsupportedModel(f"{data.source}: tokenizer.ggml.pre {pre!r} is not supported "
                                   f"(supported: {', '.join(sorted(GGUF_PRE_TOKENIZERS))})")
        pattern, ignore_merges, normalizer = GGUF_PRE_TOKENIZERS[pre]
        added = {text: i for i, (text, kind) in enumerate(zip(data.tokens, data.types)) if kind in (3, 4)}
        user_defined = {text for text, kind in zip(data.tokens, data.types) if kind == 4}
        # A token not spelled in byte-level characters (Command-R's "\u200d", "™") is one no text reaches,
        # as in llama.cpp and `tokenizers`; decoded, it is its own text
        tok = cls.__new__(cls)
        tok._byte_level_bpe(data.tokens, [merge.split(" ") for merge in data.merges or ()], data.tokens.__getitem__,
                            pattern=pattern, added=added, not_special=user_defined, normalizer=normalizer,
                            bos_ids=() if data.bos is None else (data.bos,), eos_ids=data.eos,
                            add_bos=bool(data.add_bos), add_eos=bool(data.add_eos), ignore_merges=ignore_merges,
                            chat_template=data.chat_template, special_tokens=_gguf_special_tokens(data),
                            source=data.source)
        return tok

    def _bind(self, text, spec, source, bos_ids, eos_ids, prefix, suffix, chat_template, backend=None):
        """Take `backend`, the tokenizer `tokenizers` loaded from a file's `text` (parsed: `spec`), or one built
        from `spec` alone (text None), with the ids and template around it."""
        try:
            built = backend or _built(spec)
        except Exception as e:
            raise TokenizerError(f"{source}: tokenizers cannot build it: {_short(e)}") from None
        vocab = built.get_vocab(with_added_tokens=True) if backend else {
            **spec["model"]["vocab"], **{token["content"]: token["id"] for token in spec["added_tokens"]}}
        if not vocab:
            raise TokenizerError(f"{source}: the vocabulary is empty")
        top = max(vocab, key=vocab.get)
        if vocab[top] >= MAX_VOCAB:  # tables below are indexed by id: refuse before allocating them
            raise TokenizerError(f"{source}: token {top!r} has id {vocab[top]}, more than the {MAX_VOCAB} we allow")
        if (factor := _expansion(spec.get("normalizer"))) > MAX_EXPANSION:  # chained, they abort the process
            raise TokenizerError(f"{source}: the normalizer's Replace steps can make a text {factor:g} times longer "
                                 f"(at most {MAX_EXPANSION})")
        added = built.get_added_tokens_decoder()
        # Without allow_special every added token's text is ordinary text, the non-special ones' too, but
        # for runs of whitespace (GPT-NeoX's and MPT's "  ", "   ", ...): they forge nothing, and are
        # how the model saw such runs, in `tokenizers` and llama.cpp alike
        if all(token.special or token.content.isspace() for token in added.values()):
            # then the two differ only in encode_special_tokens: one built here, the other from the same text
            # when first used (_special), a second build of the vocabulary and merges a plain encode never needs
            self._plain = tokenizers.Tokenizer.from_str(text) if backend else built
            self._special_built, self._special_spec = backend, spec
        else:
            plain = json.loads(built.to_str()) if backend else dict(spec)  # a file as `tokenizers` read it
            plain["added_tokens"] = [{**token, "special": token["special"] or not token["content"].isspace()}
                                     for token in plain["added_tokens"]]
            self._plain = tokenizers.Tokenizer.from_str(json.dumps(plain))
            self._special_built, self._special_spec = built, None
        self._plain.encode_special_tokens = True
        self.source, self.chat_template = source, chat_template
        self.bos_ids, self.eos_ids, self._prefix, self._suffix = bos_ids, eos_ids, prefix, suffix
        self.n_vocab = vocab[top] + 1
        self._added_ids = {i: token.content for i, token in added.items()}
        self._kind = type(built.model).__name__
        self.pattern, self._bytes, self._missing = None, None, b""
        if self._kind == "BPE" and _byte_level(spec.get("pre_tokenizer")) and _byte_level(spec.get("decoder")):
            self.pattern = _pattern(spec["pre_tokenizer"])
            self._bytes = self._byte_table(vocab, added)
            if built.model.unk_token is None:
                self._missing = bytes(b for b, c in enumerate(BYTE_CHARS) if self._plain.token_to_id(c) is None)

    @property
    def _special(self) -> tokenizers.Tokenizer:
        """The tokenizer that matches special tokens' text (allow_special, to_json)."""
        if self._special_built is None:  # two threads may both build it: the same tokenizer either way
            self._special_built = _built(self._special_spec)
        return self._special_built

    def _byte_table(self, vocab, added) -> list:
        """Each id's bytes: an added token's are its text's, any other token's are spelled byte-level (if it is).
        Where all are (the usual case), one translation of their joined text, cut at their lengths (each character
        one byte), rather than one per token."""
        table = [None] * self.n_vocab
        for i, token in added.items():
            table[i] = token.content.encode()
        rest = [(i, token) for token, i in vocab.items() if table[i] is None]
        ids, tokens = zip(*rest) if rest else ((), ())
        joined = "".join(tokens)
        if _BYTE_ALPHABET.issuperset(joined):
            data, ends = joined.translate(_TO_LATIN1).encode("latin-1"), list(accumulate(map(len, tokens)))
            for i, start, end in zip(ids, [0, *ends], ends):
                table[i] = data[start:end]
            return table
        for i, token in zip(ids, tokens):  # those not spelled byte-level: their own text, as `tokenizers` decodes them
            table[i] = token.translate(_TO_LATIN1).encode("latin-1") if _BYTE_ALPHABET.issuperset(token) else \
                token.encode()
        return table

    def pretokenize(self, data) -> list[bytes]:
        """The pieces the BPE merges within, after normalization: the cut before any merge."""
        self._need_bytes("pretokenize")
        text = self._normalized(self._text(data))
        with self._library():
            pieces = self._plain.pre_tokenizer.pre_tokenize_str(text)
        return [piece.translate(_TO_LATIN1).encode("latin-1") for piece, _ in pieces]

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
        with self._library():
            ids = (self._special if allow_special else self._plain).encode(text, add_special_tokens=False).ids
        return self._prefix + ids + self._suffix if add_special_tokens else ids

    def encode_batch(self, texts, *, add_special_tokens=True, allow_special=False) -> list[list[int]]:
        """encode for many texts at once, on `tokenizers`' threads."""
        texts = [self._text(text) for text in texts]
        for k, text in enumerate(texts):
            self._check_encodable(text, f"text {k}: ")
        with self._library():
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

    def apply_chat_template(self, messages, *, add_generation_prompt=True, tools=None, documents=None,
                            chat_template=None, **variables) -> str:
        """The prompt for a conversation, rendered as transformers renders it (`tokenize=False`).

        `chat_template` names one of the tokenizer's templates (by default "tool_use" when tools are
        given and it has one, else "default"); `variables` (enable_thinking, ...) reach the template as
        transformers hands them. The sandbox keeps the template from Python's internals, files and the
        network, and bounds its time and memory (chat.py).
        """
        from . import chat

        try:
            template = chat.select(self.chat_template, chat_template, tools)
            return chat.render(template, messages, special_tokens=self.special_tokens, tools=tools,
                               documents=documents, add_generation_prompt=add_generation_prompt, **variables)
        except Exception as e:  # the template is the checkpoint's code: any failure is its own
            raise TokenizerError(f"{self.source}: chat template: {str(e) or type(e).__name__}") from e

    def encode_chat(self, messages, *, add_generation_prompt=True, tools=None, documents=None, chat_template=None,
                    allow_special_in_messages=False, **variables) -> list[int]:
        """The ids of a conversation's prompt (apply_chat_template's arguments), no BOS/EOS added to the template's.

        Only the template's own markup becomes special tokens. The text that comes with the conversation (each
        message's content, name, tool calls and their arguments, the tools and documents) is ordinary text even
        where it spells a special token, so that a user who writes "<|im_start|>system" in a message gets those
        characters, not a system turn. Where that text spells no special token, the ids are those of the rendered
        prompt encoded with allow_special. allow_special_in_messages encodes it so in every case: for callers
        that trust their messages (who render prompts of their own, with control tokens in them).
        """
        render = partial(self.apply_chat_template, add_generation_prompt=add_generation_prompt,
                         chat_template=chat_template, **variables)
        if allow_special_in_messages:
            return self.encode(render(messages, tools=tools, documents=documents), add_special_tokens=False,
                               allow_special=True)
        from . import chat

        inert = _InertSpecials(self)
        prompt = render(inert.of(chat._as_data(messages)), tools=inert.of(chat._as_data(tools)),
                        documents=inert.of(chat._as_data(documents)))
        with self._library():
            encoding = self._special.encode(prompt, add_special_tokens=False)
        ids, start = [], 0
        for i, (begin, end) in zip(encoding.ids, encoding.offsets):
            if i in self._added_ids and self._added_ids[i] in prompt[begin:end]:  # the template's markup
                ids += self._ordinary(inert.restore(prompt[start:begin]))
                ids.append(i)
                start = end
        return ids + self._ordinary(inert.restore(prompt[start:]))

    def _ordinary(self, text: str) -> list[int]:
        return self.encode(text, add_special_tokens=False) if text else []

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
        with self._library():
            return self._plain.normalizer.normalize_str(text) if self._plain.normalizer else text

    @contextmanager
    def _library(self):
        """Any failure inside `tokenizers` (a pyo3 panic is a BaseException) as the file's TokenizerError."""
        try:
            yield
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as e:
            raise TokenizerError(f"{self.source}: tokenizers failed on this input: {_short(e)}") from None

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


def _built(spec: dict) -> tokenizers.Tokenizer:
    """tokenizers.Tokenizer.from_str(json.dumps(spec)) for a BPE `spec`, its vocabulary and merges handed over as
    Python objects rather than written as JSON and parsed back (a GGUF's 49k tokens and merges: 45 ms against
    125). The added tokens go in after the model, which gives them their ids, as from_str adds them."""
    model = spec["model"]
    built = tokenizers.Tokenizer.from_str(json.dumps({**spec, "added_tokens": [],
                                                      "model": {**model, "vocab": {}, "merges": []}}))
    options = {key: model[key] for key in ("unk_token", "fuse_unk", "byte_fallback", "ignore_merges") if key in model}
    built.model = tokenizers.models.BPE(model["vocab"], [tuple(merge) for merge in model["merges"]], **options)
    built.add_tokens([tokenizers.AddedToken(token["content"], single_word=token["single_word"], lstrip=token["lstrip"],
                                            rstrip=token["rstrip"], normalized=token["normalized"],
                                            special=token["special"]) for token in spec["added_tokens"]])
    return built


def _short(error: BaseException, limit: int = 120) -> str:
    """The first line of a `tokenizers` error (a pyo3 panic's message can run to many), at most `limit` characters."""
    line = next((line.strip() for line in str(error).splitlines() if line.strip()), type(error).__name__)
    return line if len(line) <= limit else line[:limit - 3] + "..."


class _InertSpecials:
    """Stand-ins for what a conversation's strings spell of added tokens, as the tokenizer itself matches them
    (normalized, stripped): private-use characters around a random number and the index of the text they stand
    for, which the template's markup cannot contain and which are put back after rendering."""

    def __init__(self, tokenizer: "Tokenizer"):
        self.tokenizer, self.texts = tokenizer, []
        self.nonce = str(10**15 + secrets.randbelow(9 * 10**15))  # digits: a template's |upper leaves them be
        self.stand_in = re.compile(f"\ue000{self.nonce}(\\d+)\ue001")

    def of(self, value):
        """value with every added token its strings (not its keys) spell replaced by a stand-in."""
        if isinstance(value, str):
            return self._inert(value) if value and self.tokenizer._added_ids else value
        if isinstance(value, dict):
            return {key: self.of(item) for key, item in value.items()}
        if isinstance(value, (list, tuple)):
            return type(value)(self.of(item) for item in value)
        return value

    def _inert(self, text: str) -> str:
        with self.tokenizer._library():
            encoding = self.tokenizer._special.encode(text, add_special_tokens=False)
        pieces, start = [], 0
        for i, (begin, end) in zip(encoding.ids, encoding.offsets):
            if i in self.tokenizer._added_ids and begin < end:
                pieces += [text[start:begin], f"\ue000{self.nonce}{len(self.texts)}\ue001"]
                self.texts.append(text[begin:end])
                start = end
        return "".join(pieces) + text[start:]

    def restore(self, text: str) -> str:
        text = self.stand_in.sub(lambda m: self.texts[int(m.group(1))], text)
        if self.nonce in text:
            raise TokenizerError("the chat template altered a special token's text in a message (escaped, cut or "
                                 "changed it), so it cannot be kept as ordinary text")
        return text


def _gguf_special_tokens(data: TokenizerData) -> dict:
    """The named special tokens' texts, as transformers takes them from a GGUF (the first EOS id's)."""
    ids = {"bos_token": data.bos, "eos_token": data.eos[0] if data.eos else None, "unk_token": data.unk,
           "pad_token": data.pad}
    return {name: data.tokens[i] for name, i in ids.items() if i is not None}


def _sentencepiece(cls, data: TokenizerData) -> "Tokenizer":
    """A GGUF's SentencePiece vocabulary as llama.cpp (and SentencePiece) tokenize it: BPE over "▁"-spelled
    tokens with byte fallback, merges from the file or, without them, from the scores; control tokens
    special, user-defined ones added.

    Every text, and every stretch of text after an added token, starts with "▁" (so " a" is "▁▁a"), as
    Llama 2's tokenizer.json has it; transformers' GGUF conversion instead puts a Metaspace there that
    adds none before a leading space, for every architecture but phi3. With `add_space_prefix` false
    (Gemma 1-3) nothing is prepended, and decoding strips no leading space.
    """
    vocab = _vocabulary(data)
    if data.merges is not None:
        merges = [merge.split(" ") for merge in data.merges]
    elif data.scores is not None:
        merges = _merges_from_scores(vocab, dict(zip(data.tokens, data.scores)))
    else:
        raise TokenizerError(f"{data.source}: a SentencePiece vocabulary needs tokenizer.ggml.merges or .scores")
    space_prefix = data.add_space_prefix is not False  # llama.cpp's default for a SentencePiece vocabulary
    specials = _gguf_special_tokens(data)
    added = [(i, text, kind == 3 or text in specials.values()) for i, (text, kind) in
             enumerate(zip(data.tokens, data.types)) if kind in (3, 4) or text in specials.values()]
    spec = {
        "version": "1.0",
        "added_tokens": [{"id": i, "content": text, "single_word": False, "lstrip": False, "rstrip": False,
                          "normalized": False, "special": special} for i, text, special in added],
        "normalizer": {"type": "Sequence", "normalizers": [
            *([{"type": "Prepend", "prepend": "▁"}] if space_prefix else []),
            {"type": "Replace", "pattern": {"String": " "}, "content": "▁"}]},
        "pre_tokenizer": None,
        "decoder": {"type": "Sequence", "decoders": [
            {"type": "Replace", "pattern": {"String": "▁"}, "content": " "}, {"type": "ByteFallback"},
            {"type": "Fuse"}, *([{"type": "Strip", "content": " ", "start": 1, "stop": 0}] if space_prefix else [])]},
        "model": {"type": "BPE", "vocab": vocab, "merges": merges, "unk_token": specials.get("unk_token", "<unk>"),
                  "fuse_unk": True, "byte_fallback": True, "ignore_merges": False},
    }
    return _from_spec(cls, data, spec)


def _gemma4(cls, data: TokenizerData) -> "Tokenizer":
    """Gemma 4's vocabulary (`tokenizer.ggml.model = "gemma4"`): BPE over the text's UTF-8 with "▁" for
    spaces and no prefix space, merges from the file, `<0xNN>` byte fallback; cut only at runs of newlines."""
    vocab = _vocabulary(data)
    if data.merges is None:
        raise TokenizerError(f"{data.source}: a gemma4 vocabulary needs tokenizer.ggml.merges")
    specials = _gguf_special_tokens(data)
    added = [(i, text, kind == 3) for i, (text, kind) in enumerate(zip(data.tokens, data.types)) if kind in (3, 4)]
    spec = {
        "version": "1.0",
        "added_tokens": [{"id": i, "content": text, "single_word": False, "lstrip": False, "rstrip": False,
                          "normalized": False, "special": special} for i, text, special in added],
        "normalizer": {"type": "Replace", "pattern": {"String": " "}, "content": "▁"},
        "pre_tokenizer": {"type": "Split", "pattern": {"Regex": "\n+"}, "behavior": "Isolated", "invert": False},
        "decoder": {"type": "Sequence", "decoders": [
            {"type": "Replace", "pattern": {"String": "▁"}, "content": " "}, {"type": "ByteFallback"},
            {"type": "Fuse"}]},
        "model": {"type": "BPE", "vocab": vocab, "merges": [merge.split(" ") for merge in data.merges],
                  "unk_token": specials.get("unk_token"), "fuse_unk": True, "byte_fallback": True,
                  "ignore_merges": False},
    }
    return _from_spec(cls, data, spec)


def _vocabulary(data: TokenizerData) -> dict:
    vocab = {}
    for i, token in enumerate(data.tokens):
        if vocab.setdefault(token, i) != i:
            raise TokenizerError(f"{data.source}: token {i} {token!r} repeats token {vocab[token]}")
    return vocab


def _from_spec(cls, data: TokenizerData, spec: dict) -> "Tokenizer":
    """The tokenizer of a GGUF's tokenizer.json-style `spec`, with the file's BOS/EOS, flags and chat template."""
    bos_ids = () if data.bos is None else (data.bos,)
    tok = cls.__new__(cls)
    tok._bind(None, spec, data.source, bos_ids, data.eos, list(bos_ids) if data.add_bos is not False
              else [], list(data.eos[:1]) if data.add_eos else [], data.chat_template)
    tok.special_tokens = _gguf_special_tokens(data)
    return tok


def _merges_from_scores(vocab: dict, scores: dict) -> list:
    """The merges a SentencePiece vocabulary implies: every split of a token into two tokens, best score first.

    Ties go to the longer left then right piece, then to the order transformers lists them in (tokens in
    vocabulary order, each token's splits by their pieces' ids), so the merges are the ones it derives.
    """
    merges = []
    for token, score in scores.items():
        pairs = [(token[:k], token[k:]) for k in range(1, len(token)) if token[:k] in vocab and token[k:] in vocab]
        merges += [(left, right, score) for left, right in sorted(pairs, key=lambda p: (vocab[p[0]], vocab[p[1]]))]
    merges.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [[left, right] for left, right, _ in merges]


def _chat_templates(directory: Path, template, config_file: Path):
    """The chat template(s) beside a tokenizer.json, as transformers finds them: a string, or {name: template}.

    chat_template.jinja (the default) and additional_chat_templates/NAME.jinja take precedence over
    tokenizer_config.json's chat_template, a string or a list of {name, template}.
    """
    named = {}
    if (directory / "chat_template.jinja").is_file():
        named["default"] = read_text(directory / "chat_template.jinja", TokenizerError)
    if (directory / "additional_chat_templates").is_dir():
        for file in sorted((directory / "additional_chat_templates").glob("*.jinja")):
            named[file.name.removesuffix(".jinja")] = read_text(file, TokenizerError)
    if not named and isinstance(template, list):
        for t in template:
            if not (isinstance(t, dict) and isinstance(t.get("name"), str) and isinstance(t.get("template"), str)):
                raise TokenizerError(f"{config_file}: chat_template list entry {t!r} is not {{name, template}}")
            named[t["name"]] = t["template"]
    elif not named:
        if template is not None and not isinstance(template, str):
            raise TokenizerError(f"{config_file}: chat_template is a {type(template).__name__}, expected a string "
                                 f"or a list of {{name, template}}")
        return template
    return named["default"] if list(named) == ["default"] else named


def _expansion(normalizer) -> float:
    """At most how many times longer the normalizer's Replace steps make a text (1: never longer)."""
    if not isinstance(normalizer, dict):
        return 1.0
    if normalizer.get("type") == "Sequence":
        return math.prod(_expansion(step) for step in normalizer.get("normalizers") or [])
    content, pattern = normalizer.get("content"), normalizer.get("pattern")
    if normalizer.get("type") != "Replace" or not isinstance(content, str):
        return 1.0
    text = pattern.get("String") if isinstance(pattern, dict) else None
    if isinstance(text, str) and text:
        return max(1.0, len(content) / len(text))
    return len(content) + 1.0  # a regex may match nothing, between every two characters


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
