"""Decode threads sized to the cores that other processes leave free, measured between tokens.

A decode step splits each of its few hundred small operators over the threads and waits for the slowest at
every barrier: with another busy process on the cores, whichever thread is descheduled stalls the rest, and two
threads beside one busy process keep about 30% of their quiet speed. One thread on the core left free keeps more.
So every INTERVAL seconds (checked between tokens) `Threads.adapt` takes the CPU time the cores this process may
run on spent on other processes (their busy time in /proc/stat, less this process's own) and runs as many threads
as cores were left free, at least one and never more than the caller's torch.get_num_threads().

Only competitors count. Processes of lower priority than this one are not: the scheduler gives a core to a nice 0
thread at once over a nice 19 batch job (a compile, an indexer), so counting the job would halve the threads and
let it fill the freed core for good. /proc/stat's `nice` column is the user time of processes with nice > 0; at
nice 0 or below, this process leaves it out (its own user time is in `user` then). A niced process cannot tell
from /proc/stat whether another niced one runs above or below it, so it counts them all, as before. System time
is not split by priority in /proc/stat and always counts.

`release_team` is for a thread that hands its computing to another (an engine's stepping thread): see there.
"""

import ctypes
import os
import time

import torch

INTERVAL = 0.1  # seconds between measurements: /proc/stat counts clock ticks (1-10 ms)
TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
OMP_PAUSE_SOFT = 1


def _read_stat() -> str | None:
    try:
        with open("/proc/stat") as f:
            return f.read()
    except OSError:
        return None


def _busy_seconds(cpus: set[int], count_niced: bool) -> float | None:
    """CPU seconds the given cores spent on anything but idle and I/O wait since boot, niced processes' user time
    only if count_niced; None without /proc/stat."""
    stat = _read_stat()
    if stat is None:
        return None
    busy = 0
    for line in stat.splitlines():
        name, *fields = line.split()
        if not name.startswith("cpu") or name == "cpu":
            continue
        if int(name[3:]) in cpus:
            user, nice, system, idle, iowait, irq, softirq, steal = (int(v) for v in fields[:8])
            busy += user + system + irq + softirq + steal + (nice if count_niced else 0)
    return busy / TICK


def _own_seconds() -> float:
    times = os.times()
    return times.user + times.system


class Threads:
    """Made where decoding starts (its thread count is the limit); adapt() between tokens, restore() at the end."""

    def __init__(self):
        self.limit = torch.get_num_threads()
        self.cpus = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set()
        self.count_niced = hasattr(os, "getpriority") and os.getpriority(os.PRIO_PROCESS, 0) > 0  # the docstring
        self.last = None  # (wall, busy, own) seconds at the last measurement

    def adapt(self):
        if self.limit == 1 or not self.cpus:
            return
        now = time.monotonic()
        if self.last is not None and now - self.last[0] < INTERVAL:
            return
        busy = _busy_seconds(self.cpus, self.count_niced)
        if busy is None:
            self.cpus = set()
            return
        sample = (now, busy, _own_seconds())
        if self.last is not None:
            others = (sample[1] - self.last[1] - (sample[2] - self.last[2])) / (now - self.last[0])
            threads = max(1, min(self.limit, round(len(self.cpus) - others)))
            if threads != torch.get_num_threads():
                torch.set_num_threads(threads)
        self.last = sample

    def restore(self):
        if torch.get_num_threads() != self.limit:
            torch.set_num_threads(self.limit)


def release_team():
    """Let go of the OpenMP worker threads that the calling thread's parallel operators ran on.

    libgomp keeps each thread's team of workers after use, and while the process holds more of them than there
    are cores, a worker waiting for the next parallel region sleeps at once instead of spinning: a decode step,
    a few hundred small regions, then pays a wake-up for each (SmolLM2 on 2 cores: 39 tokens/s instead of 68).
    A model loaded in one thread and stepped in another leaves such a second team, unless the first lets go.
    A no-op under another OpenMP runtime; the team comes back if the caller runs parallel operators again.
    """
    try:
        pause = ctypes.CDLL(None).omp_pause_resource_all
    except (AttributeError, OSError, TypeError):  # no OpenMP 5 runtime in the process (or no dlopen(NULL))
        return
    pause(OMP_PAUSE_SOFT)
