"""Chat templates rendered as transformers' `apply_chat_template(..., tokenize=False)` renders them.

Each template here is written for the test, to exercise one thing transformers hands a template; the
oracle is transformers on the same tokenizer directory, in the same run.
"""

import json
from dataclasses import dataclass

import pytest
import tokenizers
from tokenizers import decoders, models, pre_tokenizers

from lmstack import Tokenizer, TokenizerError
from lmstack.tokenizer import BYTE_CHARS

SPECIALS = {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>", "unk_token": "<unk>",
            "sep_token": "<sep>", "cls_token": "<cls>", "mask_token": "<mask>"}
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi <b>there</b> & \"you\""},
        {"role": "assistant", "content": "Hello!", "reasoning_content": "They greet me."},
        {"role": "user", "content": "Ünïcödé 日本語?"}]
TOOL_CHAT = [{"role": "user", "content": "Weather in Paris?"},
             {"role": "assistant", "content": None, "tool_calls": [
                 {"type": "function", "function": {"name": "weather", "arguments": {"city": "Paris", "days": 2}}}]},
             {"role": "tool", "content": "sunny", "tool_call_id": None}]
TOOLS = [{"type": "function", "function": {"name": "weather", "description": "The forecast.", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}}]
DOCUMENTS = [{"title": "Paris", "text": "Capital of France."}, {"title": "Lyon", "text": "On the Rhône."}]


def save(directory, template, **config):
    """A byte-level tokenizer with the SPECIALS, and a tokenizer_config.json with `template` and `config`."""
    directory.mkdir(parents=True, exist_ok=True)
    tok = tokenizers.Tokenizer(models.BPE({c: b for b, c in enumerate(BYTE_CHARS)}, []))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(SPECIALS.values()))
    tok.save(str(directory / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "chat_template": template, **config}
    (directory / "tokenizer_config.json").write_text(json.dumps({k: v for k, v in config.items() if v is not None}))
    return directory


def both(directory, conversation, **options):
    """(lmstack's rendering, transformers') of the conversation, with the same options."""
    from transformers import AutoTokenizer
    expected = AutoTokenizer.from_pretrained(str(directory)).apply_chat_template(
        conversation, tokenize=False, **{"add_generation_prompt": True, **options})
    return Tokenizer.from_pretrained(directory).apply_chat_template(conversation, **options), expected


def test_generation_blocks_render_their_content(tmp_path):
    template = ("{% for m in messages %}<{{ m.role }}>{% if m.role == 'assistant' %}{% generation %}"
                "{{ m.content }}</s>{% endgeneration %}{% else %}{{ m.content }}{% endif %}\n{% endfor %}"
                "{%- if add_generation_prompt %}<assistant>{% endif %}")
    ours, expected = both(save(tmp_path, template), CHAT)
    assert ours == expected
    assert "Hello!</s>" in ours


@pytest.mark.parametrize("defined", [(), ("bos_token",), ("eos_token", "pad_token"), tuple(SPECIALS)])
def test_special_tokens_the_tokenizer_lacks_are_undefined(tmp_path, defined):
    template = "".join(f"{name}={{% if {name} is defined %}}[{{{{ {name} }}}}]{{% else %}}undefined{{% endif %}} "
                       for name in SPECIALS) + "{{ bos_token }}{{ messages[0].content }}"
    directory = save(tmp_path, template, **{name: SPECIALS[name] for name in defined})
    ours, expected = both(directory, CHAT)
    assert ours == expected
    assert ("None" in ours) == ("None" in expected) == False  # noqa: E712


def test_keyword_arguments_override_special_tokens(tmp_path):
    ours, expected = both(save(tmp_path, "{{ bos_token }}|{{ eos_token }}", **SPECIALS), CHAT, bos_token="[B]")
    assert ours == expected == "[B]|</s>"


def test_none_values_are_dropped_and_reasoning_is_also_thinking(tmp_path):
    template = ("{% for m in messages %}{{ m.role }}: {{ m.content }}"
                "{% if m.content is not defined %}(no content){% endif %}"
                "{% if m.tool_call_id is defined %}(id){% endif %}"
                "{% if m.thinking is defined %} thinking={{ m.thinking }}{% endif %}"
                "{% if m.reasoning_content is defined %} reasoning={{ m.reasoning_content }}{% endif %}"
                "{% for call in m.tool_calls or [] %} call {{ call.function.name }}"
                "({{ call.function.arguments | tojson }}){% endfor %}\n{% endfor %}")
    directory = save(tmp_path, template)
    for conversation in (CHAT, TOOL_CHAT, [{"role": "assistant", "content": "ok", "thinking": "hmm"}],
                         [{"role": "assistant", "content": "ok", "reasoning": "old name", "thinking": None}]):
        ours, expected = both(directory, conversation)
        assert ours == expected
        assert "None" not in ours


def test_message_objects_are_their_fields(tmp_path):
    @dataclass
    class Message:
        role: str
        content: str | None
        name: str | None = None

    template = "{% for m in messages %}{{ m | tojson }}\n{% endfor %}"
    conversation = [Message("user", "hi"), Message("assistant", None, "bot")]
    ours, expected = both(save(tmp_path, template), conversation)
    assert ours == expected


def named_templates(directory, as_files):
    templates = {"default": "default: {{ messages[-1].content }}",
                 "tool_use": "tool_use: {{ tools | map(attribute='function.name') | join(',') }}",
                 "rag": "rag: {% for d in documents %}{{ d.title }};{% endfor %}"}
    if as_files:
        save(directory, None)
        (directory / "chat_template.jinja").write_text(templates.pop("default"))
        (directory / "additional_chat_templates").mkdir()
        for name, text in templates.items():
            (directory / "additional_chat_templates" / f"{name}.jinja").write_text(text)
    else:
        save(directory, [{"name": name, "template": text} for name, text in templates.items()])
    return directory


@pytest.mark.parametrize("as_files", [False, True])
def test_named_templates_are_chosen_as_transformers_chooses(tmp_path, as_files):
    directory = named_templates(tmp_path, as_files)
    for options in ({}, {"tools": TOOLS}, {"chat_template": "rag", "documents": DOCUMENTS},
                    {"chat_template": "default", "tools": TOOLS}):
        ours, expected = both(directory, CHAT, **options)
        assert ours == expected
        assert ours.startswith(options.get("chat_template", "tool_use" if "tools" in options else "default"))
    with pytest.raises(TokenizerError, match="no chat_template named 'missing' \\(it has: default, rag, tool_use\\)"):
        Tokenizer.from_pretrained(directory).apply_chat_template(CHAT, chat_template="missing")


def test_globals_filters_and_arguments_are_handed_as_transformers_hands_them(tmp_path):
    template = """{%- set ns = namespace(count=0, last=none) -%}
{%- for m in messages -%}
  {%- if loop.index > 3 %}{% break %}{% endif -%}
  {%- if m.role == 'system' %}{% continue %}{% endif -%}
  {%- set ns.count = ns.count + 1 %}{% set ns.last = m.role -%}
  {{ m | tojson }}|{{ m | tojson(indent=2, sort_keys=true) }}|{{ m | tojson(ensure_ascii=true) }}
  {{- m | tojson(separators=(',', ':')) }}
{% endfor -%}
{{ ns.count }} {{ ns.last }} {{ dict(a=1, b=[2]) | tojson }} {{ dict.fromkeys(['x', 'y'], 0) | tojson }}
year {{ strftime_now('%Y') }}
tools {{ tools | tojson }} documents {{ documents | tojson }}
{% if enable_thinking is defined %}thinking {{ enable_thinking }}{% endif %}
{% if extra is defined %}extra {{ extra | tojson }}{% endif %}
{%- if messages[-1].role == 'assistant' %}{{ raise_exception('last message from ' ~ messages[-1].role) }}{% endif %}
{%- if add_generation_prompt %}<assistant>{% endif %}"""
    directory = save(tmp_path, template, **SPECIALS)
    for options in ({}, {"add_generation_prompt": False}, {"tools": TOOLS, "documents": DOCUMENTS},
                    {"enable_thinking": False, "extra": {"k": [1, 2.5, None, True], "t": ("a", "b")}}):
        ours, expected = both(directory, CHAT, **options)
        assert ours == expected
    from transformers import AutoTokenizer
    with pytest.raises(Exception, match="last message from assistant") as raised:
        AutoTokenizer.from_pretrained(str(directory)).apply_chat_template(CHAT[:3], tokenize=False)
    with pytest.raises(TokenizerError, match=f"chat template: {raised.value}"):
        Tokenizer.from_pretrained(directory).apply_chat_template(CHAT[:3])


@pytest.mark.parametrize("template,message", [
    ("{% set ns = namespace(_x=1) %}", "may not start with '_'"),
    ("{% set ns = namespace() %}{% set ns._x = 1 %}", "may not start with '_'"),
])
def test_globals_refuse_what_transformers_refuses(tmp_path, template, message):
    from transformers import AutoTokenizer
    directory = save(tmp_path, template)
    with pytest.raises(Exception):
        AutoTokenizer.from_pretrained(str(directory)).apply_chat_template(CHAT, tokenize=False)
    with pytest.raises(TokenizerError, match=message):
        Tokenizer.from_pretrained(directory).apply_chat_template(CHAT)


@pytest.mark.parametrize("conversation,options,message", [
    ([], {}, "empty conversation"),
    ([["not", "a", "dict"]], {}, "message 0 is a list"),
    (CHAT, {"tools": [len]}, r"tools\[0\] is a builtin_function_or_method, expected a JSON schema"),
    (CHAT, {"documents": ["text"]}, r"documents\[0\] is a str"),
    (CHAT, {"continue_final_message": True}, "continue_final_message is not supported"),
])
def test_inputs_transformers_would_treat_otherwise_are_refused_by_name(tmp_path, conversation, options, message):
    tok = Tokenizer.from_pretrained(save(tmp_path, "{{ messages }}"))
    with pytest.raises(TokenizerError, match=message):
        tok.apply_chat_template(conversation, **options)
