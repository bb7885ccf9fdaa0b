"""Microbenchmark of paged attention in an engine's decode step: every layer's keys and values of `--seqs` sequences
of one context length, in a pool per layer (more than the L3 holds), their blocks handed out in lockstep as
sequences growing together take them, one query per sequence. It prints each step's median ms and the GB/s of
keys and values it read; with --baseline REV the kernels of git revision REV are built beside this tree's and the
two are timed alternately in one run (their outputs must agree bit for bit).

    python bench/attention.py --model 1.7b --contexts 40,77,150
    python bench/attention.py --model 135m --seqs 1 --contexts 4000 --baseline HEAD~1
"""

import argparse
import os
import statistics
import time

import torch
from gguf_kquants import operators

# (q heads, kv heads, head dim, layers)
MODELS = {"135m": (9, 3, 64, 30), "1.7b": (32, 32, 64, 24)}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--baseline", help="a git revision to compare with")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=10)
    parser.add_argument("--model", choices=MODELS, default="1.7b")
    parser.add_argument("--contexts", default="40,77,150", help="keys each sequence attends to, less one")
    parser.add_argument("--seqs", type=int, default=16)
    parser.add_argument("--block-size", type=int, default=16)
    args = parser.parse_args()
    ops = operators(args)
    heads, kv_heads, dim, layers = MODELS[args.model]
    size, seqs = args.block_size, args.seqs
    print(f"load average {os.getloadavg()[0]:.1f} at the start", flush=True)
    for context in map(int, args.contexts.split(",")):
        per_seq = -(-(context + 1) // size)
        tables = torch.tensor([[j * seqs + s for j in range(per_seq)] for s in range(seqs)])
        generator = torch.Generator().manual_seed(context)
        pools = [[torch.randn(seqs * per_seq, kv_heads, size, dim, generator=generator).bfloat16() for _ in "kv"]
                 for _ in range(layers)]
        q = torch.randn(seqs, heads, dim, generator=generator).bfloat16()
        order, positions = torch.arange(seqs), torch.full((seqs,), context)
        step = lambda label: [ops[label].paged_attention(q, k, v, tables, order, positions, 0, 0.0)  # noqa: E731
                              for k, v in pools]
        times = {label: [] for label in ops}
        for _ in range(args.repeat):  # alternating
            for label in ops:
                start = time.perf_counter()
                step(label)
                times[label].append(time.perf_counter() - start)
        if len(ops) == 2:
            assert all(torch.equal(a, b) for a, b in zip(step("base"), step("new"))), "outputs differ"
        read = seqs * (context + 1) * kv_heads * dim * 2 * 2 * layers
        for label in ops:
            median = statistics.median(times[label])
            print(f"{args.model} {seqs} x {context + 1} keys {label:4} {args.threads} thread(s): {median * 1e3:7.2f} ms "
                  f"a step ({layers} layers), {read / median / 1e9:5.1f} GB/s of keys and values", flush=True)
    print(f"load average {os.getloadavg()[0]:.1f} at the end")


if __name__ == "__main__":
    main()
