"""Microbenchmark of the K-quant kernels on one layer's shapes (8192x2048 and 2048x8192, random blocks with sane
scales): the bf16 matvec (decode) and the dequantize to bfloat16 (prefill), per type. With --baseline REV the
kernels of git revision REV are built beside this tree's and the two are timed alternately in one run."""

import argparse
import subprocess
import time
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType as Q

from lmstack import kernels
from lmstack.formats import GGUF_DENSE_BYTES

SRC = Path(kernels.__file__).parent


def sane_blocks(qtype, rows, cols, seed=0) -> torch.Tensor:
    """Random blocks whose float16 scales (d, dmin) are 1e-3 (the weights then spread as a model's do)."""
    kind = kernels.GGUF_TYPES[qtype.value]
    raw = np.random.default_rng(seed).integers(0, 256, (rows, cols // kind.values, kind.bytes), dtype=np.uint8)
    for at in kind.float16_at:
        raw[..., at:at + 2] = np.array([1e-3], np.float16).view(np.uint8)
    return torch.from_numpy(raw.reshape(rows, -1))


def build_baseline(rev: str):
    """REV's kernel sources (those of this tree's kernels.SOURCES it has, and its kernels.h) as the operators
    torch.ops.lmstack_base.*: the whole library, since one source may call another's functions."""
    from torch.utils import cpp_extension

    build = Path(".torch_ext/lmstack_base")
    build.mkdir(parents=True, exist_ok=True)
    paths = []
    for source in (*kernels.SOURCES, "kernels.h"):
        shown = subprocess.run(["git", "show", f"{rev}:src/lmstack/{source}"], capture_output=True, text=True,
                               cwd=SRC)
        if shown.returncode:
            continue  # a source REV does not have yet
        text = shown.stdout.replace("TORCH_LIBRARY(lmstack,", "TORCH_LIBRARY(lmstack_base,")
        text = text.replace("TORCH_LIBRARY_FRAGMENT(lmstack,", "TORCH_LIBRARY_FRAGMENT(lmstack_base,")
        path = build / source
        if not path.exists() or path.read_text() != text:
            path.write_text(text)
        if source.endswith(".cpp"):
            paths.append(str(path))
    cpp_extension.load(name="lmstack_base", sources=paths, extra_cflags=kernels.FLAGS, build_directory=str(build),
                       is_python_module=False)
    return torch.ops.lmstack_base


def seconds(f, repeat):
    f()
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        f()
        best = min(best, time.perf_counter() - t)
    return best


def kernel_arguments(types: str) -> argparse.ArgumentParser:
    """The options of a kernel benchmark: --types, --baseline, --threads, --repeat."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--types", default=types)
    parser.add_argument("--baseline", help="a git revision to compare with")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeat", type=int, default=5)
    return parser


def operators(args) -> dict:
    """{"base": the --baseline revision's kernels, if any, "new": this tree's}, on --threads threads."""
    torch.set_num_threads(args.threads)
    assert kernels.available()
    return {**({"base": build_baseline(args.baseline)} if args.baseline else {}), "new": torch.ops.lmstack}


def packed_by(op, raw: torch.Tensor, qtype) -> torch.Tensor:
    """raw's blocks packed by op's own pack_gguf_into: a baseline revision may lay a record out for another tile
    of rows (kernels.TILE where this tree's is REGROUPED_TILE)."""
    kind = kernels.GGUF_TYPES[qtype.value]
    n, blocks = raw.shape[0], raw.shape[1] // kind.bytes
    flags = (qtype.value in kernels.FIFTH_BITS, qtype.value == kernels.Q8_0)
    for tile in dict.fromkeys((kind.tile, kernels.TILE)):
        out = torch.empty((-(-n // tile), blocks, tile * kind.bytes), dtype=torch.uint8)
        for scales in ((len(kind.float16_at), kind.float16_at[0]), (len(kind.float16_at),)):  # a baseline may not
            try:                                                                             # take scales_at
                op.pack_gguf_into(raw, out, 0, n, kind.bytes, tile != kernels.TILE, *scales, *flags)
                return out
            except RuntimeError:
                continue
    raise SystemExit(f"{qtype.name}: the baseline packs no layout this bench knows")


def main():
    args = kernel_arguments("Q4_K,Q5_K,Q6_K").parse_args()
    ops = operators(args)
    for name in args.types.split(","):
        qtype = Q[name]
        for n, k in ((8192, 2048), (2048, 8192)):
            raw = sane_blocks(qtype, n, k)
            packed = {label: packed_by(op, raw, qtype) for label, op in ops.items()}
            x = torch.randn(1, k).bfloat16()
            nbytes = raw.numel()
            # a prefill dequantizes GGUF_DENSE_BYTES of bfloat16 weights at a time (formats.py)
            rows = min(n, GGUF_DENSE_BYTES // (2 * k)) // 16 * 16
            chunks = {label: p[:rows * p.shape[0] // n] for label, p in packed.items()}  # rows a multiple of any tile
            row = []
            for label, op in ops.items():
                mv = seconds(lambda: op.gguf_matvec(x, packed[label], qtype.value, n, None), args.repeat)
                dq = seconds(lambda: op.gguf_dequantize(chunks[label], qtype.value, rows, k, None, torch.bfloat16),
                             args.repeat)
                row.append(f"{label}: matvec {mv * 1e3:6.2f} ms ({nbytes / mv / 1e9:5.2f} GB/s)"
                           f"  dequant-bf16 {dq * 1e3:6.2f} ms ({rows * k / dq / 1e9:5.2f} Gw/s)")
            if len(ops) == 2:  # the dequantized weights agree bit for bit, the products within float32 sums' order
                dequant = (op.gguf_dequantize(chunks[label], qtype.value, rows, k, None, torch.bfloat16)
                           for label, op in ops.items())
                assert torch.equal(*dequant), f"{name}: dequantized weights differ"
                base, new = (op.gguf_matvec(x, packed[label], qtype.value, n, None).float()
                             for label, op in ops.items())
                assert ((base - new).abs() <= 2.0 ** -7 * base.abs().max()).all(), f"{name}: products differ"
            print(f"{name} {n}x{k}  " + "  |  ".join(row), flush=True)


if __name__ == "__main__":
    main()
