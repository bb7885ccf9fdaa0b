"""The Mamba 2 block: pre-norm RMSNorm, SSD mixer with grouped B/C and a gated RMSNorm, residual.

Prefill runs the SSD chunked algorithm (Dao & Gu 2024): inside a chunk the scan is a masked
(T x T) matrix product, between chunks the state is carried by a loop over chunks; spans of
SPAN_CHUNKS chunks at a time bound the memory of long prompts. Decoding one token is the plain
recurrence. Heads are laid out (groups, heads per group) so B and C are never repeated per head.

The bf16 numeric profile: the projections and the conv run in bfloat16, as in transformers; A_log, D,
dt_bias and the norm weights stay float32, and so do the SSD arithmetic and the SSM state (the decay compounds over
every token). The residual stream is float32 when the config says residual_in_fp32 (its default).
"""

import torch
import torch.nn.functional as F
from torch import nn

from .mamba1 import Mamba1Block, RecurrentContext, SSMCache, causal_conv

SPAN_CHUNKS = 8


def _decays(a_cum: torch.Tensor) -> torch.Tensor:
    """exp(a_cum[i] - a_cum[j]) for j <= i, else 0: the decay from step j to step i inside a chunk.

    The difference of in-chunk cumulative sums, as mamba_ssm's kernels compute it; transformers' masked
    cumsum over a (T, T) expansion agrees to float32 rounding and is slower.
    """
    T = a_cum.shape[-1]
    causal = torch.ones(T, T, dtype=torch.bool, device=a_cum.device).tril()
    return torch.exp((a_cum[..., :, None] - a_cum[..., None, :]).masked_fill(~causal, -torch.inf))


def _ssd_span(x, dt, A, B, C, chunk, state):
    """SSD over one span. x (b, L, g, r, p), dt (b, L, g, r), A (g, r), B, C (b, L, g, n), state (b, g, r, p, n)."""
    L = x.shape[1]
    T = min(chunk, L)
    pad = -L % T
    if pad:  # dt = 0 past the end: no input, no decay, so the last state is the state after token L
        x, dt, B, C = (F.pad(t, (0, 0) * (t.dim() - 2) + (0, pad)) for t in (x, dt, B, C))
    c = (L + pad) // T
    x = x.unflatten(1, (c, T)).permute(0, 1, 3, 4, 2, 5)  # (b, c, g, r, T, p)
    dt = dt.unflatten(1, (c, T)).permute(0, 1, 3, 4, 2)  # (b, c, g, r, T)
    B = B.unflatten(1, (c, T)).permute(0, 1, 3, 2, 4)[:, :, :, None]  # (b, c, g, 1, T, n)
    C = C.unflatten(1, (c, T)).permute(0, 1, 3, 2, 4)[:, :, :, None]
    a_cum = (dt * A[..., None]).cumsum(dim=-1)  # log decay from the chunk's start
    xdt = x * dt[..., None]

    # inside each chunk: y = (C B^T masked by the decays) xdt
    y = ((C @ B.transpose(-1, -2)) * _decays(a_cum)) @ xdt
    # each chunk's own contribution to the state at its end
    to_end = torch.exp(a_cum[..., -1:] - a_cum)
    ends = (xdt * to_end[..., None]).transpose(-1, -2) @ B  # (b, c, g, r, p, n)
    # between chunks: carry the state, one step per chunk
    decay = torch.exp(a_cum[..., -1])[..., None, None]  # (b, c, g, r, 1, 1)
    starts = []
    for i in range(c):
        starts.append(state)
        state = state * decay[:, i] + ends[:, i]
    starts = torch.stack(starts, dim=1)
    y = y + (C @ starts.transpose(-1, -2)) * torch.exp(a_cum)[..., None]
    y = y.permute(0, 1, 4, 2, 3, 5).flatten(1, 2)[:, :L]  # (b, L, g, r, p)
    return y, state


def ssd(x, dt, A, B, C, chunk, state):
    """The chunked SSD scan over spans of SPAN_CHUNKS chunks; returns (y like x, last state). Float32."""
    ys, span = [], chunk * SPAN_CHUNKS
    for s in range(0, x.shape[1], span):
        part = slice(s, s + span)
        y, state = _ssd_span(x[:, part], dt[:, part], A, B[:, part], C[:, part], chunk, state)
        ys.append(y)
    return torch.cat(ys, dim=1), state


def ssd_step(x, dt, A, B, C, state):
    """One token of the recurrence: state <- exp(dt A) state + dt x B^T, y = state C. Shapes as `ssd`, L = 1."""
    x, dt, B, C = x[:, 0], dt[:, 0], B[:, 0, :, None, None], C[:, 0, :, None, :, None]
    state = state * torch.exp(dt * A)[..., None, None] + (x * dt[..., None])[..., None] * B
    return (state @ C).squeeze(-1)[:, None], state


class GatedRMSNorm(nn.Module):
    """RMSNorm of y * silu(z) over each of n_groups slices, in float32: Mamba 2's output norm."""

    def __init__(self, dim: int, n_groups: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim), requires_grad=False)
        self.n_groups, self.eps = n_groups, eps

    def forward(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        y = (y.float() * F.silu(z.float())).unflatten(-1, (self.n_groups, -1))
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * y.flatten(-2)


class Mamba2Mixer(nn.Module):
    def __init__(self, d_model: int, o: dict, dtype):
        super().__init__()
        d_inner, n, h, g = o["d_inner"], o["d_state"], o["n_heads"], o["n_groups"]
        self.sizes = (d_inner, d_inner + 2 * g * n, h)  # in_proj rows: z, x|B|C (through the conv), dt
        self.heads = (g, h // g, o["head_dim"])
        self.d_state, self.chunk_size, self.dt_limit = n, o["chunk_size"], o["dt_limit"]
        conv_dim = self.sizes[1]
        self.in_proj = nn.Linear(d_model, sum(self.sizes), bias=o["bias"], dtype=dtype)
        self.conv1d = nn.Conv1d(conv_dim, conv_dim, o["d_conv"], groups=conv_dim, bias=o["conv_bias"], dtype=dtype)
        self.dt_bias = nn.Parameter(torch.empty(h), requires_grad=False)
        self.A_log = nn.Parameter(torch.empty(h), requires_grad=False)
        self.D = nn.Parameter(torch.empty(h), requires_grad=False)
        self.norm = GatedRMSNorm(d_inner, g, o["norm_eps"])
        self.out_proj = nn.Linear(d_inner, d_model, bias=o["bias"], dtype=dtype)

    def forward(self, h: torch.Tensor, cache: SSMCache | None, ctx: RecurrentContext) -> torch.Tensor:
        b, L, _ = h.shape
        (g, r, p), n = self.heads, self.d_state
        fresh = cache is None or ctx.start == 0
        z, xBC, dt = self.in_proj(h).split(self.sizes, dim=-1)
        xBC = causal_conv(xBC.transpose(1, 2), self.conv1d, cache, ctx).transpose(1, 2)
        x, B, C = xBC.split([g * r * p, g * n, g * n], dim=-1)
        x = x.unflatten(-1, (g, r, p))
        dt = F.softplus(dt.float() + self.dt_bias).clamp(*self.dt_limit).unflatten(-1, (g, r))
        A = -torch.exp(self.A_log).view(g, r)
        state = x.new_zeros(b, g, r, p, n, dtype=torch.float32) if fresh else cache.ssm.view(b, g, r, p, n)
        B, C = B.unflatten(-1, (g, n)).float(), C.unflatten(-1, (g, n)).float()
        if L == 1:
            y, state = ssd_step(x.float(), dt, A, B, C, state)
        else:
            y, state = ssd(x.float(), dt, A, B, C, self.chunk_size, state)
        if cache is not None:
            cache.ssm.copy_(state.view(cache.ssm.shape))
        y = y + x * self.D.view(g, r, 1)
        return self.out_proj(self.norm(y.flatten(2), z).to(h.dtype))

    def new_cache(self, batch: int, dtype, device) -> SSMCache:
        g, r, p = self.heads
        return SSMCache(torch.zeros(batch, self.sizes[1], self.conv1d.weight.shape[-1] - 1, dtype=dtype, device=device),
                        torch.zeros(batch, g * r, p, self.d_state, device=device))


class Mamba2Block(Mamba1Block):
    Mixer = Mamba2Mixer
    PROJECTIONS = ("mixer.in_proj", "mixer.out_proj")
