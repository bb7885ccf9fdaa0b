"""`lmstack serve` under hostile load: does the front door stay open, memory flat, and the KV pool come back?

Starts `lmstack serve` (the default model unless `--model`) and keeps `--connections` clients busy for
`--minutes`, each opening a fresh connection per request to 127.0.0.1, its kind drawn at random:

    stream      a streamed completion read to its end
    whole       a completion answered in one body
    leave       a stream dropped after its first event
    slow        a stream of `--slow-tokens` tokens nobody reads (a small receive buffer, never read): the server
                must cut it off once its send buffer is full, abort it and count it (lmstack_clients_cut_off_total)

A client answered 429 waits its Retry-After. Meanwhile, once a second, a fresh client (from a process of its own)
asks /health and another a one-token completion; their latencies' p50/p99 are reported (an answer is what counts:
a 429 with Retry-After is the front door open; the one-token probes answered 200 are also reported alone), with
the server's resident memory sampled every 5 s and its slope (MiB/min, least squares) from `--settle` seconds on.
At the end the load stops, and once the server has nothing running or waiting, /metrics must show every KV block
free.

    python bench/serve_load.py                       # 10 minutes, 256 connections (the README's figures)
    python bench/serve_load.py --minutes 2 --connections 64 --settle 60
"""

import argparse
import asyncio
import json
import multiprocessing
import os
import random
import re
import socket
import statistics
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

from serve_http import free_port, wait_healthy

KINDS = {"stream": 0.4, "whole": 0.3, "leave": 0.15, "slow": 0.15}
WORDS = ("river lamp orbit garden copper violin winter harbor signal maple engine quiet lantern desert "
         "mirror comet meadow ladder cipher thunder").split()


def machine() -> str:
    """The CPU model and the number of cores this process may use."""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            name = next((line.split(":", 1)[1].strip() for line in cpuinfo if line.startswith("model name")), "?")
    except OSError:
        name = "?"
    return f"{name}, {len(os.sched_getaffinity(0))} cores"


def resident_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmRSS:")) / 1024


def slope(points) -> float:
    """Least-squares slope of (seconds, MiB) points, in MiB per minute."""
    if len(points) < 2:
        return float("nan")
    ts, ys = zip(*points)
    mt, my = statistics.fmean(ts), statistics.fmean(ys)
    var = sum((t - mt) ** 2 for t in ts)
    return 60 * sum((t - mt) * (y - my) for t, y in points) / var if var else float("nan")


def percentile(values, q) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


async def connect(port: int, receive_buffer: int | None = None):
    """A fresh connection; with receive_buffer, that many bytes in the socket and in asyncio's reader."""
    sock = socket.socket()
    if receive_buffer:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, receive_buffer)
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", port))
    return await asyncio.open_connection(sock=sock, **({"limit": receive_buffer // 2} if receive_buffer else {}))


def request(method: str, path: str, body: dict | None = None) -> bytes:
    data = json.dumps(body).encode() if body is not None else b""
    return (f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(data)}\r\nConnection: close\r\n\r\n").encode() + data


async def head(reader) -> tuple[int, dict]:
    status = int((await reader.readline()).split()[1])
    headers = {}
    while (line := await reader.readline()) not in (b"\r\n", b""):
        key, _, value = line.decode().partition(":")
        headers[key.strip().lower()] = value.strip()
    return status, headers


class Load:
    def __init__(self, args, port: int, model: str):
        self.args, self.port, self.model = args, port, model
        self.outcomes = Counter()  # (kind, outcome)
        self.stop = False

    def body(self, kind: str) -> dict:
        prompt = " ".join(random.choices(WORDS, k=random.randint(4, 40)))
        tokens = self.args.slow_tokens if kind == "slow" else random.randint(8, self.args.max_tokens)
        return {"model": self.model, "prompt": prompt, "max_tokens": tokens, "temperature": 0.8,
                "stream": kind != "whole", "ignore_eos": True}

    async def client(self):
        while not self.stop:
            kind = random.choices(list(KINDS), weights=list(KINDS.values()))[0]
            try:
                outcome, wait = await asyncio.wait_for(self.one(kind), self.args.request_timeout)
            except asyncio.TimeoutError:
                outcome, wait = "timeout", 0
            except OSError as e:
                outcome, wait = f"socket error ({type(e).__name__})", 0.5
            self.outcomes[kind, outcome] += 1
            if wait:
                await asyncio.sleep(wait)

    async def one(self, kind: str):
        reader, writer = await connect(self.port, 4096 if kind == "slow" else None)
        try:
            writer.write(request("POST", "/v1/completions", self.body(kind)))
            await writer.drain()
            if kind == "slow":  # never read: hold the connection until the server drops it or the time is up
                outcome = await self.unread(reader)
                return outcome, 1 if outcome == "429" else 0
            status, headers = await head(reader)
            if status != 200:
                await reader.read()
                return str(status), float(headers.get("retry-after", 0))
            if kind == "leave":
                await reader.readline()
                return "left", 0
            data = await reader.read()
            if kind == "whole":
                return ("ok" if json.loads(data)["choices"][0]["finish_reason"] else "bad body"), 0
            if b"data: [DONE]" not in data:
                return "cut short", 0
            return ("error event" if b'data: {"error"' in data else "ok"), 0
        finally:
            writer.transport.abort()

    async def unread(self, reader) -> str:
        """Hold the connection unread for --slow-hold seconds or until the server resets it; then read what came."""
        deadline = time.monotonic() + self.args.slow_hold
        while time.monotonic() < deadline and not self.stop and reader.exception() is None:
            await asyncio.sleep(0.5)
        if reader.exception() is not None:
            return "cut off"
        try:
            data = await asyncio.wait_for(reader.read(), 5)
        except (ConnectionResetError, BrokenPipeError):
            return "cut off"
        except asyncio.TimeoutError:
            return "still open"
        return "429" if data.startswith(b"HTTP/1.1 429") else "answered in full"



def probe_process(port: int, model: str, seconds: float, pipe):
    """The probes in a process of their own, so that the load's event loop, busy with its clients, delays them
    no more than it would a client on another machine; sends (health, one_token, statuses) down the pipe."""
    pipe.send(asyncio.run(probes(port, model, seconds)))


async def probes(port: int, model: str, seconds: float) -> tuple:
    """Once a second for `seconds`, whether the last ones have answered or not: (seconds, status) of each
    /health and one-token probe answered, and a count of every (path, status or error)."""
    health, one_token, statuses = [], [], Counter()

    async def probe(path: str, body: dict | None, into: list):
        start = time.perf_counter()
        try:
            reader, writer = await connect(port)
            writer.write(request("GET" if body is None else "POST", path, body))
            status, _ = await asyncio.wait_for(head(reader), 30)
            await asyncio.wait_for(reader.read(), 30)
            writer.transport.abort()
            into.append((time.perf_counter() - start, status))
            statuses[path, status] += 1
        except (OSError, asyncio.TimeoutError) as e:
            statuses[path, type(e).__name__] += 1

    one = {"model": model, "prompt": "Hi", "max_tokens": 1}
    running, end = set(), time.monotonic() + seconds
    while time.monotonic() < end:
        for task in (probe("/health", None, health), probe("/v1/completions", one, one_token)):
            running.add(task := asyncio.create_task(task))
            task.add_done_callback(running.discard)
        await asyncio.sleep(1)
    await asyncio.wait(running, timeout=60) if running else None
    return health, one_token, statuses


async def metrics(port: int) -> dict:
    reader, writer = await connect(port)
    writer.write(request("GET", "/metrics"))
    await head(reader)
    text = (await reader.read()).decode()
    writer.close()
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            values[name] = float(value)
    return values


async def run(args, process, port: int, model: str) -> dict:
    load = Load(args, port, model)
    start = time.monotonic()
    rss = []

    async def sample():
        while not load.stop:
            rss.append((time.monotonic() - start, resident_mib(process.pid)))
            await asyncio.sleep(5)

    tasks = [asyncio.create_task(load.client()) for _ in range(args.connections)]
    tasks.append(asyncio.create_task(sample()))
    await asyncio.sleep(args.minutes * 60)
    load.stop = True
    await asyncio.wait(tasks, timeout=args.request_timeout + 30)
    for task in tasks:
        task.cancel()
    drained = time.monotonic() + 120
    while True:  # every request aborted or finished: the pool must be all free
        m = await metrics(port)
        if (m.get("lmstack_requests_running", 1) == 0 and m.get("lmstack_requests_waiting", 1) == 0) \
                or time.monotonic() > drained:
            break
        await asyncio.sleep(1)
    statuses = {k: v for k, v in m.items() if k.startswith("lmstack_requests_total")}
    return dict(load=load, rss=rss, metrics=m, statuses=statuses)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="what `lmstack serve --model` gets (default: smollm2)")
    parser.add_argument("--minutes", type=float, default=10)
    parser.add_argument("--connections", type=int, default=256)
    parser.add_argument("--settle", type=float, default=180, help="seconds before the RSS slope is measured")
    parser.add_argument("--max-tokens", type=int, default=64, help="most tokens of a stream, whole or leave request")
    parser.add_argument("--slow-tokens", type=int, default=2048, help="tokens a slow reader asks for")
    parser.add_argument("--slow-hold", type=float, default=120, help="seconds a slow reader holds its connection")
    parser.add_argument("--request-timeout", type=float, default=300)
    parser.add_argument("--serve-args", default="", help="more `lmstack serve` flags, e.g. '--max-running 8'")
    args = parser.parse_args()

    port = free_port()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[1] / "src"),
                                                        os.environ.get("PYTHONPATH", "")])}
    command = [sys.executable, "-m", "lmstack", "serve", "--port", str(port), "-q", *args.serve_args.split()]
    if args.model:
        command += ["--model", args.model]
    log = open(Path(os.environ.get("TMPDIR", "/tmp")) / f"serve_load_{port}.log", "w")
    process = subprocess.Popen(command, env=env, stderr=log)
    model = args.model or "smollm2"
    try:
        wait_healthy(port, process, f"lmstack serve (log: {log.name})")
        idle = resident_mib(process.pid)
        load_before = os.getloadavg()[0]
        receive, send = multiprocessing.Pipe(duplex=False)
        prober = multiprocessing.get_context("fork").Process(target=probe_process,
                                                              args=(port, model, args.minutes * 60, send))
        prober.start()
        result = asyncio.run(run(args, process, port, model))
        result["load average"] = (load_before, os.getloadavg()[0])
        result["probes"] = receive.recv()
        prober.join()
    finally:
        process.terminate()
        process.wait(timeout=60)
    report(args, idle, result, log.name)


def report(args, idle: float, result: dict, log_name: str):
    load, rss, m = result["load"], result["rss"], result["metrics"]
    settle = args.settle if args.settle < args.minutes * 60 else args.minutes * 30
    late = [(t, y) for t, y in rss if t >= settle]
    print(f"{args.connections} connections for {args.minutes:g} min (server log: {log_name})")
    print(f"  machine          {machine()}; load average {result['load average'][0]:.1f} at the start, "
          f"{result['load average'][1]:.1f} at the end")
    for kind in KINDS:
        outcomes = {o: n for (k, o), n in sorted(load.outcomes.items()) if k == kind}
        print(f"  {kind:<7} {sum(outcomes.values()):>6} requests: {outcomes}")
    health, one_token, probe_statuses = result["probes"]
    for name, answered in (("/health", health), ("one-token", one_token),
                           ("  of them 200", [probe for probe in one_token if probe[1] == 200])):
        seconds = [t for t, _ in answered]
        print(f"  {name:<16} p50 {percentile(seconds, .5) * 1e3:7.1f} ms  p99 {percentile(seconds, .99) * 1e3:7.1f} ms"
              f"  max {max(seconds, default=float('nan')) * 1e3:7.1f} ms  ({len(seconds)} answered)")
    print(f"  probe answers    {dict(probe_statuses)}")
    print(f"  RSS              idle {idle:.0f} MiB, peak {max(y for _, y in rss):.0f} MiB, end {rss[-1][1]:.0f} MiB;"
          f" slope from {settle:.0f} s {slope(late):+.2f} MiB/min")
    statuses = {" ".join(re.findall(r'"([^"]*)"', k)[::-1]): int(v) for k, v in result["statuses"].items()}
    print(f"  server statuses  {statuses}")
    used, total = m.get("lmstack_kv_cache_blocks_used"), m.get("lmstack_kv_cache_blocks_total")
    print(f"  cut off          {m.get('lmstack_clients_cut_off_total', 0):.0f} slow readers")
    print(f"  KV blocks        {total - used:.0f} of {total:.0f} free at the end")


if __name__ == "__main__":
    main()
