"""The machine's memory read bandwidth as decode sees it: N threads summing a buffer far larger than the caches.

Decode at batch 1 reads every weight once per token, so its speed is bounded by how fast the cores can stream
memory; bench/decode.py reports each engine's decode as a share of this figure (tensor bytes read per token x
tokens/s / GB/s). The read is torch's sum over float32 on `--threads` threads (vectorized, one pass, nothing
written back); the best of `--repeats` passes is the machine's, since a shared machine only ever slows it.

    python bench/bandwidth.py                 # 2 threads, 1 GiB
    python bench/bandwidth.py --threads 1 --mib 512
"""

import argparse
import time


def read_bandwidth(threads: int = 2, mib: int = 1024, repeats: int = 5) -> float:
    """GB/s (10^9 bytes) of the fastest of `repeats` plain reads of a `mib` MiB buffer on `threads` threads."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        buffer = torch.ones(mib * 2**20 // 4, dtype=torch.float32)  # written once: every page resident
        buffer.sum()  # warm: the threads started
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            buffer.sum()
            best = min(best, time.perf_counter() - start)
        return buffer.numel() * 4 / best / 1e9
    finally:
        torch.set_num_threads(before)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--mib", type=int, default=1024, help="buffer size (MiB)")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    print(f"{read_bandwidth(args.threads, args.mib, args.repeats):.1f} GB/s read, {args.threads} threads, "
          f"{args.mib} MiB buffer, best of {args.repeats}")


if __name__ == "__main__":
    main()
