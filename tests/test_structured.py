"""Structured output, tool calls and log-probabilities, through the library and `lmstack serve` with `openai`.

The model is test_server's tiny random Llama with SmolLM2's real tokenizer: its text is garbage, so every
JSON answer that parses and validates does so because the grammar made it. Log-probabilities are checked
against the model's own forward in the same run.
"""

import json
import time

import pytest
import torch

jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("llguidance")

from lmstack import kernels  # noqa: E402
from lmstack.grammar import GrammarError, compile  # noqa: E402
from lmstack.sampling import generate_text  # noqa: E402
from lmstack.server.tools import PARSERS, ToolStream, parser_for  # noqa: E402
from test_server import NAME, _assert_error, chat_ids, checkpoint, model, raw, running, start  # noqa: E402,F401

POINT = {"type": "object", "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 99},
                                          "y": {"type": "integer", "minimum": -9, "maximum": 9}},
         "required": ["x", "y"], "additionalProperties": False}
SCHEMAS = {
    "enum and integer bounds": {"type": "object", "properties": {
        "colour": {"enum": ["red", "green", "blue"]}, "n": {"type": "integer", "minimum": -5, "maximum": 5}},
        "required": ["colour", "n"], "additionalProperties": False},
    "nested objects, string lengths": {"type": "object", "properties": {"person": {
        "type": "object", "properties": {"name": {"type": "string", "minLength": 2, "maxLength": 8},
                                         "age": {"type": "integer", "minimum": 0, "maximum": 150}},
        "required": ["name", "age"], "additionalProperties": False}},
        "required": ["person"], "additionalProperties": False},
    "array minItems/maxItems": {"type": "object", "properties": {"tags": {
        "type": "array", "items": {"type": "string", "maxLength": 5}, "minItems": 2, "maxItems": 4}},
        "required": ["tags"], "additionalProperties": False},
    "string pattern": {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"}},
                       "required": ["code"], "additionalProperties": False},
    "anyOf": {"type": "object", "properties": {"v": {"anyOf": [
        {"type": "integer", "minimum": 0, "maximum": 9}, {"type": "boolean"}, {"type": "string", "maxLength": 4}]}},
        "required": ["v"], "additionalProperties": False},
    "$ref": {"$defs": {"point": POINT}, "type": "object",
             "properties": {"a": {"$ref": "#/$defs/point"}, "b": {"$ref": "#/$defs/point"}},
             "required": ["a", "b"], "additionalProperties": False},
}
WEATHER = {"type": "function", "function": {"name": "weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                     "unit": {"enum": ["C", "F"]}},
    "required": ["city", "unit"], "additionalProperties": False}}}
ADD = {"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                     "b": {"type": "integer", "minimum": 0, "maximum": 99}},
    "required": ["a", "b"], "additionalProperties": False}}}
TOOLS = [WEATHER, ADD]
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"}]


@pytest.fixture(scope="module")
def server(model):
    service = start(model, max_running=4, max_tokens_limit=200)
    with running(service) as url:
        yield service, url


@pytest.fixture
def client(server):
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=server[1] + "/v1", api_key="unused", max_retries=0, timeout=120)


def sampling(mode):
    return dict(temperature=0) if mode == "greedy" else dict(temperature=1.0, seed=11)


# ---- JSON Schema ---------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["greedy", "sampled"])
@pytest.mark.parametrize("name", list(SCHEMAS))
def test_json_schema_answers_parse_and_validate(client, name, mode):
    schema = SCHEMAS[name]
    response_format = {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}}
    answer = client.chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=150,
                                            response_format=response_format, **sampling(mode))
    choice = answer.choices[0]
    assert choice.finish_reason == "stop"
    jsonschema.validate(json.loads(choice.message.content), schema)
    stream = client.chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=150, stream=True,
                                            response_format=response_format, **sampling(mode))
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == choice.message.content  # greedy, or the same seed: the same answer


def test_logprobs_under_a_grammar_list_only_allowed_tokens(client):
    answer = client.chat.completions.create(
        model=NAME, messages=MESSAGES, max_tokens=20, temperature=0, logprobs=True, top_logprobs=20,
        response_format={"type": "json_schema", "json_schema": {"name": "b", "schema": {"type": "boolean"}}})
    content = answer.choices[0].logprobs.content
    assert answer.choices[0].message.content in ("true", "false")
    assert content[0].token in ("t", "f", "true", "false", "tr", "fa", "fal", "tru")
    for entry in content:
        assert 1 <= len(entry.top_logprobs) <= 20
        assert all(t.logprob > -1e30 for t in entry.top_logprobs)
        assert sum(torch.tensor([t.logprob for t in entry.top_logprobs]).exp()) == pytest.approx(1, abs=1e-3) \
            or len(entry.top_logprobs) == 20


def test_a_schema_sent_again_is_compiled_once_and_reordered_keys_anew(client, monkeypatch):
    from lmstack import grammar

    compiled = []
    real = grammar.compile
    monkeypatch.setattr(grammar, "compile", lambda *a, **k: compiled.append(k["json_schema"]) or real(*a, **k))
    schema = {"type": "object", "properties": {"u": {"type": "integer", "minimum": 123456, "maximum": 123457},
                                               "v": {"type": "boolean"}},
              "required": ["u", "v"], "additionalProperties": False}
    swapped = {**schema, "properties": dict(reversed(schema["properties"].items()))}
    answers = []
    for sent in (schema, schema, swapped):
        answer = client.chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=40, temperature=0,
            response_format={"type": "json_schema", "json_schema": {"name": "uv", "schema": sent}})
        answers.append(json.loads(answer.choices[0].message.content))
        jsonschema.validate(answers[-1], sent)
    assert compiled == [schema, swapped]  # the swapped order is its own grammar: its answer lists v first
    assert answers[0] == answers[1] and list(answers[0]) == ["u", "v"] and list(answers[2]) == ["v", "u"]


def test_json_object_answer_is_an_object(client):
    answer = client.chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=60, temperature=0,
                                            response_format={"type": "json_object"})
    content = answer.choices[0].message.content
    assert content.startswith("{")
    if answer.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(content), dict)


def test_library_generate_follows_schema_regex_and_lark(model):
    lm, tokenizer = model
    schema = SCHEMAS["$ref"]
    texts = generate_text(lm, tokenizer, ["Hello", "A point:"], 80, json_schema=schema)
    for text in texts:
        jsonschema.validate(json.loads(text), schema)
    (code,) = generate_text(lm, tokenizer, ["Code:"], 20, regex=r"[A-Z]{2}[0-9]{3}")
    assert len(code) == 5 and code[:2].isupper() and code[2:].isdigit()
    (word,) = generate_text(lm, tokenizer, ["Answer:"], 10, grammar='start: "yes" | "no"')
    assert word in ("yes", "no")
    ids = tokenizer.encode("Hello")
    constraint = compile(tokenizer, lm.vocab_size, json_schema=schema, eos_ids=lm.eos_ids + tokenizer.eos_ids)
    tokens = lm.generate([ids], 80, constraint=constraint)[0, len(ids):]
    assert tokenizer.decode([t for t in tokens.tolist() if t >= 0]) == texts[0]


def test_masks_computed_ahead_together_are_each_rows_own(model):
    """One side-thread job computes the next masks of many requests' rows (as the engine starts it each step);
    each row's logits must come out as llguidance's own mask for that row says (its logit bias: 200 allowed)."""
    from lmstack.grammar import compute_ahead

    _, tokenizer = model
    vocab = 49152 + 64  # embedding rows past the tokenizer's: never allowed
    masks, prefixes = [], ['{"person":{"na', '{"tags":["ab",', '', '{"colour":"gr']
    for prefix, name in zip(prefixes, ["nested objects, string lengths", "array minItems/maxItems", "anyOf",
                                       "enum and integer bounds"]):
        mask = compile(tokenizer, vocab, json_schema=SCHEMAS[name]).mask(2)
        for token in tokenizer.encode(prefix, add_special_tokens=False) if prefix else []:
            mask(torch.zeros(2, vocab))
            mask.accept(torch.tensor([token, -1 if prefix.startswith('{"tags"') else token]))  # row 1: done
        masks.append(mask)
    compute_ahead(masks)
    for mask in masks:
        logits = torch.randn(2, vocab)
        out = mask(logits)
        for row, matcher in enumerate(mask.matchers):
            if row not in mask._rows and not mask.ended[row]:  # a row made done: left as it was
                assert torch.equal(out[row], logits[row])
                continue
            bias = torch.frombuffer(bytearray(matcher._matcher.compute_logit_bias()), dtype=torch.uint8)
            allowed = torch.zeros(vocab, dtype=torch.bool)
            allowed[:len(bias)] = bias[:vocab] > 0
            assert 0 < allowed.sum() < vocab
            assert torch.equal(out[row], logits[row].masked_fill(~allowed, -torch.inf))


def test_a_matchers_single_token_check_agrees_with_its_mask(model):
    """Lazy masking asks `allows(token)` instead of computing the mask: it must say what the mask says, for every
    id (EOS where the grammar may end, ids past the tokenizer's never), in every state a mask is asked for (a
    stopped matcher ends its row instead)."""
    _, tokenizer = model
    vocab = 49152 + 64
    eos = tokenizer.eos_ids[0]
    for source, prefix in [(dict(json_schema=SCHEMAS["nested objects, string lengths"]), '{"person":{"name":"ab'),
                           (dict(json_schema=SCHEMAS["anyOf"]), '{"v":'), (dict(regex="[0-9]{1,3}"), "1"),
                           (dict(regex="[0-9]{1,3}"), "12"), (dict(lark='start: "yes" | "no"'), "")]:
        matcher = compile(tokenizer, vocab, **source).matcher()
        for token in tokenizer.encode(prefix, add_special_tokens=False) if prefix else []:
            matcher.accept(token)
        allowed = matcher.allowed()
        assert not matcher.stopped and allowed.any() and not allowed[49152:].any()
        assert [matcher.allows(t) for t in range(vocab)] == allowed.tolist(), (source, prefix)
        assert allowed[eos] == (prefix in ("1", "12")), (source, prefix)


def test_lazy_and_eager_masks_choose_the_same_greedy_tokens(model, monkeypatch):
    """Requests whose unmasked argmax the grammar often refuses get the same tokens lazily masked (the default) as
    eagerly (logprobs asked: every step masked): a random model under schemas (refused almost always), and one
    biased to "7" under a grammar that allows it every other token."""
    from lmstack.engine import Engine
    from lmstack.grammar import GrammarMask

    lm, tokenizer = model
    checks, refusals = [], []
    refused, masked = GrammarMask.refused, GrammarMask.masked
    monkeypatch.setattr(GrammarMask, "refused", lambda self, tokens: checks.append(1) or refused(self, tokens))
    monkeypatch.setattr(GrammarMask, "masked", lambda self, logits, rows: refusals.append(len(rows))
                        or masked(self, logits, rows))
    seven = tokenizer.encode("7", add_special_tokens=False)[0]
    requests = [("Hello", dict(json_schema=SCHEMAS["$ref"]), None),
                ("A person:", dict(json_schema=SCHEMAS["nested objects, string lengths"]), None),
                ("Sevens:", dict(regex="(7[a-z]){25}"), {seven: 100})]
    with Engine(lm, tokenizer, max_running=8) as engine:
        pairs = []
        for prompt, source, bias in requests:
            constraint = compile(tokenizer, lm.vocab_size, **source)
            pairs.append([engine.add(tokenizer.encode(prompt), max_tokens=60, constraint=constraint, eos_ids=(),
                                     logit_bias=bias, logprobs=logprobs) for logprobs in (None, 0)])
        for lazy, eager in pairs:
            assert list(lazy) == list(eager) and lazy.finish_reason == eager.finish_reason
            assert len(lazy.tokens) > 10
        assert pairs[2][0].text.count("7") == 25
    assert 0.2 * len(checks) < sum(refusals) < 0.9 * len(checks)  # both ways taken, the refused one often


def test_lazy_sampling_draws_from_the_masked_distribution():
    """Sampling from the tempered distribution uncut: a token the grammar refuses is drawn again from the masked
    row (rejection sampling), which gives exactly the masked distribution, seed for seed the same. Most of the
    unmasked mass is on refused tokens, so resampling wrongly (masked argmax, no temperature, the unmasked row)
    fails the chi-square test."""
    from lmstack.decoding import Decoder
    from lmstack.sampling import Sampler
    from lmstack.tokenizer import Tokenizer
    from test_server import TOKENIZER

    tokenizer = Tokenizer.from_pretrained(TOKENIZER)
    vocab, rows, temperature = 49152, 3000, 0.7
    digits = [tokenizer.encode(d, add_special_tokens=False)[0] for d in "012"]
    letters = [tokenizer.encode(c, add_special_tokens=False)[0] for c in "abc"]
    logits = torch.full((rows, vocab), -torch.inf)
    logits[:, digits] = torch.tensor([1.0, 0.5, 0.0])
    logits[:, letters] = torch.tensor([2.5, 2.0, 1.5])
    constraint = compile(tokenizer, vocab, regex="[0-9]")

    def draw(seed):
        decoder = Decoder.build(Sampler(temperature=temperature, seed=seed), [[0]] * rows, vocab, "cpu",
                                constraint=constraint)
        assert decoder.mask.lazy
        return decoder.choose(logits)

    tokens = draw(5)
    assert torch.equal(draw(5), tokens)
    counts = torch.tensor([(tokens == d).sum().item() for d in digits], dtype=torch.float64)
    assert counts.sum() == rows
    expected = rows * (logits[0, digits] / temperature).softmax(-1).double()
    chi2 = ((counts - expected) ** 2 / expected).sum().item()
    assert chi2 < 13.8, (counts, expected)  # 2 degrees of freedom, p = 0.001


@pytest.mark.skipif(not kernels.available(), reason="prompt lookup needs lmstack's CPU kernels")
def test_prompt_lookup_under_a_grammar_gives_the_plain_constrained_tokens(model):
    lm, tokenizer = model
    constraint = compile(tokenizer, lm.vocab_size, json_schema=SCHEMAS["array minItems/maxItems"])
    ids = tokenizer.encode('{"tags":["ab","ab","ab"]} {"tags":["ab","ab"')
    sampled = dict(greedy=False, temperature=0.8, seed=3)
    for sampling in ({}, sampled, dict(sampled, top_p=0.9)):  # greedy and sampled lazily, truncated eagerly
        plain = lm.generate([ids], 40, constraint=constraint, **sampling)
        assert torch.equal(lm.generate([ids], 40, constraint=constraint, prompt_lookup=4, **sampling), plain)


def test_unenforceable_or_slow_schemas_are_refused_by_name(model, monkeypatch):
    import llguidance

    _, tokenizer = model
    with pytest.raises(GrammarError, match="not"):
        compile(tokenizer, 49152, json_schema={"type": "object", "properties": {"a": {"not": {"type": "string"}}}})
    with pytest.raises(GrammarError, match="uniqueItems"):
        compile(tokenizer, 49152, json_schema={"type": "array", "uniqueItems": True})
    matcher = llguidance.LLMatcher

    class Slow:  # a compile that takes 0.5 s
        grammar_from_json_schema = staticmethod(matcher.grammar_from_json_schema)

        def __new__(cls, *args, **kwargs):
            time.sleep(0.5)
            return matcher(*args, **kwargs)

    monkeypatch.setattr(llguidance, "LLMatcher", Slow)
    started = time.monotonic()
    with pytest.raises(GrammarError, match="longer than 0.1 s"):
        compile(tokenizer, 49152, json_schema=SCHEMAS["$ref"], timeout=0.1)
    assert time.monotonic() - started < 0.4  # refused at the bound, not when the compile ends


# ---- tools ---------------------------------------------------------------------------------------


def check_calls(calls, names):
    assert calls
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        tool = next(t for t in TOOLS if t["function"]["name"] == call.function.name)
        assert call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])


def streamed_calls(stream):
    """The calls of a stream, assembled by index, and its content and finish reason."""
    calls, content, finish = {}, "", None
    for chunk in stream:
        for choice in chunk.choices:
            content += choice.delta.content or ""
            finish = choice.finish_reason or finish
            for delta in choice.delta.tool_calls or ():
                call = calls.setdefault(delta.index, {"id": delta.id, "name": "", "arguments": ""})
                call["name"] += delta.function.name or ""
                call["arguments"] += delta.function.arguments or ""
    return [calls[i] for i in sorted(calls)], content, finish


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "add"}}],
                         ids=["required", "named"])
def test_required_and_named_tool_choice_give_valid_calls(client, choice):
    names = {"weather", "add"} if choice == "required" else {"add"}
    answer = client.chat.completions.create(model=NAME, messages=MESSAGES, tools=TOOLS, tool_choice=choice,
                                            max_tokens=60, temperature=0, parallel_tool_calls=False)
    message = answer.choices[0].message
    assert answer.choices[0].finish_reason == "tool_calls"
    check_calls(message.tool_calls, names)
    assert len(message.tool_calls) == 1
    assert message.content is None
    stream = client.chat.completions.create(model=NAME, messages=MESSAGES, tools=TOOLS, tool_choice=choice,
                                            max_tokens=60, temperature=0, parallel_tool_calls=False, stream=True)
    calls, content, finish = streamed_calls(stream)
    assert finish == "tool_calls" and content == ""
    assert [(c["name"], c["arguments"]) for c in calls] == [(c.function.name, c.function.arguments)
                                                            for c in message.tool_calls]


def test_auto_answers_text_or_valid_calls_and_arms_the_grammar_at_the_trigger(client, model):
    answer = client.chat.completions.create(model=NAME, messages=MESSAGES, tools=TOOLS, max_tokens=30,
                                            temperature=0)
    message = answer.choices[0].message
    if message.tool_calls:
        check_calls(message.tool_calls, {"weather", "add"})
    assert "<tool_call>" not in (message.content or "")
    _, tokenizer = model
    grammar = compile(tokenizer, 49152, lark=PARSERS["hermes"].auto(TOOLS, parallel=True), eos_ids=[2])
    free = grammar.matcher()
    assert free.allowed().sum() > 40000  # before the trigger: any text
    for token in tokenizer.encode("Sure. <tool_call>\n", add_special_tokens=False):
        free.accept(token)
    allowed = {tokenizer.decode([t]) for t in free.allowed().nonzero()[0].tolist()}
    assert allowed and all('{"name":"'.startswith(text) or text.startswith('{"') for text in allowed)


def test_tool_history_renders_and_the_follow_up_answers(client, model):
    _, tokenizer = model
    first = client.chat.completions.create(model=NAME, messages=MESSAGES, tools=TOOLS, tool_choice="required",
                                           max_tokens=60, temperature=0, parallel_tool_calls=False)
    call = first.choices[0].message.tool_calls[0]
    history = MESSAGES + [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "18 C, sunny"}]
    answer = client.chat.completions.create(model=NAME, messages=history, tools=TOOLS, max_tokens=5, temperature=0)
    assert answer.choices[0].finish_reason in ("stop", "length")
    expected = [dict(m) for m in history]
    expected[2] = {"role": "assistant", "content": "", "tool_calls": [{"id": call.id, "type": "function", "function": {
        "name": call.function.name, "arguments": json.loads(call.function.arguments)}}]}
    assert answer.usage.prompt_tokens == len(chat_ids(tokenizer, expected, TOOLS))
    as_returned = client.chat.completions.create(  # the answer's message object handed back, as agents do
        model=NAME, messages=MESSAGES + [first.choices[0].message, history[-1]], tools=TOOLS, max_tokens=5,
        temperature=0)
    assert as_returned.usage.prompt_tokens == answer.usage.prompt_tokens


@pytest.mark.parametrize("name, text, content, calls", [
    ("hermes", 'Let me check. <tool_call>\n{"name": "weather", "arguments": {"city": "Oslo", "unit": "C"}}\n'
               '</tool_call>\n<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>',
     "Let me check.", [("weather", {"city": "Oslo", "unit": "C"}), ("add", {"a": 1, "b": 2})]),
    ("llama3_json", '<|python_tag|>{"name": "add", "parameters": {"a": 1, "b": 2}}', None, [("add", {"a": 1, "b": 2})]),
    ("llama3_json", '{"name": "weather", "parameters": {"city": "Rome", "unit": "F"}}', None,
     [("weather", {"city": "Rome", "unit": "F"})]),
    ("mistral", '[TOOL_CALLS][{"name": "add", "arguments": {"a": 3, "b": 4}}]', None, [("add", {"a": 3, "b": 4})]),
    ("hermes", "no call here", "no call here", []),
    ("mistral", "[TOOL_CALLS] not json", "[TOOL_CALLS] not json", []),
])
def test_parsers_take_calls_out_of_the_text_whole_and_streamed(name, text, content, calls):
    parser = PARSERS[name]
    got_content, got_calls = parser.parse(text)
    assert got_content == content
    assert [(n, json.loads(a)) for n, a in got_calls] == calls
    for size in (1, 3, 7):
        stream, streamed, streamed_calls_ = ToolStream(parser), "", []
        for i in range(0, len(text), size):
            piece, new = stream.feed(text[i:i + size])
            streamed, streamed_calls_ = streamed + piece, streamed_calls_ + new
        piece, new = stream.finish()
        streamed, streamed_calls_ = streamed + piece, streamed_calls_ + new
        assert [(n, json.loads(a)) for n, a in streamed_calls_] == calls
        assert streamed.strip() == (content or "")


def test_parser_is_chosen_from_the_template():
    assert parser_for("{{ '<tool_call>' }}").name == "hermes"
    assert parser_for("{{ '<|python_tag|>' }}").name == "llama3_json"
    assert parser_for("[TOOL_CALLS] {{ tools }}").name == "mistral"
    assert parser_for(None).name == "hermes"
    assert parser_for("<tool_call>", "mistral").name == "mistral"
    with pytest.raises(ValueError, match="nope"):
        parser_for(None, "nope")


# ---- logprobs and n ------------------------------------------------------------------------------


def model_logprobs(lm, prompt, tokens, temperature=1.0):
    with torch.no_grad():
        logits = lm.forward(torch.tensor([prompt + tokens]))[0, len(prompt) - 1:-1].float()
    return (logits / temperature).log_softmax(-1)


@pytest.mark.parametrize("temperature", [0, 0.7])
def test_chat_logprobs_are_the_model_distribution(client, model, temperature):
    lm, tokenizer = model
    answer = client.chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=12, temperature=temperature,
                                            seed=5, logprobs=True, top_logprobs=5, extra_body={"ignore_eos": True})
    content = answer.choices[0].logprobs.content
    assert len(content) == 12
    prompt = chat_ids(tokenizer, MESSAGES)
    tokens = [tokenizer.encode(c.token, add_special_tokens=False) for c in content]
    if not all(len(t) == 1 for t in tokens):
        pytest.skip("a token's text does not encode back to itself")
    expected = model_logprobs(lm, prompt, [t[0] for t in tokens], temperature or 1.0)
    for j, entry in enumerate(content):
        row = expected[j]
        assert entry.logprob == pytest.approx(float(row[tokens[j][0]]), abs=1e-3)
        top = row.topk(5)
        assert [t.logprob for t in entry.top_logprobs] == pytest.approx(top.values.tolist(), abs=1e-3)
        assert [t.token for t in entry.top_logprobs] == [tokenizer.decode([i]) for i in top.indices.tolist()]
        assert sum(torch.tensor([t.logprob for t in entry.top_logprobs]).exp()) <= 1 + 1e-4
        if temperature == 0:
            assert entry.top_logprobs[0].token == entry.token
    stream = client.chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=12, temperature=temperature,
                                            seed=5, logprobs=True, top_logprobs=5, stream=True,
                                            extra_body={"ignore_eos": True})
    streamed = [e for c in stream if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [(e.token, round(e.logprob, 4)) for e in streamed] == [(e.token, round(e.logprob, 4)) for e in content]


def test_completion_echo_logprobs_score_the_prompt(client, model):
    lm, tokenizer = model
    prompt = "The quick brown fox jumps"
    ids = tokenizer.encode(prompt)
    answer = client.completions.create(model=NAME, prompt=prompt, max_tokens=3, temperature=0, echo=True,
                                       logprobs=2, extra_body={"ignore_eos": True})
    logprobs = answer.choices[0].logprobs
    assert answer.choices[0].text.startswith(prompt)
    assert logprobs.token_logprobs[0] is None and len(logprobs.tokens) == len(ids) + 3
    with torch.no_grad():
        expected = lm.forward(torch.tensor([ids]))[0, :-1].float().log_softmax(-1)
    scored = expected.gather(1, torch.tensor(ids[1:])[:, None])[:, 0].tolist()
    assert logprobs.token_logprobs[1:len(ids)] == pytest.approx(scored, abs=1e-3)
    assert all(len(top) == 2 for top in logprobs.top_logprobs[1:])
    assert logprobs.text_offset[:3] == [0, len(logprobs.tokens[0]), len(logprobs.tokens[0] + logprobs.tokens[1])]


def test_n_choices_share_their_prompt_blocks(client, server):
    engine = server[0].engine
    prompt = "Samples share a prompt: " + " ".join(f"w{i}" for i in range(30))  # over two 16-token blocks
    before = engine.stats()["prefix_hits"]
    answer = client.completions.create(model=NAME, prompt=prompt, max_tokens=4, temperature=1.0, seed=9, n=3)
    assert len(answer.choices) == 3
    assert engine.stats()["prefix_hits"] - before >= 2 * 2  # choices 2 and 3 found the first one's full blocks


def test_n_choices(client):
    sampled = client.chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=8, temperature=1.0, seed=3,
                                             n=3)
    assert [c.index for c in sampled.choices] == [0, 1, 2]
    assert len({c.message.content for c in sampled.choices}) > 1
    assert sampled.usage.completion_tokens == 24 or sampled.usage.completion_tokens <= 24
    greedy = client.completions.create(model=NAME, prompt="Hello", max_tokens=6, temperature=0, n=2)
    assert greedy.choices[0].text == greedy.choices[1].text
    stream = client.completions.create(model=NAME, prompt="Hello", max_tokens=6, temperature=0, n=2, stream=True)
    texts = ["", ""]
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] += choice.text
    assert texts == [greedy.choices[0].text] * 2


def test_logit_bias_forces_and_bans_tokens(client, server):
    forced = 1000
    answer = client.completions.create(model=NAME, prompt="Hello", max_tokens=4, temperature=0,
                                       logit_bias={str(forced): 100}, logprobs=0, extra_body={"ignore_eos": True})
    assert answer.choices[0].logprobs.tokens == [server[0].tokenizer.decode([forced])] * 4
    plain = client.completions.create(model=NAME, prompt="Hello", max_tokens=1, temperature=0, logprobs=0)
    first = plain.choices[0].logprobs.tokens[0]
    first_id = server[0].tokenizer.encode(first, add_special_tokens=False)[0]
    banned = client.completions.create(model=NAME, prompt="Hello", max_tokens=1, temperature=0, logprobs=0,
                                       logit_bias={str(first_id): -100})
    assert banned.choices[0].logprobs.tokens[0] != first
    status, _, body = raw(server[1], "POST", "/v1/completions",
                          {"model": NAME, "prompt": "x", "logit_bias": {"49152": 1}})
    _assert_error(status, body, 400, "logit_bias", "49152")


# ---- errors --------------------------------------------------------------------------------------


def test_bad_schemas_and_tools_are_400s_and_the_server_goes_on(server, client):
    url = server[1]
    chat = {"model": NAME, "messages": MESSAGES, "max_tokens": 4}

    def schema(value):
        return {"type": "json_schema", "json_schema": {"name": "x", "schema": value}}

    for body, words, param in [
        ({"response_format": schema({"type": "foo"})}, ["foo"], "response_format"),
        ({"response_format": schema({"type": "array", "uniqueItems": True})}, ["uniqueItems"], "response_format"),
        ({"response_format": {"type": "json_schema"}}, ["json_schema"], "response_format"),
        ({"response_format": {"type": "xml"}}, ["json_object"], "response_format.type"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, ["nope"],
         "tool_choice"),
        ({"tool_choice": "required"}, ["tools"], "tool_choice"),
        ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, ["name"],
         "tools[0].function.name"),
        ({"tools": [{"type": "function", "function": {"name": "x", "parameters": {"type": "nope"}}}]}, ["nope"],
         "tools"),
        ({"tools": [WEATHER, WEATHER]}, ["unique"], "tools"),
    ]:
        status, _, answer = raw(url, "POST", "/v1/chat/completions", {**chat, **body})
        _assert_error(status, answer, 400, *words, param=param)
    status, _, answer = raw(url, "POST", "/v1/completions", {"model": NAME, "prompt": [5] * 300, "echo": True,
                                                              "logprobs": 1, "max_tokens": 1})
    _assert_error(status, answer, 400, "300", param="prompt")
    answer = client.chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=4)
    assert answer.choices[0].finish_reason in ("stop", "length")


def test_cli_json_schema_file(checkpoint, tmp_path, capsys):
    from lmstack.cli import main

    schema = SCHEMAS["enum and integer bounds"]
    (tmp_path / "schema.json").write_text(json.dumps(schema))
    assert main(["generate", "-m", str(checkpoint), "--json-schema", str(tmp_path / "schema.json"), "-q", "-n", "60",
                 "Hello"]) == 0
    jsonschema.validate(json.loads(capsys.readouterr().out), schema)
    (tmp_path / "bad.json").write_text(json.dumps({"type": "array", "uniqueItems": True}))
    assert main(["generate", "-m", str(checkpoint), "--json-schema", str(tmp_path / "bad.json"), "-q", "Hi"]) == 1
    assert "uniqueItems" in capsys.readouterr().err


def test_a_failing_constraint_ends_only_its_own_request(model):
    from lmstack.engine import Engine, EngineError

    lm, tokenizer = model

    class Failing:  # a constraint whose (eager) mask fails at the third step
        lazy, steps = False, 0

        def mask(self, batch, lazy):
            return self

        def __call__(self, logits):
            self.steps += 1
            if self.steps == 3:
                raise GrammarError("the grammar broke")
            return logits

        def accept(self, tokens):
            pass

    with Engine(lm, tokenizer, max_running=4) as engine:
        broken = engine.add(tokenizer.encode("Hello"), max_tokens=8, constraint=Failing(), eos_ids=())
        fine = engine.add(tokenizer.encode("Hello"), max_tokens=8, eos_ids=())
        assert len(list(fine)) == 8 and fine.finish_reason == "length"
        with pytest.raises(EngineError, match="the grammar broke"):
            list(broken)
        assert broken.finish_reason == "error" and len(broken.tokens) == 2
