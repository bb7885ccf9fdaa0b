"""lmstack against llama.cpp on the same GGUF file per type: decode, prefill, contention, long contexts, bandwidth.

    python bench/decode.py                  # the table (BF16, Q8_0, Q4_0 files of the default model)
    python bench/decode.py --quick          # fewer tokens, one shorter long context: a couple of minutes
    python bench/decode.py --rows BF16=bfloat16,Q8_0=int8,Q8_0=gguf,Q4_0=int4 --transformers
    python bench/decode.py --model smollm2-1.7b-random --rows BF16=bfloat16,Q8_0=gguf,Q4_0=gguf,Q4_K_M=gguf \
        --contexts "" --no-lookup --cold-start     # the SmolLM2-1.7B-shaped model, where decode is bandwidth-bound

The files (BF16, Q8_0, Q4_0, Q4_K_M, Q5_K_M, Q6_K) are made once by bench/ggufs.py under --cache: SmolLM2-135M
requantized from an F32 source, or the SmolLM2-1.7B-shaped random model, by llama.cpp's quantizer (see there).
A row FILE=FORMAT runs lmstack on that file with that weight format (numeric profile bf16) beside llama.cpp on
the same file. Each engine runs in its own worker process, loaded once per row, and the measurements alternate
between them (A B, B A, ...); every figure is the median of --repeats. Decode is batch 1, the tokens/s of the
greedy steps after the first token; prefill the tokens/s of a prompt's forward. Machines here are shared and
noisy: only the ratios of one run mean anything, and the load average is printed with them.

llama.cpp is llama-cpp-python (which pins its own llama.cpp) and, with `--llama-bench PATH` (or `llama-bench` on
PATH), the decode tok/s of llama.cpp's own `llama-bench` on the same file, the newest llama.cpp, built for this
CPU (bench/README.md says how): a third engine in the decode turns (A B C, C B A, ...), each turn one run of its
tg test, so that the VM's phases fall on it as on the others.

The contention rows decode beside one CPU-bound process at nice 0 (a competitor) and at nice 19 (a batch job,
which lmstack/threads.py does not count), as a share of the quiet decode. The second table gives each decode as a
share of the machine's read bandwidth (the file's tensor bytes read per token x tokens/s / the GB/s of
bench/bandwidth.py's plain read on --threads threads, read right before and right after every decode (each
engine's turn, llama-bench's run): each decode's share is against the better of the two readings beside it, and
an engine's share is the median of its decodes' (this VM's read moves by 2x within a minute, in phases of
seconds, so one reading before and one after a whole run say little about a row in between); an
untied embedding counts one row, i.e. nothing; of a mixture's stacked experts, the share a token chooses, beside
what a dense model of the file's size reads), beside each engine's peak RSS (VmHWM of its worker after decode and
prefill; llama-bench's read while it runs). For lmstack's requantized formats (int8, int4) the bytes are the
file's, so the share is an effective one. `--turns` shows each decode turn as it comes: its tok/s, the reads
beside it and its share.
`--cold-start` adds the seconds from starting `lmstack generate` to its first token (and to its exit), beside
llama.cpp's `llama-completion`; `--cold-start-only` measures that alone. `--scaling` adds, per row, lmstack's decode on --threads threads as a multiple of its decode on
one (a second worker, the two alternating), beside llama-bench's at the same counts, and the plain read on one thread: the
bound of that multiple where decode is bandwidth-bound.
"""

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import ggufs
from bandwidth import read_bandwidth
from workers import Worker, serve

DEFAULT_ROWS = "BF16=bfloat16,Q8_0=int8,Q4_0=int4"
RSS_POLL = 0.05  # seconds between readings of llama-bench's peak RSS (VmHWM only grows; its last reading counts)
LONG_DECODE = 32  # tokens decoded after each long context
CHUNK = 512  # prefill chunk of the long contexts (llama.cpp's default batch)


# ---- the engines, each in its own worker process ---------------------------------------------------------

class Engine:
    def peak_rss(self) -> float:
        """MB: the worker process's peak resident set so far."""
        return high_water_mark()


class Lmstack(Engine):
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


class LlamaCpp(Engine):
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


def llama_bench(binary: str, path: Path, threads: int, tokens: int) -> tuple[float, float]:
    """(decode tok/s, peak RSS MB) of one run of llama.cpp's llama-bench on the file (its tg test: `tokens` tokens
    after an empty prompt)."""
    command = [binary, "-m", str(path), "-t", str(threads), "-p", "0", "-n", str(tokens), "-r", "1", "-o", "json"]
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        process = subprocess.Popen(command, stdout=out, stderr=err, text=True)
        peak = 0.0
        while process.poll() is None:  # wait4's ru_maxrss would be this process's: a child inherits it at fork
            peak = max(peak, high_water_mark(process.pid) or 0.0)
            time.sleep(RSS_POLL)
        out.seek(0)
        err.seek(0)
        if process.returncode != 0:
            raise RuntimeError(f"llama-bench exited with {process.returncode}: {err.read()[-500:]}")
        return json.loads(out.read())[0]["avg_ts"], peak


class LlamaBench:
    """llama-bench as an engine that takes its turns in `alternating`: each decode one run of its tg test."""

    def __init__(self, binary: str, path: Path, threads: int):
        self.binary, self.path, self.threads = binary, path, threads
        self.peak_rss = 0.0  # MB, over its runs

    def __call__(self, op, prompt, tokens) -> float:
        assert op == "decode", op
        rate, peak = llama_bench(self.binary, self.path, self.threads, tokens)
        self.peak_rss = max(self.peak_rss, peak)
        return rate


def high_water_mark(pid="self") -> float | None:
    """MB: a process's peak resident set so far (VmHWM), None once it has exited."""
    try:
        with open(f"/proc/{pid}/status") as f:
            return next((int(line.split()[1]) / 1024 for line in f if line.startswith("VmHWM:")), None)
    except OSError:
        return None


class Transformers(Engine):
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


def alternating(workers: dict, op, repeats, after=None, **arguments) -> dict:
    """The median of each worker's answers, the workers taking turns (A B, B A, ...) so drift hits all alike;
    after(name, answer) called once each answer is in (decode: a plain read beside it, Bandwidth.note)."""
    answers = {name: [] for name in workers}
    for i in range(repeats):
        for name in (list(workers) if i % 2 == 0 else list(workers)[::-1]):
            answers[name].append(workers[name](op, **arguments))
            if after:
                after(name, answers[name][-1])
    return {name: statistics.median(values) for name, values in answers.items()}


class Bandwidth:
    """Plain reads (bench/bandwidth.py) beside a row's decodes: note(engine, rate) reads again, and the decode's
    share is of the better of that reading and the one before it (the first taken at construction); share(engine)
    is the median of the engine's. --bandwidth: a fixed GB/s instead; --turns: each turn shown on stderr."""

    def __init__(self, bytes_per_token: int, threads: int, fixed: float | None, show_turns: bool):
        self.bytes_per_token, self.threads, self.fixed, self.show_turns = bytes_per_token, threads, fixed, show_turns
        self.readings = [fixed or read_bandwidth(threads)]
        self.shares = {}

    def note(self, engine: str, rate: float):
        self.readings.append(self.fixed or read_bandwidth(self.threads))
        share = self.bytes_per_token * rate / (max(self.readings[-2:]) * 1e9)
        self.shares.setdefault(engine, []).append(share)
        if self.show_turns:
            before, after = self.readings[-2:]
            print(f"    {engine}: {rate:.1f} tok/s between reads of {before:.1f} and {after:.1f} GB/s: {share:.0%}",
                  file=sys.stderr)

    def share(self, engine: str) -> float | None:
        return statistics.median(self.shares[engine]) if engine in self.shares else None


# ---- the tables ------------------------------------------------------------------------------------------

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
            if v is None:
                return "-"
            return f"{v:.0%}" if self.unit == "%" else f"{v:.2f}x" if self.unit == "x" else \
                f"{v:.1f}" if v < 100 else f"{v:.0f}"

        def ratio(v):
            return "-" if not v else f"{self.lmstack / v:.2f}x"
        return [self.name, fmt(self.lmstack), fmt(self.llama_cpp), ratio(self.llama_cpp), fmt(self.transformers),
                fmt(self.llama_bench), ratio(self.llama_bench)]


def table(rows) -> str:
    lines = ["| measure | lmstack | llama.cpp | lmstack / llama.cpp | transformers bf16 | llama-bench | "
             "lmstack / llama-bench |", "|---|--:|--:|--:|--:|--:|--:|"]
    return "\n".join(lines + ["| " + " | ".join(row.cells()) + " |" for row in rows])


@dataclass
class Memory:
    """One decode row's bandwidth and memory: decode tok/s and peak RSS (MB) per engine, None if not run."""
    name: str
    bytes_per_token: int
    dense_bytes: int  # what a dense model of the file's total size reads a token (a mixture reads its chosen experts)
    share: dict  # of the bandwidth read beside each decode, per engine (Bandwidth)
    rss: dict
    readings: list  # GB/s

    def cells(self):
        def share(engine):
            return "-" if self.share.get(engine) is None else f"{self.share[engine]:.0%}"

        def mb(engine):
            return "-" if self.rss.get(engine) is None else f"{self.rss[engine]:.0f}"
        engines = ("lmstack", "llama.cpp", "llama-bench")
        readings = f"{min(self.readings):.0f}-{max(self.readings):.0f}"
        return [self.name, f"{self.bytes_per_token / 1e6:.0f}", f"{self.dense_bytes / 1e6:.0f}", readings,
                *map(share, engines), *map(mb, engines)]


def memory_table(records) -> str:
    lines = ["| decode | MB read a token | a dense model of its size | plain reads GB/s | lmstack's share "
             "of bandwidth | llama.cpp's | llama-bench's | lmstack peak RSS MB | llama.cpp's | llama-bench's |",
             "|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|"]
    return "\n".join(lines + ["| " + " | ".join(r.cells()) + " |" for r in records])


def prompt_lookup_rows(files, args) -> list:
    """The prompt-lookup row: bench/lookup.py's rows(files, args), where that file exists."""
    try:
        import lookup
    except ModuleNotFoundError:
        return []
    return lookup.rows(files, args)


def busy(niceness=0):
    """One CPU-bound process at the given niceness (ended by the caller)."""
    return subprocess.Popen(["nice", "-n", str(niceness), sys.executable, "-c", "while True: pass"])


def contention_rows(workers, quiet: Row, args, prompt, row) -> list:
    """Decode beside one busy process, at nice 0 (a competitor) and at nice 19 (a batch job the scheduler puts
    behind lmstack), each as a share of the quiet decode."""
    rows = []
    for niceness in (0, 19):
        competitor = busy(niceness)
        try:
            crowded = alternating(workers, "decode", args.repeats, prompt=prompt, tokens=args.new_tokens)
        finally:
            competitor.kill()
            competitor.wait()
        rows.append(row(f"decode beside 1 busy process at nice {niceness}, % of quiet",
                        {"lmstack": crowded["lmstack"] / quiet.lmstack,
                         **({"llama.cpp": crowded["llama.cpp"] / quiet.llama_cpp} if args.llama_cpp else {})},
                        unit="%"))
    return rows


def scaling_row(workers, args, prompt, path, weight_format) -> Row:
    """lmstack's decode on --threads threads as a multiple of its decode on one, each in its own worker (one
    process switching its OpenMP team between the counts slowed its own decode), the two alternating; beside
    llama-bench's at the same counts, its runs at the two counts alternating as well."""
    one = Worker(__file__, "lmstack", weight_format=weight_format, path=path, threads=1, warmup=prompt[:8])
    try:
        rates = alternating({1: one, args.threads: workers["lmstack"]}, "decode", args.repeats, prompt=prompt,
                            tokens=args.new_tokens)
    finally:
        one.close()
    peer = None
    if args.llama_bench:
        bench = alternating({n: LlamaBench(args.llama_bench, path, n) for n in (1, args.threads)}, "decode",
                            args.repeats, prompt=prompt, tokens=args.new_tokens)
        peer = bench[args.threads] / bench[1]
    return Row(f"decode on {args.threads} threads, x 1 thread's (lmstack {rates[1]:.1f} and "
               f"{rates[args.threads]:.1f} tok/s)", rates[args.threads] / rates[1], None, unit="x", llama_bench=peer)


def measure_row(file_type, path, weight_format, args, prompt, long_prompt, contexts, hf_dir) -> tuple:
    """(the rows of one file and lmstack format, its Memory record); contexts: random ids of each long context to
    decode after."""
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
        bandwidth = Bandwidth(ggufs.bytes_per_token(path), args.threads, args.bandwidth, args.turns)
        decoders = dict(workers)
        if args.llama_bench:
            decoders["llama-bench"] = LlamaBench(args.llama_bench, path, args.threads)
        decode = alternating(decoders, "decode", args.repeats, after=bandwidth.note, prompt=prompt,
                             tokens=args.new_tokens)
        rows = [row("decode, tok/s", decode)]
        memory = Memory(label, bandwidth.bytes_per_token, ggufs.bytes_per_token(path, dense=True), {}, {},
                        bandwidth.readings)
        if args.llama_bench:
            rows[0].llama_bench, memory.rss["llama-bench"] = decode["llama-bench"], decoders["llama-bench"].peak_rss
        memory.share = {name: bandwidth.share(name) for name in ("lmstack", "llama.cpp", "llama-bench")}
        rows += [row(f"prefill {len(long_prompt)}, tok/s", alternating(workers, "prefill", args.repeats,
                                                                       prompt=long_prompt))]
        memory.rss.update({name: workers[name]("peak_rss") for name in ("lmstack", "llama.cpp") if name in workers})
        if hf_dir:
            workers.pop("transformers").close()
        if args.contention == file_type:
            rows += contention_rows(workers, rows[0], args, prompt, row)
        if args.scaling:
            scaling = scaling_row(workers, args, prompt, path, weight_format)
            scaling.name = f"{label} {scaling.name}"
            rows.append(scaling)
        for context in contexts:
            fill = {name: worker("fill", context=context) for name, worker in workers.items()}
            rows.append(row(f"decode {LONG_DECODE} after {len(context)}, tok/s",
                            alternating(workers, "decode_after", args.repeats, tokens=LONG_DECODE)))
            rows.append(row(f"prefill {len(context)}, tok/s", fill))
        return rows, memory
    finally:
        for worker in workers.values():
            worker.close()


# ---- cold start ------------------------------------------------------------------------------------------

def seconds_to_first_token(command: list, env=None) -> tuple:
    """(seconds to the first byte on the command's stdout, seconds to its exit): each command prints only what it
    generates, flushed as it comes, so the first byte is its first token's text."""
    with tempfile.TemporaryFile() as errors:
        start = time.perf_counter()
        process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=errors, env=env)
        first = None
        while chunk := os.read(process.stdout.fileno(), 1 << 16):
            first = first or time.perf_counter()
        process.wait()
        done = time.perf_counter()
        process.stdout.close()
        if process.returncode != 0 or first is None:
            errors.seek(0)
            raise RuntimeError(f"{command[0]} exited with {process.returncode}"
                               f"{'' if first else ', printing nothing'}: {errors.read()[-500:].decode(errors='replace')}")
    return first - start, done - start


def cold_start(path: Path, args) -> dict:
    """{engine: (seconds to the first token, seconds to exit)} from starting a process that loads the file, reads a
    short prompt and prints one greedy token: `lmstack generate` as the CLI runs a GGUF (weight format gguf), in
    llama.cpp's arithmetic (numeric profile bf16) and in the default fp32 (each weight dequantized exactly), and
    llama.cpp's `llama-completion` (--llama-completion) printing only what it generates, without its warm-up run
    (a forward pass before the prompt's, on by default: off, llama.cpp's first token comes sooner). Each runs once
    unmeasured first (lmstack's kernels compiled and cached, the file in the page cache), then they take turns;
    the median of --repeats."""
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(Path(__file__).parents[1] / "src"), env.get("PYTHONPATH")]))
    env.pop("PYTHONDONTWRITEBYTECODE", None)  # lmstack's modules compiled once, as an installed package's are
    prompt = "The capital of France is"
    lmstack = [sys.executable, "-m", "lmstack", "generate", "--model", str(path), "-n", "1", "-q", prompt]
    commands = {"lmstack": lmstack + ["--numeric-profile", "bf16"], "lmstack fp32": lmstack}
    if args.llama_completion:
        commands["llama.cpp"] = [args.llama_completion, "-m", str(path), "-p", prompt, "-n", "1", "-t",
                                 str(args.threads), "-no-cnv", "--temp", "0", "--no-display-prompt", "--no-warmup"]
    for command in commands.values():
        seconds_to_first_token(command, env)
    times = {name: [] for name in commands}
    for i in range(args.repeats):
        for name in (list(commands) if i % 2 == 0 else list(commands)[::-1]):
            times[name].append(seconds_to_first_token(commands[name], env))
    return {name: tuple(statistics.median(t[j] for t in values) for j in range(2)) for name, values in times.items()}


def cold_start_table(results: dict) -> str:
    lines = ["| file | first token, s: lmstack (bf16) | lmstack (fp32, the default) | llama.cpp (llama-completion) "
             "| lmstack (bf16) / llama.cpp | exit, s: lmstack (bf16) | llama.cpp |",
             "|---|--:|--:|--:|--:|--:|--:|"]
    for name, seconds in results.items():
        (first, done), peer = seconds["lmstack"], seconds.get("llama.cpp")
        cells = [f"{first:.2f}", f"{seconds['lmstack fp32'][0]:.2f}", "-", "-", f"{done:.2f}", "-"]
        if peer is not None:
            cells[2:4], cells[5] = [f"{peer[0]:.2f}", f"{first / peer[0]:.2f}x"], f"{peer[1]:.2f}"
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None,
                        help=f"source GGUF file or name (default: the built-in smollm2), or one of "
                        f"{', '.join(ggufs.RANDOM)}")
    parser.add_argument("--rows", default=DEFAULT_ROWS, help="FILE=lmstack weight format, comma-separated")
    parser.add_argument("--cache", type=Path, default=ggufs.CACHE, help="where the files are made and kept")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prompt-tokens", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--prefill-tokens", type=int, default=512)
    parser.add_argument("--contexts", default="4096,8000", help="long contexts (tokens), comma-separated")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--contention", default="BF16", help="file of the contention rows ('' for none)")
    parser.add_argument("--long-context", default="BF16", help="file of the long-context rows ('' for none)")
    parser.add_argument("--no-lookup", action="store_true", help="no prompt-lookup rows")
    parser.add_argument("--transformers", action="store_true", help="transformers bf16 beside the BF16 row (slow)")
    parser.add_argument("--llama-bench", default=shutil.which("llama-bench"),
                        help="llama.cpp's llama-bench binary: its decode tok/s as a column")
    parser.add_argument("--llama-quantize", default=shutil.which("llama-quantize"),
                        help="llama.cpp's llama-quantize binary, to make the files (else llama-cpp-python's)")
    parser.add_argument("--llama-completion", default=shutil.which("llama-completion"),
                        help="llama.cpp's llama-completion binary, for --cold-start")
    parser.add_argument("--cold-start", action="store_true", help="seconds to the first token, per file")
    parser.add_argument("--cold-start-only", action="store_true", help="--cold-start, and no decode rows")
    parser.add_argument("--scaling", action="store_true",
                        help="decode on --threads threads as a multiple of 1 thread's, per row, and the plain read's")
    parser.add_argument("--bandwidth", type=float, help="GB/s of a plain read (default: bench/bandwidth.py's)")
    parser.add_argument("--turns", action="store_true",
                        help="each decode turn on stderr: its tok/s, the reads beside it and its share")
    parser.add_argument("--quick", action="store_true",
                        help="16 new tokens, 128-token prefill, one 1024 context, unless given")
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
    if args.scaling and args.threads < 2:
        parser.error("--scaling compares --threads threads with one: give --threads 2 or more")
    if args.quick:  # shorter defaults; what is given stays
        for name, value in dict(new_tokens=16, prefill_tokens=128, contexts="1024").items():
            if getattr(args, name) == parser.get_default(name):
                setattr(args, name, value)

    from lmstack.config import plan_for
    from lmstack.gguf import GGUFFile

    rows_spec = [item.split("=") for item in args.rows.split(",")]
    for item in rows_spec:
        if len(item) != 2 or item[0] not in ggufs.TYPES:
            parser.error(f"--rows: {'='.join(item)!r} is not FILE=FORMAT with FILE one of {', '.join(ggufs.TYPES)}")
    needed = list(dict.fromkeys([t for t, _ in rows_spec] + ([] if args.no_lookup else ["BF16"])))
    files = ggufs.bench_files(args.model, needed, args.cache, args.llama_quantize)
    with GGUFFile(files[rows_spec[0][0]]) as f:
        vocab = plan_for(f.config).vocab_size
    generator = random.Random(0)
    lengths = [args.prompt_tokens, args.prefill_tokens, *(int(c) for c in args.contexts.split(",") if c)]
    prompt, long_prompt, *contexts = [[generator.randrange(vocab) for _ in range(n)] for n in lengths]
    hf_dir = None
    if args.transformers and "BF16" in files:
        hf_dir = ggufs.hf_checkpoint(files["BF16"])

    load_before = os.getloadavg()
    bandwidth_one = read_bandwidth(1) if args.scaling else None
    rows, records, cold = [], [], {}
    args.cold_start |= args.cold_start_only
    for file_type, weight_format in [] if args.cold_start_only else rows_spec:
        measured, record = measure_row(file_type, files[file_type], weight_format, args, prompt, long_prompt,
                                       contexts, hf_dir if file_type == "BF16" else None)
        rows += measured
        records.append(record)
        print(f"  measured {file_type}={weight_format}", file=sys.stderr)
    if not args.no_lookup and not args.cold_start_only:
        rows += prompt_lookup_rows(files, args)
    if args.cold_start:
        cold = {f"{file_type} ({files[file_type].name})": cold_start(files[file_type], args)
                for file_type in dict.fromkeys(t for t, _ in rows_spec)}
    print(f"model: {args.model or 'smollm2'}; files: {files[rows_spec[0][0]].parent}\n{args.threads} threads, batch 1, "
          f"{args.prompt_tokens}-token prompt, {args.new_tokens} new tokens; median of {args.repeats}, engines "
          f"alternating, each in its own process\nllama-bench: {args.llama_bench or 'not measured'}\n"
          f"plain {args.threads}-thread read: per row, in the second table"
          f"{f'; 1-thread read: {bandwidth_one:.1f} GB/s' if bandwidth_one else ''}\n"
          f"load average (1 min) before {load_before[0]:.2f}, after {os.getloadavg()[0]:.2f}\n")
    if rows:
        print(table(rows))
        print()
        print(memory_table(records))
    if cold:
        print()
        print(cold_start_table(cold))


if __name__ == "__main__":
    sys.exit(main())
