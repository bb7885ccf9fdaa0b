"""Hostile tokenizer.json and chat templates, round 2: failures inside `tokenizers` (a pyo3 panic, a normalizer
that expands text until the process aborts) and templates that would run forever or fill memory. Each runs
in a child process under a memory cap and a time limit (isolated.py)."""

import json

import isolated
from lmstack import Tokenizer
from lmstack.chat import MAX_OUTPUT, SECONDS
from test_hostile import tok

BPE = {"type": "BPE", "vocab": {"a": 0, "b": 1, "c": 2}, "merges": []}


def spec(**parts) -> dict:
    return {"version": "1.0", "model": BPE, **parts}


def replace(pattern, content, regex=False):
    return {"type": "Replace", "pattern": {"Regex" if regex else "String": pattern}, "content": content}


def encode(root, text):
    return Tokenizer.from_pretrained(root).encode(text, add_special_tokens=False)


def chat(root):
    return len(Tokenizer.from_pretrained(root).apply_chat_template([{"role": "user", "content": "hi"}]))


def outcomes(tmp_path, cases: dict, action, *args) -> dict:
    """{name: outcome} of `action(root, *args)` for each case's directory, all in one child."""
    roots = []
    for i, build in enumerate(cases.values()):
        root = tmp_path / str(i)
        build(root)
        roots.append(str(root))
    results = isolated.run(*[(__name__, action, root, *args) for root in roots], seconds=30 + 10 * len(cases))
    return dict(zip(cases, results))


# ---- class 8: tokenizer.json ------------------------------------------------------------------------


def test_tokenizers_failures_and_expanding_normalizers_are_tokenizer_errors(tmp_path):
    cases = {
        "catastrophic Split regex": tok(spec=spec(pre_tokenizer={"type": "Split", "pattern": {"Regex": "(a+)+b"},
                                                                 "behavior": "Isolated", "invert": False})),
        "Replace x100000": tok(spec=spec(normalizer=replace("a", "a" * 100_000))),
        "chained Replace x10 eight times": tok(spec=spec(normalizer={"type": "Sequence", "normalizers": [
            replace("a", "a" * 10)] * 8})),
        "regex Replace matching nothing": tok(spec=spec(normalizer=replace("", "abcabcabcabcabcabc", regex=True))),
    }
    results = outcomes(tmp_path, cases, "encode", "a" * 41)
    for name, result in results.items():
        assert result["error"] == "TokenizerError" and "tokenizer.json" in result["message"], (name, result)
    panic = results["catastrophic Split regex"]["message"]  # one short line, no class name
    assert "retry-limit" in panic and "Exception" not in panic and "\n" not in panic and len(panic) < 250, panic
    assert "100000 times longer" in results["Replace x100000"]["message"]
    assert "1e+08 times longer" in results["chained Replace x10 eight times"]["message"]


def test_a_normalizer_that_replaces_in_kind_still_works(tmp_path):
    tok(spec=spec(normalizer={"type": "Sequence", "normalizers": [replace("b", "c"), replace("aa", "a")]}))(tmp_path)
    assert encode(tmp_path, "aab") == [0, 2]


# ---- class 9: chat templates ----------------------------------------------------------------------------


def test_templates_that_run_forever_or_fill_memory_are_refused_by_name(tmp_path):
    loops = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
    macro = "{% macro f(n) %}{% if n %}{{ f(n - 1) }}{{ f(n - 1) }}{% endif %}{% endmacro %}{{ f(40) }}"
    cases = {
        "nested range loops": (loops, "took more than"),
        "exponential macro": (macro, "took more than"),
        "lipsum(n=10**6)": ("{{ lipsum(n=10**6) }}", ""),
        "10**(10**9)": ("{{ 10**(10**9) }}", "bits"),
        "a big product": ("{{ (2**4000) * (2**4000) }}", "bits"),
        "'a'*10**9": ("{{ 'a' * 10**9 }}", str(MAX_OUTPUT)),
        "[0]*10**9": ("{{ ([0] * 10**9)|length }}", str(MAX_OUTPUT)),
        "tojson(indent=10**9)": ("{{ messages|tojson(indent=10**9) }}", "tojson"),
        "center(10**9)": ("{{ 'x'|center(10**9) }}", "center"),
        "ljust(10**9)": ("{{ 'x'.ljust(10**9) }}", "ljust"),
        "'%*d'": ("{{ '%*d' % (10**9, 1) }}", "'%' formatting"),
        "output of 8M characters": ("{% for i in range(8) %}{{ 'a' * 1048576 }}{% endfor %}", "passes"),
    }
    results = outcomes(tmp_path, {name: tok(template=t) for name, (t, _) in cases.items()}, "chat")
    for name, result in results.items():
        words = ["chat template", cases[name][1]]
        assert result["error"] == "TokenizerError" and all(w in result["message"] for w in words), (name, result)
    assert f"{SECONDS} s" in results["nested range loops"]["message"]


def test_templates_within_the_bounds_render(tmp_path):
    template = ("{% for i in range(300) %}{% for j in range(300) %}{% endfor %}{% endfor %}"
                "{{ 2**64 }} {{ 'ab' * 3 }} {{ '%5d' % 7 }} {{ messages|tojson(indent=2) }}")
    tok(template=template)(tmp_path)
    text = Tokenizer.from_pretrained(tmp_path).apply_chat_template([{"role": "user", "content": "hi"}])
    assert text == ("18446744073709551616 ababab     7 "
                    + json.dumps([{"role": "user", "content": "hi"}], indent=2))
