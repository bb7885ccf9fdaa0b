"""GPU check for ParallelCausalLM: a model split between cuda:0 and the CPU against the one-device model.

    python bench/parallel_gpu_check.py [CHECKPOINT]   (default: a tiny random llama, built here by transformers)

Checks, and prints one line each: the split model's logits, decode state and greedy tokens against
CausalLM on cuda:0 and on the CPU (close, since the two kinds of device round differently); each
layer's weights and state on its device; the GPU memory handed back by close(). Exits non-zero on a failure.
"""

import sys
import tempfile

import torch

from lmstack import CausalLM, ParallelCausalLM


def tiny_checkpoint(root):
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                      tie_word_embeddings=True)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(root)
    return root


def check(what, ok):
    print(f"{'ok  ' if ok else 'FAIL'} {what}")
    return ok


def main(path):
    ids = torch.randint(0, 200, (2, 12), generator=torch.Generator().manual_seed(0))
    n = CausalLM.load(path, device="cpu").plan.n_layers
    split = [0] * (n // 2) + ["cpu"] * (n - n // 2)  # embedding on cuda:0, norm and (tied) head on the CPU
    results = []
    for device in ("cuda:0", "cpu"):
        reference = CausalLM.load(path, device=device)
        with ParallelCausalLM.load(path, layer_devices=split) as lm:
            logits = lm.forward(ids)
            results.append(check(f"logits close to CausalLM on {device} (max diff "
                                 f"{(logits.cpu() - reference.forward(ids).cpu()).abs().max():.2e})",
                                 torch.allclose(logits.cpu(), reference.forward(ids).cpu(), rtol=1e-4, atol=1e-4)))
            results.append(check(f"greedy tokens equal to CausalLM on {device}",
                                 torch.equal(lm.generate(ids, 16).cpu(), reference.generate(ids, 16).cpu())))
            ours, theirs = lm.allocate_state(2, 20), reference.allocate_state(2, 20)
            lm.forward(ids, ours), reference.forward(ids, theirs)
            results.append(check(f"decode state close to CausalLM's on {device}", all(
                torch.allclose(a.k.cpu(), b.k.cpu(), rtol=1e-4, atol=1e-4)
                and torch.allclose(a.v.cpu(), b.v.cpu(), rtol=1e-4, atol=1e-4)
                for a, b in zip(ours.layers, theirs.layers))))
    del ours, theirs, logits
    baseline = torch.cuda.memory_allocated(0)
    with ParallelCausalLM.load(path, layer_devices=split) as lm:
        state = lm.allocate_state(1, 8)
        placed = all(p.device == d for b, d in zip(lm.blocks, lm.layer_devices) for p in b.parameters())
        placed &= all(s.k.device == d for s, d in zip(state.layers, lm.layer_devices))
        placed &= lm.embed.device.type == "cuda" and lm.head.device.type == "cpu"
        results.append(check(f"every layer's weights and state on its device ({lm!r})", placed))
        del state
        held = torch.cuda.memory_allocated(0)
    after = torch.cuda.memory_allocated(0) - baseline  # what is left: the rotary table, a few bytes
    results.append(check(f"close() gave back the GPU memory ({held - baseline} bytes held, {after} after)",
                         after < 4096 < held - baseline))
    return all(results)


if __name__ == "__main__":
    if not torch.cuda.is_available():
        sys.exit("parallel_gpu_check: no CUDA device here")
    with tempfile.TemporaryDirectory() as tmp:
        ok = main(sys.argv[1] if len(sys.argv) > 1 else tiny_checkpoint(tmp))
    sys.exit(0 if ok else 1)
