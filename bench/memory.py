"""Peak resident memory of loading and running GGUF files, against the bound lmstack promises.

Each file runs in a fresh process: import lmstack (and its kernels), load the file as the CLI does
(weight_format "gguf"), then a greedy generate (a prompt, then decode). From /proc/self/status: the
import baseline (VmHWM after the imports), the RSS after loading, and the peak (VmHWM at the end). The
bound is the file's tensor bytes + the KV cache the generate allocated + the baseline + 150 MiB.

Files: those given, else SmolLM2-135M (the default model, Q4_1) requantized to the --make mixes with the
test quantizer (tests/quantize.py). --llama-simple PATH adds llama.cpp's peak RSS for the same prompt and
token count (its `llama-simple` example, run in its own process).

    python bench/memory.py                     # SmolLM2 as Q4_K_M, as shipped (Q4_1) and Q8_0
    python bench/memory.py --make Q4_K_M,Q6_K model.gguf
"""

import argparse
import json
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

HEADROOM = 150 << 20
TESTS = Path(__file__).resolve().parent.parent / "tests"


def status(key: str) -> int:
    """A /proc/self/status memory figure in bytes."""
    with open("/proc/self/status") as fh:
        return next(int(line.split()[1]) * 1024 for line in fh if line.startswith(key + ":"))


def measure(path: str, weight_format: str, profile: str | None, prompt: int, new: int, threads: int) -> dict:
    """In this (fresh) process: the figures of one file."""
    import torch

    from lmstack import CausalLM, kernels
    from lmstack.gguf import GGUFHeader

    torch.set_num_threads(threads)
    kernels.available()  # the kernels' library is part of the import baseline
    baseline = status("VmHWM")
    with GGUFHeader(path) as header:
        tensor_bytes = sum(t.nbytes for t in header.tensors.values())
        types = sorted({t.type.name for t in header.tensors.values()})
    lm = CausalLM.load(path, weight_format=weight_format, numeric_profile=profile, device="cpu")
    loaded, load_peak = status("VmRSS"), status("VmHWM")
    ids = torch.randint(0, lm.vocab_size, (1, prompt), generator=torch.Generator().manual_seed(0))
    lm.generate(ids, new)
    kv = lm.page_bytes(1) * (prompt + new - 1)  # generate's state: the last token is not fed
    return dict(tensor_bytes=tensor_bytes, types=types, baseline=baseline, loaded=loaded, load_peak=load_peak,
                peak=status("VmHWM"), kv=kv, bound=tensor_bytes + kv + baseline + HEADROOM)


def llama_peak(binary: str, path: str, prompt: int, new: int, threads: int) -> int:
    """Peak RSS of llama.cpp's llama-simple on the file: this process's only child, so RUSAGE_CHILDREN is its own."""
    text = " ".join(["the"] * prompt)
    subprocess.run([binary, "-m", path, "-n", str(new), text], capture_output=True, check=True)
    return resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024


def make_files(names: list[str], out: Path) -> list[str]:
    """The default model requantized to each named mix: Q<n>_K_M (llama.cpp's mix, in tests/quantize.py), a
    single type (Q8_0, Q6_K, ...) for every matrix, or Q4_1 (the file as shipped)."""
    sys.path.insert(0, str(TESTS))
    from gguf import GGMLQuantizationType as Q
    from quantize import k_m, requantize_gguf

    from lmstack import models

    source, files = models.smollm2(), []
    mixes = {"Q4_K_M": k_m(Q.Q4_K, Q.Q6_K), "Q5_K_M": k_m(Q.Q5_K, Q.Q6_K), "Q3_K_M": k_m(Q.Q3_K, Q.Q4_K)}
    for name in names:
        if name == "Q4_1":
            files.append(str(source))
            continue
        path = out / f"SmolLM2-135M-{name}.gguf"
        if not path.exists():
            qtype = Q[name] if name in Q.__members__ else None
            if name not in mixes and qtype is None:
                raise SystemExit(f"--make {name}: expected one of {', '.join(mixes)}, Q4_1 or a GGUF type name")
            requantize_gguf(source, path, mixes.get(name) or (lambda *_, qtype=qtype: qtype))
        files.append(str(path))
    return files


def mib(n: int) -> str:
    return f"{n / 2**20:.0f}"


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("files", nargs="*")
    parser.add_argument("--make", default="Q4_K_M,Q4_1,Q8_0",
                        help="without files: the mixes of the default model to make (Q4_K_M, Q5_K_M, Q3_K_M, Q4_1, "
                             "or one type for all, e.g. Q6_K)")
    parser.add_argument("--out", type=Path, default=Path(tempfile.gettempdir()) / "lmstack-memory",
                        help="where made files are kept (reused when present)")
    parser.add_argument("--weight-format", default="gguf")
    parser.add_argument("--numeric-profile", default=None)
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--llama-simple", help="llama.cpp's llama-simple binary, for its peak RSS")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--llama-worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(measure(args.worker, args.weight_format, args.numeric_profile, args.prompt, args.new,
                                 args.threads)))
        return
    if args.llama_worker:
        print(llama_peak(args.llama_simple, args.llama_worker, args.prompt, args.new, args.threads))
        return
    args.out.mkdir(parents=True, exist_ok=True)
    files = args.files or make_files(args.make.split(","), args.out)
    common = ["--weight-format", args.weight_format, "--prompt", str(args.prompt), "--new", str(args.new),
              "--threads", str(args.threads)] + (["--numeric-profile", args.numeric_profile]
                                                 if args.numeric_profile else [])
    print(f"MiB; {args.prompt}-token prompt + {args.new} greedy tokens, weight_format {args.weight_format}; "
          f"bound = tensors + KV + baseline + {mib(HEADROOM)}")
    header = ["file", "types", "tensors", "KV", "baseline", "after load", "load peak", "peak", "bound",
              "peak/bound"] + (["llama.cpp peak"] if args.llama_simple else [])
    rows = []
    for path in files:
        run = subprocess.run([sys.executable, __file__, "--worker", path, *common], capture_output=True, text=True)
        if run.returncode:
            raise SystemExit(f"{path}: the worker failed:\n{run.stderr[-4000:]}")
        r = json.loads(run.stdout.splitlines()[-1])
        row = [Path(path).name, "+".join(r["types"]), *(mib(r[k]) for k in (
            "tensor_bytes", "kv", "baseline", "loaded", "load_peak", "peak", "bound")),
            f"{r['peak'] / r['bound']:.2f}" + ("" if r["peak"] <= r["bound"] else " OVER")]
        if args.llama_simple:
            out = subprocess.run([sys.executable, __file__, "--llama-worker", path, "--llama-simple",
                                  args.llama_simple, *common], capture_output=True, text=True, check=True).stdout
            row.append(mib(int(out.split()[-1])))
        rows.append(row)
    widths = [max(len(str(x)) for x in column) for column in zip(header, *rows)]
    for row in [header, *rows]:
        print("  ".join(str(x).rjust(w) if i > 1 else str(x).ljust(w) for i, (x, w) in enumerate(zip(row, widths))))


if __name__ == "__main__":
    main()
