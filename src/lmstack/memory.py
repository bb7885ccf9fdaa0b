"""What a device can still allocate: a request that cannot fit is refused by name and size before the
allocator fails with a bare RuntimeError, or the kernel's OOM killer ends the process."""

import mmap
import resource

import torch


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
    """Bytes `device` can still allocate (memory and swap for the CPU), or None when unknown."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    if device.type != "cpu":
        return None
    known = [n for n in (_meminfo("MemAvailable", "SwapFree"), _address_space_left()) if n is not None]
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
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    itemsize = torch.empty((), dtype=dtype).element_size()
    nbytes = itemsize
    for n in shape:
        nbytes *= n
    if nbytes < mmap.PAGESIZE:
        return torch.zeros(shape, dtype=dtype)
    return torch.frombuffer(mmap.mmap(-1, nbytes), dtype=dtype).view(shape)

