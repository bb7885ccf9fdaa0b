"""Prefill and decode speed of lmstack per weight format, against transformers and llama.cpp, in one run.

    python bench/decode.py                      # the default model (SmolLM2-135M-Instruct GGUF)
    python bench/decode.py --model PATH_OR_GGUF --formats float32,bfloat16,int8 --profiles fp32

Machines here are noisy (memory bandwidth drifts by 2x between sittings), so every number is printed
beside a baseline measured in the same run: transformers in the same dtype (bfloat16 for int8/int4),
this machine's read bandwidth, and llama.cpp on the same weights when `llama-cpp-python` is installed.
Prefill is the time to the first token of a long prompt (its logits only, as generation needs);
decode, the tokens/s of the steps after it. Peak RSS of each load is measured in a fresh process.
"""

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from lmstack import CausalLM, kernels, models
from lmstack.convert import convert
from lmstack.formats import PROFILES_OF
from lmstack.gguf import is_gguf

HF_DTYPE = {"fp32": torch.float32, "bf16": torch.bfloat16}  # transformers' baseline: the profile's arithmetic
LLAMA_CPP_TYPES = ("BF16", "Q8_0", "Q4_0")
SILENT = None  # llama.cpp's log callback, made on first use (its per-tensor log would fill the screen)


def median_time(fn, repeats):
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def read_bandwidth(repeats=7, nbytes=1 << 30) -> float:
    """GB/s of a streaming read: the fastest of several reductions over a buffer far larger than the caches."""
    buffer = torch.ones(nbytes // 4)
    best = float("inf")
    for reduce in (buffer.sum, buffer.amax, buffer.sum, buffer.amax):
        reduce()
        for _ in range(repeats):
            start = time.perf_counter()
            reduce()
            best = min(best, time.perf_counter() - start)
    return nbytes / best / 1e9


def bytes_per_token(lm: CausalLM) -> int:
    """Weight bytes one decode step reads: every block, the final norm and the head (the embedding
    lookup reads one row)."""
    def size(module):
        plain = sum(t.numel() * t.element_size() for t in vars(module).values() if isinstance(t, torch.Tensor))
        return plain + sum(p.numel() * p.element_size() for p in module.parameters(recurse=False))

    modules = [*lm.blocks.modules(), lm.norm, lm.head_projection]
    return sum(size(m) for m in modules)


def lmstack_speeds(lm, prompt, long_prompt, new_tokens, repeats):
    def decode():
        stream = lm.stream(prompt, new_tokens)
        next(stream)  # the prefill and the first token
        start = time.perf_counter()
        for _ in stream:
            pass
        return (new_tokens - 1) / (time.perf_counter() - start)

    decode()  # warm up
    decode_rate = statistics.median(decode() for _ in range(repeats))
    prefill_rate = long_prompt.shape[1] / median_time(lambda: next(lm.stream(long_prompt, 1)), repeats)
    return prefill_rate, decode_rate


def transformers_speeds(path, dtype, prompt, long_prompt, new_tokens, repeats):
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    hf.generation_config.eos_token_id = None
    options = dict(do_sample=False, pad_token_id=0, attention_mask=torch.ones_like(prompt))
    with torch.no_grad():
        hf.generate(prompt, max_new_tokens=4, **options)
        first = median_time(lambda: hf.generate(prompt, max_new_tokens=1, **options), repeats)
        full = median_time(lambda: hf.generate(prompt, max_new_tokens=new_tokens, **options), repeats)
        prefill = median_time(lambda: hf.generate(long_prompt, max_new_tokens=1, do_sample=False, pad_token_id=0,
                                                  attention_mask=torch.ones_like(long_prompt)), repeats)
    return long_prompt.shape[1] / prefill, (new_tokens - 1) / (full - first)


def silence_llama_cpp():
    global SILENT
    import llama_cpp

    SILENT = llama_cpp.llama_log_callback(lambda level, text, data: None)
    llama_cpp.llama_log_set(SILENT, None)


def llama_cpp_speeds(gguf_path, prompt, long_prompt, new_tokens, repeats, threads):
    from llama_cpp import Llama

    llm = Llama(model_path=str(gguf_path), n_threads=threads, n_threads_batch=threads,
                n_ctx=long_prompt.shape[1] + 64, n_batch=long_prompt.shape[1], verbose=False)

    def decode():
        llm.reset()
        llm.eval(prompt[0].tolist())
        start = time.perf_counter()
        for _ in range(new_tokens - 1):
            llm.eval([int(prompt[0, -1])])  # the step's cost does not depend on the token
        return (new_tokens - 1) / (time.perf_counter() - start)

    decode()
    decode_rate = statistics.median(decode() for _ in range(repeats))

    def prefill():
        llm.reset()
        llm.eval(long_prompt[0].tolist())

    prefill_rate = long_prompt.shape[1] / median_time(prefill, repeats)
    return prefill_rate, decode_rate


def quantized_ggufs(source: Path, workdir: Path) -> dict:
    """The same weights in llama.cpp's BF16, Q8_0 and Q4_0 (requantized from the source GGUF)."""
    import llama_cpp

    out = {}
    for name in LLAMA_CPP_TYPES:
        target = workdir / f"model-{name}.gguf"
        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{name}")
        params.allow_requantize = True
        params.nthread = 2
        if llama_cpp.llama_model_quantize(str(source).encode(), str(target).encode(), params) == 0:
            out[name] = target
    return out


def load_peak(path, weight_format, profile) -> dict:
    """Load in a fresh process: the peak of resident memory (VmHWM) over the resident memory before the
    load, once the format's kernels (and so their libraries) have run on a toy matrix."""
    code = f"""
import json, time, torch
from lmstack import CausalLM
from lmstack.formats import convert, resolve
torch.set_num_threads(2)
def status(key): return int(open('/proc/self/status').read().split(key + ':')[1].split()[0]) * 1024
dtype = resolve({weight_format!r}, {profile!r})
convert(torch.nn.Linear(64, 64).to(dtype), {weight_format!r}, dtype)(torch.ones(2, 64, dtype=dtype))
before = status('VmRSS')
start = time.perf_counter()
lm = CausalLM.load({str(path)!r}, weight_format={weight_format!r}, numeric_profile={profile!r}, device='cpu')
print(json.dumps(dict(seconds=time.perf_counter() - start, peak=status('VmHWM') - before)))
"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return json.loads(result.stdout.strip().splitlines()[-1])


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="checkpoint directory, GGUF file or name (default: smollm2)")
    parser.add_argument("--formats", default="float32,bfloat16,int8,int4")
    parser.add_argument("--profiles", default="fp32,bf16", help="numeric profiles, each with every format it takes")
    parser.add_argument("--prompt-tokens", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--prefill-tokens", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--no-transformers", action="store_true")
    parser.add_argument("--no-llama-cpp", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)

    source = models.resolve(args.model)
    workdir = Path(tempfile.mkdtemp(prefix="lmstack-bench-"))
    checkpoint = source
    if is_gguf(source):
        checkpoint = workdir / "hf"
        convert(source, checkpoint)
    first = CausalLM.load(checkpoint, device="cpu")
    vocab = first.vocab_size
    del first
    prompt = torch.randint(0, vocab, (1, args.prompt_tokens))
    long_prompt = torch.randint(0, vocab, (1, args.prefill_tokens))
    bandwidth = read_bandwidth()
    print(f"model: {source}\nthreads: {args.threads}; prompt {args.prompt_tokens} tokens, {args.new_tokens} new "
          f"tokens; prefill {args.prefill_tokens} tokens; median of {args.repeats}\n"
          f"lmstack's CPU kernels: {'on' if kernels.available() else 'off (PyTorch operators)'}\n"
          f"read bandwidth: {bandwidth:.1f} GB/s\n")

    rows, baselines = [], {}
    runs = [(f, p) for p in args.profiles.split(",") for f in args.formats.split(",") if p in PROFILES_OF[f]]
    for weight_format, profile in runs:
        lm = CausalLM.load(checkpoint, weight_format=weight_format, numeric_profile=profile, device="cpu")
        prefill, decode = lmstack_speeds(lm, prompt, long_prompt, args.new_tokens, args.repeats)
        weight_bytes = bytes_per_token(lm)
        model_bytes = weight_bytes + lm.embed.numel() * lm.embed.element_size()
        del lm
        dtype = HF_DTYPE[profile]
        if not args.no_transformers and dtype not in baselines:
            baselines[dtype] = transformers_speeds(checkpoint, dtype, prompt, long_prompt, args.new_tokens,
                                                   args.repeats)
        hf_prefill, hf_decode = baselines.get(dtype, (float("nan"), float("nan")))
        bound = bandwidth * 1e9 / weight_bytes
        load = load_peak(checkpoint, weight_format, profile)
        rows.append((f"{weight_format}/{profile}", prefill, prefill / hf_prefill, decode, decode / hf_decode,
                     weight_bytes / 1e6, decode / bound, load["peak"] / model_bytes, load["seconds"]))
        print(f"  measured {weight_format}/{profile}", file=sys.stderr)

    print(f"{'format':<13} {'prefill/s':>9} {'vs HF':>6} {'decode/s':>9} {'vs HF':>6} {'MB/token':>9} "
          f"{'of bound':>8} {'load peak':>9} {'load s':>6}")
    for fmt, prefill, prefill_ratio, decode, decode_ratio, mb, fraction, peak, seconds in rows:
        print(f"{fmt:<13} {prefill:9.0f} {prefill_ratio:5.2f}x {decode:9.1f} {decode_ratio:5.2f}x {mb:9.0f} "
              f"{fraction:7.0%} {peak:8.2f}x {seconds:6.2f}")
    for dtype, (prefill, decode) in baselines.items():
        print(f"transformers {str(dtype).removeprefix('torch.')}: prefill {prefill:.0f}/s, decode {decode:.1f}/s")
    print("(vs HF: against transformers in the profile's dtype; of bound: decode speed over "
          "read bandwidth / weight bytes per token; load peak: peak RSS of the load over the weight bytes)")

    if args.no_llama_cpp or not is_gguf(source):
        return
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        print("llama.cpp: not measured (pip install llama-cpp-python)")
        return
    silence_llama_cpp()
    print("\nllama.cpp on the same weights (requantized from the source GGUF):")
    bf16_decode = baselines.get(torch.bfloat16, (None, None))[1]
    for name, gguf_path in {"source": source, **quantized_ggufs(source, workdir)}.items():
        prefill, decode = llama_cpp_speeds(gguf_path, prompt, long_prompt, args.new_tokens, args.repeats,
                                           args.threads)
        ratio = f" ({decode / bf16_decode:.2f}x transformers bfloat16)" if bf16_decode else ""
        print(f"  {name:<6} prefill {prefill:6.0f}/s  decode {decode:6.1f}/s{ratio}")


if __name__ == "__main__":
    sys.exit(main())
