"""Decode threads sized to the free cores: the rule on given measurements, and decoding that does not change."""

import threading

import torch

from lmstack import CausalLM, threads
from lmstack.threads import Threads


class Clock:
    """Stands in for time and /proc/stat: other processes keep `others` cores busy, this one `own`."""

    def __init__(self, monkeypatch, cpus=4):
        self.now, self.busy, self.own_total, self.others, self.own = 0.0, 0.0, 0.0, 0.0, 1.0
        monkeypatch.setattr(threads.time, "monotonic", lambda: self.now)
        monkeypatch.setattr(threads, "_busy_seconds", lambda cpus, count_niced: self.busy)
        monkeypatch.setattr(threads, "_own_seconds", lambda: self.own_total)
        monkeypatch.setattr(threads.os, "sched_getaffinity", lambda pid: set(range(cpus)))

    def advance(self, seconds):
        self.now += seconds
        self.busy += (self.others + self.own) * seconds
        self.own_total += self.own * seconds


def test_threads_follow_the_cores_other_processes_leave(monkeypatch):
    clock = Clock(monkeypatch)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(3)
        governor = Threads()
        governor.adapt()  # the first measurement only starts a window
        assert torch.get_num_threads() == 3
        for others, expected in [(0.2, 3), (1.0, 3), (1.4, 3), (2.0, 2), (2.7, 1), (6.0, 1), (0.0, 3)]:
            clock.others = others
            clock.advance(0.05)
            governor.adapt()  # within the interval: nothing measured
            clock.advance(threads.INTERVAL)
            governor.adapt()
            assert torch.get_num_threads() == expected, (others, torch.get_num_threads())
        clock.others = 4.0
        clock.advance(threads.INTERVAL)
        governor.adapt()
        governor.restore()
        assert torch.get_num_threads() == 3
    finally:
        torch.set_num_threads(before)


class Stat:
    """Stands in for time and /proc/stat's per-core lines: `columns` maps a column to the cores it keeps busy
    (split evenly over the cores); this process's own time goes to `own_column`."""

    COLUMNS = ("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal", "guest", "guest_nice")

    def __init__(self, monkeypatch, cpus=4, own_column="user", niceness=0):
        self.cpus, self.own_column, self.now, self.own_total = cpus, own_column, 0.0, 0.0
        self.ticks = {column: 0 for column in self.COLUMNS}  # per core
        self.columns = {}
        monkeypatch.setattr(threads.time, "monotonic", lambda: self.now)
        monkeypatch.setattr(threads, "_read_stat", self.text)
        monkeypatch.setattr(threads, "_own_seconds", lambda: self.own_total)
        monkeypatch.setattr(threads.os, "sched_getaffinity", lambda pid: set(range(cpus)))
        monkeypatch.setattr(threads.os, "getpriority", lambda which, who: niceness)

    def advance(self, seconds, own=1.0):
        self.now += seconds
        self.own_total += own * seconds
        busy = dict(self.columns)
        busy[self.own_column] = busy.get(self.own_column, 0.0) + own
        busy["idle"] = self.cpus - sum(busy.values())
        for column, cores in busy.items():
            self.ticks[column] += round(cores * seconds * threads.TICK / self.cpus)

    def text(self):
        total = " ".join(str(self.ticks[c] * self.cpus) for c in self.COLUMNS)
        cores = [f"cpu{i} " + " ".join(str(self.ticks[c]) for c in self.COLUMNS) for i in range(self.cpus)]
        return "\n".join([f"cpu  {total}", *cores, "intr 12345 0 1", "ctxt 999", "btime 1700000000"]) + "\n"


def test_busy_time_leaves_out_idle_io_wait_and_other_cores_and_niced_time_when_asked(monkeypatch):
    fields = {0: [100, 40, 30, 500, 20, 3, 2, 1, 0, 0], 1: [7, 11, 13, 900, 17, 19, 23, 29, 0, 0],
              2: [1000, 1000, 1000, 1000, 1000, 1000, 1000, 1000, 0, 0]}
    lines = ["cpu  " + " ".join(str(sum(f[i] for f in fields.values())) for i in range(10)),
             *[f"cpu{core} " + " ".join(map(str, f)) for core, f in fields.items()], "intr 1 2 3"]
    monkeypatch.setattr(threads, "_read_stat", lambda: "\n".join(lines) + "\n")
    for count_niced in (False, True):
        expected = sum(f[0] + f[2] + f[5] + f[6] + f[7] + (f[1] if count_niced else 0)
                       for core, f in fields.items() if core in (0, 1))
        assert threads._busy_seconds({0, 1}, count_niced) == expected / threads.TICK
    monkeypatch.setattr(threads, "_read_stat", lambda: None)
    assert threads._busy_seconds({0, 1}, False) is None


def threads_beside(stat: Stat, columns: dict) -> int:
    """The thread count a governor limited to 3 settles on while other processes load the given columns."""
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(3)
        governor = Threads()
        governor.adapt()
        stat.columns = columns
        for _ in range(3):
            stat.advance(10 * threads.INTERVAL)  # ticks enough for whole cores
            governor.adapt()
        return torch.get_num_threads()
    finally:
        torch.set_num_threads(before)


def test_niced_processes_are_no_competition_for_a_process_at_nice_0(monkeypatch):
    assert threads_beside(Stat(monkeypatch), {"nice": 3.0}) == 3
    assert threads_beside(Stat(monkeypatch), {"nice": 3.0, "user": 2.0}) == 2
    assert threads_beside(Stat(monkeypatch), {"user": 3.0}) == 1
    assert threads_beside(Stat(monkeypatch), {"steal": 1.0, "system": 1.0}) == 2
    assert threads_beside(Stat(monkeypatch), {"idle": 0.0, "iowait": 2.5}) == 3


def test_a_niced_process_counts_other_niced_processes_as_competition(monkeypatch):
    assert threads_beside(Stat(monkeypatch, own_column="nice", niceness=10), {"nice": 2.0}) == 2
    assert threads_beside(Stat(monkeypatch, own_column="nice", niceness=10), {"nice": 3.0}) == 1
    assert threads_beside(Stat(monkeypatch, own_column="nice", niceness=10), {}) == 3


def test_decoding_gives_the_same_tokens_while_threads_change(tiny_checkpoint, monkeypatch):
    path, _ = tiny_checkpoint("llama_tied_gqa")
    lm = CausalLM.load(path, device="cpu")
    prompt = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(5))
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        steady = lm.generate(prompt, 12)
        counts = iter([1, 2] * 12)
        monkeypatch.setattr(Threads, "adapt", lambda self: torch.set_num_threads(next(counts)))
        assert torch.equal(lm.generate(prompt, 12), steady)
        assert torch.get_num_threads() == 2  # restored after the decode
    finally:
        torch.set_num_threads(before)


def test_a_thread_that_lets_its_team_go_leaves_the_others_computing():
    a = torch.randn(512, 512, generator=torch.Generator().manual_seed(0))
    expected = a @ a
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        results = []
        other = threading.Thread(target=lambda: results.extend(torch.allclose(a @ a, expected) for _ in range(20)))
        other.start()
        threads.release_team()
        other.join()
        assert results == [True] * 20
        assert torch.allclose(a @ a, expected)  # the caller's team comes back when it computes again
    finally:
        torch.set_num_threads(before)
