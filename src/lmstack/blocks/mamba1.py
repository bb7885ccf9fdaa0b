"""The Mamba 1 block (pre-norm RMSNorm, selective-scan mixer, residual) and what Mamba 2 shares with it.

Prefill scans in chunks of SCAN_CHUNK tokens; inside a chunk a Hillis-Steele scan takes log2(chunk)
vectorized steps, so no Python loop runs over single time steps. Decoding one token is the same code
with a chunk of one.

The bf16 numeric profile: the projections and the conv run in bfloat16, as in transformers; A_log, D,
dt_proj's bias and the norm weights stay float32, and so do the scan and the SSM state, because the decay
exp(dt * A) compounds over every token and bfloat16's 8-bit mantissa would drift. Weight formats re-store
the four projections only (PROJECTIONS). The residual stream is float32
when the config says residual_in_fp32 (its default).
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .transformer import RMSNorm

SCAN_CHUNK = 128


@dataclass
class SSMCache:
    """One layer's decode state, preallocated and overwritten in place by every forward that carries it."""

    conv: torch.Tensor  # (B, conv channels, conv_kernel - 1): the last inputs of the causal conv, model dtype
    ssm: torch.Tensor  # (B, d_inner, d_state) for Mamba 1, (B, n_heads, head_dim, d_state) for Mamba 2; float32


@dataclass
class RecurrentContext:
    """What every recurrent layer of one forward shares."""

    start: int  # tokens already in the state; 0: start from zeros, whatever a reused state still holds
    real: torch.Tensor | None = None  # (B, L) False at left padding, whose inputs are zeroed; None: all real


def causal_conv(x: torch.Tensor, conv: nn.Conv1d, cache: SSMCache | None, ctx: RecurrentContext) -> torch.Tensor:
    """Depthwise causal conv1d + SiLU over x (B, C, L), continuing from cache.conv unless the state is fresh.

    Padding is zero going in and coming out, so neither the conv nor the SSM state sees it.
    """
    B, C, L = x.shape
    real = None if ctx.real is None else ctx.real[:, None]
    if real is not None:
        x = x * real
    kept = conv.weight.shape[-1] - 1
    before = x.new_zeros(B, C, kept) if cache is None or ctx.start == 0 else cache.conv
    x = torch.cat([before, x], dim=-1)
    if cache is not None:
        cache.conv.copy_(x[:, :, L:])
    x = F.silu(F.conv1d(x, conv.weight, conv.bias, groups=C))
    return x if real is None else x * real


def _scan(a: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Every h_t of h_t = a_t * h_{t-1} + u_t (h_{-1} = 0) along dim 1, in log2(T) vectorized steps."""
    T, k = a.shape[1], 1
    while k < T:
        u = torch.cat([u[:, :k], torch.addcmul(u[:, k:], a[:, k:], u[:, :-k])], dim=1)
        if 2 * k < T:
            a = torch.cat([a[:, :k], a[:, k:] * a[:, :-k]], dim=1)
        k *= 2
    return u


def selective_scan(x, dt, A, B, C, h):
    """y_t = h_t . C_t with h_t = exp(dt_t A) h_{t-1} + dt_t x_t B_t; returns (y, last h).

    x, dt (b, L, d); A (d, n); B, C (b, L, n); h (b, d, n) or None for zeros; all float32.
    """
    ys = []
    for s in range(0, x.shape[1], SCAN_CHUNK):
        part = slice(s, s + SCAN_CHUNK)
        a = torch.exp(dt[:, part, :, None] * A)  # (b, T, d, n)
        u = (dt[:, part] * x[:, part])[..., None] * B[:, part, None]
        if h is not None:
            u[:, 0] += a[:, 0] * h
        states = _scan(a, u)
        h = states[:, -1]
        ys.append((states @ C[:, part, :, None]).squeeze(-1))
    return torch.cat(ys, dim=1), h


class Mamba1Mixer(nn.Module):
    def __init__(self, d_model: int, o: dict, dtype):
        super().__init__()
        d_inner, n, rank = o["d_inner"], o["d_state"], o["dt_rank"]
        self.d_state, self.dt_rank = n, rank
        self.in_proj = nn.Linear(d_model, 2 * d_inner, bias=o["bias"], dtype=dtype)
        self.conv1d = nn.Conv1d(d_inner, d_inner, o["d_conv"], groups=d_inner, bias=o["conv_bias"], dtype=dtype)
        self.x_proj = nn.Linear(d_inner, rank + 2 * n, bias=False, dtype=dtype)
        self.dt_proj = nn.Linear(rank, d_inner, bias=False, dtype=dtype)
        self.dt_bias = nn.Parameter(torch.empty(d_inner), requires_grad=False)  # float32, added after the matmul
        self.A_log = nn.Parameter(torch.empty(d_inner, n), requires_grad=False)
        self.D = nn.Parameter(torch.empty(d_inner), requires_grad=False)
        self.out_proj = nn.Linear(d_inner, d_model, bias=o["bias"], dtype=dtype)

    def forward(self, h: torch.Tensor, cache: SSMCache | None, ctx: RecurrentContext) -> torch.Tensor:
        fresh = cache is None or ctx.start == 0
        x, z = self.in_proj(h).chunk(2, dim=-1)
        x = causal_conv(x.transpose(1, 2), self.conv1d, cache, ctx).transpose(1, 2)
        dt, B, C = self.x_proj(x).split([self.dt_rank, self.d_state, self.d_state], dim=-1)
        dt = F.softplus(self.dt_proj(dt).float() + self.dt_bias)
        y, last = selective_scan(x.float(), dt, -torch.exp(self.A_log), B.float(), C.float(),
                                 None if fresh else cache.ssm)
        if cache is not None:
            cache.ssm.copy_(last)
        y = (y + x * self.D) * F.silu(z)
        return self.out_proj(y.to(h.dtype))

    def new_cache(self, batch: int, dtype, device) -> SSMCache:
        d_inner, kernel = self.conv1d.weight.shape[0], self.conv1d.weight.shape[-1]
        return SSMCache(torch.zeros(batch, d_inner, kernel - 1, dtype=dtype, device=device),
                        torch.zeros(batch, d_inner, self.d_state, device=device))


class Mamba1Block(nn.Module):
    """x + mixer(norm(x)); the residual stream turns float32 after the first block when residual_in_fp32."""

    Mixer = Mamba1Mixer
    PROJECTIONS = ("mixer.in_proj", "mixer.x_proj", "mixer.dt_proj", "mixer.out_proj")  # what a format re-stores

    def __init__(self, d_model: int, options: dict, dtype):
        super().__init__()
        self.norm = RMSNorm(d_model, options["norm_eps"])  # float32 weight: the product rounds once, to dtype
        self.mixer = self.Mixer(d_model, options, dtype)
        self.dtype, self.residual_in_fp32 = dtype, options["residual_in_fp32"]

    def forward(self, x: torch.Tensor, cache: SSMCache | None, ctx: RecurrentContext) -> torch.Tensor:
        h = self.mixer(self.norm(x.to(self.dtype)).to(self.dtype), cache, ctx)
        return (x.float() if self.residual_in_fp32 else x) + h

    def compute_in(self, dtype):
        """Run the (re-stored) projections and the conv in dtype; A_log, D, the dt bias and the norms stay float32."""
        self.dtype = dtype
        self.mixer.conv1d.to(dtype)

    def new_cache(self, batch: int, max_tokens: int | None, dtype, device) -> SSMCache:
        """The state does not grow with the tokens: max_tokens is not needed."""
        return self.mixer.new_cache(batch, dtype, device)
