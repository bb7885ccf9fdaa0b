"""SentencePiece-style tokenizers (Llama 2, Mistral 7B, TinyLlama, Phi-3): "▁" for spaces, byte fallback.

The tokenizer.json forms are compared with `tokenizers` on the same file.
"""

import json
from pathlib import Path

import pytest
import tokenizers
from tokenizers import decoders, models, normalizers, pre_tokenizers, processors, trainers

from lmstack import Tokenizer

FIXTURES = Path(__file__).parent / "fixtures" / "tokenizers"

BYTES = [f"<0x{b:02X}>" for b in range(256)]
TEXTS = ["Hello world", " leading space", "two  spaces and\ttab\nnewline",
         "日本語 and émoji 🦙 (not in the vocabulary)",
         "<s> is text here", "", " ", "a\x00b"]


def corpus():
    return (FIXTURES / "sample_corpus.txt").read_text(encoding="utf-8").split("\n")


def sentencepiece_json(directory, form, add_bos_token=True):
    """A Llama-2-style BPE trained on the corpus: "▁" for spaces, byte fallback, BOS added.

    form "normalizer": Llama 2's original file (Prepend + Replace normalizer, no pre-tokenizer);
    form "metaspace": as transformers writes Llama and Mistral files now (Metaspace pre-tokenizer).
    """
    tok = tokenizers.Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    if form == "normalizer":
        tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    else:
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    trainer = trainers.BpeTrainer(vocab_size=500, limit_alphabet=80, special_tokens=["<unk>", "<s>", "</s>", *BYTES])
    tok.train_from_iterator(corpus(), trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    spec = json.loads(tok.to_str())  # byte tokens are the model's, not added tokens, as in the real files
    spec["added_tokens"] = [t for t in spec["added_tokens"] if t["content"] not in BYTES]
    (directory / "tokenizer.json").write_text(json.dumps(spec))
    config = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "add_bos_token": add_bos_token}
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return tokenizers.Tokenizer.from_file(str(directory / "tokenizer.json"))


@pytest.mark.parametrize("form", ["normalizer", "metaspace"])
def test_tokenizer_json_forms_equal_tokenizers(tmp_path, form):
    ref = sentencepiece_json(tmp_path, form)
    tok = Tokenizer.from_pretrained(tmp_path)
    texts = corpus() + TEXTS
    assert tok.encode_batch(texts, allow_special=True) == [e.ids for e in ref.encode_batch(texts)]
    assert tok.encode_batch(texts, allow_special=True, add_special_tokens=False) == [
        e.ids for e in ref.encode_batch(texts, add_special_tokens=False)]
    fallback = ref.encode("🦙", add_special_tokens=False).tokens
    assert {"<0xF0>", "<0x9F>", "<0xA6>", "<0x99>"} <= set(fallback)  # the bytes of a character not in the vocabulary
    for text in texts:
        ids = tok.encode(text, allow_special=True)
        assert ids[0] == ref.token_to_id("<s>")
        assert tok.decode(ids) == ref.decode(ids, skip_special_tokens=False)
        if form == "normalizer" or not text.startswith(" "):  # Metaspace adds no "▁" before one: the decoder drops it
            assert tok.decode(tok.encode(text, add_special_tokens=False)) == text
    assert tok.encode("<s>x", allow_special=True)[1] == ref.token_to_id("<s>")
    assert ref.token_to_id("<s>") not in tok.encode("<s>x")[1:]
