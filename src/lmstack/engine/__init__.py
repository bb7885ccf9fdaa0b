"""Serving many requests at once: continuous batching over a paged KV cache with prefix reuse.

    engine = Engine(model, tokenizer=None, *, max_running=16, kv_cache_memory=None, block_size=16,
                    max_prefill_tokens=512, short_slots=max_running // 8, short_tokens=8)
    engine.start()                  # step in a background thread; engine.close() stops it (requests still running
                                    # end with EngineError); `with Engine(...) as engine:` does both
    handle = engine.add(prompt_ids, *, max_tokens, temperature=0.0, top_k=0, top_p=1.0, min_p=0.0,
                        repetition_penalty=1.0, presence_penalty=0.0, frequency_penalty=0.0, seed=None,
                        stop=(), eos_ids=None, constraint=None, logprobs=None, sample_of=None)
    for token_id in handle: ...     # blocks until each token is made; without start(), iterating steps the engine
    async for token_id in handle: ...          # for asyncio: awaits a future the engine resolves, no polling
    handle.text_pieces()            # the text as it is released (needs the tokenizer)
    async for text in handle.atext_chunks(): ...  # the text released since the last chunk (all of it if behind)
    handle.abort()                  # within one step: the request stops and its KV blocks are freed
    engine.stats()                  # dict, below

`add` refuses a bad request with a ValueError naming the field (prompt_ids empty or not token ids, prompt_ids +
max_tokens beyond the model's context or the KV pool, max_tokens < 1, sampling values out of range, stop
strings without a tokenizer), before it touches the running ones. It is safe from any thread.

A handle ends with `finish_reason` "stop" (a token of eos_ids, which is yielded, or a stop string, which the
text leaves out), "length" (max_tokens made), "abort", or "error": the iterating caller then gets the
EngineError (a step failed, or the engine closed). While it runs, finish_reason is None. It also has
prompt_tokens, completion_tokens, tokens (the ids so far), text, time_to_first_token (seconds from add) and
token_times (time.monotonic() of each token; time_between_tokens their gaps). eos_ids None means the model's
and the tokenizer's EOS ids. Sampling options are `Sampler`'s (sampling.py); presence and frequency penalties
apply to the completion's tokens, as in OpenAI's API; a seed makes a request's samples the same whatever runs
beside it. Every token is chosen by the request's decoding.Decoder: penalties, then the `constraint`'s mask (a
grammar.Grammar; the request ends, "stop", when the grammar is complete, and a grammar that fails ends only its
own request, "error"), then the sampler. `logprobs=k` records each token's log-probability and its k best
alternatives in `handle.logprobs` ([(logprob, [(id, logprob)])]). `sample_of=handle` marks another sample of the
same prompt (OpenAI's n): it starts once that one's prompt is computed and shares its full KV blocks.

Each step the scheduler (scheduler.py) gives every running sequence one decode token and prompts chunks of at most
max_prefill_tokens in all, admits waiting requests while fewer than max_running run (a prompt that fits the step
whole before the next chunk of a longer one; the least work first, prompt + max_tokens less the steps waited, so
nothing starves; short_slots of the slots only for requests of at most short_tokens tokens to make), and when the
KV pool is short preempts the sequence ranked last in that order (recomputed later). The block manager
(kv_cache.py) hands out blocks of block_size token slots from one pool of kv_cache_memory bytes (default: enough
for max_running sequences of the model's whole context, but at most a quarter of the memory free at start), and
keeps full blocks keyed by their prefix for later prompts that start the same way. The pool is not touched when it
is made, and released blocks are taken before never-used ones: resident memory follows the blocks in use. The
runner (runner.py) makes one forward of every scheduled token (CausalLM.forward_paged); recurrent models (Mamba 1
and 2) keep one state per running sequence instead of blocks.

A request's numbers never depend on what runs beside it: each token's attention and every matmul row is
computed alone, in the same order whatever the batch (formats.row_invariant, kernels.paged_attention), so a
greedy request gives the same tokens alone or among others, chunked or not, with a prefix hit or without.
One exception: Mamba 2's prefill batches its SSD matmuls over a prompt's chunks, so a prompt entering in
chunks differs from one prefill in the last bits of its logits (chunks end on the model's chunk_size).

stats(): running, waiting, preemptions, kv_blocks_total / _used / _free / _cached, prefix_queries and
prefix_hits (full prompt blocks looked up in the prefix cache, and found) and prefix_hit_rate.
"""

from .engine import FINISH_REASONS, Engine, EngineError, Handle

__all__ = ["Engine", "EngineError", "Handle", "FINISH_REASONS"]
