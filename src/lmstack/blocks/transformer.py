"""The pre-norm transformer block shared by every attention family, configured by plan options."""

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .. import formats, kernels, memory
from ..rope import apply_rotary

ACTIVATIONS = {
    "silu": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
}


class RMSNorm(nn.Module):
    """Normalize in float32, scale in the input's dtype: the order the reference uses. With an `offset` (Gemma's
    1.0), scale by (offset + weight) in float32 and round once, as Gemma's reference does."""

    def __init__(self, dim: int, eps: float, offset: float | None = None):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim), requires_grad=False)
        self.eps, self.offset = eps, offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.offset is not None:
            normed = F.rms_norm(x.float(), self.weight.shape, eps=self.eps)
            return (normed * (self.offset + self.weight.float())).to(x.dtype)
        if self.weight.dtype == x.dtype and kernels.usable(x):  # (Mamba keeps a float32 weight)
            return kernels.rms_norm(x, self.weight, self.eps)
        return self.weight * F.rms_norm(x.float(), self.weight.shape, eps=self.eps).to(x.dtype)


@dataclass
class KVCache:
    """One layer's keys and values, preallocated for max_tokens and written in place."""

    k: torch.Tensor  # (B, n_kv_heads, max_tokens, head_dim)
    v: torch.Tensor


@dataclass
class AttentionContext:
    """What every layer of one forward shares: where the new tokens go, rotary tables, masks."""

    start: int  # cache slot of the first new token
    cos: torch.Tensor
    sin: torch.Tensor
    masks: dict  # window (None: full) -> boolean mask (B, 1, L, S), or None for plain causal; with `alone`, a list
    # of each query's one-token-step mask
    alone: bool = False  # each query attends as a one-token step would (needs the kernels): exact verification
    local: tuple | None = None  # (cos, sin) of the sliding layers' own rotary settings (Gemma 3), where they differ


@dataclass
class PagedKV:
    """One layer's share of a paged KV pool: fixed-size blocks of slots that any sequence may own, in any order."""

    k: torch.Tensor  # (n_blocks, n_kv_heads, block_size, head_dim)
    v: torch.Tensor


@dataclass
class PagedContext:
    """Tokens of many sequences laid out in one row (1, T), each reading its sequence's keys through a block table."""

    cos: torch.Tensor  # (1, T, 1, head_dim)
    sin: torch.Tensor
    slots: torch.Tensor  # (T,) pool slot (block * block_size + offset) each token's k and v are written to
    tables: torch.Tensor  # (S, max_blocks) int64: each sequence's blocks in order
    seqs: torch.Tensor  # (T,) each token's sequence (row of tables)
    positions: torch.Tensor  # (T,) each token's position: it attends to its sequence's positions up to it
    local: tuple | None = None  # (cos, sin) of the sliding layers' own rotary settings (Gemma 3), where they differ


def paged_attention(q, cache: PagedKV, ctx: PagedContext, window: int | None, scale: float | None = None,
                    softcap: float | None = None) -> torch.Tensor:
    """q (T, H, D) -> (T, H * D): token t attends to positions max(0, p - window + 1)..p of its sequence, p its
    position. Each (token, head) is computed alone, in the same order whatever the other tokens are. Scores are
    scaled by `scale` (None: 1/sqrt(D)) and soft-capped by `softcap`, which only the reference path takes."""
    if kernels.usable(q) and softcap is None:
        return kernels.paged_attention(q, cache.k, cache.v, ctx.tables, ctx.seqs, ctx.positions, window or 0, scale)
    return _paged_attention_reference(q, cache, ctx, window, scale, softcap)


def _paged_attention_reference(q, cache: PagedKV, ctx: PagedContext, window: int | None, scale: float | None = None,
                               softcap: float | None = None) -> torch.Tensor:
    """PyTorch's operators, one sequence at a time, in float64 rounded once to q's dtype: where the kernel cannot run,
    other rows change a result only when float64 sums that differ in their last bits round differently."""
    T, H, D = q.shape
    n_blocks, KV, size, _ = cache.k.shape
    out = torch.empty(T, H, D, dtype=q.dtype, device=q.device)
    for s in ctx.seqs.unique().tolist():
        rows = (ctx.seqs == s).nonzero()[:, 0]
        positions = ctx.positions[rows]
        n = int(positions.max()) + 1
        blocks = ctx.tables[s, :(n + size - 1) // size]
        k, v = (c[blocks].transpose(0, 1).reshape(KV, -1, D)[:, :n].double() for c in (cache.k, cache.v))
        k, v = k.repeat_interleave(H // KV, 0), v.repeat_interleave(H // KV, 0)  # (H, n, D)
        scores = (q[rows].transpose(0, 1).double() @ k.transpose(1, 2)) * (D ** -0.5 if scale is None else scale)
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap  # (H, L, n)
        keys = torch.arange(n, device=q.device)
        allowed = keys[None] <= positions[:, None]
        if window is not None:
            allowed &= positions[:, None] - keys[None] < window
        y = scores.masked_fill(~allowed, -torch.inf).softmax(-1) @ v
        out[rows] = y.transpose(0, 1).to(q.dtype)
    return out.view(T, H * D)


class Attention(nn.Module):
    """Grouped-query attention with rotary q and k. Options beyond Llama's: `scale` of the scores (None:
    1/sqrt(head_dim)), `softcap` (scores -> cap * tanh(scores / cap)), `local_rope` (the context's second rotary
    tables, for a sliding layer), `norm_offset` of the q/k norms, `rotary_dim` (rotate that many values of each
    head, pass the rest: partial rotary; None: all)."""

    def __init__(self, d_model, n_heads, n_kv_heads, head_dim, qkv_bias, o_bias, qk_norm, norm_eps, window,
                 scale=None, softcap=None, local_rope=False, norm_offset=None, rotary_dim=None):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim, self.window = n_heads, n_kv_heads, head_dim, window
        self.scale, self.softcap, self.local_rope, self.rotary_dim = scale, softcap, local_rope, rotary_dim
        self.qkv = nn.Linear(d_model, (n_heads + 2 * n_kv_heads) * head_dim, bias=qkv_bias)
        self.o = nn.Linear(n_heads * head_dim, d_model, bias=o_bias)
        self.q_norm = RMSNorm(head_dim, norm_eps, norm_offset) if qk_norm else None
        self.k_norm = RMSNorm(head_dim, norm_eps, norm_offset) if qk_norm else None

    def rotary(self, ctx) -> tuple[torch.Tensor, torch.Tensor]:
        """The (cos, sin) tables this layer rotates by."""
        return ctx.local if self.local_rope and ctx.local is not None else (ctx.cos, ctx.sin)

    def forward(self, x: torch.Tensor, cache: KVCache | None, ctx: AttentionContext) -> torch.Tensor:
        B, L, _ = x.shape
        H, KV = self.n_heads, self.n_kv_heads
        qkv = self.qkv(x).view(B, L, H + 2 * KV, self.head_dim)
        if self.q_norm is not None:
            qkv = torch.cat((self.q_norm(qkv[:, :, :H]), self.k_norm(qkv[:, :, H:H + KV]), qkv[:, :, H + KV:]), dim=2)
        if isinstance(ctx, PagedContext):
            return self.o(self._paged(qkv, cache, ctx)[None])
        mask = ctx.masks[self.window]
        cos, sin = self.rotary(ctx)
        if cache is not None and kernels.usable(qkv) and self.rotary_dim is None:  # (the kernel rotates whole heads)
            q = kernels.rope_into_cache(qkv, cos, sin, cache.k, cache.v, ctx.start)
            end = ctx.start + L
            if ctx.alone:
                y = [self._one_query(q[:, i:i + 1], cache, ctx.start + i + 1, mask[i]) for i in range(L)]
                return self.o(torch.cat(y, dim=1))
            if L == 1:
                return self.o(self._one_query(q, cache, end, mask))
            if (mask is None and self.softcap is None and qkv.dtype == torch.bfloat16 and self.head_dim % 32 == 0
                    and kernels.gemm_for_prefill()):  # (with AMX PyTorch's attention keeps it, as oneDNN the GEMMs)
                return self.o(kernels.prefill_attention(q, cache.k, cache.v, ctx.start, self.scale))
            q, k, v = q.transpose(1, 2), cache.k[:, :, :end], cache.v[:, :, :end]
        else:
            qk = apply_rotary(qkv[:, :, :H + KV], cos, sin)  # the q and k heads in one pass
            q, k, v = qk[:, :, :H].transpose(1, 2), qk[:, :, H:].transpose(1, 2), qkv[:, :, H + KV:].transpose(1, 2)
            if cache is not None:
                end = ctx.start + L
                cache.k[:, :, ctx.start:end] = k
                cache.v[:, :, ctx.start:end] = v
                k, v = cache.k[:, :, :end], cache.v[:, :, :end]
        y = self._attend(q, k, v, mask, causal=mask is None and L > 1)
        return self.o(y.transpose(1, 2).reshape(B, L, H * self.head_dim))

    def _attend(self, q, k, v, mask, causal: bool) -> torch.Tensor:
        """q (B, H, L, D) over k, v (B, KV, S, D) -> (B, H, L, D); `mask` boolean, or None (causal or none)."""
        gqa = self.n_kv_heads != self.n_heads
        if self.softcap is not None:
            return self._attend_softcapped(q, k, v, mask, causal)
        if q.shape[2] == 1 and mask is None and q.dtype == torch.bfloat16 and q.device.type == "cpu":
            # one query: PyTorch's CPU kernel is 3x faster on float32 copies than on bfloat16
            return F.scaled_dot_product_attention(q.float(), k.float(), v.float(), enable_gqa=gqa,
                                                  scale=self.scale).to(q.dtype)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, enable_gqa=gqa,
                                              scale=self.scale)

    def _attend_softcapped(self, q, k, v, mask, causal: bool) -> torch.Tensor:
        """Attention with soft-capped scores, which SDPA cannot do: as the reference's eager path computes it
        (scores in q's dtype, softmax in float32 rounded back)."""
        groups = self.n_heads // self.n_kv_heads
        k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
        scale = self.head_dim ** -0.5 if self.scale is None else self.scale
        scores = torch.tanh((q @ k.transpose(2, 3)) * scale / self.softcap) * self.softcap
        L, S = scores.shape[-2:]
        if causal:
            mask = torch.ones(L, S, dtype=torch.bool, device=q.device).tril(S - L)
        if mask is not None:
            scores = scores.masked_fill(~mask, -torch.inf)
        return scores.softmax(-1, dtype=torch.float32).to(q.dtype) @ v

    def _one_query(self, q: torch.Tensor, cache: KVCache, end: int, mask) -> torch.Tensor:
        """A one-token step's attention with the kernels: q (B, 1, H, D), its k and v already at slot end - 1,
        over slots 0..end-1 -> (B, 1, H * D)."""
        if mask is None and self.softcap is None:
            return kernels.decode_attention(q, cache.k, cache.v, end, self.scale)
        y = self._attend(q.transpose(1, 2), cache.k[:, :, :end], cache.v[:, :, :end], mask, causal=False)
        return y.transpose(1, 2).reshape(q.shape[0], 1, -1)

    def _paged(self, qkv: torch.Tensor, cache: PagedKV, ctx: PagedContext) -> torch.Tensor:
        """qkv (1, T, H + 2 KV, D) of tokens laid out as ctx says: k and v into the pool, then attention."""
        H, KV = self.n_heads, self.n_kv_heads
        cos, sin = self.rotary(ctx)
        if kernels.usable(qkv) and self.rotary_dim is None:
            q = kernels.rope_into_pages(qkv, cos, sin, cache.k, cache.v, ctx.slots)[0]
        else:
            qk = apply_rotary(qkv[:, :, :H + KV], cos, sin)[0]
            size = cache.k.shape[2]
            blocks, offsets = ctx.slots // size, ctx.slots % size
            cache.k[blocks, :, offsets] = qk[:, H:]
            cache.v[blocks, :, offsets] = qkv[0, :, H + KV:]
            q = qk[:, :H]
        return paged_attention(q, cache, ctx, self.window, self.scale, self.softcap)


class MLP(nn.Module):
    def __init__(self, d_model, d_ff, act, bias):
        super().__init__()
        self.gate_up = nn.Linear(d_model, 2 * d_ff, bias=bias)
        self.down = nn.Linear(d_ff, d_model, bias=bias)
        self.act, self.act_name = ACTIVATIONS[act], act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up(x)
        if self.act is F.silu and kernels.usable(gate_up):
            return self.down(kernels.silu_mul(gate_up))
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down(self.act(gate) * up)


class MixtureOfExperts(nn.Module):
    """The MLP as a mixture: a router scores every expert, each token runs through its top_k experts, and their
    outputs are summed weighted by the softmax of the scores (over all experts, then the chosen renormalized to
    sum to 1 where `norm_topk_prob`), as transformers' Qwen3-MoE and Mixtral compute it. Mixtral keeps the weights
    in float32 (`float32_weights`), Qwen3-MoE rounds them to the activations' dtype first.

    Only the chosen experts run, each on the tokens that chose it (a prefill groups its tokens by expert). A token's
    expert outputs are added in expert order, each row computed by projections that are row-invariant under
    formats.row_invariant, so a token's result does not depend on the tokens that share the step."""

    def __init__(self, d_model: int, options: dict, act: str):
        super().__init__()
        self.top_k, self.norm_topk_prob = options["top_k"], options["norm_topk_prob"]
        self.float32_weights, self.act_name = options["float32_weights"], act
        self.router = nn.Linear(d_model, options["n_experts"], bias=False)
        self.experts = nn.ModuleList(MLP(d_model, options["d_ff"], act, False) for _ in range(options["n_experts"]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        probs = self._router_logits(x).float().softmax(-1)
        weights, chosen = probs.topk(self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(-1, keepdim=True)
        if not self.float32_weights:
            weights = weights.to(x.dtype)
        out = torch.zeros_like(x)
        for e in chosen.unique().tolist():  # ascending: each token's outputs summed in expert order
            rows, k = (chosen == e).nonzero(as_tuple=True)
            y = self.experts[e](x[rows]) * weights[rows, k, None]
            out.index_add_(0, rows, y.to(x.dtype))
        return out.view(shape)

    def _router_logits(self, x: torch.Tensor) -> torch.Tensor:
        """x @ router.T in x's dtype; lmstack's kernels where a projection would take them (few rows, or under
        formats.row_invariant), so the routing of a row does not depend on its batch-mates either."""
        w = self.router.weight
        if kernels.usable(x) and w.dtype == x.dtype and (
                x.shape[0] <= formats.MATVEC_ROWS or formats.row_invariant_active()):
            return kernels.matvec_f32(x, w, None) if x.dtype == torch.float32 else kernels.matvec_bf16(x, w, None)
        return F.linear(x, w)


class TransformerBlock(nn.Module):
    """Pre-norm attention and MLP, each added to the residual. Options beyond Llama's: `sandwich_norms` (a norm on
    each output before its residual add, Gemma's), `norm_offset` (see RMSNorm), Attention's `attn_scale`,
    `attn_softcap`, `local_rope` (sliding layers rotate by their own settings) and `rotary_dim`, and `experts`
    (the MLP as a MixtureOfExperts, in the layers where `experts` is passed True)."""

    PROJECTIONS = ("attn.qkv", "attn.o", "mlp.gate_up", "mlp.down")  # what a weight format may re-store

    def __init__(self, d_model: int, options: dict, window: int | None, experts: bool = False):
        super().__init__()
        o = options
        offset = o.get("norm_offset")
        self.attn_norm = RMSNorm(d_model, o["norm_eps"], offset)
        self.attn = Attention(d_model, o["n_heads"], o["n_kv_heads"], o["head_dim"], o["qkv_bias"],
                              o["o_bias"], o["qk_norm"], o["norm_eps"], window, scale=o.get("attn_scale"),
                              softcap=o.get("attn_softcap"), local_rope=window is not None and "local_rope" in o,
                              norm_offset=offset, rotary_dim=o.get("rotary_dim"))
        self.mlp_norm = RMSNorm(d_model, o["norm_eps"], offset)
        if experts:
            self.mlp = MixtureOfExperts(d_model, o["experts"], o["act"])
            self.PROJECTIONS = self.PROJECTIONS[:2] + tuple(
                f"mlp.experts.{e}.{p}" for e in range(len(self.mlp.experts)) for p in ("gate_up", "down"))
        else:
            self.mlp = MLP(d_model, o["d_ff"], o["act"], o["mlp_bias"])
        sandwich = o.get("sandwich_norms", False)
        self.post_attn_norm = RMSNorm(d_model, o["norm_eps"], offset) if sandwich else None
        self.post_mlp_norm = RMSNorm(d_model, o["norm_eps"], offset) if sandwich else None

    def forward(self, x: torch.Tensor, cache: KVCache | None, ctx: AttentionContext) -> torch.Tensor:
        if cache is not None and self.fusable(x, ctx) and (layer := self.fused_layer(x.dtype)) is not None:
            cos, sin = self.attn.rotary(ctx)
            if isinstance(ctx, PagedContext):
                return layer.paged(x, cos, sin, cache.k, cache.v, ctx.slots, ctx.tables, ctx.seqs, ctx.positions)
            return layer.decode(x, cos, sin, cache.k, cache.v, ctx.start)
        y = self.attn(self.attn_norm(x), cache, ctx)
        h = x + (y if self.post_attn_norm is None else self.post_attn_norm(y))
        y = self.mlp(self.mlp_norm(h))
        return h + (y if self.post_mlp_norm is None else self.post_mlp_norm(y))

    def fused_options(self) -> list[str]:
        """The options this block uses that kernels_layer.cpp's Layer does not take: where any is, the block runs
        its Python path (never a fused call that would compute something else)."""
        a = self.attn
        used = {"attn_softcap": a.softcap is not None, "rotary_dim": a.rotary_dim is not None}
        return [name for name, on in used.items() if on]

    def fusable(self, x: torch.Tensor, ctx) -> bool:
        """Whether forward calls only lmstack's kernels for these rows, so that one fused call can stand for it:
        a decode step (one new token per row, no mask) or a paged step."""
        few = x.shape[0] * x.shape[1] <= formats.MATVEC_ROWS or formats.row_invariant_active()
        if not few or not kernels.usable(x):
            return False
        return isinstance(ctx, PagedContext) or (x.shape[1] == 1 and not ctx.alone and
                                                 ctx.masks[self.attn.window] is None)

    def fused_layer(self, dtype: torch.dtype) -> torch.ScriptObject | None:
        """The whole block as one call of lmstack's kernels (kernels_layer.cpp's Layer), made once per dtype;
        None where a part has no kernel."""
        fused = getattr(self, "_layer", None)
        if fused is None or fused[0] != dtype:
            self._layer = fused = (dtype, self._build_fused(dtype))
        return fused[1]

    def _build_fused(self, dtype: torch.dtype) -> torch.ScriptObject | None:
        a, mlp = self.attn, self.mlp
        if self.fused_options():
            return None
        norms = [self.attn_norm, self.mlp_norm, a.q_norm, a.k_norm, self.post_attn_norm, self.post_mlp_norm]
        projections = [("qkv", a.qkv), ("o", a.o)]
        if isinstance(mlp, MixtureOfExperts):
            projections += [(name, getattr(expert, p)) for expert in mlp.experts
                            for name, p in (("expert_gate_up", "gate_up"), ("expert_down", "down"))]
        else:
            projections += [("gate_up", mlp.gate_up), ("down", mlp.down)]
        calls = [(name, getattr(module, "kernel_call", lambda _: None)(dtype)) for name, module in projections]
        offset = self.attn_norm.offset
        if (offset is None and any(n.weight.dtype != dtype for n in norms if n is not None)) or \
                any(c is None for _, c in calls):
            return None
        # with an offset every norm scales by (offset + weight) in float32, as RMSNorm.forward
        w = [None if n is None else n.weight if offset is None else offset + n.weight.float() for n in norms]
        layer = torch.classes.lmstack.Layer(w[0], w[1], self.attn_norm.eps, a.n_heads, a.n_kv_heads, a.head_dim,
                                            a.window or 0, self.mlp.act_name)
        layer.set_float32_norms(offset is not None)
        layer.set_attention(a.scale or 0.0, a.local_rope)
        if a.q_norm is not None:
            layer.set_qk_norms(w[2], w[3])
        if self.post_attn_norm is not None:
            layer.set_post_norms(w[4], w[5])
        for name, c in calls:
            layer.set_projection(name, c.kind, c.weight, c.scales, c.n, c.qtype, c.bias, c.bias_after)
            for part in c.parts:
                layer.add_part(name, part.kind, part.weight, part.scales, part.n, part.qtype, part.bias,
                               part.bias_after)
        if isinstance(mlp, MixtureOfExperts):
            router = mlp.router.weight  # as MixtureOfExperts._router_logits computes a few rows
            kind = "linear" if router.dtype != dtype else "f32" if dtype == torch.float32 else "bf16"
            layer.set_projection("router", kind, router, None, router.shape[0], 0, None, None)
            layer.set_experts(mlp.top_k, mlp.norm_topk_prob, mlp.float32_weights)
        return layer

    def new_cache(self, batch: int, max_tokens: int, dtype, device) -> KVCache:
        a = self.attn
        shape = (batch, a.n_kv_heads, max_tokens, a.head_dim)
        return KVCache(memory.zeros(shape, dtype, device), memory.zeros(shape, dtype, device))

    def new_pages(self, n_blocks: int, block_size: int, dtype, device) -> PagedKV:
        """Zero pages mapped on first touch: untouched pages take no memory (RSS grows with use, not with the
        pool's size)."""
        a = self.attn
        shape = (n_blocks, a.n_kv_heads, block_size, a.head_dim)
        return PagedKV(memory.zeros(shape, dtype, device), memory.zeros(shape, dtype, device))
