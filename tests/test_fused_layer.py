"""The fused blocks (kernels_layer.cpp): one call per layer (TransformerBlock.fused_layer), or one for the whole
stack (CausalLM._fused_stack), gives bit for bit what the blocks' Python code gives, decode steps and paged engine
steps alike, for every weight format and family.

The oracle is the same model with the fused path switched off, run beside it in the same test.
"""

import gguf
import pytest
import torch

from lmstack import CausalLM, kernels
from lmstack.blocks.transformer import TransformerBlock
from lmstack.engine import Engine

needs_kernels = pytest.mark.skipif(not kernels.available(), reason="the fused block needs the kernels")
FAMILIES = ["llama", "llama_tied_gqa", "llama_bias", "mistral_window", "qwen2_sliding", "qwen3", "qwen3_bias_sliding",
            "phi3", "gemma3_text", "gemma3_text_legacy", "qwen3_moe_norm", "mixtral"]


@pytest.fixture
def unfused(monkeypatch):
    """Within it, every block runs its Python code."""
    def off():
        monkeypatch.setattr(TransformerBlock, "fusable", lambda self, x, ctx: False)
    return off


def decode_logits(lm, rows=1):
    """Prefill 2 tokens per row, then 12 greedy steps: the logits of every step (past every sliding window, whose
    masked steps are not fused)."""
    ids = torch.randint(0, 256, (rows, 2), generator=torch.Generator().manual_seed(0))
    state = lm.allocate_state(rows, 20)
    logits = [lm.forward(ids, state)[:, -1]]
    for _ in range(12):
        logits.append(lm.step(logits[-1].argmax(-1), state))
    return torch.stack(logits)


def fused_layers(lm) -> int:
    return sum(getattr(block, "_layer", (None, None))[1] is not None for block in lm.blocks)


def stacked(lm) -> bool:
    return getattr(lm, "_stack", (None, None))[1] is not None


@needs_kernels
@pytest.mark.parametrize("weight_format, profile", [("float32", None), ("bfloat16", None), ("bfloat16", "bf16"),
                                                    ("int8", None), ("int8", "bf16"), ("int4", "bf16")])
@pytest.mark.parametrize("name", FAMILIES)
def test_fused_decode_steps_equal_the_blocks_python(tiny_checkpoint, unfused, name, weight_format, profile):
    lm = CausalLM.load(tiny_checkpoint(name)[0], weight_format=weight_format, numeric_profile=profile, device="cpu")
    got = decode_logits(lm, rows=2)
    assert fused_layers(lm) == len(lm.blocks) and stacked(lm)
    unfused()
    assert torch.equal(got, decode_logits(lm, rows=2))


@needs_kernels
@pytest.mark.parametrize("profile", [None, "bf16"])
@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q4_1"])
def test_fused_decode_of_gguf_blocks_equals_the_blocks_python(tiny_checkpoint, tmp_path, unfused, qtype, profile):
    from test_gguf import write_gguf

    write_gguf(tmp_path / "m.gguf", tiny_checkpoint("llama_tied_gqa")[1], qtype=gguf.GGMLQuantizationType[qtype])
    lm = CausalLM.load(tmp_path / "m.gguf", weight_format="gguf", numeric_profile=profile, device="cpu")
    got = decode_logits(lm)
    assert fused_layers(lm) == len(lm.blocks) and stacked(lm)
    unfused()
    assert torch.equal(got, decode_logits(lm))


@needs_kernels
def test_fused_decode_of_mixed_gguf_types_equals_the_blocks_python(tiny_checkpoint, tmp_path, unfused):
    """A Q4_K_M file's mix: v and up in other types than q, k and gate (a projection of parts of two
    types: kernels_layer.cpp's "cat")."""
    from test_gguf import write_gguf

    reference = tiny_checkpoint("llama_tied_gqa")[1]
    mixed = {f"model.layers.{i}.{name}.weight": gguf.GGMLQuantizationType.Q8_0
             for i in range(reference.config.num_hidden_layers) for name in ("self_attn.v_proj", "mlp.up_proj")}
    write_gguf(tmp_path / "m.gguf", reference, qtype=gguf.GGMLQuantizationType.Q4_0, tensor_types=mixed)
    lm = CausalLM.load(tmp_path / "m.gguf", weight_format="gguf", numeric_profile="bf16", device="cpu")
    got = decode_logits(lm)
    assert fused_layers(lm) == len(lm.blocks) and stacked(lm)
    unfused()
    assert torch.equal(got, decode_logits(lm))


@needs_kernels
@pytest.mark.parametrize("name", ["llama_bias", "qwen2_sliding", "qwen3", "gemma3_text", "qwen3_moe"])
def test_fused_paged_steps_equal_the_blocks_python(tiny_checkpoint, unfused, name):
    lm = CausalLM.load(tiny_checkpoint(name)[0], weight_format="bfloat16", numeric_profile="bf16", device="cpu")

    def serve():
        prompts = [torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (3, 9, 17)]
        engine = Engine(lm, max_running=4, block_size=4, max_prefill_tokens=8)
        handles = [engine.add(p, max_tokens=10) for p in prompts]
        return [list(h) for h in handles]

    got = serve()
    assert fused_layers(lm) == len(lm.blocks) and stacked(lm)
    unfused()
    assert serve() == got


@needs_kernels
def test_a_masked_or_many_row_step_is_not_fused(tiny_checkpoint):
    lm = CausalLM.load(tiny_checkpoint("llama")[0], weight_format="bfloat16", numeric_profile="bf16", device="cpu")
    lm.generate([[1, 2, 3], [4, 5]], 3)  # ragged rows: left padding needs a mask every step
    lm.generate(torch.zeros(9, 3, dtype=torch.long), 3)  # more rows than the kernels take
    assert fused_layers(lm) == 0 and not stacked(lm)
