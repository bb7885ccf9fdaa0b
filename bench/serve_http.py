"""`lmstack serve` over HTTP against llama.cpp's `llama-server` on the same weights, in one run.

Each level runs N concurrent clients, each streaming `--requests` completions of exactly `--tokens` tokens (greedy,
`ignore_eos`, a short prompt each, none that an earlier level or warm-up sent: a prompt cache would answer it at once)
back to back, after a warm-up of one request per client of the largest level on each server, on prompts of its own
(the KV memory that level needs is then touched: llama-server clears its whole cache at start, lmstack's pool takes
pages as it first needs them, a fault each on a fresh page); it reports the aggregate completion tokens/s over the
level's wall time and the p50/p95 of a request's latency (sent to last token) and of its time to first token, and the
server process's CPU time per completion token (user + system, all its threads; with `--threads 1` it stays meaningful
on a loaded machine, where wall times are not and where llama.cpp's spinning threads make its 2-thread CPU time
balloon). The servers take turns level by level (the first to go alternates), so each ratio compares runs seconds
apart on the same machine. The "newcomer" row is the time to first token of a short request sent while 15 other
streams run (`--probes` of them, one after another). `--engine` adds the same requests on lmstack's Engine in this
process, without HTTP. `--constrained` adds two lmstack rows of chat requests with the same prompts, one plain and one
with a `json_schema` response_format (a long string field, so every request still makes `--tokens` tokens):
constrained decoding's cost at each level is their tokens/s ratio. Greedy, those masks are lazy (a mask only where the
unmasked choice is refused); `--logprobs` makes both chat rows ask for logprobs, which needs every step's mask
(decoding.py), so the ratio is that path's.

llama-server (`--llama-server PATH`, or `llama-server` on PATH) gets the model's weights in BF16
(bench/ggufs.py's cached file), `--threads` threads and one slot per client of the largest level; lmstack as many
running slots for long requests, and besides them the eighth it keeps for short ones (`--short-slots`). With
`--file-type T` both servers run bench/ggufs.py's file of that type (BF16, Q8_0, Q4_0, Q4_K_M, ...; lmstack in
--weight-format), e.g. the SmolLM2-1.7B-shaped random model in Q4_0:

    python bench/serve_http.py --llama-server /work/peers/llama.cpp-build/bin/llama-server
    python bench/serve_http.py --model smollm2-1.7b-random --file-type Q4_0 --weight-format gguf \
        --llama-server /work/peers/llama.cpp-build/bin/llama-server
"""

import argparse
import http.client
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from functools import partial
from pathlib import Path

TOPICS = ["a lighthouse keeper", "a lost robot", "the first city on Mars", "a dragon who bakes bread",
          "two rival chess players", "a river that flows uphill", "a forgotten library", "a storm at sea",
          "a talking cat", "an old clockmaker", "the last train home", "a garden on the moon",
          "a detective in Venice", "a mountain village", "a space station cook", "a haunted piano"]
OPENINGS = ["Once upon a time, there was", "Long ago there lived", "In a faraway land lived", "This is the story of",
            "Everyone in town knew", "The old book tells of", "At the edge of the map lived",
            "Sailors still talk about", "My grandmother once met", "The newspaper wrote about"]


def prompt(n: int) -> str:
    """The n-th of 160 prompts: every topic after one opening, then after the next, so that the levels' requests
    do not repeat one (a prompt cache would answer it at once) until 160 have gone; the warm-up counts back from the
    last (negative n)."""
    return f"{OPENINGS[n // len(TOPICS) % len(OPENINGS)]} {TOPICS[n % len(TOPICS)]} who"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(port: int, process: subprocess.Popen, what: str, timeout=600):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{what} exited with {process.returncode}")
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
            conn.request("GET", "/health")
            if conn.getresponse().status == 200:
                return
        except OSError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{what} did not become healthy in {timeout} s")


STORY_SCHEMA = {"type": "object", "properties": {"story": {"type": "string", "minLength": 2000}},
                "required": ["story"], "additionalProperties": False}


def stream_one(port: int, model: str, prompt: str, tokens: int, chat: str | None = None, logprobs=False) -> dict:
    """One streamed completion: {latency, ttft, tokens}; chat "plain" or "schema": a chat request instead, the
    prompt as its user message, with STORY_SCHEMA as its response_format for "schema" (and logprobs if asked)."""
    request = {"model": model, "max_tokens": tokens, "temperature": 0, "stream": True, "ignore_eos": True,
               "stream_options": {"include_usage": True}}
    if chat is None:
        route, request["prompt"] = "/v1/completions", prompt
    else:
        route, request["messages"] = "/v1/chat/completions", [{"role": "user", "content": prompt}]
        if logprobs:
            request["logprobs"] = True
        if chat == "schema":
            request["response_format"] = {"type": "json_schema", "json_schema": {"name": "story",
                                                                                  "schema": STORY_SCHEMA}}
    body = json.dumps(request)
    start = time.perf_counter()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
    conn.request("POST", route, body, {"Content-Type": "application/json"})
    response = conn.getresponse()
    if response.status != 200:
        raise RuntimeError(f"HTTP {response.status}: {response.read()[:300]!r}")
    first, made, chunks = None, None, 0
    for line in response:
        if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
            continue
        chunk = json.loads(line[6:])
        if "error" in chunk:
            raise RuntimeError(chunk["error"])
        if any(c.get("text") or c.get("delta", {}).get("content") for c in chunk.get("choices", ())):
            chunks += 1
            first = first or time.perf_counter()
        if chunk.get("usage"):
            made = chunk["usage"]["completion_tokens"]
        elif chunk.get("timings"):
            made = chunk["timings"].get("predicted_n", made)
    end = time.perf_counter()
    conn.close()
    return dict(latency=end - start, ttft=(first or end) - start, tokens=made if made is not None else chunks)


def engine_one(engine, tokenizer, prompt: str, tokens: int) -> dict:
    """The same request on an Engine in this process: what HTTP costs is the difference."""
    start = time.perf_counter()
    handle = engine.add(tokenizer.encode(prompt), max_tokens=tokens, temperature=0, eos_ids=())
    for _ in handle.text_pieces():
        pass
    return dict(latency=time.perf_counter() - start, ttft=handle.time_to_first_token, tokens=handle.completion_tokens)


def cpu_seconds(pid: int | None) -> float:
    """User + system CPU time of process pid so far (0 for None)."""
    if pid is None:
        return 0.0
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def level(one, clients: int, requests: int, first: int, pid: int | None = None) -> dict:
    """`clients` threads, each making `requests` requests one after another with one(prompt), client i's k-th
    prompt(first + k * clients + i); pid: the server's process, whose CPU time per token is measured."""
    results, errors = [], []

    def client(i):
        try:
            for k in range(requests):
                results.append(one(prompt(first + k * clients + i)))
        except Exception as e:  # noqa: BLE001 -- reported below
            errors.append(e)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    start, cpu = time.perf_counter(), cpu_seconds(pid)
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall, cpu = time.perf_counter() - start, cpu_seconds(pid) - cpu
    if errors:
        raise errors[0]
    made = sum(r["tokens"] for r in results)
    return dict(rate=made / wall, latency=percentiles([r["latency"] for r in results]),
                ttft=percentiles([r["ttft"] for r in results]), tokens=statistics.mean(r["tokens"] for r in results),
                cpu_ms=1000 * cpu / made if pid is not None else None)


def newcomers(one, busy: int, probes: int) -> dict:
    """Time to first token of `probes` short requests, one after another, each sent while `busy` other
    streams run (they stream back to back until the probes are done)."""
    done, streaming, errors = threading.Event(), threading.Semaphore(0), []

    def background(i):
        try:
            k = 0
            while not done.is_set():
                one(f"Once upon a time, there was {TOPICS[(i + k) % len(TOPICS)]} who", started=streaming)
                k += 1
        except Exception as e:  # noqa: BLE001 -- reported below
            errors.append(e)
            streaming.release()

    threads = [threading.Thread(target=background, args=(i,)) for i in range(busy)]
    for t in threads:
        t.start()
    for _ in range(busy):  # every background stream has its first token
        streaming.acquire()
    ttfts = []
    for k in range(probes):
        if errors:
            break
        ttfts.append(one(f"Question {k}: what colour is the sky?", tokens=8)["ttft"])
    done.set()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return dict(ttft=percentiles(ttfts), worst=max(ttfts))


def percentiles(values):
    values = sorted(values)
    return tuple(values[min(len(values) - 1, round(q * (len(values) - 1)))] for q in (0.5, 0.95))


def signalling(one, prompt: str, tokens: int, started=None) -> dict:
    """one(prompt, tokens), releasing `started` once (when the request ends: its first token came long before)."""
    result = one(prompt, tokens=tokens)
    if started is not None:
        started.release()
    return result


def in_process_engine(args):
    """(Engine, Tokenizer) of the same model and settings as the server's, in this process."""
    import torch

    from lmstack import models
    from lmstack.engine import Engine

    torch.set_num_threads(args.threads)
    lm, tokenizer = models.load(args.model, weight_format=args.weight_format, numeric_profile=args.numeric_profile)
    slots, kept = running_slots(args)
    return Engine(lm, tokenizer, max_running=slots, short_slots=kept).start(), tokenizer


def running_slots(args) -> tuple:
    """(max_running, short_slots): a slot for every client of the largest level, as llama-server's, besides the
    slots lmstack keeps for short requests (the default share, an eighth)."""
    clients = max(args.clients)
    return clients + clients // 8, clients // 8


def start_lmstack(args, env) -> tuple:
    port = free_port()
    command = [sys.executable, "-m", "lmstack", "serve", "--model", args.model, "--port", str(port),
               "--weight-format", args.weight_format, "--numeric-profile", args.numeric_profile,
               *(f"--{name}={value}" for name, value in zip(("max-running", "short-slots"), running_slots(args)))]
    process = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_healthy(port, process, "lmstack serve")
    return process, port


def bench_file(model: str, file_type: str) -> Path:
    """The model's GGUF in the type, made once by bench/ggufs.py and kept between runs."""
    import ggufs

    return ggufs.bench_files(model, [file_type])[file_type]


def start_llama_server(binary: Path, weights: Path, workdir: Path, args, env) -> tuple:
    slots = max(args.clients)
    port = free_port()
    command = [str(binary), "-m", str(weights), "--host", "127.0.0.1", "--port", str(port), "-t", str(args.threads),
               "-tb", str(args.threads), "-np", str(slots), "-c", str(slots * 512)]
    log = open(workdir / "llama-server.log", "w")
    process = subprocess.Popen(command, env=env, stdout=log, stderr=log)
    wait_healthy(port, process, "llama-server")
    return process, port, weights


def load() -> str:
    return "/".join(f"{x:.1f}" for x in os.getloadavg())


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--weight-format", default="bfloat16")
    parser.add_argument("--numeric-profile", default="bf16")
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 4, 8, 16])
    parser.add_argument("--requests", type=int, default=2, help="requests per client per level")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--probes", type=int, default=6, help="newcomer requests (0: no newcomer row)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--engine", action="store_true", help="also the in-process Engine, without HTTP")
    parser.add_argument("--constrained", action="store_true",
                        help="also lmstack chat requests, plain and with a json_schema response_format")
    parser.add_argument("--logprobs", action="store_true", help="the --constrained requests ask for logprobs")
    parser.add_argument("--llama-server", type=Path, default=shutil.which("llama-server"))
    parser.add_argument("--file-type", help="both servers on bench/ggufs.py's file of this type (default: lmstack "
                        "on --model, llama-server on its BF16 file)")
    args = parser.parse_args()
    if args.file_type:
        args.model = str(bench_file(args.model, args.file_type))
    elif args.model == "smollm2-1.7b-random":
        parser.error("--model smollm2-1.7b-random needs --file-type")

    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    src = str(Path(__file__).parents[1] / "src")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [src, env.get("PYTHONPATH")]))
    servers, engine = {}, None
    with tempfile.TemporaryDirectory() as workdir:
        try:
            servers["lmstack"] = start_lmstack(args, env)[:2]
            if args.llama_server and Path(args.llama_server).exists():
                weights = Path(args.model) if args.file_type else bench_file(args.model, "BF16")
                process, port, weights = start_llama_server(Path(args.llama_server), weights, Path(workdir), args, env)
                servers["llama-server"] = process, port
                print(f"llama-server: {args.llama_server} on {weights.name}, {args.threads} threads, "
                      f"{max(args.clients)} slots")
            else:
                print("llama-server: not measured (give --llama-server PATH)")
            print(f"lmstack serve --model {args.model} --weight-format {args.weight_format} --numeric-profile "
                  f"{args.numeric_profile}; {args.requests} requests of {args.tokens} tokens per client; "
                  f"load average {load()} at the start")
            runs = {name: partial(signalling, partial(stream_one, port, args.model), tokens=args.tokens)
                    for name, (_, port) in servers.items()}
            if args.constrained:
                port = servers["lmstack"][1]
                for kind in ("plain", "schema"):
                    runs[f"lmstack chat {kind}"] = partial(signalling, partial(stream_one, port, args.model,
                                                                                chat=kind, logprobs=args.logprobs),
                                                              tokens=args.tokens)
            if args.engine:
                engine, tokenizer = in_process_engine(args)
                runs["engine"] = partial(signalling, partial(engine_one, engine, tokenizer), tokens=args.tokens)
            for one in runs.values():  # warm up: kernels compiled, and the KV memory of the largest level touched
                level(one, max(args.clients), 1, -max(args.clients))
            rows, order = {}, list(runs)
            pids = {name: process.pid for name, (process, _) in servers.items()}
            pids.update({name: pids["lmstack"] for name in runs if name.startswith("lmstack chat")})
            first = 0  # each level's prompts new to both servers, the same for both
            for clients in args.clients:
                for name in order:
                    rows[clients, name] = level(runs[name], clients, args.requests, first, pids.get(name))
                    r = rows[clients, name]
                    print(f"  {clients:>2} clients, {name}: {r['rate']:.1f} tok/s, {r['tokens']:.1f} tokens a request "
                          f"(load {load()})", flush=True)
                order.reverse()
                first += clients * args.requests
            if args.probes:
                busy = max(args.clients) - 1
                for name in order:
                    rows["newcomer", name] = newcomers(runs[name], busy, args.probes)
                    print(f"  newcomer beside {busy} streams, {name}: TTFT p50 "
                          f"{rows['newcomer', name]['ttft'][0]:.3f} s (load {load()})", flush=True)
            report(rows, args, list(runs), busy=max(args.clients) - 1)
            print(f"\nload average {load()} at the end")
        finally:
            if engine is not None:
                engine.close()
            for process, _ in servers.values():
                process.terminate()
                process.wait(timeout=30)


def report(rows, args, names, busy):
    ours = "lmstack"
    print("\n| clients | server | tok/s | latency p50 / p95 s | TTFT p50 / p95 s | CPU ms/token | "
          "lmstack's tok/s over it | lmstack's p95 latency over it |")
    print("|---|---|---|---|---|---|---|---|")
    for clients in args.clients:
        for name in names:
            r, us = rows[clients, name], rows[clients, ours]
            ratios = "| | |" if name == ours else (f"| {us['rate'] / r['rate']:.2f}x | "
                                                 f"{us['latency'][1] / r['latency'][1]:.2f}x |")
            cpu = "" if r["cpu_ms"] is None else f"{r['cpu_ms']:.2f}"
            print(f"| {clients} | {name} | {r['rate']:.1f} | {r['latency'][0]:.2f} / {r['latency'][1]:.2f} | "
                  f"{r['ttft'][0]:.3f} / {r['ttft'][1]:.3f} | {cpu} {ratios}")
    if "lmstack chat schema" in names:
        print("\n| clients | chat tok/s plain | with json_schema | constrained over plain | "
              "CPU ms/token plain / json_schema |")
        print("|---|---|---|---|---|")
        for clients in args.clients:
            plain, schema = rows[clients, "lmstack chat plain"], rows[clients, "lmstack chat schema"]
            print(f"| {clients} | {plain['rate']:.1f} | {schema['rate']:.1f} | {schema['rate'] / plain['rate']:.2f}x | "
                  f"{plain['cpu_ms']:.2f} / {schema['cpu_ms']:.2f} |")
    for name in names:
        if ("newcomer", name) in rows:
            r = rows["newcomer", name]
            print(f"| newcomer beside {busy} streams | {name} | | | {r['ttft'][0]:.3f} / {r['ttft'][1]:.3f} "
                  f"(worst {r['worst']:.3f}) | | | |")


if __name__ == "__main__":
    main()
