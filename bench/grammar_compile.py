"""Compile time of real-world JSON Schemas as `lmstack serve` compiles them (grammar.compile), median and p95.

Give files, directories of `.json` schemas, or a git clone of JSONSchemaBench (github.com/guidance-ai/jsonschemabench:
about 10,000 schemas from GitHub, Kubernetes, Snowplow, JSON Schema Store, the Washington Post's API and Glaive's
function-calling set, in data/<subset>/*.json; MIT-licensed as published on Hugging Face, epfl-dlab/JSONSchemaBench;
read from the clone's HEAD with git, nothing checked out or copied here). A file holding {"json_schema": {...}} or
{"schema": {...}} is read there. Each subset (a directory's name) is sampled with a fixed seed, `--per-subset` files
of each, and each schema is compiled once for the default model's tokenizer and vocabulary (its llguidance view is
built before timing starts). It reports, per subset and overall, the median and p95 of the compile time and of the
compile plus the first mask (llguidance builds its lexer lazily, so a request's first token waits for both), how
many took longer than grammar.COMPILE_SECONDS (the server refuses those), and the refused schemas by reason:
the schema features llguidance cannot enforce, by keyword.

    python bench/grammar_compile.py /path/to/jsonschemabench --per-subset 50
"""

import argparse
import json
import random
import re
import statistics
import subprocess
import time
from collections import Counter, defaultdict
from pathlib import Path


def git_files(repo: Path) -> dict:
    """{subset: [(name, read)]} of a JSONSchemaBench clone's data/*/*.json at HEAD."""
    listing = subprocess.run(["git", "-C", str(repo), "ls-tree", "-r", "--name-only", "HEAD", "data/"],
                             capture_output=True, text=True, check=True).stdout.split("\n")
    subsets = defaultdict(list)
    for name in filter(None, listing):
        parts = name.split("/")
        if len(parts) == 3 and name.endswith(".json"):
            read = (lambda n=name: subprocess.run(["git", "-C", str(repo), "show", f"HEAD:{n}"], capture_output=True,
                                                  check=True).stdout)
            subsets[parts[1]].append((name, read))
    return subsets


def source_files(path: Path) -> dict:
    if (path / ".git").exists() or (path / "HEAD").is_file():
        return git_files(path)
    if path.is_dir():
        subsets = defaultdict(list)
        for file in sorted(path.rglob("*.json")):
            subsets[file.parent.name].append((str(file), file.read_bytes))
        return subsets
    return {path.parent.name: [(str(path), path.read_bytes)]}


def schema_of(data: bytes):
    value = json.loads(data)
    for key in ("json_schema", "schema"):
        if isinstance(value, dict) and isinstance(value.get(key), dict):
            value = value[key]
    return value


def reasons(message: str) -> list[str]:
    """The refusal's causes, as short names: the keywords llguidance does not implement, one by one."""
    message = message.removeprefix("json_schema: ")
    if keys := re.search(r"Unimplemented keys: \[([^\]]*)\]", message):
        return [f"keyword {k.strip()}" for k in keys.group(1).split(",")]
    if "oneOf constraints are not supported" in message:  # llguidance could only loosen it to anyOf
        return ["keyword \"oneOf\""]
    if fmt := re.search(r"[Uu]nknown format:? *\"?([\w-]+)", message):
        return [f"format {fmt.group(1)}"]
    return [re.sub(r"\s+", " ", message)[:110]]


def percentile(values, q):
    values = sorted(values)
    return values[min(len(values) - 1, round(q * (len(values) - 1)))]


def summary(ms) -> str:
    return f"median {statistics.median(ms):.1f} ms, p95 {percentile(ms, 0.95):.1f} ms, max {max(ms):.1f} ms" \
        if ms else "none"


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("paths", type=Path, nargs="+")
    parser.add_argument("--per-subset", type=int, default=50, help="schemas sampled per subset (0: all)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cap", type=float, default=60.0, help="seconds after which a compile is abandoned")
    parser.add_argument("--model", default="smollm2")
    args = parser.parse_args()

    from lmstack import models
    from lmstack.grammar import COMPILE_SECONDS, GrammarError, compile

    subsets = defaultdict(list)
    for path in args.paths:
        for subset, files in source_files(path).items():
            subsets[subset] += files
    lm, tokenizer = models.load(args.model, weight_format="gguf" if args.model == "smollm2" else "float32")
    compile(tokenizer, lm.vocab_size, regex="warm")  # llguidance's view of the tokenizer, built once
    print(f"{args.model} tokenizer, vocabulary {lm.vocab_size}; {args.per_subset or 'all'} schemas per subset, "
          f"seed {args.seed}")
    compiled, first_mask, slow, refused, counts = defaultdict(list), defaultdict(list), Counter(), Counter(), Counter()
    for subset, files in sorted(subsets.items()):
        files = sorted(files)
        if args.per_subset and len(files) > args.per_subset:
            files = random.Random(f"{args.seed}/{subset}").sample(files, args.per_subset)
        counts[subset] = len(files)
        for name, read in files:
            try:
                schema = schema_of(read())
            except ValueError as e:
                refused.update([f"not JSON ({e.__class__.__name__})"])
                counts[subset, "refused"] += 1
                continue
            start = time.perf_counter()
            try:
                grammar = compile(tokenizer, lm.vocab_size, json_schema=schema, timeout=args.cap)
            except GrammarError as e:
                if "to compile" in str(e):
                    slow[subset] += 1
                    print(f"  {name}: abandoned after {args.cap:g} s")
                else:
                    refused.update(reasons(str(e)))
                    counts[subset, "refused"] += 1
                continue
            seconds = time.perf_counter() - start
            grammar.matcher().allowed()
            compiled[subset].append(1000 * seconds)
            first_mask[subset].append(1000 * (time.perf_counter() - start))
            slow[subset] += seconds > COMPILE_SECONDS
    print(f"\n| subset | sampled | compiled | refused | over {COMPILE_SECONDS:g} s | compile | compile + first mask |")
    print("|---|---|---|---|---|---|---|")
    for subset in sorted(subsets):
        print(f"| {subset} | {counts[subset]} | {len(compiled[subset])} | {counts[subset, 'refused']} | "
              f"{slow[subset]} | {summary(compiled[subset])} | {summary(first_mask[subset])} |")
    every = [t for ts in compiled.values() for t in ts]
    masks = [t for ts in first_mask.values() for t in ts]
    total = sum(counts[s] for s in subsets)
    print(f"| all | {total} | {len(every)} | {sum(counts[s, 'refused'] for s in subsets)} | {sum(slow.values())} | "
          f"{summary(every)} | {summary(masks)} |")
    print("\nrefusal reasons (a schema may have several):" + "".join(
        f"\n  {n} x {why}" for why, n in refused.most_common()))


if __name__ == "__main__":
    main()
