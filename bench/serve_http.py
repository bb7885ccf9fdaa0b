"""`lmstack serve` over HTTP against llama.cpp's `llama-server` on the same weights, in one run.

Each level runs N concurrent clients, each streaming `--requests` completions of `--tokens` tokens (greedy, a
different short prompt each) back to back; it reports the aggregate completion tokens/s over the level's wall
time, the p50/p95 of a request's latency (sent to last token) and of its time to first token. The servers
alternate level by level, so each ratio compares runs minutes apart on the same machine; "engine" is the
same requests on lmstack's Engine in this process, without HTTP.

llama-server (`--llama-server PATH`, or `llama-server` on PATH) gets the default model's weights requantized to
BF16 by `llama-quantize` (found beside it), 2 threads and one slot per client of the largest level:

    python bench/serve_http.py --llama-server /work/llama-build/build/bin/llama-server
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


def stream_one(port: int, model: str, prompt: str, tokens: int) -> dict:
    """One streamed completion: {latency, ttft, tokens}."""
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": tokens, "temperature": 0, "stream": True,
                       "stream_options": {"include_usage": True}})
    start = time.perf_counter()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
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
        if any(c.get("text") for c in chunk.get("choices", ())):
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
    handle = engine.add(tokenizer.encode(prompt), max_tokens=tokens, temperature=0)
    for _ in handle.text_pieces():
        pass
    return dict(latency=time.perf_counter() - start, ttft=handle.time_to_first_token, tokens=handle.completion_tokens)


def level(one, clients: int, requests: int) -> dict:
    """`clients` threads, each making `requests` requests one after another with one(prompt)."""
    results, errors = [], []

    def client(i):
        try:
            for k in range(requests):
                topic = TOPICS[(i + k * clients) % len(TOPICS)]
                results.append(one(f"Once upon a time, there was {topic} who"))
        except Exception as e:  # noqa: BLE001 -- reported below
            errors.append(e)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    if errors:
        raise errors[0]
    return dict(rate=sum(r["tokens"] for r in results) / wall, latency=percentiles([r["latency"] for r in results]),
                ttft=percentiles([r["ttft"] for r in results]), tokens=statistics.mean(r["tokens"] for r in results))


def percentiles(values):
    values = sorted(values)
    return tuple(values[min(len(values) - 1, round(q * (len(values) - 1)))] for q in (0.5, 0.95))


def in_process_engine(args):
    """(Engine, Tokenizer) of the same model and settings as the server's, in this process."""
    import torch

    from lmstack import models
    from lmstack.engine import Engine

    torch.set_num_threads(args.threads)
    lm, tokenizer = models.load(args.model, weight_format=args.weight_format, numeric_profile=args.numeric_profile)
    return Engine(lm, tokenizer, max_running=max(args.clients)).start(), tokenizer


def start_lmstack(args, env) -> tuple:
    port = free_port()
    command = [sys.executable, "-m", "lmstack", "serve", "--model", args.model, "--port", str(port),
               "--weight-format", args.weight_format, "--numeric-profile", args.numeric_profile,
               "--max-running", str(max(args.clients))]
    process = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_healthy(port, process, "lmstack serve")
    return process, port


def start_llama_server(binary: Path, gguf: Path, workdir: Path, args, env) -> tuple:
    quantize = binary.parent / "llama-quantize"
    weights = gguf
    if quantize.exists():
        weights = workdir / "model-BF16.gguf"
        subprocess.run([str(quantize), "--allow-requantize", str(gguf), str(weights), "BF16", "2"], check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    slots = max(args.clients)
    port = free_port()
    command = [str(binary), "-m", str(weights), "--host", "127.0.0.1", "--port", str(port), "-t", str(args.threads),
               "-tb", str(args.threads), "-np", str(slots), "-c", str(slots * 512)]
    log = open(workdir / "llama-server.log", "w")
    process = subprocess.Popen(command, env=env, stdout=log, stderr=log)
    wait_healthy(port, process, "llama-server")
    return process, port, weights


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--weight-format", default="bfloat16")
    parser.add_argument("--numeric-profile", default="bf16")
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 4, 8, 16])
    parser.add_argument("--requests", type=int, default=2, help="requests per client per level")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--llama-server", type=Path, default=shutil.which("llama-server"))
    args = parser.parse_args()

    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    src = str(Path(__file__).parents[1] / "src")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [src, env.get("PYTHONPATH")]))
    servers, engine = {}, None
    with tempfile.TemporaryDirectory() as workdir:
        try:
            servers["lmstack"] = start_lmstack(args, env)[:2]
            if args.llama_server and Path(args.llama_server).exists():
                from lmstack.models import resolve

                process, port, weights = start_llama_server(Path(args.llama_server), resolve(args.model),
                                                            Path(workdir), args, env)
                servers["llama-server"] = process, port
                print(f"llama-server: {args.llama_server} on {weights.name}, {args.threads} threads, "
                      f"{max(args.clients)} slots")
            else:
                print("llama-server: not measured (give --llama-server PATH)")
            print(f"lmstack serve --model {args.model} --weight-format {args.weight_format} --numeric-profile "
                  f"{args.numeric_profile}; {args.requests} "
                  f"requests of {args.tokens} tokens per client; machine shared, so compare ratios only\n")
            runs = {name: partial(stream_one, port, args.model, tokens=args.tokens)
                    for name, (_, port) in servers.items()}
            engine, tokenizer = in_process_engine(args)
            runs["engine"] = partial(engine_one, engine, tokenizer, tokens=args.tokens)
            for one in runs.values():  # warm up: kernels compiled, caches touched
                level(one, 2, 1)
            rows = {}
            for clients in args.clients:
                for name, one in runs.items():
                    rows[clients, name] = level(one, clients, args.requests)
            print(f"{'clients':>7}  {'server':<12} {'tok/s':>7} {'lat p50':>8} {'lat p95':>8} {'ttft p50':>8} "
                  f"{'ttft p95':>8} {'tok/req':>7}  lmstack over it: tok/s, lat p95")
            for clients in args.clients:
                for name in runs:
                    r, ours = rows[clients, name], rows[clients, "lmstack"]
                    print(f"{clients:>7}  {name:<12} {r['rate']:7.1f} {r['latency'][0]:8.2f} {r['latency'][1]:8.2f} "
                          f"{r['ttft'][0]:8.3f} {r['ttft'][1]:8.3f} {r['tokens']:7.1f}" +
                          ("" if name == "lmstack" else f"  {ours['rate'] / r['rate']:.2f}x, "
                                                         f"{ours['latency'][1] / r['latency'][1]:.2f}x"))
        finally:
            if engine is not None:
                engine.close()
            for process, _ in servers.values():
                process.terminate()
                process.wait(timeout=30)


if __name__ == "__main__":
    main()
