"""What a device can still allocate: a request that cannot fit is refused by name and size before the
allocator fails with a bare RuntimeError, or the kernel's OOM killer ends the process. And the CPU's anonymous
mappings: caches resident only as they fill, and memory faulted in ahead of a load (Prefault). Imports no torch
at import time: the command starts a Prefault before it imports torch (launch.py)."""

from __future__ import annotations

import contextlib
import ctypes
import gc
import math
import mmap
import resource
import threading

PREFAULT_THREAD = "lmstack-prefault"  # the name of Prefault's thread, which writes no stderr (cli.py)


@contextlib.contextmanager
def collector_paused():
    """The garbage collector off while a stretch makes many objects and no garbage (importing torch: about a
    million; loading a model and its tokenizer: ~10^5), where its passes over them took a fifth of a second of
    every start; on again after, if it was on."""
    collecting = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if collecting:
            gc.enable()


def _meminfo(*keys: str) -> int | None:
    try:
        with open("/proc/meminfo") as fh:
            values = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in fh}
    except (OSError, ValueError, IndexError):
        return None
    return sum(values.get(k, 0) for k in keys)


def _address_space_left() -> int | None:
    """Bytes of address space left under RLIMIT_AS (None without a limit)."""
    limit = resource.getrlimit(resource.RLIMIT_AS)[0]
    if limit == resource.RLIM_INFINITY:
        return None
    try:
        with open("/proc/self/status") as fh:
            used = next(int(line.split()[1]) * 1024 for line in fh if line.startswith("VmSize:"))
    except (OSError, StopIteration, ValueError):
        return None
    return limit - used


def available(device: torch.device) -> int | None:
    """Bytes `device` can still allocate (memory and swap for the CPU, with the prefaulted bytes not yet taken),
    or None when unknown."""
    if device.type == "cuda":
        import torch

        return torch.cuda.mem_get_info(device)[0]
    if device.type != "cpu":
        return None
    return _cpu_available()


def _cpu_available() -> int | None:
    """Memory and swap, and address space, left to allocate, counting what the prefault holds for the load."""
    memory, space = _meminfo("MemAvailable", "SwapFree"), _address_space_left()
    if _prefault is not None:  # resident already, and mapped: the load's to take
        memory = None if memory is None else memory + _prefault.held()
        space = None if space is None else space + _prefault.limit - _prefault.taken
    known = [n for n in (memory, space) if n is not None]
    return min(known) if known else None


def ensure(nbytes: int, device: torch.device, what: str):
    """Refuse `what` (a phrase) when its `nbytes` exceed what `device` can still allocate."""
    have = available(device)
    if have is not None and nbytes > have:
        raise MemoryError(f"{what} needs {gib(nbytes)} on {device}, which has {gib(have)} available")


def gib(nbytes: int) -> str:
    return f"{nbytes / (1 << 30):.2f} GiB ({nbytes} bytes)"


def zeros(shape: tuple, dtype: torch.dtype, device) -> torch.Tensor:
    """torch.zeros, but on the CPU in an anonymous mapping: its pages stay the kernel's shared zero page until
    written, so a KV cache sized for a whole context is resident only as far as it is filled (torch.zeros
    writes every byte at once)."""
    import torch

    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    itemsize = torch.empty((), dtype=dtype).element_size()
    nbytes = itemsize
    for n in shape:
        nbytes *= n
    if nbytes < mmap.PAGESIZE:
        return torch.zeros(shape, dtype=dtype)
    anonymous = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)  # shared: tmpfs, slower faults
    return torch.frombuffer(anonymous, dtype=dtype).view(shape)


class Prefault:
    """An anonymous mapping whose pages a thread writes while the process does other work (importing torch takes
    one core for a second), handed out in order as the buffers of a load: a fresh page's first write is a fault,
    about 0.6 ns a byte on a VM, so 1.8 GB of packed weights cost 0.7-1.1 s of CPU. Once the load takes past what
    the thread has written, the thread stops (the load's own threads fault the rest as they write it).

    The thread calls memset, which releases the interpreter lock; MADV_POPULATE_WRITE was as fast but holds the
    process's mmap lock, and stalled the import's own mappings (dlopen) for most of a second."""

    CHUNK = 64 << 20  # bytes written per call: between them the thread takes the interpreter lock back

    def __init__(self, nbytes: int):
        self.map = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)  # shared: slower, tmpfs
        self.limit = self.stop = nbytes  # bytes handed out at most; bytes the thread writes
        self.written = self.taken = 0
        self.lock = threading.Lock()  # held while the thread writes a chunk
        self.base = ctypes.addressof(ctypes.c_char.from_buffer(self.map))
        self.thread = threading.Thread(target=self._write, name=PREFAULT_THREAD, daemon=True)
        self.thread.start()

    def _write(self):
        while True:
            with self.lock:
                if self.written >= self.stop:
                    self._free_past_limit()
                    return
                n = min(self.CHUNK, self.stop - self.written)
                ctypes.memset(self.base + self.written, 0, n)
                self.written += n

    def _free_past_limit(self):
        """Free the pages written past the limit (with the lock held)."""
        start = -(-self.limit // mmap.PAGESIZE) * mmap.PAGESIZE
        if self.written > start:
            self.map.madvise(mmap.MADV_DONTNEED, start, self.written - start)
        self.written = min(self.written, self.limit)

    def keep(self, nbytes: int):
        """The load needs only `nbytes` of it: the thread stops there, and pages written past it are freed, by
        the thread itself if it is writing a chunk (the load need not wait for it: a chunk is tens of ms)."""
        self.limit = min(self.limit, max(nbytes, self.taken))
        self.stop = min(self.stop, self.limit)
        if self.lock.acquire(blocking=False):
            try:
                self._free_past_limit()
            finally:
                self.lock.release()

    def held(self) -> int:
        """Bytes written and not yet handed out: resident already, and the load's to take."""
        return max(0, self.written - self.taken)

    def take(self, nbytes: int) -> memoryview | None:
        """`nbytes` of it (64-byte aligned), or None when fewer remain under the limit."""
        start = -(-self.taken // 64) * 64
        if start + nbytes > self.limit:
            return None
        if start + nbytes > self.written:  # past the thread, which must not write over what the load writes
            with self.lock:
                self.stop = min(self.stop, self.written)
        self.taken = start + nbytes
        return memoryview(self.map)[start:start + nbytes]


_prefault: Prefault | None = None  # the process's, while a load draws on it


def start_prefault(nbytes: int) -> Prefault | None:
    """Start writing `nbytes` of anonymous memory for the next load (CPU): not where they exceed what the machine
    has available, which the load's own check then refuses by name."""
    global _prefault
    have = _cpu_available()
    if nbytes < mmap.PAGESIZE or (have is not None and nbytes > have):
        return None
    _prefault = Prefault(nbytes)
    return _prefault


def keep_prefaulted(nbytes: int):
    """The load about to run takes at most `nbytes` from the process's prefault (none: 0)."""
    if _prefault is not None:
        _prefault.keep(nbytes)


def end_prefault():
    """The load is done: what it did not take is freed (its buffers keep the mapping alive)."""
    global _prefault
    if _prefault is not None:
        _prefault.keep(0)
        _prefault = None


def empty_bytes(shape: tuple):
    """torch.empty(shape, dtype=torch.uint8) on the CPU, taken from the process's prefault while it has room."""
    import torch

    nbytes = math.prod(shape)
    buffer = _prefault.take(nbytes) if _prefault is not None and nbytes else None
    if buffer is None:
        return torch.empty(shape, dtype=torch.uint8)
    return torch.frombuffer(buffer, dtype=torch.uint8).view(shape)
