"""How byte-level BPE vocabularies cut text before merging: regexes, by name and by GGUF `tokenizer.ggml.pre`.

A pre-tokenization is a sequence of regexes, each isolating its matches within the pieces the one
before left (`Split(..., "isolated")` in `tokenizers`, `unicode_regex_split` in llama.cpp); the text
between matches stays a piece too. A step may also be a `tokenizers` pre-tokenizer, where only that
cuts as the model's tokenizer does. The GGUF names are llama.cpp's, each cut as the model's own
tokenizer.json cuts it.
"""

GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
         r"|\s*[\r\n]+|\s+(?!\S)|\s+")
LLAMA3 = QWEN2.replace(r"|\p{N}|", r"|\p{N}{1,3}|")
QWEN35 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
          r"|\s*[\r\n]+|\s+(?!\S)|\s+")
GPT4O = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
         r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
         r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
DIGIT = r"\p{N}"
CJK = "[一-龥ࠀ-一가-퟿]+"
DEEPSEEK_LETTERS = (
    "\\s?[A-Za-zµÀ-ÖØ-öø-ƺƼ-ƿǄ-ʓʕ-ʯͰ-ͳͶͷͻ-ͽͿΆΈ-ΊΌΎ-ΡΣ-ϵϷ-ҁҊ-ԯԱ-ՖႠ-ჅᎠ-Ᏽᏸ-ᏽᲐ-ᲺᲽ-Ჿᴀ-ᴫᵫ-ᵷᵹ-ᶚḀ-ἕἘ-Ἕἠ"
    "-ὅὈ-Ὅὐ-ὗὙὛὝὟ-\u1f7dᾀ-ᾴᾶ-ᾼ\u1fbeῂ-ῄ"
    "ῆ-ῌῐ-\u1fd3ῖ-\u1fdbῠ-Ῥῲ-ῴῶ-ῼℂℇℊ-ℓℕℙ-ℝℤ\u2126ℨ\u212a-ℭℯ-ℴℹℼ-ℿⅅ-ⅉⅎↃↄⰀ-ⱻⱾ-ⳤⳫ-ⳮⳲⳳꙀ-ꙭꚀ-ꚛꜢ-ꝯꝱ-ꞇꞋ"
    "-ꞎꭰ-ꮿﬀ-ﬆﬓ-ﬗＡ-Ｚａ-ｚ𐐀-𐑏𐒰-𐓓𐓘-𐓻𐲀-𐲲𐳀-𐳲"
    "𑢠-𑣟𞤀-𞥃]+")

PATTERNS = {
    "gpt2": (GPT2,),
    "smollm": (DIGIT, GPT2),  # Digits(individual_digits) before GPT-2, as SmolLM and StarCoder
    "llama3": (LLAMA3,),
    "qwen2": (QWEN2,),
    "qwen35": (QWEN35,),
    "gpt4o": (GPT4O,),
    "deepseek-llm": ("[\r\n]", DEEPSEEK_LETTERS, r"\s?[!-/:-~！-／：-～‘-‟　-。]+", r"\s+$", CJK, r"\p{N}+"),
    "deepseek-coder": ("[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", CJK, DIGIT),
    "deepseek-v3": (r"\p{N}{1,3}", "[一-龥぀-ゟ゠-ヿ]+",
                    r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
                    r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"),
    # Falcon's own steps, not regexes: its Digits step runs after the byte-level mapping, so it also cuts
    # at bytes whose stand-in is numeric ("½" for 0xBD, inside some emoji), as llama.cpp's regexes cannot
    "falcon": ({"type": "Punctuation", "behavior": "Contiguous"},
               {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True},
               {"type": "Digits", "individual_digits": False},
               {"type": "Split", "pattern": {"Regex": "[0-9][0-9][0-9]"}, "behavior": "Isolated", "invert": False}),
}

# tokenizer.ggml.pre -> (PATTERNS name, ignore_merges, normalizer): llama.cpp's names and flags, the
# normalizer the model's tokenizer.json has
GGUF_PRE_TOKENIZERS = {
    **dict.fromkeys(("gpt2", "gpt-2", "phi-2", "mpt", "olmo"), ("gpt2", False, None)),
    **dict.fromkeys(("starcoder", "smollm", "refact", "command-r", "codeshell", "exaone", "minerva-7b"),
                    ("smollm", False, None)),
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "pixtral"), ("llama3", True, None)),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "megrez"), ("qwen2", False, "NFC")),
    "qwen35": ("qwen35", False, None),
    **dict.fromkeys(("gpt-4o", "llama4"), ("gpt4o", False, None)),
    "deepseek-llm": ("deepseek-llm", False, None),
    "deepseek-coder": ("deepseek-coder", False, None),
    "deepseek-v3": ("deepseek-v3", False, None),
    "falcon": ("falcon", False, None),
}
