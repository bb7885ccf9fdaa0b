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
        monkeypatch.setattr(threads, "_busy_seconds", lambda cpus: self.busy)
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
