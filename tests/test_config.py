"""HFConfig parsing and plan_for: what is honored, and what is refused by name before any weight is read."""

import json

import pytest

from lmstack import FAMILIES, CausalLM, ConfigError, HFConfig, UnsupportedModel, plan_for

LLAMA = dict(model_type="llama", hidden_size=64, intermediate_size=96, num_hidden_layers=2,
             num_attention_heads=4, vocab_size=256, max_position_embeddings=128)


def with_(base=LLAMA, **changes):
    return {**base, **changes}


def test_from_json_reads_a_directory_or_a_file(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(LLAMA))
    for where in (tmp_path, tmp_path / "config.json"):
        cfg = HFConfig.from_json(where)
        assert cfg.model_type == "llama"
        assert cfg["hidden_size"] == 64 and cfg.get("missing", 7) == 7
        assert cfg.path == tmp_path / "config.json"
        assert dict(cfg) == LLAMA
    with pytest.raises(TypeError):
        cfg["hidden_size"] = 1


@pytest.mark.parametrize("content, error, words", [
    (None, FileNotFoundError, "config.json"),
    ("{not json", ConfigError, "not valid JSON"),
    ("[1, 2]", ConfigError, "JSON object"),
    ('{"hidden_size": 4}', ConfigError, "model_type"),
])
def test_from_json_errors_name_the_problem(tmp_path, content, error, words):
    if content is not None:
        (tmp_path / "config.json").write_text(content)
    with pytest.raises(error, match=words):
        HFConfig.from_json(tmp_path)


def test_unknown_model_type_lists_the_supported_ones():
    with pytest.raises(UnsupportedModel) as e:
        plan_for(with_(model_type="gpt_neox"))
    assert "gpt_neox" in str(e.value)
    for name in FAMILIES:
        assert name in str(e.value)


def test_both_rope_spellings_give_the_same_plan():
    scaling = dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=64)
    legacy = plan_for(with_(rope_theta=500000.0, rope_scaling={"type": "llama3", **scaling}))
    legacy_rope_type = plan_for(with_(rope_theta=500000.0, rope_scaling={"rope_type": "llama3", **scaling}))
    modern = plan_for(with_(rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, **scaling}))
    assert legacy.block_options["rope"] == modern.block_options["rope"] == legacy_rope_type.block_options["rope"]
    assert modern.block_options["rope"]["type"] == "llama3"
    assert plan_for(LLAMA).block_options["rope"] == {"type": "default", "theta": 10000.0}


def test_plan_fields_and_weight_layout():
    plan = plan_for(with_(model_type="qwen3", num_key_value_heads=2, head_dim=24, tie_word_embeddings=True))
    assert (plan.kind, plan.family, plan.n_layers, plan.d_model, plan.vocab_size) == ("transformer", "qwen3", 2, 64, 256)
    assert plan.tie_embeddings and plan.head_name is None
    o = plan.block_options
    assert (o["n_heads"], o["n_kv_heads"], o["head_dim"], o["qk_norm"]) == (4, 2, 24, True)
    weights = {key: (name, rows) for key, name, rows in plan.layer_weights(1)}
    assert weights["attn.q_norm.weight"][0] == "model.layers.1.self_attn.q_norm.weight"
    qkv = [(name, rows) for key, name, rows in plan.layer_weights(1) if key == "attn.qkv.weight"]
    assert [rows for _, rows in qkv] == [slice(0, 96), slice(96, 144), slice(144, 192)]
    assert [name.split(".")[-2] for name, _ in qkv] == ["q_proj", "k_proj", "v_proj"]
    with pytest.raises(IndexError):
        plan.layer_weights(2)


def test_sliding_windows_per_family():
    assert plan_for(with_(model_type="mistral", sliding_window=8)).layer_windows == (8, 8)
    assert plan_for(with_(model_type="mistral", sliding_window=None)).layer_windows == (None, None)
    qwen = with_(model_type="qwen2", num_hidden_layers=3, sliding_window=8, max_window_layers=1)
    assert plan_for(qwen).layer_windows == (None, None, None)  # use_sliding_window is off
    assert plan_for({**qwen, "use_sliding_window": True}).layer_windows == (None, 8, 8)
    typed = {**qwen, "use_sliding_window": True,
             "layer_types": ["sliding_attention", "full_attention", "sliding_attention"]}
    assert plan_for(typed).layer_windows == (8, None, 8)


@pytest.mark.parametrize("changes, field", [
    (dict(rope_scaling={"type": "dynamic", "factor": 2.0}), "dynamic"),
    (dict(rope_parameters={"rope_type": "longrope", "rope_theta": 1e4}), "longrope"),
    (dict(partial_rotary_factor=0.5), "partial_rotary_factor"),
    (dict(hidden_act="swish_glu"), "hidden_act"),
    (dict(model_type="qwen2", mlp_bias=True), "mlp_bias"),
    (dict(model_type="mistral", attention_bias=True), "attention_bias"),
    (dict(model_type="qwen2", use_sliding_window=True, sliding_window=4,
          layer_types=["chunked_attention", "full_attention"]), "layer_types"),
    (dict(final_logit_softcapping=30.0), "final_logit_softcapping"),
    (dict(rope_parameters={"full_attention": {"rope_type": "default"}}), "rope_parameters"),
])
def test_refusals_name_the_field_and_value(changes, field):
    with pytest.raises(UnsupportedModel) as e:
        plan_for(with_(**changes))
    message = str(e.value)
    assert field in message and repr(changes.get("model_type", "llama")) in message


@pytest.mark.parametrize("changes, field", [
    (dict(hidden_size="64"), "hidden_size"),
    (dict(hidden_size=0), "hidden_size"),
    (dict(num_hidden_layers=-1), "num_hidden_layers"),
    (dict(num_hidden_layers=10**6), "num_hidden_layers"),
    (dict(vocab_size=10**9), "vocab_size"),
    (dict(hidden_size=66), "hidden_size"),
    (dict(num_key_value_heads=3), "num_key_value_heads"),
    (dict(rms_norm_eps=float("nan")), "rms_norm_eps"),
    (dict(tie_word_embeddings="yes"), "tie_word_embeddings"),
    (dict(rope_scaling={"type": "linear"}), "factor"),
    (dict(rope_theta=-1.0), "rope_theta"),
    (dict(rope_scaling={"type": "llama3", "factor": 8.0, "low_freq_factor": 4.0, "high_freq_factor": 1.0}),
     "high_freq_factor"),
])
def test_malformed_values_are_refused_by_name(changes, field):
    with pytest.raises(ConfigError, match=field):
        plan_for(with_(**changes))


def test_refusal_happens_before_any_weight_is_read(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(with_(partial_rotary_factor=0.5)))
    (tmp_path / "model.safetensors").write_bytes(b"\xff" * 64)  # reading it would fail differently
    with pytest.raises(UnsupportedModel, match="partial_rotary_factor"):
        CausalLM.load(tmp_path)
