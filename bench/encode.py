"""Encode throughput of lmstack's Tokenizer as a ratio of the `tokenizers` library's own, on the same file.

The sample corpus is repeated to >= 1 MB and encoded as one text and as a batch of its lines; both sides
give the same ids (checked). A ratio under 0.9 means the wrapper costs more than 10%.

    python bench/encode.py [--repeats 6]
"""

import argparse
import os
import time
from pathlib import Path

# One thread unless told otherwise: the wrapper's cost is Python work around each call, and parallel
# batches on a shared machine would time the neighbours.
os.environ.setdefault("RAYON_NUM_THREADS", "1")
import tokenizers  # noqa: E402

from lmstack.tokenizer import Tokenizer  # noqa: E402

FIXTURES = Path(__file__).parents[1] / "tests" / "fixtures" / "tokenizers"


def seconds(fn):
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=6)
    args = parser.parse_args()
    corpus = (FIXTURES / "sample_corpus.txt").read_bytes().decode("utf-8")
    text = corpus * -(-(1 << 20) // len(corpus.encode()))
    lines = text.split("\n")
    megabytes = len(text.encode()) / 1e6
    print(f"text: {megabytes:.2f} MB, {len(lines)} lines; best of {args.repeats}; "
          f"RAYON_NUM_THREADS={os.environ['RAYON_NUM_THREADS']}")
    print(f"{'tokenizer':10} {'how':6} {'tokenizers MB/s':>16} {'lmstack MB/s':>13} {'ratio':>6}")
    for name in ["smollm2", "qwen2"]:
        tok = Tokenizer.from_pretrained(FIXTURES / name)
        ref = tokenizers.Tokenizer.from_file(str(FIXTURES / name / "tokenizer.json"))
        runs = {  # the same ids on both sides: special tokens' text is the token, nothing added
            "text": (lambda: ref.encode(text, add_special_tokens=False).ids,
                     lambda: tok.encode(text, add_special_tokens=False, allow_special=True)),
            "batch": (lambda: [e.ids for e in ref.encode_batch(lines, add_special_tokens=False)],
                      lambda: tok.encode_batch(lines, add_special_tokens=False, allow_special=True)),
        }
        for how, (baseline, ours) in runs.items():
            assert baseline() == ours(), f"{name} {how}: ids differ"
            # interleaved, each side first in turn, so that other load on the machine hits both alike
            times = [(seconds(baseline), seconds(ours)) if k % 2 else (seconds(ours), seconds(baseline))[::-1]
                     for k in range(args.repeats)]
            base, mine = (megabytes / min(side) for side in zip(*times))
            print(f"{name:10} {how:6} {base:16.2f} {mine:13.2f} {mine / base:6.3f}")


if __name__ == "__main__":
    main()
