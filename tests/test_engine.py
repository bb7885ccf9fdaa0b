"""The engine: concurrent requests give what each gives alone; prefix hits, chunking and preemption change nothing."""

import asyncio

import pytest
import torch
import transformers

from lmstack import CausalLM, kernels
from lmstack.blocks.transformer import PagedContext, PagedKV, _paged_attention_reference
from lmstack.engine import Engine, EngineError
from lmstack.engine.kv_cache import BlockPool, Sequence

VOCAB = 256


def prompts(n, seed=0, shortest=1, longest=40):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(shortest, longest + 1, (n,), generator=g).tolist()
    return [torch.randint(0, VOCAB, (k,), generator=g).tolist() for k in lengths]


@pytest.fixture(scope="module")
def llama(tiny_checkpoint):
    return CausalLM.load(tiny_checkpoint("llama_tied_gqa")[0])


@pytest.fixture(scope="module")
def mistral(tiny_checkpoint):  # a sliding window of 5
    return CausalLM.load(tiny_checkpoint("mistral_window")[0])


@pytest.fixture(scope="module")
def llama_bf16(tiny_checkpoint):
    return CausalLM.load(tiny_checkpoint("llama_bf16")[0], weight_format="bfloat16")


@pytest.fixture(scope="module")
def gemma3(tiny_checkpoint):  # sliding and global layers with their own rope, scaled and soft-capped logits
    return CausalLM.load(tiny_checkpoint("gemma3_text")[0])


@pytest.fixture(scope="module")
def kquant_gguf(tiny_checkpoint, tmp_path_factory):  # every K-quant, Q5_0 and Q5_1 as stored, bfloat16 arithmetic
    from test_gguf_blocks import K_MIXED, Q, tiny_gguf

    path = tiny_gguf(tiny_checkpoint, tmp_path_factory.mktemp("kquant"), "llama_wide", qtype=Q.Q4_K,
                     tensor_types=K_MIXED)
    return CausalLM.load(path, weight_format="gguf", numeric_profile="bf16")


@pytest.fixture(scope="module")
def qwen3_moe(tiny_checkpoint):  # top 3 of 6 experts in every other layer
    return CausalLM.load(tiny_checkpoint("qwen3_moe_norm")[0])


def engine_for(model, blocks=64, **options):
    return Engine(model, kv_cache_memory=blocks * model.page_bytes(options.get("block_size", 16)), **options)


def alone(model, prompt, **request):
    """The request run by itself, in a fresh engine: the oracle for every concurrent run."""
    return list(engine_for(model).add(prompt, **request))


class Recorder:
    """Wraps an engine's runner to keep the logits each sequence sampled from, in order."""

    def __init__(self, engine):
        self.logits, run = {}, engine.runner.run

        def recording(batch):
            seqs, logits = results = run(batch)
            for seq, row in zip(seqs, logits):
                self.logits.setdefault(seq.arrival, []).append(row.clone())
            return results

        engine.runner.run = recording


@pytest.mark.parametrize("name", ["llama", "mistral", "llama_bf16", "gemma3", "kquant_gguf", "qwen3_moe"])
def test_sixteen_concurrent_requests_equal_each_alone(request, name):
    model = request.getfixturevalue(name)
    sampled = dict(temperature=0.9, top_k=50, top_p=0.95)
    cases = [(p, dict(max_tokens=12, eos_ids=(), **(dict(sampled, seed=i) if i % 2 else {})))
             for i, p in enumerate(prompts(16, seed=1))]  # every request runs its 12 tokens
    with engine_for(model, max_prefill_tokens=24) as engine:
        handles = [engine.add(p, **r) for p, r in cases]
        together = [list(h) for h in handles]
    assert all(h.finish_reason == "length" for h in handles)
    assert together == [alone(model, p, **r) for p, r in cases]


def test_greedy_engine_matches_generate(llama):
    for prompt in prompts(4, seed=2):
        engine = engine_for(llama)
        assert list(engine.add(prompt, max_tokens=8)) == llama.generate([prompt], 8)[0, len(prompt):].tolist()


def test_prefix_hit_gives_the_logits_of_a_cold_prefill(llama):
    prompt = prompts(1, seed=3, shortest=40)[0]
    engine = engine_for(llama)
    recorder = Recorder(engine)
    cold = engine.add(prompt, max_tokens=3)
    list(cold)
    warm = engine.add(prompt[:37] + [5, 6], max_tokens=3)  # shares two full blocks of 16
    list(warm)
    assert engine.stats()["prefix_hits"] == 2
    other = engine_for(llama)
    other_recorder = Recorder(other)
    list(other.add(prompt[:37] + [5, 6], max_tokens=3))
    assert all(torch.equal(a, b) for a, b in zip(recorder.logits[1], other_recorder.logits[0]))
    reference = llama.forward([prompt[:37] + [5, 6]])[0, -1]
    torch.testing.assert_close(recorder.logits[1][0], reference, rtol=1e-5, atol=1e-5)


def test_chunked_prefill_equals_one_prefill(llama):
    prompt = prompts(1, seed=4, shortest=40)[0]
    runs = []
    for chunk in (512, 7):
        engine = engine_for(llama, max_prefill_tokens=chunk)
        recorder = Recorder(engine)
        tokens = list(engine.add(prompt, max_tokens=6))
        runs.append((tokens, recorder.logits[0]))
    assert runs[0][0] == runs[1][0]
    assert all(torch.equal(a, b) for a, b in zip(runs[0][1], runs[1][1]))


def test_a_short_prompt_does_not_wait_behind_a_long_ones_chunks(llama):
    long, short = prompts(1, seed=12, shortest=100, longest=100)[0], prompts(1, seed=13, longest=6)[0]
    engine = engine_for(llama, max_prefill_tokens=16)  # not started: each step() is one step
    first = engine.add(long, max_tokens=4)
    engine.step()
    second = engine.add(short, max_tokens=4)
    engine.step()
    assert (len(first.tokens), len(second.tokens)) == (0, 1)  # the long prompt still prefilling
    assert [list(first), list(second)] == [alone(llama, long, max_tokens=4), alone(llama, short, max_tokens=4)]


def test_a_short_request_is_admitted_before_a_full_queue_of_long_ones(llama):
    long, short = prompts(6, seed=20, shortest=10, longest=10), prompts(1, seed=21, longest=3)[0]
    engine = engine_for(llama, max_running=1, short_slots=0)  # not started: each step() is one step
    longs = [engine.add(p, max_tokens=8, eos_ids=()) for p in long]
    engine.step()
    quick = engine.add(short, max_tokens=2, eos_ids=())
    while quick.finish_reason is None:
        engine.step()
    assert [len(h.tokens) for h in longs] == [8, 0, 0, 0, 0, 0]  # five were waiting before it came
    assert [list(h) for h in longs] == [alone(llama, p, max_tokens=8, eos_ids=()) for p in long]
    assert list(quick) == alone(llama, short, max_tokens=2, eos_ids=())


def test_a_slot_kept_for_short_requests_admits_one_at_once(llama):
    long, short = prompts(5, seed=22, shortest=10, longest=10), prompts(1, seed=23, longest=3)[0]
    engine = engine_for(llama, max_running=3, short_slots=1, short_tokens=4)
    longs = [engine.add(p, max_tokens=20, eos_ids=()) for p in long]
    engine.step()
    assert engine.stats()["running"] == 2  # long requests never take the third slot
    quick = engine.add(short, max_tokens=2, eos_ids=())
    engine.step()
    engine.step()
    assert quick.finish_reason == "length" and [len(h.tokens) for h in longs] == [3, 3, 0, 0, 0]
    assert [list(h) for h in longs] == [alone(llama, p, max_tokens=20, eos_ids=()) for p in long]
    assert list(quick) == alone(llama, short, max_tokens=2, eos_ids=())


def test_a_long_request_is_not_starved_by_a_stream_of_shorter_ones(llama):
    """More short requests arrive than the engine finishes, all with less work than the long one: each step
    waited counts as a token of work less, so it overtakes those that arrive later and finishes."""
    cases = prompts(200, seed=24, shortest=2, longest=2)
    engine = engine_for(llama, max_running=2, short_slots=1, short_tokens=4)
    engine.add(cases[0], max_tokens=4, eos_ids=())
    engine.step()
    long = prompts(1, seed=25, shortest=10, longest=10)[0]
    patient = engine.add(long, max_tokens=30, eos_ids=())
    for step, prompt in enumerate(cases[1:]):
        if patient.finish_reason is not None:
            break
        engine.add(prompt, max_tokens=4, eos_ids=())
        engine.step()
    assert patient.finish_reason == "length", f"not finished after {step} steps"
    assert engine.stats()["waiting"] > 10  # the short ones kept coming faster than they were served
    assert list(patient) == alone(llama, long, max_tokens=30, eos_ids=())


def test_short_slots_must_leave_a_slot_for_long_requests(llama):
    with pytest.raises(ValueError, match=r"short_slots must be an integer in \[0, max_running 4\), got 4"):
        engine_for(llama, max_running=4, short_slots=4)


def test_a_pool_too_small_for_all_completes_all_through_preemption(llama):
    cases = prompts(8, seed=5, shortest=20, longest=40)
    engine = engine_for(llama, blocks=9)  # each request needs 2-4 blocks of 16
    with engine:
        handles = [engine.add(p, max_tokens=16) for p in cases]
        together = [list(h) for h in handles]
    assert engine.stats()["preemptions"] > 0
    assert together == [alone(llama, p, max_tokens=16) for p in cases]


def test_a_request_that_cannot_fit_alone_is_refused_naming_sizes(llama):
    engine = engine_for(llama, blocks=2)
    with pytest.raises(ValueError, match=r"need 3 KV blocks of 16 tokens; the pool holds 2"):
        engine.add(list(range(30)), max_tokens=5)


def test_a_kv_pool_larger_than_the_memory_left_is_refused_before_allocating(llama):
    with pytest.raises(MemoryError, match=r"a KV pool of \d+ blocks \(kv_cache_memory\) needs .* available"):
        Engine(llama, kv_cache_memory=1 << 50)


def test_abort_frees_the_blocks(llama):
    with engine_for(llama) as engine:
        handle = engine.add(prompts(1, seed=6, shortest=30)[0], max_tokens=90)
        tokens = iter(handle)
        next(tokens), next(tokens)
        handle.abort()
        rest = list(tokens)
        assert handle.finish_reason == "abort" and len(rest) < 88
        list(engine.add([1], max_tokens=1))  # a step after the abort
    stats = engine.stats()  # published at the end of every step; close waits for the last one
    assert stats["kv_blocks_used"] == 0 and stats["kv_blocks_free"] == stats["kv_blocks_total"]


def test_requests_one_after_another_touch_the_blocks_of_one_request():
    """Released blocks are taken before blocks never used: the pool's touched memory follows the most blocks
    held at once, and a prompt repeated meanwhile still finds its blocks cached."""
    pool = BlockPool(64, 4)
    touched = set()
    for k in range(20):
        seq = Sequence()
        tokens = [k] * 12
        assert pool.grow(seq, len(tokens) + 1)
        pool.seal(seq, tokens, len(tokens))
        touched |= set(seq.blocks)
        pool.release(seq)
    assert len(touched) == 4 and pool.n_free == 64
    again = [19] * 12
    assert len(pool.match(again)) == 3  # the last prompt's full blocks


@pytest.mark.parametrize("bad, words", [
    (dict(prompt_ids=[]), "prompt_ids is empty"),
    (dict(prompt_ids=[1, VOCAB]), "prompt_ids holds 256"),
    (dict(prompt_ids="hello"), "prompt_ids must be a sequence"),
    (dict(max_tokens=0), "max_tokens must be a positive integer"),
    (dict(prompt_ids=list(range(100)), max_tokens=40), "exceed the model's context of 128"),
    (dict(temperature=-1), "temperature"),
    (dict(top_p=0), "top_p"),
    (dict(top_k=-3), "top_k"),
    (dict(presence_penalty=3), "presence_penalty"),
    (dict(seed=-1), "seed"),
    (dict(stop=["x"]), "stop strings need the engine's tokenizer"),
    (dict(eos_ids=[-1]), "eos_ids"),
])
def test_bad_requests_are_refused_by_name_while_others_run(llama, bad, words):
    prompt = prompts(1, seed=7, shortest=10)[0]
    with engine_for(llama) as engine:
        running = engine.add(prompt, max_tokens=20)
        with pytest.raises(ValueError, match=words):
            engine.add(**{"prompt_ids": [1, 2], "max_tokens": 4, **bad})
        assert list(running) == alone(llama, prompt, max_tokens=20)


def test_eos_stops_and_async_iteration(llama):
    prompt = prompts(1, seed=8)[0]
    free = alone(llama, prompt, max_tokens=10)

    async def consume(engine):
        handles = [engine.add(prompt, max_tokens=10, eos_ids=[free[4]]), engine.add(prompt, max_tokens=10)]
        return [[t async for t in h] for h in handles], handles

    with engine_for(llama) as engine:
        (stopped, full), handles = asyncio.run(consume(engine))
    assert full == free and stopped == free[:free.index(free[4]) + 1]
    assert [h.finish_reason for h in handles] == ["stop", "length"]
    assert handles[1].time_to_first_token > 0 and len(handles[1].time_between_tokens) == 9


def test_close_ends_running_requests_with_an_error(llama):
    engine = engine_for(llama).start()
    handle = engine.add(prompts(1, seed=9)[0], max_tokens=80)
    next(iter(handle))
    engine.close()
    with pytest.raises(EngineError, match="closed"):
        list(handle)
    assert handle.finish_reason == "error"


@pytest.fixture(scope="module", params=["mamba", "mamba2"])
def mamba(request, tmp_path_factory):
    if request.param == "mamba":
        config = transformers.MambaConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, state_size=8)
    else:
        config = transformers.Mamba2Config(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_heads=8,
                                           head_dim=8, n_groups=1, state_size=16, chunk_size=8)
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp(request.param)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(path)
    return CausalLM.load(path)


def test_mamba_is_served(mamba):
    cases = prompts(6, seed=10, longest=30)
    with Engine(mamba, max_running=4, max_prefill_tokens=16) as engine:
        handles = [engine.add(p, max_tokens=8, **(dict(temperature=1.0, seed=i) if i % 2 else {}))
                   for i, p in enumerate(cases)]
        together = [list(h) for h in handles]
    for i, (p, tokens) in enumerate(zip(cases, together)):
        if i % 2 == 0:
            assert tokens == mamba.generate([p], 8)[0, len(p):].tolist()
        assert tokens == list(Engine(mamba).add(p, max_tokens=8, **(dict(temperature=1.0, seed=i) if i % 2 else {})))


def test_mamba_chunked_prefill_equals_one_prefill(mamba):
    prompt = prompts(1, seed=14, shortest=41, longest=41)[0]  # 41 = 5 chunks of 8 and one token
    runs = []
    for chunk in (512, 8):
        engine = Engine(mamba, max_prefill_tokens=chunk)
        recorder = Recorder(engine)
        runs.append((list(engine.add(prompt, max_tokens=4)), recorder.logits[0]))
    assert runs[0][0] == runs[1][0]
    for a, b in zip(runs[0][1], runs[1][1]):
        if mamba.plan.kind == "mamba1":  # the scan's chunks fall where they fall in one prefill
            assert torch.equal(a, b)
        else:  # Mamba 2's SSD batches its matmuls over a prompt's chunks: their count changes the last bits
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_stop_strings_end_the_text_before_them(llama):
    from lmstack import Tokenizer
    from conftest import FIXTURES

    tokenizer = Tokenizer.from_pretrained(FIXTURES / "tokenizers" / "smollm2")
    prompt = prompts(1, seed=11)[0]
    with Engine(llama, tokenizer, kv_cache_memory=64 * llama.page_bytes(16)) as engine:
        free = engine.add(prompt, max_tokens=12, eos_ids=())
        text = "".join(free.text_pieces())
        assert text == tokenizer.decode(free.tokens) and len(text) > 6
        stop = text[4:6]
        stopped = engine.add(prompt, max_tokens=12, eos_ids=(), stop=[stop])
        assert "".join(stopped.text_pieces()) == text[:text.index(stop)]
    assert stopped.finish_reason == "stop" and stopped.tokens == free.tokens[:len(stopped.tokens)]



def test_async_text_chunks_bring_the_pieces_made_meanwhile(llama):
    from lmstack import Tokenizer
    from conftest import FIXTURES

    tokenizer = Tokenizer.from_pretrained(FIXTURES / "tokenizers" / "smollm2")
    engine = Engine(llama, tokenizer, kv_cache_memory=64 * llama.page_bytes(16))  # not started: steps run inline
    handle = engine.add(prompts(1, seed=11)[0], max_tokens=12, eos_ids=())
    for _ in range(4):
        engine.step()
    made = "".join(handle.pieces)
    assert made, "the first four tokens released no text"

    async def chunks():
        return [text async for text in handle.atext_chunks()]

    texts = asyncio.run(chunks())
    assert texts[0] == made and all(texts) and len(texts) <= 12 - 3
    assert "".join(texts) == handle.text == tokenizer.decode(handle.tokens)

needs_kernels = pytest.mark.skipif(not kernels.available(), reason="lmstack's CPU kernels do not run here")


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 5, 300])
@pytest.mark.parametrize("size, longest", [(4, 20), (16, 700)])
@pytest.mark.parametrize("scale", [None, 0.3])
def test_paged_attention_kernel_matches_the_reference(dtype, window, size, longest, scale):
    """700 positions span several chunks of keys, merged; a token alone gets the numbers it gets in the batch."""
    g = torch.Generator().manual_seed(12)
    KV, D, H = 2, 24, 6
    n_blocks = 2 * -(-longest // size) + 2
    pages = PagedKV(*(torch.randn(n_blocks, KV, size, D, generator=g).to(dtype) for _ in range(2)))
    tables = torch.randperm(n_blocks, generator=g)[:n_blocks - 2].view(2, -1)
    seqs = torch.tensor([0] * 7 + [1] * 3)
    positions = torch.tensor([*range(7), 3, longest // 2 + 1, longest - 1])
    q = torch.randn(10, H, D, generator=g).to(dtype)
    ctx = PagedContext(None, None, None, tables, seqs, positions)
    kernel = kernels.paged_attention(q, pages.k, pages.v, tables, seqs, positions, window or 0, scale)
    reference = _paged_attention_reference(q, pages, ctx, window, scale)
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(kernel.float(), reference.float(), rtol=tolerance, atol=tolerance)
    alone = torch.cat([kernels.paged_attention(q[t:t + 1], pages.k, pages.v, tables, seqs[t:t + 1],
                                               positions[t:t + 1], window or 0, scale) for t in range(10)])
    assert torch.equal(kernel, alone)


@needs_kernels
def test_bf16_matvec_rows_do_not_depend_on_their_batch_mates():
    g = torch.Generator().manual_seed(13)
    for n, k in ((64, 96), (13, 100)):  # full tiles, and a ragged tail of output rows and inputs
        w, bias = torch.randn(n, k, generator=g).bfloat16(), torch.randn(n, generator=g).bfloat16()
        x = torch.randn(11, k, generator=g).bfloat16()
        tiled = kernels.tile_int8(w)
        for matvec in (lambda x: kernels.matvec_bf16(x, w, bias),
                       lambda x: kernels.matvec_bf16_tiled(x, tiled, n, bias)):
            alone = torch.cat([matvec(x[i:i + 1]) for i in range(11)])
            assert all(torch.equal(matvec(x[:m]), alone[:m]) for m in range(1, 12))
            torch.testing.assert_close(alone.float(), x.float() @ w.float().T + bias.float(), rtol=2e-2, atol=2e-2)
