"""Aggregate tokens/s of the engine at 1/4/8/16 concurrent requests, beside sequential `generate`, in one run.

    python bench/serve.py                       # the default model (SmolLM2-135M-Instruct), bf16 weights and profile
    python bench/serve.py --model PATH --weight-format float32 --concurrency 1,4,16 --tokens 64

Every request has its own prompt (--prompt-tokens random ids) and makes exactly --tokens tokens (no EOS).
Throughput is completion tokens over wall time, prefill included, for `generate` (two requests one after
another, measured beside each level, since a shared machine's speed drifts) and for the engine with all
requests added at once.
"""

import argparse
import statistics
import time

import torch

from lmstack import models
from lmstack.engine import Engine
from lmstack.threads import release_team


def prompts(n, length, vocab, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (length,), generator=g).tolist() for _ in range(n)]


def sequential(lm, batch, tokens):
    """generate's tokens/s, in this thread; its OpenMP team is let go after, as the engine's is while it waits,
    so that each runs alone (threads.release_team)."""
    start = time.perf_counter()
    for prompt in batch:
        lm.generate([prompt], tokens)
    rate = len(batch) * tokens / (time.perf_counter() - start)
    release_team()
    return rate


def served(engine, batch, tokens):
    start = time.perf_counter()
    handles = [engine.add(prompt, max_tokens=tokens, eos_ids=()) for prompt in batch]
    made = sum(len(list(h)) for h in handles)
    elapsed = time.perf_counter() - start
    ttft = statistics.median(h.time_to_first_token for h in handles)
    gaps = [g for h in handles for g in h.time_between_tokens]
    return made / elapsed, ttft, statistics.median(gaps) if gaps else 0.0


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model")
    parser.add_argument("--weight-format", default="bfloat16")
    parser.add_argument("--numeric-profile", default="bf16")
    parser.add_argument("--concurrency", default="1,4,8,16")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--prompt-tokens", type=int, default=32)
    args = parser.parse_args()
    lm, _ = models.load(args.model, weight_format=args.weight_format, numeric_profile=args.numeric_profile,
                        device="cpu")
    levels = [int(c) for c in args.concurrency.split(",")]
    print(f"{lm!r}, {torch.get_num_threads()} threads; {args.prompt_tokens}-token prompts, {args.tokens} tokens each")
    lm.generate([[1, 2, 3]], 2)  # warm up: kernels built, allocator primed
    print("| concurrent | generate tokens/s | engine tokens/s | x generate | x engine at 1 | median TTFT s | "
          "median gap s |")
    print("|---|---|---|---|---|---|---|")
    single = None
    with Engine(lm, max_running=max(levels), short_slots=0) as engine:  # every request long: all run at once
        list(engine.add([1, 2, 3], max_tokens=2))
        for n in levels:  # generate measured beside each level: a shared machine's speed drifts
            baseline = sequential(lm, prompts(2, args.prompt_tokens, lm.vocab_size, seed=99), args.tokens)
            rate, ttft, gap = served(engine, prompts(n, args.prompt_tokens, lm.vocab_size, seed=n), args.tokens)
            single = single or rate
            print(f"| {n} | {baseline:.1f} | {rate:.1f} | {rate / baseline:.2f} | {rate / single:.2f} | {ttft:.3f} | "
                  f"{gap:.4f} |", flush=True)
    print(engine.stats())


if __name__ == "__main__":
    main()
