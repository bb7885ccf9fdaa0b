"""Decode speed of GGUF files run as stored (weight_format "gguf") against llama.cpp on the same file.

Each engine runs in its own process (2 threads, batch 1, 64 greedy tokens after a 16-token prompt), the pairs
alternating, and the median of --repeats is printed with lmstack's ratio. llama.cpp is `llama-bench`'s tg64
(`--llama-bench PATH`); files: the default model and any GGUF given (bench/decode.py makes Q8_0 and Q4_0 ones).

    python bench/gguf_decode.py --llama-bench /path/to/llama-bench model-Q8_0.gguf model-Q4_0.gguf
"""

import argparse
import json
import statistics
import subprocess
import sys
import time


def lmstack_decode(path: str, profile: str, threads: int, tokens: int) -> float:
    import torch

    from lmstack import CausalLM

    torch.set_num_threads(threads)
    lm = CausalLM.load(path, weight_format="gguf", numeric_profile=profile)
    state = lm.allocate_state(1, 16 + tokens)
    logits = lm.forward(torch.arange(1, 17)[None], state)[:, -1]
    lm.step(logits.argmax(-1), state)  # warm
    start = time.perf_counter()
    for _ in range(tokens - 1):
        logits = lm.step(logits.argmax(-1), state)
    return (tokens - 1) / (time.perf_counter() - start)


def llama_decode(llama_bench: str, path: str, threads: int, tokens: int) -> float:
    out = subprocess.run([llama_bench, "-m", path, "-t", str(threads), "-p", "0", "-n", str(tokens), "-r", "1",
                          "-o", "json"], capture_output=True, text=True, check=True).stdout
    return json.loads(out)[0]["avg_ts"]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("files", nargs="*")
    parser.add_argument("--llama-bench", required=True)
    parser.add_argument("--profile", default="bf16", choices=("fp32", "bf16"))
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(lmstack_decode(args.worker, args.profile, args.threads, args.tokens))
        return
    from lmstack import models

    for path in args.files or [str(models.smollm2())]:
        ours, theirs = [], []
        for _ in range(args.repeats):
            run = subprocess.run([sys.executable, __file__, "--worker", path, "--llama-bench", args.llama_bench,
                                  "--profile", args.profile, "--threads", str(args.threads), "--tokens",
                                  str(args.tokens)], capture_output=True, text=True, check=True)
            ours.append(float(run.stdout.split()[-1]))
            theirs.append(llama_decode(args.llama_bench, path, args.threads, args.tokens))
        a, b = statistics.median(ours), statistics.median(theirs)
        print(f"{path}: lmstack gguf {args.profile} {a:.1f} tok/s, llama.cpp {b:.1f} tok/s, ratio {a / b:.2f} "
              f"(runs {[round(x, 1) for x in ours]} / {[round(x, 1) for x in theirs]})", flush=True)


if __name__ == "__main__":
    main()
