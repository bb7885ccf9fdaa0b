"""llama.cpp's own tokenizer test vectors (its tests/test-tokenizer-0), id for id.

tests/fixtures/llama_cpp_vocab/ holds llama.cpp's `models/ggml-vocab-*.gguf` (xz-compressed, tokenizer
metadata only) with their `.inp` texts and `.out` ids, which llama.cpp's convert_hf_to_gguf_update.py
wrote from each model's own Hugging Face tokenizer. As test-tokenizer-0 does, each text is encoded with
no BOS/EOS and with control tokens' text as ordinary text.
"""

import lzma
from pathlib import Path

import pytest

from lmstack import Tokenizer, UnsupportedModel

FIXTURES = Path(__file__).parent / "fixtures" / "llama_cpp_vocab"
SEPARATOR = "\n__ggml_vocab_test__\n"
SENTENCEPIECE = ["llama-spm", "phi-3"]
BPE = ["command-r", "deepseek-coder", "deepseek-llm", "falcon", "gemma-4", "gpt-2", "llama-bpe", "mpt", "qwen2",
       "qwen35", "refact", "starcoder"]
REFUSED = {"bert-bge": "tokenizer.ggml.model 'bert' is not supported"}  # WordPiece


@pytest.fixture(scope="module")
def vocab_file(tmp_path_factory):
    directory = tmp_path_factory.mktemp("llama_cpp_vocab")

    def unpack(name: str) -> Path:
        path = directory / f"ggml-vocab-{name}.gguf"
        path.write_bytes(lzma.decompress((FIXTURES / f"{path.name}.xz").read_bytes()))
        return path
    return unpack


def vectors(name: str) -> list[tuple[str, list[int]]]:
    """The (text, ids) pairs, split as test-tokenizer-0 splits the .inp and .out files."""
    text = (FIXTURES / f"ggml-vocab-{name}.gguf.inp").read_bytes().decode("utf-8")
    texts = text.split(SEPARATOR)
    if text.endswith(SEPARATOR):  # a separator that ends the file starts no text
        texts.pop()
    lines = (FIXTURES / f"ggml-vocab-{name}.gguf.out").read_bytes().decode("ascii").split("\n")
    if lines[-1] == "":
        lines.pop()
    assert len(texts) == len(lines) > 40, name
    return [(t, [int(i) for i in line.split()]) for t, line in zip(texts, lines)]


def test_every_vocabulary_in_the_fixtures_is_tested():
    files = {path.name.removeprefix("ggml-vocab-").removesuffix(".gguf.xz") for path in FIXTURES.glob("*.gguf.xz")}
    assert files == {*SENTENCEPIECE, *BPE, *REFUSED}


@pytest.mark.parametrize("name", SENTENCEPIECE + BPE)
def test_llama_cpp_vectors_id_for_id(vocab_file, name):
    tok = Tokenizer.from_pretrained(vocab_file(name))
    cases = vectors(name)
    encoded = tok.encode_batch([text for text, _ in cases], add_special_tokens=False)
    wrong = [(text, ids, got) for (text, ids), got in zip(cases, encoded) if got != ids]
    assert not wrong, f"{len(wrong)} of {len(cases)} differ, first: {wrong[0]}"
    assert [tok.encode(text, add_special_tokens=False) for text, _ in cases[:12]] == [ids for _, ids in cases[:12]]
    assert [tok.decode(ids) for _, ids in cases] == [text for text, _ in cases]


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_other_kinds_of_vocabulary_are_refused_by_name(vocab_file, name):
    with pytest.raises(UnsupportedModel, match=REFUSED[name]):
        Tokenizer.from_pretrained(vocab_file(name))
