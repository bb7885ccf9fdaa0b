"""Rotary position embeddings and their scalings, computed as transformers computes them."""

import math

import torch

ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope")


def inverse_frequencies(rope: dict, dim: int) -> tuple[torch.Tensor, float]:
    """Return (inv_freq, attention_scaling) for a rope spec as `plan_for` normalizes it."""
    base = rope["theta"]
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    inv_freq = 1.0 / (base**exponents)
    kind = rope["type"]
    if kind == "default":
        return inv_freq, 1.0
    if kind == "linear":
        return inv_freq / rope["factor"], 1.0
    if kind == "llama3":
        return _llama3(inv_freq, rope), 1.0
    if kind == "yarn":
        return _yarn(base, dim, rope)
    if kind == "longrope":
        return _longrope(base, dim, rope, rope["short_factor"])
    raise ValueError(f"rope type {kind!r} is not one of {ROPE_TYPES}")


def _llama3(inv_freq: torch.Tensor, rope: dict) -> torch.Tensor:
    """Llama 3.1: long wavelengths divided by `factor`, short ones kept, the band between blended."""
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    context = rope["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > context / low, inv_freq / factor, inv_freq)
    smooth = (context / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < context / high) * ~(wavelen > context / low)
    return torch.where(medium, blended, scaled)


def _yarn(base: float, dim: int, rope: dict) -> tuple[torch.Tensor, float]:
    """YaRN: interpolate low frequencies, extrapolate high ones, ramp between; scale cos/sin."""
    factor = rope["factor"]
    context = rope["original_max_position_embeddings"]

    def mscale(scale, m=1.0):
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention = rope.get("attention_factor")
    if attention is None:
        m, m_all = rope.get("mscale"), rope.get("mscale_all_dim")
        attention = float(mscale(factor, m) / mscale(factor, m_all)) if m and m_all else mscale(factor)

    def correction_dim(rotations):
        return (dim * math.log(context / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low = correction_dim(rope.get("beta_fast") or 32)
    high = correction_dim(rope.get("beta_slow") or 1)
    if rope.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    extrapolate = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolate) + (1.0 / pos_freqs) * extrapolate
    return inv_freq, attention


def _longrope(base: float, dim: int, rope: dict, factors) -> tuple[torch.Tensor, float]:
    """LongRoPE (Phi-3): each frequency divided by its own factor; cos/sin scaled by the attention factor, by default
    sqrt(1 + ln(factor) / ln(original context)) where factor = max_position_embeddings / original context."""
    attention = rope.get("attention_factor")
    if attention is None:
        factor, context = rope["factor"], rope["original_max_position_embeddings"]
        attention = 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(context))
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    return 1.0 / (torch.tensor(factors, dtype=torch.float32) * base**exponents), attention


class Rotary:
    """cos/sin tables for given positions; computed once per forward and shared by every layer. `dim` is the
    rotated part of a head (all of it, or partial_rotary_factor of it)."""

    def __init__(self, rope: dict, dim: int, device):
        inv_freq, self.scaling = inverse_frequencies(rope, dim)
        self.inv_freq = inv_freq.to(device)
        self.long = None  # LongRoPE: (long factors' inv_freq, original context)
        if rope["type"] == "longrope":
            long, _ = _longrope(rope["theta"], dim, rope, rope["long_factor"])
            self.long = (long.to(device), rope["original_max_position_embeddings"])

    def __call__(self, positions: torch.Tensor, dtype: torch.dtype,
                 groups: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """positions (B, L) -> cos, sin of shape (B, L, 1, dim) in `dtype`, broadcast over heads.

        LongRoPE takes its long factors for a forward whose largest position is past the original context, as
        the reference decides per forward; with `groups` (each position's sequence, in a paged step) per
        sequence, so that no sequence's tables depend on its batch-mates."""
        inv_freq = self.inv_freq if self.long is None else self._longrope_choice(positions, groups)
        freqs = positions[..., None].float() * inv_freq
        angles = torch.cat((freqs, freqs), dim=-1)[:, :, None]
        return (angles.cos() * self.scaling).to(dtype), (angles.sin() * self.scaling).to(dtype)

    def _longrope_choice(self, positions: torch.Tensor, groups: torch.Tensor | None) -> torch.Tensor:
        long, context = self.long
        if groups is None:
            return long if int(positions.max()) + 1 > context else self.inv_freq
        flat, seqs = positions.reshape(-1), groups.reshape(-1)
        last = torch.zeros(int(seqs.max()) + 1, dtype=flat.dtype, device=flat.device)
        last = last.scatter_reduce(0, seqs, flat, "amax")
        use_long = (last[seqs] + 1 > context).reshape(positions.shape)
        return torch.where(use_long[..., None], long, self.inv_freq)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate (B, L, H, D) by the half-split convention of Hugging Face checkpoints; where the tables are
    narrower than D (partial rotary), the first cos.shape[-1] values only, the rest passed through."""
    if cos.shape[-1] < x.shape[-1]:
        rotated, passed = x.split((cos.shape[-1], x.shape[-1] - cos.shape[-1]), dim=-1)
        return torch.cat((apply_rotary(rotated, cos, sin), passed), dim=-1)
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin
