"""Microbenchmark of the many-row matvec (an engine step of many sequences): every projection of a few layers of
a model's shapes (SmolLM2-135M or the SmolLM2-1.7B-shaped model), more weights than the L3 holds, for 1..16 rows
of x (a decode step) and 181 (a step that prefills 15 prompts), in bfloat16 (tiled) and the GGUF block types, random
weights. It prints each pass's ms and, against one
row, the cost of a row; with --baseline REV the kernels of git revision REV are built
beside this tree's and the two are timed alternately in one run (their results must agree bit for bit where
both pack the blocks alike).

    python bench/many_rows.py --model 135m --threads 1
    python bench/many_rows.py --model 1.7b --types bf16,Q4_0 --baseline HEAD~1
"""

import time

import torch
from gguf import GGMLQuantizationType as Q
from gguf_kquants import kernel_arguments, operators, packed_by, sane_blocks

from lmstack import kernels

# (hidden, ffn, kv width, layers timed): qkv, o, gate_up and down of each layer
MODELS = {"135m": (576, 1536, 192, 30), "1.7b": (2048, 8192, 2048, 4)}


def shapes(model: str):
    hidden, ffn, kv, layers = MODELS[model]
    layer = [(hidden + 2 * kv, hidden), (hidden, hidden), (2 * ffn, hidden), (hidden, ffn)]
    return layer * layers


def weights(kind: str, model: str, ops: dict):
    """[(call(label, x), weights)] for every projection of the model's layers, each operator's weights as it
    packs them, and whether all operators share one layout (their results are then compared bit for bit)."""
    calls, same = [], True
    for i, (n, k) in enumerate(shapes(model)):
        if kind == "bf16":
            w = kernels.tile_int8(torch.randn(n, k, generator=torch.Generator().manual_seed(i)).bfloat16())
            calls.append((lambda label, x, w=w, n=n: ops[label].matvec_bf16_tiled(x, w, n, None), k))
        else:
            qtype = Q[kind]
            raw = sane_blocks(qtype, n, k, seed=i)
            w = {label: packed_by(op, raw, qtype) for label, op in ops.items()}
            same = same and all(torch.equal(p, w["new"]) for p in w.values())
            calls.append((lambda label, x, w=w, n=n, t=qtype.value: ops[label].gguf_matvec(x, w[label], t, n, None),
                          k))
    return calls, same


def main():
    parser = kernel_arguments("bf16,Q8_0,Q4_0")
    parser.add_argument("--model", choices=MODELS, default="135m")
    parser.add_argument("--rows", default="1,4,8,16,181")
    args = parser.parse_args()
    ops = operators(args)
    rows = [int(m) for m in args.rows.split(",")]
    generator = torch.Generator().manual_seed(0)
    for kind in args.types.split(","):
        calls, same_layout = weights(kind, args.model, ops)
        xs = {m: {k: torch.randn(m, k, generator=generator).bfloat16() for _, k in calls} for m in rows}
        # each call's best time, summed: on a shared machine a whole pass is seldom left alone, one call often is
        best = {(label, m): [float("inf")] * len(calls) for label in ops for m in rows}
        for _ in range(args.repeat):  # alternating: each round times every revision at every row count
            for m in rows:
                for label in ops:
                    times = best[label, m]
                    for i, (call, k) in enumerate(calls):
                        start = time.perf_counter()
                        call(label, xs[m][k])
                        times[i] = min(times[i], time.perf_counter() - start)
        best = {key: sum(times) for key, times in best.items()}
        if len(ops) == 2 and same_layout:
            for m in rows:
                for call, k in calls[:4]:
                    assert torch.equal(call("base", xs[m][k]), call("new", xs[m][k])), f"{kind}: differ"
        elif len(ops) == 2:
            print(f"{kind}: the baseline's layout differs, its results are not compared", flush=True)
        for label in ops:
            one = best[label, rows[0]]
            cells = [f"M={m} {best[label, m] * 1e3:7.2f} ms ({best[label, m] / one:5.2f}x)" for m in rows]
            print(f"{args.model} {kind:5} {label:4} {args.threads} thread(s): " + "  ".join(cells), flush=True)


if __name__ == "__main__":
    main()
