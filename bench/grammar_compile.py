"""Compile time of JSON Schemas as `lmstack serve` compiles them (grammar.compile), median and p95.

Give files or directories of `.json` schemas, e.g. a sample of JSONSchemaBench's (one schema per file; a file
holding {"json_schema": {...}} or {"schema": {...}} is read there). Each schema is compiled for the default
model's tokenizer and vocabulary, once (the tokenizer's llguidance view is built before timing starts); schemas
refused (a feature llguidance cannot enforce, or past the compile bound) are counted by reason, not timed.

    python bench/grammar_compile.py path/to/schemas/
"""

import argparse
import json
import statistics
import time
from collections import Counter
from pathlib import Path


def schemas(paths):
    for path in paths:
        for file in sorted(path.rglob("*.json")) if path.is_dir() else [path]:
            value = json.loads(file.read_text(encoding="utf-8"))
            for key in ("json_schema", "schema"):
                if isinstance(value, dict) and isinstance(value.get(key), dict):
                    value = value[key]
            yield file, value


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("paths", type=Path, nargs="+")
    parser.add_argument("--model", default="smollm2")
    args = parser.parse_args()

    from lmstack import models
    from lmstack.grammar import GrammarError, compile

    lm, tokenizer = models.load(args.model, weight_format="gguf" if args.model == "smollm2" else "float32")
    compile(tokenizer, lm.vocab_size, regex="warm")  # llguidance's view of the tokenizer, built once
    times, refused = [], Counter()
    for file, schema in schemas(args.paths):
        start = time.perf_counter()
        try:
            compile(tokenizer, lm.vocab_size, json_schema=schema)
        except GrammarError as e:
            refused[str(e).removeprefix("json_schema: ")[:100]] += 1
            continue
        times.append(time.perf_counter() - start)
    if times:
        ms = sorted(1000 * t for t in times)
        print(f"{len(ms)} schemas compiled: median {statistics.median(ms):.1f} ms, "
              f"p95 {ms[min(len(ms) - 1, int(0.95 * len(ms)))]:.1f} ms, max {ms[-1]:.1f} ms")
    print(f"{sum(refused.values())} refused" + "".join(f"\n  {n} x {why}" for why, n in refused.most_common()))


if __name__ == "__main__":
    main()
