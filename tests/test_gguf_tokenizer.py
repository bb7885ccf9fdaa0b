"""GGUF tokenizers, whatever the model's architecture.

SentencePiece vocabularies (`tokenizer.ggml.model = "llama"`) against transformers' own conversion of
the same file; byte-level BPE pre-tokenizer names (`tokenizer.ggml.pre`) against `tokenizers` set up as
each reference model's tokenizer.json sets it up. Every file is written here with gguf.GGUFWriter,
from vocabularies `tokenizers` trains on the fixtures' corpus.
"""

import json
from functools import cache
from pathlib import Path

import gguf
import pytest
import tokenizers
from tokenizers import Regex, decoders, models, normalizers, pre_tokenizers, trainers
from transformers.integrations.gguf.gguf_tokenizer_mapping import GGUF_PRE_TOKENIZER_SPLITS

from lmstack import Tokenizer, UnsupportedModel
from lmstack.tokenizer import BYTE_CHARS

CORPUS = (Path(__file__).parent / "fixtures" / "tokenizers" / "sample_corpus.txt").read_text(encoding="utf-8")
EXTRA = ["1234567 12 3.14159 x=100000;", "日本語中文 한국어 ひらがな カタカナ", "$+<=>^~|` a+b<=c", "Hello!!! ... ???",
         "  spaces   \n\n\t tabs \r\n", "don't I'M we'VE", "²³¹ ½ ٣٤ ⅷ", "🦙 emoji", "e\u0301 decomposed", "Ⅻ ÀÉÎ ǅ",
         "[1,2,3] {'a': 'b'}", "    indented code\n\tand(tab)", "  "]
TEXTS = CORPUS.split("\n") + EXTRA
BYTES = [f"<0x{b:02X}>" for b in range(256)]


def write(path, arch, tokens, types, **keys):
    """A GGUF holding only tokenizer metadata (and the few model keys transformers reads for its config)."""
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(1), writer.add_context_length(64), writer.add_embedding_length(8)
    writer.add_feed_forward_length(16), writer.add_head_count(2), writer.add_head_count_kv(1)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_token_list(tokens), writer.add_token_types(types)
    for key, value in keys.items():
        getattr(writer, f"add_{key}")(value)
    writer.write_header_to_file(), writer.write_kv_data_to_file(), writer.write_tensors_to_file(), writer.close()
    return path


# ---- SentencePiece ----------------------------------------------------------------------------

@cache
def sentencepiece_vocabulary():
    """A Llama-2-style vocabulary: "▁" for spaces, <0xNN> byte tokens, control and user-defined tokens."""
    tok = tokenizers.Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
    specials = ["<unk>", "<s>", "</s>", *BYTES, "<|im_start|>", "<tool>"]
    tok.train_from_iterator(TEXTS, trainers.BpeTrainer(vocab_size=600, limit_alphabet=90, special_tokens=specials))
    model = json.loads(tok.to_str())["model"]
    tokens = sorted(model["vocab"], key=model["vocab"].get)
    assert [model["vocab"][t] for t in tokens] == list(range(len(tokens)))
    kinds = {"<unk>": 2, "<s>": 3, "</s>": 3, "<|im_start|>": 3, "<tool>": 4, **dict.fromkeys(BYTES, 6)}
    types = [kinds.get(t, 1) for t in tokens]
    scores = [0.0 if t in kinds else -float(i) for i, t in enumerate(tokens)]  # SentencePiece: earlier is better
    return tokens, types, scores, [" ".join(m) if isinstance(m, list) else m for m in model["merges"]]


@pytest.mark.parametrize("arch", ["llama", "phi3"])
@pytest.mark.parametrize("with_merges", [False, True])
def test_sentencepiece_gguf_equals_transformers(tmp_path, arch, with_merges):
    """The reference is transformers' conversion of the vocabulary in a phi3 file, whatever `arch`: there
    it puts the prefix "▁" in a normalizer, as SentencePiece and llama.cpp do (" a" is "▁▁a"); for other
    architectures it uses a Metaspace that adds none before a leading space, unlike llama.cpp and Llama 2's
    own tokenizer (their ids: tests/test_llama_cpp_vocab.py)."""
    from transformers import AutoTokenizer

    tokens, types, scores, merges = sentencepiece_vocabulary()
    for directory, name in ((tmp_path, arch), (tmp_path / "reference", "phi3")):
        directory.mkdir(exist_ok=True)
        write(directory / "m.gguf", name, tokens, types, tokenizer_model="llama", token_scores=scores,
              bos_token_id=1, eos_token_id=2, unk_token_id=0,
              chat_template="{{ bos_token }}{{ messages[0].content }}", **({"token_merges": merges} if with_merges
                                                                            else {}))
    reference = AutoTokenizer.from_pretrained(str(tmp_path / "reference"), gguf_file="m.gguf")
    tok = Tokenizer.from_pretrained(tmp_path / "m.gguf")
    texts = TEXTS + ["<s> and <tool> and <|im_start|> as text", ""]
    expected = [reference.encode(text) for text in texts]
    assert tok.encode_batch(texts, allow_special=True) == expected
    assert {"<0xF0>", "<0x9F>"} <= set(reference.convert_ids_to_tokens(reference.encode("🦙")))  # byte fallback
    assert [tok.decode(ids) for ids in expected] == [reference.decode(ids) for ids in expected]
    assert tok.encode("<tool>") != tok.encode("<tool>", allow_special=True)
    conversation = [{"role": "user", "content": "hi"}]
    assert tok.apply_chat_template(conversation) == reference.apply_chat_template(conversation, tokenize=False)


def test_named_chat_templates_of_a_gguf_are_chosen_as_transformers_chooses(tmp_path):
    from transformers import AutoTokenizer

    templates = [{"name": "default", "template": "default: {{ messages[0].content }}"},
                 {"name": "tool_use", "template": "tool_use: {{ tools | length }}"}]
    tokens, types, scores, _ = sentencepiece_vocabulary()
    write(tmp_path / "m.gguf", "llama", tokens, types, tokenizer_model="llama", token_scores=scores,
          chat_template=templates)
    tok = Tokenizer.from_pretrained(tmp_path / "m.gguf")
    save = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="m.gguf")
    save.chat_template = {t["name"]: t["template"] for t in templates}  # transformers reads only the default
    conversation = [{"role": "user", "content": "hi"}]
    for options in ({}, {"tools": [{"type": "function", "function": {"name": "f"}}]}, {"chat_template": "default"}):
        expected = save.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True, **options)
        assert tok.apply_chat_template(conversation, **options) == expected


GEMMA_CONTROL = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<start_of_turn>", "<end_of_turn>"]
GEMMA_USER_DEFINED = ["[multimodal]", *("\n" * n for n in range(1, 5)), *(" " * n for n in range(2, 9)), "\t\t",
                      "<table>", "</table>", "<b>"]
GEMMA_TEMPLATE = (  # the shape of Gemma 3's own template
    "{{ bos_token }}{% for message in messages %}{% set role = 'model' if message['role'] == 'assistant' "
    "else message['role'] %}{{ '<start_of_turn>' + role + '\n' + message['content'] | trim + '<end_of_turn>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}")
GEMMA_TAGS = [token for token in GEMMA_USER_DEFINED if not token.isspace()]
GEMMA_TEXTS = TEXTS + ["a  b   c    d     e\t\tf", "x\n\n\ny\n\n\n\nz", "<start_of_turn>user\nhi<end_of_turn>",
                       " lead and trail  ", "<bos>", "<table><b>bold</b></table>", "[multimodal] 🦙"]


@cache
def gemma_vocabulary():
    """A Gemma-1-3-style SentencePiece vocabulary as its GGUFs carry it: no prefix space, control tokens, the
    runs of newlines and spaces (in real spaces) and HTML tags user-defined, <0xNN> byte tokens scored 0,
    the others scored by rank, no merges."""
    tok = tokenizers.Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="never", split=False)
    specials = [*GEMMA_CONTROL, *GEMMA_USER_DEFINED, *BYTES]
    corpus = [text for text in TEXTS if "<|" not in text]  # llama.cpp makes a "<|im_end|>" token control
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=700, limit_alphabet=90, special_tokens=specials))
    vocab = json.loads(tok.to_str())["model"]["vocab"]
    # SentencePiece learns no piece across a user-defined run of spaces
    learned = [t for t in sorted(vocab, key=vocab.get)[len(specials):] if "▁▁" not in t]
    tokens = specials + learned
    types = [3] * len(GEMMA_CONTROL) + [4] * len(GEMMA_USER_DEFINED) + [6] * len(BYTES) + [1] * len(learned)
    scores = [-1000.0] * (len(GEMMA_CONTROL) + len(GEMMA_USER_DEFINED)) + [0.0] * len(BYTES) + [
        -float(i) for i in range(len(learned))]
    return tokens, types, scores


@pytest.fixture(params=["gemma2", "gemma3"])
def gemma_gguf(tmp_path, request):
    tokens, types, scores = gemma_vocabulary()
    return write(tmp_path / "m.gguf", request.param, tokens, types, tokenizer_model="llama", tokenizer_pre="default",
                 token_scores=scores, bos_token_id=2, eos_token_id=1, unk_token_id=3, pad_token_id=0,
                 add_bos_token=True, add_eos_token=False, add_space_prefix=False, chat_template=GEMMA_TEMPLATE)


def test_gemma_sentencepiece_gguf_equals_transformers(gemma_gguf):
    """Gemma 1-3 (`add_space_prefix` false) against transformers' conversion of the same file: no "▁" before the
    text or after an added token, runs of spaces and newlines as their user-defined tokens, byte fallback, BOS
    added, decoding without a stripped space, the chat template from tokenizer.chat_template, <end_of_turn> ends a
    generation. The tags (user-defined, not whitespace) are ordinary text without allow_special, as for any
    vocabulary (README: Tokenizer); transformers always matches them, so they are compared with allow_special.
    A run of spaces longer than the longest such token is cut as llama.cpp cuts it (longest first) where
    transformers merges the runs as pieces: those texts are compared with llama.cpp only (next test)."""
    from transformers import AutoTokenizer

    reference = AutoTokenizer.from_pretrained(str(gemma_gguf.parent), gguf_file=gemma_gguf.name)
    tok = Tokenizer.from_pretrained(gemma_gguf)
    texts = [text for text in GEMMA_TEXTS if " " * 9 not in text]
    expected = [reference.encode(text) for text in texts]
    assert tok.encode_batch(texts, allow_special=True) == expected
    plain = [text for text in texts if not any(tag in text for tag in GEMMA_CONTROL + GEMMA_TAGS)]
    assert tok.encode_batch(plain) == [reference.encode(text) for text in plain]
    assert tok.encode("a  b") == [2, tok.encode("a", add_special_tokens=False)[0], GEMMA_USER_DEFINED.index("  ") + 7,
                                  tok.encode("b", add_special_tokens=False)[0]]
    assert tok.encode("<table>") != tok.encode("<table>", allow_special=True)
    assert {"<0xF0>", "<0x9F>"} <= set(reference.convert_ids_to_tokens(reference.encode("🦙")))  # byte fallback
    assert [tok.decode(ids) for ids in expected] == [reference.decode(ids) for ids in expected]
    assert tok.decode(tok.encode(" lead", add_special_tokens=False)) == " lead"
    conversation = [{"role": "user", "content": "Hi  there"}, {"role": "assistant", "content": "Hello."},
                    {"role": "user", "content": "And\n\nnow?"}]
    prompt = reference.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
    assert tok.apply_chat_template(conversation) == prompt
    assert tok.encode_chat(conversation) == reference.encode(prompt, add_special_tokens=False)
    assert tok.eos_ids == (1, GEMMA_CONTROL.index("<end_of_turn>")) and tok.bos_ids == (2,)


def test_gemma_sentencepiece_gguf_equals_llama_cpp(gemma_gguf):
    """The same file through llama.cpp's own tokenizer (llm_tokenizer_spm), where llama-cpp-python is installed:
    plain text, and with control tokens parsed."""
    llama_cpp = pytest.importorskip("llama_cpp")
    reference = llama_cpp.Llama(str(gemma_gguf), vocab_only=True, verbose=False)
    tok = Tokenizer.from_pretrained(gemma_gguf)
    plain = [text for text in GEMMA_TEXTS if not any(tag in text for tag in GEMMA_TAGS)]
    assert tok.encode_batch(plain) == [reference.tokenize(text.encode()) for text in plain]
    assert tok.encode_batch(GEMMA_TEXTS, allow_special=True) == [reference.tokenize(text.encode(), special=True)
                                                                 for text in GEMMA_TEXTS]


# ---- byte-level BPE, by pre-tokenizer name ----------------------------------------------------

GPT2_BYTE_LEVEL = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
DEEPSEEK_LETTERS = (  # the reference tokenizer.json's class of letters
    "\\s?[A-Za-zµÀ-ÖØ-öø-ƺƼ-ƿǄ-ʓʕ-ʯͰ-ͳͶͷͻ-ͽͿΆΈ-ΊΌΎ-ΡΣ-ϵϷ-ҁҊ-ԯԱ-ՖႠ-ჅᎠ-Ᏽᏸ-ᏽᲐ-ᲺᲽ-Ჿᴀ-ᴫᵫ-ᵷᵹ-ᶚḀ-ἕἘ-Ἕἠ"
    "-ὅὈ-Ὅὐ-ὗὙὛὝὟ-\u1f7dᾀ-ᾴᾶ-ᾼ\u1fbeῂ-ῄ"
    "ῆ-ῌῐ-\u1fd3ῖ-\u1fdbῠ-Ῥῲ-ῴῶ-ῼℂℇℊ-ℓℕℙ-ℝℤ\u2126ℨ\u212a-ℭℯ-ℴℹℼ-ℿⅅ-ⅉⅎↃↄⰀ-ⱻⱾ-ⳤⳫ-ⳮⳲⳳꙀ-ꙭꚀ-ꚛꜢ-ꝯꝱ-ꞇꞋ"
    "-ꞎꭰ-ꮿﬀ-ﬆﬓ-ﬗＡ-Ｚａ-ｚ𐐀-𐑏𐒰-𐓓𐓘-𐓻𐲀-𐲲𐳀-𐳲"
    "𑢠-𑣟𞤀-𞥃]+")


def split(*regexes, then=()):
    steps = [pre_tokenizers.Split(Regex(r), "isolated") for r in regexes]
    return pre_tokenizers.Sequence([*steps, *then, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])


# name -> (an architecture that uses it, the reference pre-tokenizer, its normalizer, ignore_merges)
REFERENCES = {
    "gpt-2": ("gpt2", GPT2_BYTE_LEVEL, None, False),
    "mpt": ("mpt", GPT2_BYTE_LEVEL, None, False),
    "starcoder": ("starcoder2", pre_tokenizers.Sequence([pre_tokenizers.Digits(True), GPT2_BYTE_LEVEL]), None, False),
    "refact": ("refact", pre_tokenizers.Sequence([pre_tokenizers.Digits(True), GPT2_BYTE_LEVEL]), None, False),
    "smollm": ("llama", pre_tokenizers.Sequence([pre_tokenizers.Digits(True), GPT2_BYTE_LEVEL]), None, False),
    "command-r": ("command-r", pre_tokenizers.Sequence([pre_tokenizers.Digits(True), GPT2_BYTE_LEVEL]), None, False),
    "llama-bpe": ("llama", split(GGUF_PRE_TOKENIZER_SPLITS["llama-bpe"]), None, True),
    "qwen2": ("qwen2", split(GGUF_PRE_TOKENIZER_SPLITS["qwen2"]), "NFC", False),
    "qwen35": ("qwen35", split(GGUF_PRE_TOKENIZER_SPLITS["qwen35"]), None, False),  # no NFC (llama.cpp's vectors)
    "gpt-4o": ("gpt-oss", split(GGUF_PRE_TOKENIZER_SPLITS["gpt-4o"]), None, False),
    "deepseek-llm": ("deepseek", split("[\r\n]", DEEPSEEK_LETTERS, r"\s?[!-/:-~！-／：-～‘-‟　-。]+", r"\s+$",
                                      "[一-龥ࠀ-一가-퟿]+", then=[pre_tokenizers.Digits(False)]), None, False),
    "deepseek-coder": ("llama", split("[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", "[一-龥ࠀ-一가-퟿]+",
                                      then=[pre_tokenizers.Digits(True)]), None, False),
    "deepseek-v3": ("deepseek2", split(r"\p{N}{1,3}", "[一-龥぀-ゟ゠-ヿ]+",
                                       r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?"
                                       r"[\p{L}\p{M}]+| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"), None, False),
    "falcon": ("falcon", pre_tokenizers.Sequence([
        pre_tokenizers.Punctuation("contiguous"), GPT2_BYTE_LEVEL, pre_tokenizers.Digits(False),
        pre_tokenizers.Split(Regex("[0-9][0-9][0-9]"), "isolated")]), None, False),
}


@cache
def byte_level_vocabulary():
    """A byte-level BPE trained on the corpus: (tokens, merges) as a GGUF spells them, and the tokenizers model."""
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train_from_iterator(TEXTS, trainers.BpeTrainer(vocab_size=1500, special_tokens=["<|endoftext|>"],
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    model = json.loads(tok.to_str())["model"]
    tokens = sorted(model["vocab"], key=model["vocab"].get)
    return tokens, [" ".join(m) if isinstance(m, list) else m for m in model["merges"]], model


@pytest.mark.parametrize("name", list(REFERENCES))
def test_pre_tokenizer_names_cut_and_merge_as_the_reference(tmp_path, name):
    arch, pre_tokenizer, normalizer, ignore_merges = REFERENCES[name]
    tokens, merges, model = byte_level_vocabulary()
    write(tmp_path / "m.gguf", arch, tokens, [3] + [1] * (len(tokens) - 1), tokenizer_model="gpt2",
          tokenizer_pre=name, token_merges=merges, eos_token_id=0)
    tok = Tokenizer.from_pretrained(tmp_path / "m.gguf")
    reference = tokenizers.Tokenizer(models.BPE(model["vocab"], [tuple(m.split(" ")) for m in merges],
                                                ignore_merges=ignore_merges))
    reference.normalizer = normalizer and normalizers.NFC()
    reference.pre_tokenizer = pre_tokenizer
    reference.add_special_tokens(["<|endoftext|>"])
    byte_of = {c: b for b, c in enumerate(BYTE_CHARS)}
    for text in TEXTS:
        normalized = reference.normalizer.normalize_str(text) if reference.normalizer else text
        pieces = [bytes(byte_of[c] for c in piece) for piece, _ in pre_tokenizer.pre_tokenize_str(normalized)]
        assert tok.pretokenize(text.encode()) == pieces, text
    assert tok.encode_batch(TEXTS, add_special_tokens=False, allow_special=True) == [
        e.ids for e in reference.encode_batch(TEXTS)]


def test_unknown_pre_tokenizer_and_model_are_refused_by_name(tmp_path):
    tokens, merges, _ = byte_level_vocabulary()
    types = [1] * len(tokens)
    write(tmp_path / "a.gguf", "gpt2", tokens, types, tokenizer_model="gpt2", tokenizer_pre="klingon",
          token_merges=merges)
    with pytest.raises(UnsupportedModel, match="tokenizer.ggml.pre 'klingon' is not supported"):
        Tokenizer.from_pretrained(tmp_path / "a.gguf")
    write(tmp_path / "b.gguf", "bert", tokens, types, tokenizer_model="bert")
    with pytest.raises(UnsupportedModel, match="tokenizer.ggml.model 'bert' is not supported"):
        Tokenizer.from_pretrained(tmp_path / "b.gguf")
