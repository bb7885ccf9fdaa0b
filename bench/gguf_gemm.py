"""Microbenchmark of a prefill's products on GGUF blocks per type, on one layer's shapes of SmolLM2-135M (--shapes
135m) or the SmolLM2-1.7B-shaped model (1.7b), --rows rows of x: bfloat16 rows through the block kernels
(gguf_matvec: the bf16 profile without AMX) and float32 rows through the GEMM on exactly dequantized panels
(gguf_gemm: the fp32 profile), beside the same shapes' GEMMs on bfloat16 tiles (gemm_bf16_tiled, gemm_f32_tiled).
With --baseline REV the kernels of git revision REV are timed beside this tree's, alternately, in one run, and their
outputs must agree bit for bit."""

import torch
from gguf import GGMLQuantizationType as Q
from gguf_kquants import kernel_arguments, operators, packed_by, sane_blocks, seconds

from lmstack import kernels

SHAPES = {  # (N, K) of q, k (= v), o, gate (= up), down
    "135m": ((576, 576), (192, 576), (576, 576), (1536, 576), (576, 1536)),
    "1.7b": ((2048, 2048), (2048, 2048), (2048, 2048), (8192, 2048), (2048, 8192)),
}


def main():
    parser = kernel_arguments("Q5_0,Q5_1,Q8_0,Q4_K,Q5_K,Q6_K")
    parser.add_argument("--shapes", choices=SHAPES, default="135m")
    parser.add_argument("--rows", type=int, default=512)
    args = parser.parse_args()
    ops = operators(args)
    x = {k: torch.randn(args.rows, k).bfloat16() for _, k in SHAPES[args.shapes]}
    x32 = {k: v.float() for k, v in x.items()}
    tiled = [kernels.tile_int8(torch.randn(n, k).bfloat16() * 0.02) for n, k in SHAPES[args.shapes]]
    for name in ["BF16", *args.types.split(",")]:
        qtype = None if name == "BF16" else Q[name]
        # the shapes whose rows are whole blocks of the type (llama.cpp's quantizer falls back to another elsewhere)
        values = kernels.GGUF_TYPES[qtype.value].values if qtype else 2
        shapes = [(n, k) for n, k in SHAPES[args.shapes] if k % values == 0]
        raws = [sane_blocks(qtype, n, k) for n, k in shapes] if qtype else []
        # each operator's blocks as it packs them (a baseline may lay records out for another tile of rows)
        packed = {label: [packed_by(op, raw, qtype) for raw in raws] if qtype else tiled for label, op in ops.items()}

        def product(op, w, n, k, dtype):
            if qtype:
                return (op.gguf_matvec(x[k], w, qtype.value, n, None) if dtype == "bf16" else
                        op.gguf_gemm(x32[k], w, qtype.value, n, None))
            return op.gemm_bf16_tiled(x[k], w, n, None) if dtype == "bf16" else op.gemm_f32_tiled(x32[k], w, n, None)

        for dtype in ("bf16", "fp32"):
            times = {label: [] for label in ops}
            for _ in range(args.repeat):  # alternating, the best of each
                for label, op in ops.items():
                    times[label].append(seconds(lambda: [product(op, w, n, k, dtype) for (n, k), w in
                                                         zip(shapes, packed[label])], 1))
            if qtype and len(ops) == 2:
                for i, (n, k) in enumerate(shapes):
                    base, new = (product(op, packed[label][i], n, k, dtype) for label, op in ops.items())
                    assert torch.equal(base, new), f"{name} {dtype} {n}x{k}: outputs differ"
            timed = "  ".join(f"{label}: {min(t) * 1e3:7.2f} ms" for label, t in times.items())
            print(f"{name:5} {dtype} {len(shapes)} shapes  {timed}", flush=True)


if __name__ == "__main__":
    main()
