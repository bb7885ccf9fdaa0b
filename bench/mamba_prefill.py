"""Mamba 2 prefill time against transformers' own torch path, and how it grows with the prompt.

A small random Mamba 2 model is built here by transformers and loaded by both sides. Each prefill of
L tokens (batch 1, stateful, so the last state is produced too) is timed best of N rounds, the rounds
interleaving both sides and every length so that a busy neighbour slows them alike; the ratio
t(2L) / t(L) is printed: a scan linear in L gives about 2. One thread by default, for the same reason.

    python bench/mamba_prefill.py [--lengths 1024 2048 4096] [--repeats 5] [--threads 1] [--device cpu]
"""

import argparse
import tempfile
import time

import torch
import transformers

from lmstack import CausalLM

CONFIG = dict(vocab_size=1024, hidden_size=256, num_hidden_layers=4, num_heads=8, head_dim=64, expand=2,
              n_groups=1, state_size=64, chunk_size=256)


def seconds(fn, ids, device):
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    fn(ids)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    device = torch.device(args.device)
    torch.set_num_threads(args.threads)

    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as root:
        transformers.Mamba2ForCausalLM(transformers.Mamba2Config(**CONFIG)).save_pretrained(root)
        reference = transformers.AutoModelForCausalLM.from_pretrained(root, dtype=torch.float32).eval().to(device)
        lm = CausalLM.load(root, device=device)

    def ours(ids):
        lm.forward(ids, lm.allocate_state(1))

    @torch.no_grad()
    def theirs(ids):
        reference(ids, use_cache=True)

    print(f"Mamba 2: {CONFIG}; float32, batch 1, {device}, {torch.get_num_threads()} threads, best of {args.repeats}")
    print(f"{'L':>6} {'lmstack s':>10} {'transformers s':>15} {'speedup':>8} {'lmstack t(L)/t(L/2)':>20} "
          f"{'transformers t(L)/t(L/2)':>25}")
    prompts = [torch.randint(0, CONFIG["vocab_size"], (1, length), device=device) for length in args.lengths]
    best = {}
    for round in range(args.repeats + 1):  # round 0 warms up
        for ids in prompts:
            for side, fn in (("ours", ours), ("theirs", theirs)):
                t = seconds(fn, ids, device)
                if round:
                    key = side, ids.shape[1]
                    best[key] = min(best.get(key, t), t)
    previous = None
    for length in args.lengths:
        t = best["ours", length], best["theirs", length]
        growth = ("", "") if previous is None else (f"{t[0] / previous[0]:.2f}", f"{t[1] / previous[1]:.2f}")
        print(f"{length:>6} {t[0]:>10.3f} {t[1]:>15.3f} {t[1] / t[0]:>7.2f}x {growth[0]:>20} {growth[1]:>25}")
        previous = t


if __name__ == "__main__":
    main()
