"""A model larger than one device: its layers split over devices in one process (ParallelCausalLM),
or over the processes of a torch.distributed group, one pipeline stage per rank (PipelineCausalLM).

Both are a CausalLM built with one device per layer; the arithmetic is CausalLM's own blocks, in order.
"""

import os
import threading
from contextlib import contextmanager

import torch
import torch.distributed as dist

from .model import CausalLM, resolve_device

META = torch.device("meta")


def resolve_layer_devices(layer_devices, n_layers: int) -> list[torch.device]:
    """One torch.device per layer from ints (CUDA indices), device strings or torch.devices; refusals name the entry."""
    if isinstance(layer_devices, (str, int, torch.device)) or not hasattr(layer_devices, "__len__"):
        raise ValueError(f"layer_devices must be a list of one device per layer ({n_layers}), got {layer_devices!r}")
    if len(layer_devices) != n_layers:
        raise ValueError(f"layer_devices has {len(layer_devices)} entries, the checkpoint has {n_layers} layers")
    devices = []
    for i, device in enumerate(layer_devices):
        if (isinstance(device, bool) or not isinstance(device, (int, str, torch.device)) or device == "auto"
                or isinstance(device, int) and device < 0):
            raise ValueError(f"layer_devices[{i}] = {device!r} is not a CUDA index or a torch device")
        try:
            devices.append(resolve_device(torch.device("cuda", device) if isinstance(device, int) else device))
        except ValueError as e:
            raise ValueError(f"layer_devices[{i}]: {e}") from None
    return devices


class ParallelCausalLM(CausalLM):
    """A CausalLM whose layer i lives on layer_devices[i]: the embedding with the first layer, the final
    norm and head with the last (a tied head is copied there when that is another device).

    Each layer's weights are read straight to its device and its decode state is allocated there; the
    activations hop between devices where consecutive layers differ. Logits come back on the last device.
    One call runs at a time: a second thread is refused rather than interleaved on the devices.
    """

    def __init__(self, plan, weights, *, layer_devices, **options):
        """CausalLM(plan, weights, ...)'s options, with one device per layer instead of `device`."""
        if "device" in options:
            raise TypeError("ParallelCausalLM takes layer_devices (one device per layer), not device")
        super().__init__(plan, weights, device=layer_devices, **options)  # _layer_devices reads it per layer

    def _build(self, *args, **kwargs):
        self._lock = threading.RLock()
        self.closed = False
        super()._build(*args, **kwargs)

    @classmethod
    def load(cls, path, *, layer_devices, **options):
        """CausalLM.load's options (weight_format, max_positions, ...), with one device per checkpoint layer.

        Ints are CUDA indices; strings are torch devices ("cpu", "cuda:1"). layer_devices is checked
        against the checkpoint's layer count before a weight byte is read.
        """
        if "device" in options:
            raise TypeError("ParallelCausalLM.load takes layer_devices (one device per layer), not device")
        return super().load(path, device=layer_devices, **options)

    def _layer_devices(self, layer_devices, n_layers):
        return resolve_layer_devices(layer_devices, n_layers)

    @contextmanager
    def _exclusive(self):
        if not self._lock.acquire(blocking=False):
            raise RuntimeError(f"{type(self).__name__} is running a call in another thread; it runs one call at a "
                               "time (serialize the calls, or load one model per thread)")
        try:
            if self.closed:
                raise RuntimeError(f"{type(self).__name__} is closed: its weights were released")
            yield
        finally:
            self._lock.release()

    def _run(self, *args, **kwargs):
        with self._exclusive():
            return super()._run(*args, **kwargs)

    def generate(self, *args, **kwargs):
        with self._exclusive():
            return super().generate(*args, **kwargs)

    def allocate_state(self, *args, **kwargs):
        with self._exclusive():
            return super().allocate_state(*args, **kwargs)

    def close(self):
        """Release every weight on every device; states the caller still holds keep their own memory."""
        if self.closed:
            return
        with self._exclusive():
            self.closed = True
            self.blocks = self.norm = None  # re-stored projections are plain attributes, beyond .to()
            self.embed = self.head = self.head_projection = None
            self._weights.clear()
            self._converted.clear()
            if any(d.type == "cuda" for d in self.layer_devices):
                torch.cuda.empty_cache()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self):
        runs = []  # consecutive layers on one device, e.g. "cuda:0 x16, cuda:1 x16"
        for d in self.layer_devices:
            if runs and runs[-1][0] == d:
                runs[-1][1] += 1
            else:
                runs.append([d, 1])
        devices = ", ".join(f"{d} x{n}" for d, n in runs)
        base = super().__repr__()  # "CausalLM(llama, layers=..., device=...)"
        return f"{type(self).__name__}{base[base.index('('):-1]}, layer_devices=[{devices}])"


STOP, RUN, ALLOCATE = 0, 1, 2  # a header's op: what each rank asks of the next
ACTIVATION_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class PipelineCausalLM(ParallelCausalLM):
    """One pipeline stage per rank of the default torch.distributed process group.

    Rank r holds layers [r * n // world, (r + 1) * n // world) and reads only those from the checkpoint;
    rank 0 also holds the embedding, the last rank the final norm and head. Rank 0 is the model the caller
    uses (forward, step, generate, allocate_state); each call passes the activations rank to rank with
    send/recv and the last rank sends the logits back to rank 0. Every other rank calls `serve()`, which
    runs its layers until rank 0 closes. The pipeline keeps one decode state at a time.
    """

    @classmethod
    def load(cls, path, *, device="auto", **options):
        """CausalLM.load on every rank; `device` is this rank's ("auto": cuda:LOCAL_RANK, else cpu).

        Without a process group one is started from torchrun's environment (NCCL on CUDA, gloo on CPU),
        and `close()` ends it.
        """
        if device == "auto":
            device = f"cuda:{os.environ.get('LOCAL_RANK', 0)}" if torch.cuda.is_available() else "cpu"
        device = resolve_device(device)
        started = not dist.is_initialized()
        if started:
            if device.type == "cuda":
                torch.cuda.set_device(device)
            dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
        try:
            model = super(ParallelCausalLM, cls).load(path, device=device, **options)
        except BaseException:
            if started:
                dist.destroy_process_group()
            raise
        model._started_group = started
        model._state = None
        return model

    def _layer_devices(self, device, n_layers):
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        if self.world_size > n_layers:
            raise ValueError(f"{self.world_size} pipeline ranks for {n_layers} layers: at most one rank per layer")
        self.layers = range(n_layers * self.rank // self.world_size, n_layers * (self.rank + 1) // self.world_size)
        return [device if i in self.layers else META for i in range(n_layers)]

    @property
    def is_last(self) -> bool:
        return self.rank == self.world_size - 1

    def _front(self, what):
        if self.rank != 0:
            raise RuntimeError(f"rank {self.rank}: {what} runs on rank 0 only; the other ranks call serve()")

    def allocate_state(self, batch_size, max_tokens=None):
        """The one decode state of the pipeline; every rank allocates its layers' share."""
        self._front("allocate_state")
        with self._exclusive():
            state = super().allocate_state(batch_size, max_tokens)
            self._send_header(ALLOCATE, batch_size, -1 if state.max_tokens is None else state.max_tokens)
            self._state = state
            return state

    def _run(self, ids, state, last_only=False):
        self._front("the model")
        with self._exclusive():
            if state is not None and state is not self._state:
                raise ValueError("the pipeline keeps one decode state at a time: this one was replaced by a "
                                 "later allocate_state")
            B, L = ids.shape
            x = self._stage(self._embed(ids.to(self.device)), state, last_only)
            if self.world_size == 1:
                return x
            self._send_header(RUN, B, L, last_only, state, x)
            logits = torch.empty(B, 1 if last_only else L, self.vocab_size, device=self.device)
            dist.recv(logits, self.world_size - 1)
            return logits

    @torch.no_grad()
    def _stage(self, x, state, last_only):
        """CausalLM._run's steps for this rank's layers on x (B, L, d_model); the last rank ends with the head."""
        shape = x.shape[:2]
        ctx = self._context(shape, state)
        for i in self.layers:
            x = self.blocks[i](x, None if state is None else state.layers[i], ctx)
        if state is not None:
            state.length += shape[1]
        if not self.is_last:
            return x
        if last_only:
            x = x[:, -1:]
        return self._logits(x).float()

    def _send_header(self, op, batch=0, length=0, last_only=False, state=None, x=None):
        """What the next rank does next: stop, allocate a state, or run its layers on x (sent after)."""
        if self.is_last:
            return
        state_length = -1 if state is None else state.length - length  # where this run started
        dtype = 0 if x is None else ACTIVATION_DTYPES.index(x.dtype)
        header = [op, batch, length, int(last_only), state_length, dtype]
        dist.send(torch.tensor(header, device=self.device), self.rank + 1)
        if state is not None:
            dist.send(state.offsets.contiguous(), self.rank + 1)
        if x is not None:
            dist.send(x.contiguous(), self.rank + 1)

    def serve(self):
        """Run this rank's layers for rank 0 until rank 0 closes the pipeline; then release the weights."""
        if self.rank == 0:
            raise RuntimeError("rank 0 drives the pipeline (forward, step, generate); serve() is for the other ranks")
        header = torch.empty(6, dtype=torch.long, device=self.device)
        state = None
        while True:
            dist.recv(header, self.rank - 1)
            op, batch, length, last_only, state_length, dtype = header.tolist()
            if op == STOP:
                break
            if op == ALLOCATE:  # the length field carries max_tokens (-1: a recurrent state's unbounded None)
                state = CausalLM.allocate_state(self, batch, None if length < 0 else length)
                self._send_header(ALLOCATE, batch, length)
                continue
            run_state = None if state_length < 0 else state
            if run_state is not None:  # mirror rank 0's state: its length and left-padding offsets
                dist.recv(state.offsets, self.rank - 1)
                state.length = state_length
            x = torch.empty(batch, length, self.plan.d_model, dtype=ACTIVATION_DTYPES[dtype], device=self.device)
            dist.recv(x, self.rank - 1)
            out = self._stage(x, run_state, bool(last_only))
            if self.is_last:
                dist.send(out.contiguous(), 0)
            else:
                self._send_header(RUN, batch, length, bool(last_only), run_state, out)
        self._send_header(STOP)
        self.close()

    def close(self):
        """Rank 0: stop the other ranks. Every rank: release its weights, and end the group load started."""
        if self.closed:
            return
        if self.rank == 0:
            self._send_header(STOP)
        super().close()
        if self._started_group:
            dist.destroy_process_group()
