"""Microbenchmark of the many-row matvec (an engine step of many sequences): every projection of a few layers of
a model's shapes (SmolLM2-135M or the SmolLM2-1.7B-shaped model), more weights than the L3 holds, for 1..16 rows
of x, in bfloat16 (tiled) and the GGUF block types, random weights. It prints each pass's ms and, against one
row, the cost of a row; with --baseline REV the kernels.cpp and kernels_gguf.cpp of git revision REV are built
beside this tree's and the two are timed alternately in one run (their results must agree bit for bit).

    python bench/many_rows.py --model 135m --threads 1
    python bench/many_rows.py --model 1.7b --types bf16,Q4_0 --baseline HEAD~1
"""

import argparse
import subprocess
import time
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType as Q

from lmstack import kernels

SRC = Path(kernels.__file__).parent
# (hidden, ffn, kv width, layers timed): qkv, o, gate_up and down of each layer
MODELS = {"135m": (576, 1536, 192, 30), "1.7b": (2048, 8192, 2048, 4)}


def shapes(model: str):
    hidden, ffn, kv, layers = MODELS[model]
    layer = [(hidden + 2 * kv, hidden), (hidden, hidden), (2 * ffn, hidden), (hidden, ffn)]
    return layer * layers


def build_baseline(rev: str):
    """REV's kernels.cpp and kernels_gguf.cpp as the operators torch.ops.lmstack_base.*."""
    from torch.utils import cpp_extension

    build = Path(".torch_ext/many_rows_baseline")
    build.mkdir(parents=True, exist_ok=True)
    sources = []
    for name in ("kernels.cpp", "kernels_gguf.cpp", "kernels.h"):
        text = subprocess.run(["git", "show", f"{rev}:src/lmstack/{name}"], capture_output=True, text=True,
                              check=True, cwd=SRC).stdout
        text = text.replace("TORCH_LIBRARY(lmstack,", "TORCH_LIBRARY(lmstack_base,")
        text = text.replace("TORCH_LIBRARY_FRAGMENT(lmstack,", "TORCH_LIBRARY_FRAGMENT(lmstack_base,")
        path = build / name
        if not path.exists() or path.read_text() != text:
            path.write_text(text)
        if name.endswith(".cpp"):
            sources.append(str(path))
    cpp_extension.load(name="lmstack_many_rows_base", sources=sources, extra_cflags=kernels.FLAGS,
                       build_directory=str(build), is_python_module=False)
    return torch.ops.lmstack_base


def random_gguf(qtype, n, k, seed):
    """Random blocks of qtype whose float16 scales are 1e-3 (the weights spread as a model's do), packed."""
    kind = kernels.GGUF_TYPES[qtype.value]
    raw = np.random.default_rng(seed).integers(0, 256, (n, k // kind.values, kind.bytes), dtype=np.uint8)
    for at in kind.float16_at:
        raw[..., at:at + 2] = np.array([1e-3], np.float16).view(np.uint8)
    return kernels.pack_gguf(torch.from_numpy(raw.reshape(n, -1)), qtype.value)


def weights(kind: str, model: str):
    """[(call(op, x), weights)] for every projection of the model's layers."""
    calls = []
    for i, (n, k) in enumerate(shapes(model)):
        if kind == "bf16":
            w = kernels.tile_int8(torch.randn(n, k, generator=torch.Generator().manual_seed(i)).bfloat16())
            calls.append((lambda op, x, w=w, n=n: op.matvec_bf16_tiled(x, w, n, None), k))
        else:
            qtype = Q[kind]
            w = random_gguf(qtype, n, k, i)
            calls.append((lambda op, x, w=w, n=n, t=qtype.value: op.gguf_matvec(x, w, t, n, None), k))
    return calls


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", choices=MODELS, default="135m")
    parser.add_argument("--types", default="bf16,Q8_0,Q4_0")
    parser.add_argument("--rows", default="1,4,8,16")
    parser.add_argument("--baseline", help="a git revision to compare with")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    assert kernels.available()
    ops = {"new": torch.ops.lmstack}
    if args.baseline:
        ops = {"base": build_baseline(args.baseline), **ops}
    rows = [int(m) for m in args.rows.split(",")]
    generator = torch.Generator().manual_seed(0)
    for kind in args.types.split(","):
        calls = weights(kind, args.model)
        xs = {m: {k: torch.randn(m, k, generator=generator).bfloat16() for _, k in calls} for m in rows}
        # each call's best time, summed: on a shared machine a whole pass is seldom left alone, one call often is
        best = {(label, m): [float("inf")] * len(calls) for label in ops for m in rows}
        for _ in range(args.repeat):  # alternating: each round times every revision at every row count
            for m in rows:
                for label, op in ops.items():
                    times = best[label, m]
                    for i, (call, k) in enumerate(calls):
                        start = time.perf_counter()
                        call(op, xs[m][k])
                        times[i] = min(times[i], time.perf_counter() - start)
        best = {key: sum(times) for key, times in best.items()}
        if len(ops) == 2:
            for m in rows:
                for call, k in calls[:4]:
                    assert torch.equal(call(ops["base"], xs[m][k]), call(ops["new"], xs[m][k])), f"{kind}: differ"
        for label in ops:
            one = best[label, rows[0]]
            cells = [f"M={m} {best[label, m] * 1e3:7.2f} ms ({best[label, m] / one:5.2f}x)" for m in rows]
            print(f"{args.model} {kind:5} {label:4} {args.threads} thread(s): " + "  ".join(cells), flush=True)


if __name__ == "__main__":
    main()
