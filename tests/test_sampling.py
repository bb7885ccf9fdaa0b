"""Generation beyond greedy: samplers against transformers' warpers, seeds, EOS, stop strings, streams, ragged batches."""

import pytest
import torch
import transformers.generation.logits_process as hf

from lmstack import CausalLM
from lmstack.decoding import RepetitionPenalty
from lmstack.sampling import ARGMAX_BLOCK, Sampler, TextStream, argmax_rows, generate_text, stream_text, text_steps
from lmstack.tokenizer import Tokenizer
from test_gguf import write_gguf

PROMPTS = [[5, 6, 7], [40, 41, 42, 43, 44, 45, 46], [99, 98, 97, 96, 95]]


@pytest.fixture(scope="module")
def tiny(tiny_checkpoint, tmp_path_factory):
    """(CausalLM, Tokenizer) of a tiny random llama, through a GGUF file (its tokenizer: letters and pairs)."""
    from lmstack.gguf import GGUFFile

    _, reference = tiny_checkpoint("llama")
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    write_gguf(path, reference)
    source = GGUFFile(path)
    tokenizer = Tokenizer.from_gguf(source)
    return CausalLM.load(source, device="cpu"), tokenizer


def test_same_seed_same_tokens_and_other_seeds_differ(tiny):
    lm, _ = tiny
    sample = dict(greedy=False, temperature=1.0, top_p=0.95, seed=7)
    first = lm.generate(PROMPTS[:1], 24, **sample)
    assert torch.equal(first, lm.generate(PROMPTS[:1], 24, **sample))
    assert not torch.equal(first, lm.generate(PROMPTS[:1], 24, **{**sample, "seed": 8}))


@pytest.mark.parametrize("options", [dict(greedy=False, top_k=1, temperature=1.5, seed=1),
                                     dict(greedy=False, temperature=1e-6, seed=1)],
                         ids=["top_k=1", "temperature->0"])
def test_degenerate_sampling_equals_greedy(tiny, options):
    lm, _ = tiny
    assert torch.equal(lm.generate(PROMPTS[:2], 20, **options), lm.generate(PROMPTS[:2], 20))


@pytest.mark.parametrize("vocab", [3, ARGMAX_BLOCK, ARGMAX_BLOCK + 1, 3 * ARGMAX_BLOCK, 49152, 32003])
def test_argmax_rows_is_torch_argmax(vocab):
    g = torch.Generator().manual_seed(vocab)
    logits = torch.randn(12, vocab, generator=g).round(decimals=1)  # coarse values: ties within and across blocks
    logits[1] = logits[1].max()  # every entry a maximum: the first
    logits[2, -1] = 100  # the maximum in the last (shorter) block
    logits[3] = -torch.inf
    logits[4, vocab // 2] = logits[4, -1] = torch.nan  # NaN counts above every number: the first NaN
    logits[5, 0] = torch.nan
    logits[6, vocab - 1] = torch.inf
    logits[7, : vocab // 2] = -torch.inf
    assert torch.equal(argmax_rows(logits), logits.argmax(-1))
    assert torch.equal(argmax_rows(logits.bfloat16()), logits.bfloat16().argmax(-1))
    assert torch.equal(argmax_rows(logits[4:5]), logits[4:5].argmax(-1))


@pytest.mark.parametrize("options", [
    dict(temperature=0.7, top_k=10), dict(temperature=1.3, top_p=0.6), dict(temperature=1.0, min_p=0.2),
    dict(temperature=0.9, top_k=50, top_p=0.8, min_p=0.05, repetition_penalty=1.3),
])
def test_filter_matches_transformers_warpers(options):
    logits = torch.randn(4, 300, generator=torch.Generator().manual_seed(0)) * 3
    history = torch.randint(0, 300, (4, 12), generator=torch.Generator().manual_seed(1))
    seen = torch.zeros(4, 300, dtype=torch.bool).scatter_(1, history, True)
    chain = [hf.RepetitionPenaltyLogitsProcessor(options.get("repetition_penalty", 1.0)),
             hf.TemperatureLogitsWarper(options["temperature"])]
    if "top_k" in options:
        chain.append(hf.TopKLogitsWarper(options["top_k"]))
    if "top_p" in options:
        chain.append(hf.TopPLogitsWarper(options["top_p"]))
    if "min_p" in options:
        chain.append(hf.MinPLogitsWarper(options["min_p"]))
    expected = logits.clone()
    for processor in chain:
        expected = processor(history, expected)
    penalized = RepetitionPenalty(options.get("repetition_penalty", 1.0), seen)(logits)
    torch.testing.assert_close(Sampler(**options).warp(penalized), expected)


def test_repetition_penalty_greedy_matches_transformers(tiny_checkpoint):
    path, reference = tiny_checkpoint("llama")
    lm = CausalLM.load(path, device="cpu")
    ids = torch.tensor(PROMPTS[1:2])
    reference.generation_config.eos_token_id = None
    expected = reference.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=20, do_sample=False,
                                  repetition_penalty=1.5, pad_token_id=0)
    assert torch.equal(lm.generate(ids, 20, repetition_penalty=1.5), expected)
    assert not torch.equal(lm.generate(ids, 20), expected)  # the penalty did change something


def test_eos_stops_each_row_and_pads_with_minus_one(tiny):
    lm, _ = tiny
    L = len(PROMPTS[1])
    free = lm.generate(PROMPTS[:2], 16)[:, L:]
    eos = int(free[0, 5])
    stopped = lm.generate(PROMPTS[:2], 16, eos_ids=[eos])
    assert stopped.shape == (2, L + 16)  # the page's shape, whether rows stop or not
    ends = [int((row == eos).nonzero()[0]) + 1 if (row == eos).any() else 16 for row in free]
    for row, full, end in zip(stopped[:, L:], free, ends):
        assert torch.equal(row[:end], full[:end]) and (row[end:] == -1).all()


def test_text_stops_at_eos_without_showing_it(tiny):
    lm, tok = tiny
    free = lm.generate(PROMPTS[:1], 16)[0, len(PROMPTS[0]):].tolist()
    eos = free[6]
    text = generate_text(lm, tok, PROMPTS[:1], 16, eos_ids=[eos])[0]
    assert text == tok.decode(free[:free.index(eos)])


def test_stop_string_cuts_the_text_before_it(tiny):
    lm, tok = tiny
    full = generate_text(lm, tok, PROMPTS[:1], 24, eos_ids=())[0]
    stop = full[9:12]
    expected = full[:full.find(stop)]
    pieces = list(stream_text(lm, tok, PROMPTS[0], 24, stop=[stop, "never appears"], eos_ids=()))
    assert "".join(pieces) == expected
    assert generate_text(lm, tok, PROMPTS[:1], 24, stop=[stop], eos_ids=())[0] == expected
    steps = list(text_steps(lm, tok, PROMPTS[:1], 24, stop=[stop], eos_ids=()))
    assert len(steps) < 24  # generation ended at the stop string, not at max_new_tokens


def test_stream_never_splits_a_utf8_character():
    tok = Tokenizer([bytes([b]) for b in range(256)], [], pattern="gpt2")
    text = "né 😀 €!"
    stream = TextStream(tok, stop=["€!x"])
    pieces = [stream.push(b) for b in text.encode()] + [stream.finish()]
    assert "".join(pieces) == text
    assert all("\ufffd" not in piece for piece in pieces)
    assert pieces[text.encode().index("€".encode())] == ""  # held back: "€!" could start the stop string


def test_stream_decoded_a_token_at_a_time_releases_what_whole_decodes_release():
    """A byte-level tokenizer's stream decodes each token's bytes once (TextStream._decoded); another tokenizer's
    decodes the whole text every token: the same pieces, for valid and broken UTF-8, with and without stops."""
    tok = Tokenizer([bytes([b]) for b in range(256)], [], pattern="gpt2")

    class WholeText:  # no decode_bytes: TextStream decodes the whole text each token
        decode = tok.decode

    g = torch.Generator().manual_seed(0)
    texts = ["né 😀 €!x ok", "\ufffd end \ufffd", "a€b"]
    for k in range(60):
        data = texts[k % 3].encode() if k < 3 else torch.randint(0, 256, (k % 24 + 1,), generator=g).tolist()
        if 3 <= k < 30:  # whole characters among the random bytes
            data = list("é€😀".encode()) + list(data) + list("😀".encode())[:k % 4]
        for stop in ((), ("€!",), ("\ufffd",), ("x o",)):
            streams = [TextStream(tok, stop), TextStream(WholeText(), stop)]
            pieces = [[s.push(b) for b in data] + [s.finish()] for s in streams]
            assert pieces[0] == pieces[1] and streams[0].stopped == streams[1].stopped


@pytest.mark.parametrize("name", ["llama", "mistral_window", "qwen3"])
def test_ragged_batch_gives_each_row_its_tokens_alone(tiny_checkpoint, name):
    lm = CausalLM.load(tiny_checkpoint(name)[0], device="cpu")
    batch = lm.generate(PROMPTS, 12)
    width = max(map(len, PROMPTS))
    for row, prompt in zip(batch, PROMPTS):
        assert (row[:width - len(prompt)] == -1).all()  # left padding shows as -1
        assert torch.equal(row[width - len(prompt):], lm.generate([prompt], 12)[0])


def test_ragged_text_batch_equals_single_prompts(tiny):
    lm, tok = tiny
    texts = ["ab cd", "hello there, general", "xy"]
    assert generate_text(lm, tok, texts, 10) == [generate_text(lm, tok, [t], 10)[0] for t in texts]


@pytest.mark.parametrize("options", [dict(temperature=-1), dict(top_p=0), dict(min_p=2), dict(top_k=-1),
                                     dict(repetition_penalty=0), dict(seed=1.5), dict(temperature=float("nan"))])
def test_bad_sampling_options_are_refused_by_name(tiny, options):
    lm, _ = tiny
    with pytest.raises(ValueError, match=next(iter(options))):
        lm.generate(PROMPTS[:1], 4, **options)
