"""Prompt lookup decoding against plain greedy decoding on a prompt that asks to repeat a text, fixing its typos.

    python bench/lookup.py                       # lmstack, and llama.cpp / transformers where installed
    python bench/lookup.py --draft 10 --new-tokens 128 --repeats 3 --weight-format bfloat16

lmstack (`prompt_lookup`), transformers (`prompt_lookup_num_tokens`) and llama.cpp (llama-cpp-python's
LlamaPromptLookupDecoding as draft model) each run in their own worker process on the same weights (the BF16
file bench/decode.py makes from the default model; transformers on its converted directory), plain and with
prompt lookup alternating inside each engine, the engines taking turns; every figure is the median of --repeats.
Decode tokens/s leave the prompt's prefill out. "same" says whether the lookup run gave the plain run's tokens.
bench/decode.py calls rows() for its prompt-lookup rows.
"""

import argparse
import json
import os
import statistics
import sys
import time

import ggufs
from workers import Worker, serve

TEXT = ("The history of the bicycle is long and full of suprises. The first machines, built in the early nineteenth "
        "century, had no pedals at all: riders pushed themselfs along with their feet, like children on a balance "
        "bike. Pedals were atached to the front wheel some decades later, and the front wheel grew larger and larger "
        "so that each turn of the pedals carried the rider further. These high wheelers were fast but dangerous, and "
        "a fall from one could be serius. The safety bicycle, with two wheels of the same size and a chain driving "
        "the rear one, solved the problem and quickly became popular in cities and in the countryside alike. Air "
        "filled tires made the ride more confortable, and within a few years milions of people used bicycles to go "
        "to work, to visit freinds and to explore places they had never seen before.")
INSTRUCTION = "Repeat the text above, fixing the typos."


def prompt_ids(tokenizer) -> list[int]:
    messages = [{"role": "user", "content": f"{TEXT}\n\n{INSTRUCTION}"}]
    return tokenizer.encode(tokenizer.apply_chat_template(messages))


# ---- the engines, each in its own worker process: run(prompt, tokens, draft) -> tok/s, tokens ---------------

class Lmstack:
    def __init__(self, path, threads, weight_format, **_):
        import torch

        from lmstack import CausalLM

        torch.set_num_threads(threads)
        self.lm = CausalLM.load(path, weight_format=weight_format, numeric_profile="bf16", device="cpu")

    def run(self, prompt, tokens, draft):
        calls, run = [], self.lm._run
        self.lm._run = lambda *a, **k: calls.append(1) or run(*a, **k)  # forwards counted
        try:
            stream = self.lm.stream([prompt], tokens, prompt_lookup=draft)
            out = [int(next(stream))]  # the prefill and the first token
            start = time.perf_counter()
            out += [int(t) for t in stream]
            seconds = time.perf_counter() - start
        finally:
            del self.lm._run
        return dict(rate=(tokens - 1) / seconds, tokens=out, per_forward=(tokens - 1) / (len(calls) - 1))


class Transformers:
    def __init__(self, path, threads, **_):
        import torch
        import transformers

        torch.set_num_threads(threads)
        self.torch = torch
        self.hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
        self.hf.generation_config.eos_token_id = None

    def _generate(self, ids, tokens, draft):
        start = time.perf_counter()
        with self.torch.no_grad():
            out = self.hf.generate(ids, max_new_tokens=tokens, do_sample=False, pad_token_id=0,
                                   attention_mask=self.torch.ones_like(ids), prompt_lookup_num_tokens=draft or None)
        return time.perf_counter() - start, out[0, ids.shape[1]:].tolist()

    def run(self, prompt, tokens, draft):
        ids = self.torch.tensor([prompt])
        seconds, out = self._generate(ids, tokens, draft)
        return dict(rate=(tokens - 1) / (seconds - self._generate(ids, 1, draft)[0]), tokens=out)


class LlamaCpp:
    def __init__(self, path, threads, n_ctx, draft, **_):
        import llama_cpp
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

        self.silent = llama_cpp.llama_log_callback(lambda level, text, data: None)
        llama_cpp.llama_log_set(self.silent, None)
        options = dict(model_path=str(path), n_threads=threads, n_threads_batch=threads, n_ctx=n_ctx, verbose=False)
        self.llms = {0: llama_cpp.Llama(**options),
                     draft: llama_cpp.Llama(**options, draft_model=LlamaPromptLookupDecoding(num_pred_tokens=draft))}

    def run(self, prompt, tokens, draft):
        stream = self.llms[draft].generate(prompt, top_k=1, temp=0.0, reset=True)
        out = [next(stream)]
        start = time.perf_counter()
        out += [next(stream) for _ in range(tokens - 1)]
        return dict(rate=(tokens - 1) / (time.perf_counter() - start), tokens=out)

    def close(self):
        for llm in self.llms.values():
            llm.close()  # before the interpreter's exit, which would free them out of order


ENGINES = {"lmstack": Lmstack, "transformers": Transformers, "llama.cpp": LlamaCpp}


# ---- the measurement ---------------------------------------------------------------------------------------

def measure(path, hf_dir=None, *, llama_cpp=True, weight_format="bfloat16", threads=2, draft=10, new_tokens=128,
            repeats=3) -> dict:
    """{engine: {"plain", "lookup": decode tok/s (medians), "same": lookup's tokens == plain's, ...}} on the
    GGUF file `path` (transformers on hf_dir, when given; llama.cpp when llama_cpp)."""
    from lmstack import Tokenizer

    prompt = prompt_ids(Tokenizer.from_pretrained(path))
    common = dict(threads=threads, draft=draft)
    workers = {"lmstack": Worker(__file__, "lmstack", path=path, weight_format=weight_format, **common)}
    try:
        if llama_cpp:
            workers["llama.cpp"] = Worker(__file__, "llama.cpp", path=path, n_ctx=len(prompt) + new_tokens + 16, **common)
        if hf_dir is not None:
            workers["transformers"] = Worker(__file__, "transformers", path=hf_dir, **common)
        runs = {name: {0: [], draft: []} for name in workers}
        for i in range(repeats + 1):  # the first round warms up
            for name in list(workers) if i % 2 else list(workers)[::-1]:
                for d in (0, draft) if i % 2 else (draft, 0):
                    result = workers[name]("run", prompt=prompt, tokens=new_tokens, draft=d)
                    if i:
                        runs[name][d].append(result)
    finally:
        for worker in workers.values():
            worker.close()
    results = {}
    for name, by_draft in runs.items():
        plain, looked = by_draft[0], by_draft[draft]
        results[name] = dict(plain=statistics.median(r["rate"] for r in plain),
                             lookup=statistics.median(r["rate"] for r in looked),
                             same=all(r["tokens"] == plain[0]["tokens"] for r in plain + looked))
        if "per_forward" in looked[0]:
            results[name]["per_forward"] = statistics.median(r["per_forward"] for r in looked)
    return dict(prompt_tokens=len(prompt), new_tokens=new_tokens, draft=draft, engines=results)


def report(measured: dict) -> str:
    lines = [f"prompt: {measured['prompt_tokens']} tokens (a paragraph with typos, then {INSTRUCTION!r}); "
             f"{measured['new_tokens']} new tokens, greedy; drafts of up to {measured['draft']} tokens",
             "", "| engine | plain tok/s | lookup tok/s | speed-up | tokens per forward | same tokens |",
             "|---|--:|--:|--:|--:|---|"]
    for name, r in measured["engines"].items():
        per_forward = f"{r['per_forward']:.2f}" if "per_forward" in r else "-"
        lines.append(f"| {name} | {r['plain']:.1f} | {r['lookup']:.1f} | {r['lookup'] / r['plain']:.2f}x | "
                     f"{per_forward} | {'yes' if r['same'] else 'no'} |")
    engines = measured["engines"]
    for peer in ("llama.cpp", "transformers"):
        if peer in engines:
            lines.append(f"lmstack with lookup / {peer} with lookup: "
                         f"{engines['lmstack']['lookup'] / engines[peer]['lookup']:.2f}x")
    return "\n".join(lines)


def rows(files, args) -> list:
    """bench/decode.py's prompt-lookup rows: plain and prompt-lookup decode of the repeat-the-text prompt on the BF16
    file, lmstack beside llama.cpp (and transformers, with --transformers)."""
    from decode import Row

    hf_dir = None
    if args.transformers:
        hf_dir = ggufs.hf_checkpoint(files["BF16"])
    measured = measure(files["BF16"], hf_dir, llama_cpp=args.llama_cpp, threads=args.threads,
                       new_tokens=max(args.new_tokens, 64), repeats=args.repeats)
    engines = measured["engines"]

    def row(name, key):
        return Row(name, engines["lmstack"][key], engines.get("llama.cpp", {}).get(key),
                   engines.get("transformers", {}).get(key))

    title = f"repeat a text, {measured['new_tokens']} tokens"
    return [row(f"{title}: plain decode, tok/s", "plain"),
            row(f"{title}: prompt lookup {measured['draft']}, tok/s", "lookup")]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="source GGUF file (default: the built-in smollm2)")
    parser.add_argument("--weight-format", default="bfloat16")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--draft", type=int, default=10, help="draft tokens per forward")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-transformers", action="store_true")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        spec = json.loads(args.worker)
        return serve(lambda: ENGINES[spec["engine"]](**spec))
    try:
        import llama_cpp  # noqa: F401
        has_llama_cpp = True
    except ImportError:
        print("llama.cpp: not measured (pip install llama-cpp-python)", file=sys.stderr)
        has_llama_cpp = False
    bf16 = ggufs.bench_files(args.model, ["BF16"])["BF16"]
    hf_dir = None if args.no_transformers else ggufs.hf_checkpoint(bf16)
    load_before = os.getloadavg()[0]
    measured = measure(bf16, hf_dir, llama_cpp=has_llama_cpp, weight_format=args.weight_format, threads=args.threads,
                       draft=args.draft, new_tokens=args.new_tokens, repeats=args.repeats)
    print(f"file: {bf16} (lmstack as {args.weight_format}, profile bf16); {args.threads} threads; median of "
          f"{args.repeats}, plain and lookup alternating, engines taking turns, each in its own process\n"
          f"load average (1 min) before {load_before:.2f}, after {os.getloadavg()[0]:.2f}\n")
    print(report(measured))


if __name__ == "__main__":
    sys.exit(main())
