"""A transformers `PreTrainedTokenizerFast` built from GGUF tokenizer metadata.

`tokenizer.ggml.model`:
  "gpt2"  byte-level BPE (Llama 3, Qwen, SmolLM2, gpt-oss): tokens, merges, token types;
          `tokenizer.ggml.pre` picks the split regexes the merges were learned with, as llama.cpp
          does (its names grouped as llama-vocab.cpp groups them; an unknown one warns), and for
          Llama 3 and Tekken takes a piece that is itself a token whole (`ignore_merges`).
          Token type 3 (control) becomes a special added token, type 4 (user defined) a plain
          added token, so both are matched whole.
  "llama" SentencePiece (Llama 2, Mistral, Gemma, Phi-3): tokens, scores, token types, built as
          llama.cpp tokenizes them (spm.py).
BOS / EOS are added per `tokenizer.ggml.add_bos_token` / `add_eos_token`; a file that does not
say adds BOS where llama.cpp does (SentencePiece, Llama 3 and Tekken splits). A SentencePiece
file's bos / eos / unk ids default to 1 / 2 / 0.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from paged_engine.gguf.reader import GGUFFile
from paged_engine.gguf.spm import spm_backend

logger = logging.getLogger(__name__)

NORMAL, CONTROL, USER_DEFINED, UNUSED = 1, 3, 4, 5
# tokenizer.ggml.model -> (default bos, eos, unk ids; default add_bos_token), llama.cpp's
_DEFAULTS: dict[str, tuple[dict[str, int], bool]] = {
    "gpt2": ({}, False),
    "llama": ({"bos": 1, "eos": 2, "unknown": 0}, True),
}

_GPT2_SPLIT = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = _LLAMA3_SPLIT.replace(r"\p{N}{1,3}", r"\p{N}")
# An optional English contraction after a word (o200k, Kimi K2)
_CONTRACTION = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
# o200k (gpt-oss, Llama 4, MiniMax-M2): words split at case changes, a contraction kept on them
_O200K_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    + _CONTRACTION
    + r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    + _CONTRACTION
    + r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Kimi K2 (tiktoken's pattern): Han runs first, then o200k's case split with Han taken out of
# its letter classes (a class intersection), punctuation runs keeping trailing newlines
_KIMI_UPPER = r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]"
_KIMI_LOWER = r"[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]"
_KIMI_K2_SPLIT = (
    r"\p{Han}+"
    rf"|[^\r\n\p{{L}}\p{{N}}]?{_KIMI_UPPER}*{_KIMI_LOWER}+{_CONTRACTION}"
    rf"|[^\r\n\p{{L}}\p{{N}}]?{_KIMI_UPPER}+{_KIMI_LOWER}*{_CONTRACTION}"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Seed-Coder / Seed-OSS: single digits, punctuation runs that stop at a newline
_SEED_CODER_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}\r\n]+|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Tekken (Mistral Nemo / Small 3+, Pixtral): o200k's case split without contractions, 1 digit
_TEKKEN_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Ling / Bailing-MoE: Qwen2's with a single newline per piece
_BAILING_SPLIT = _QWEN2_SPLIT.replace(r"\s*[\r\n]+", r"\s*[\r\n]")
# DeepSeek-V3 / R1, Hunyuan dense: 1-3 digits, then CJK runs, then words and punctuation
_DEEPSEEK3_SPLITS = (
    r"\p{N}{1,3}",
    "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+",  # CJK ideographs, hiragana, katakana
    r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
    r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
)
# DeepSeek Coder (v1): newlines, words, punctuation, CJK runs, single digits
_DEEPSEEK_CODER_SPLITS = (
    r"[\r\n]",
    r"\s?\p{L}+",
    r"\s?\p{P}+",
    "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+",
    r"\p{N}",
)
# DeepSeek LLM (V2, V2-Lite, the 7B / 67B models): newlines, runs of cased letters (the fixed
# code point ranges below, a subset of Lu / Ll / Lt), punctuation runs, trailing whitespace,
# CJK runs, digit runs
_DEEPSEEK_LLM_CASED = (
    (0x41, 0x5A), (0x61, 0x7A), (0xB5, 0xB5), (0xC0, 0xD6), (0xD8, 0xF6), (0xF8, 0x1BA),
    (0x1BC, 0x1BF), (0x1C4, 0x293), (0x295, 0x2AF), (0x370, 0x373), (0x376, 0x377),
    (0x37B, 0x37D), (0x37F, 0x37F), (0x386, 0x386), (0x388, 0x38A), (0x38C, 0x38C),
    (0x38E, 0x3A1), (0x3A3, 0x3F5), (0x3F7, 0x481), (0x48A, 0x52F), (0x531, 0x556),
    (0x10A0, 0x10C5), (0x13A0, 0x13F5), (0x13F8, 0x13FD), (0x1C90, 0x1CBA), (0x1CBD, 0x1CBF),
    (0x1D00, 0x1D2B), (0x1D6B, 0x1D77), (0x1D79, 0x1D9A), (0x1E00, 0x1F15), (0x1F18, 0x1F1D),
    (0x1F20, 0x1F45), (0x1F48, 0x1F4D), (0x1F50, 0x1F57), (0x1F59, 0x1F59), (0x1F5B, 0x1F5B),
    (0x1F5D, 0x1F5D), (0x1F5F, 0x1F7D), (0x1F80, 0x1FB4), (0x1FB6, 0x1FBC), (0x1FBE, 0x1FBE),
    (0x1FC2, 0x1FC4), (0x1FC6, 0x1FCC), (0x1FD0, 0x1FD3), (0x1FD6, 0x1FDB), (0x1FE0, 0x1FEC),
    (0x1FF2, 0x1FF4), (0x1FF6, 0x1FFC), (0x2102, 0x2102), (0x2107, 0x2107), (0x210A, 0x2113),
    (0x2115, 0x2115), (0x2119, 0x211D), (0x2124, 0x2124), (0x2126, 0x2126), (0x2128, 0x2128),
    (0x212A, 0x212D), (0x212F, 0x2134), (0x2139, 0x2139), (0x213C, 0x213F), (0x2145, 0x2149),
    (0x214E, 0x214E), (0x2183, 0x2184), (0x2C00, 0x2C7B), (0x2C7E, 0x2CE4), (0x2CEB, 0x2CEE),
    (0x2CF2, 0x2CF3), (0xA640, 0xA66D), (0xA680, 0xA69B), (0xA722, 0xA76F), (0xA771, 0xA787),
    (0xA78B, 0xA78E), (0xAB70, 0xABBF), (0xFB00, 0xFB06), (0xFB13, 0xFB17), (0xFF21, 0xFF3A),
    (0xFF41, 0xFF5A), (0x10400, 0x1044F), (0x104B0, 0x104D3), (0x104D8, 0x104FB),
    (0x10C80, 0x10CB2), (0x10CC0, 0x10CF2), (0x118A0, 0x118DF), (0x1E900, 0x1E943),
)  # fmt: skip


def _char_class(ranges: tuple[tuple[int, int], ...]) -> str:
    """A regex character class of code point ranges, written as escapes (\\x{...})."""
    parts = (rf"\x{{{a:X}}}" + ("" if a == b else rf"-\x{{{b:X}}}") for a, b in ranges)
    return "[" + "".join(parts) + "]"


# ASCII punctuation with the ASCII letters between (the letters split 2 left are re-split here),
# fullwidth forms, curly quotes, CJK space and full stops
_DEEPSEEK_LLM_PUNCT = (
    (0x21, 0x2F), (0x3A, 0x7E), (0xFF01, 0xFF0F), (0xFF1A, 0xFF5E), (0x2018, 0x201F),
    (0x3000, 0x3002),
)  # fmt: skip
_DEEPSEEK_LLM_SPLITS = (
    r"[\r\n]",
    r"\s?" + _char_class(_DEEPSEEK_LLM_CASED) + "+",
    r"\s?" + _char_class(_DEEPSEEK_LLM_PUNCT) + "+",
    r"\s+$",
    _DEEPSEEK_CODER_SPLITS[3],  # CJK ideographs and the blocks below them, Hangul
    r"\p{N}+",
)
_FALCON_SPLITS = (
    r"[\p{P}\$\+<=>\^~\|`]+",
    r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)",
    r"[0-9][0-9][0-9]",
)


@dataclass(frozen=True)
class _Pre:
    """How one `tokenizer.ggml.pre` family splits text before BPE, as llama.cpp runs it."""

    splits: tuple[str, ...]  # regexes applied in turn, each splitting the last one's pieces
    ignore_merges: bool = False  # a piece that is itself a token is taken whole, unmerged
    add_bos: bool = False  # BOS is added when the file has no tokenizer.ggml.add_bos_token


_GPT2 = _Pre((_GPT2_SPLIT,))
# tokenizer.ggml.pre -> its family, grouped as llama.cpp's llama-vocab.cpp groups the names
_PRE_TOKENIZERS: dict[str, _Pre] = {
    "default": _GPT2,
    **dict.fromkeys(
        (
            "gpt-2",
            "phi-2",
            "olmo",
            "mpt",
            "jais",
            "trillion",
            "granite-docling",
            "exaone4",
            "mellum",
            "gigachat",
            "a.x-4.0",
        ),
        _GPT2,
    ),
    # single digits before GPT-2's split (SmolLM, StarCoder, Command-R, EXAONE 3, ...)
    **dict.fromkeys(
        ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b"),
        _Pre((r"\p{N}", _GPT2_SPLIT)),
    ),
    # Llama 3's own: a piece that is in the vocabulary is one token, BOS by default
    **dict.fromkeys(
        ("llama3", "llama-bpe", "llama-v3", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2"),
        _Pre((_LLAMA3_SPLIT,), ignore_merges=True, add_bos=True),
    ),
    **dict.fromkeys(("smaug-bpe", "dbrx", "glm4", "chatglm-bpe"), _Pre((_LLAMA3_SPLIT,))),
    **dict.fromkeys(
        ("qwen2", "deepseek-r1-qwen", "kormo", "stablelm2", "megrez", "hunyuan", "grok-2"),
        _Pre((_QWEN2_SPLIT,)),
    ),
    **dict.fromkeys(("gpt-4o", "llama4", "minimax-m2"), _Pre((_O200K_SPLIT,))),
    "seed-coder": _Pre((_SEED_CODER_SPLIT,)),
    "kimi-k2": _Pre((_KIMI_K2_SPLIT,)),
    "tekken": _Pre((_TEKKEN_SPLIT,), ignore_merges=True, add_bos=True),
    **dict.fromkeys(("bailingmoe", "bailingmoe2", "llada-moe"), _Pre((_BAILING_SPLIT,))),
    **dict.fromkeys(("deepseek-v3", "hunyuan-dense"), _Pre(_DEEPSEEK3_SPLITS)),
    "deepseek-coder": _Pre(_DEEPSEEK_CODER_SPLITS),
    "deepseek-llm": _Pre(_DEEPSEEK_LLM_SPLITS),
    "falcon": _Pre(_FALCON_SPLITS),
}


def pre_tokenizer_family(pre: str) -> _Pre:
    """The family of `tokenizer.ggml.pre`. A name we do not know splits as GPT-2 does, with a
    warning (llama.cpp's own fallback is a regex of its own)."""
    if pre not in _PRE_TOKENIZERS:
        logger.warning(
            "GGUF tokenizer.ggml.pre=%r is not one paged knows; splitting words as GPT-2 does, "
            "which may tokenize some text differently from llama.cpp and transformers",
            pre,
        )
    return _PRE_TOKENIZERS.get(pre, _GPT2)


def byte_level_pre_tokenizer(pre: str | _Pre):
    """The tokenizers pre-tokenizer for `tokenizer.ggml.pre` (a name or its family): its split
    regexes in turn, then GPT-2's byte-level alphabet."""
    from tokenizers import Regex, pre_tokenizers

    family = pre_tokenizer_family(pre) if isinstance(pre, str) else pre
    steps = [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in family.splits]
    steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False))
    return pre_tokenizers.Sequence(steps)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character table."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
            *range(ord("®"), ord("ÿ") + 1)]  # fmt: skip
    table, extra = {b: chr(b) for b in keep}, 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def gguf_tokenizer(f: GGUFFile):
    from transformers import PreTrainedTokenizerFast

    kind = f.get("tokenizer.ggml.model")
    if kind not in _DEFAULTS:
        raise ValueError(
            f"unsupported GGUF tokenizer.ggml.model {kind!r} "
            "(supported: 'gpt2' byte-level BPE, 'llama' SentencePiece)"
        )
    tokens: list[str] = f.get("tokenizer.ggml.tokens") or []
    if not tokens:
        raise ValueError("GGUF metadata lacks tokenizer.ggml.tokens")
    _check_token_arrays(f, tokens)
    types: list[int] = f.get("tokenizer.ggml.token_type") or [NORMAL] * len(tokens)
    default_ids, default_add_bos = _DEFAULTS[kind]
    for key in _SPECIAL_IDS:
        value = f.get(f"tokenizer.ggml.{key}_token_id")
        if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
            raise ValueError(
                f"{f.path}: GGUF tokenizer.ggml.{key}_token_id={value!r} is not a token id"
            )

    def token_id(key: str) -> int | None:
        # as llama.cpp: a missing or out-of-range id leaves the model type's default
        for idx in (f.get(f"tokenizer.ggml.{key}_token_id"), default_ids.get(key)):
            if idx is not None and 0 <= idx < len(tokens):
                return idx
        return None

    def token(key: str) -> str | None:
        idx = token_id(key)
        return None if idx is None else tokens[idx]

    unk = token("unknown")
    if kind == "gpt2":
        pre = f.get("tokenizer.ggml.pre", "default")
        if not isinstance(pre, str):
            raise ValueError(f"{f.path}: GGUF tokenizer.ggml.pre={pre!r} is not a name")
        family = pre_tokenizer_family(pre)
        default_add_bos = family.add_bos
        tok = _byte_level_bpe(f, tokens, types, family)
    else:
        tok = spm_backend(f, tokens, types, unk)
    add_bos = _flag(f, "add_bos_token", default_add_bos)
    add_eos = _flag(f, "add_eos_token", False)
    template = f.get("tokenizer.chat_template")
    if template is not None and not isinstance(template, str):  # (a broken one: refused when used)
        raise ValueError(
            f"{f.path}: GGUF tokenizer.chat_template is not a string: {template!r:.80}"
        )
    for key, add in (("bos", add_bos), ("eos", add_eos)):
        if add and token_id(key) is None:  # the file still loads, as before and in llama.cpp
            logger.warning(
                "GGUF tokenizer.ggml.add_%s_token is set but tokenizer.ggml.%s_token_id names "
                "no token: none is added",
                key,
                key,
            )
    add_bos = add_bos and token_id("bos") is not None
    add_eos = add_eos and token_id("eos") is not None
    if add_bos or add_eos:
        tok.post_processor = _template(
            tokens, token_id("bos") if add_bos else None, token_id("eos") if add_eos else None
        )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=token("bos"),
        eos_token=token("eos"),
        unk_token=unk,
        pad_token=token("padding"),
        chat_template=template,
        clean_up_tokenization_spaces=False,
        model_max_length=int(f.get(f"{f.get('general.architecture')}.context_length", 2048)),
    )


_SPECIAL_IDS = ("bos", "eos", "unknown", "padding", "seperator", "cls", "mask")


def _flag(f: GGUFFile, key: str, default: bool) -> bool:
    """A tokenizer.ggml boolean (llama.cpp refuses another type; "false" is not False)."""
    value = f.get(f"tokenizer.ggml.{key}", default)
    if not isinstance(value, bool) and value not in (0, 1):
        raise ValueError(f"{f.path}: GGUF tokenizer.ggml.{key}={value!r} is not a boolean")
    return bool(value)


def _check_token_arrays(f: GGUFFile, tokens: object) -> None:
    """The vocabulary arrays' types and lengths: scores and token types, one per token; merges,
    "left right" strings."""
    if not isinstance(tokens, list) or not all(isinstance(t, str) for t in tokens):
        raise ValueError(f"{f.path}: GGUF tokenizer.ggml.tokens is not an array of strings")
    for key, kind in (("scores", (int, float)), ("token_type", int)):
        values = f.get(f"tokenizer.ggml.{key}")
        if values is None:
            continue
        if not isinstance(values, list) or not all(isinstance(v, kind) for v in values):
            raise ValueError(f"{f.path}: GGUF tokenizer.ggml.{key} is not an array of numbers")
        if len(values) != len(tokens):
            raise ValueError(
                f"{f.path}: GGUF tokenizer.ggml.{key} has {len(values)} entries for "
                f"{len(tokens)} tokens"
            )
    # ids past token_embd's rows: only unused padding (SSM converters pad the list)
    embedding = f.tensors.get("token_embd.weight")
    types = f.get("tokenizer.ggml.token_type") or [NORMAL] * len(tokens)
    rows = embedding.shape[0] if embedding is not None else len(tokens)
    if any(t != UNUSED for t in types[rows:]):
        raise ValueError(
            f"{f.path}: GGUF tokenizer.ggml.tokens has {len(tokens)} tokens but token_embd.weight "
            f"only {rows} rows (tokens past them must be unused padding)"
        )
    merges = f.get("tokenizer.ggml.merges")
    if merges is not None and not (
        isinstance(merges, list) and all(isinstance(m, str) and " " in m for m in merges)
    ):
        raise ValueError(f'{f.path}: GGUF tokenizer.ggml.merges is not an array of "a b" strings')


def _template(tokens: list[str], bos: int | None, eos: int | None):
    """BOS / EOS around each sequence; a pair's second sequence has type id 1."""
    from tokenizers.processors import TemplateProcessing

    def around(seq: str, type_id: int) -> str:
        first = f"{tokens[bos]}:{type_id} " if bos is not None else ""
        last = f" {tokens[eos]}:{type_id}" if eos is not None else ""
        return f"{first}{seq}:{type_id}{last}"

    return TemplateProcessing(
        single=around("$A", 0),
        pair=f"{around('$A', 0)} {around('$B', 1)}",
        special_tokens=[(tokens[i], i) for i in {bos, eos} if i is not None],
    )


def _byte_level_bpe(f: GGUFFile, tokens: list[str], types: list[int], family: _Pre):
    from tokenizers import AddedToken, Tokenizer, decoders, models

    merges: list[str] = f.get("tokenizer.ggml.merges") or []
    alphabet = _bytes_to_unicode()
    chars = set(alphabet.values())
    # Tokens are stored byte-level spelled; respell the rare one that is not (raw UTF-8 text).
    spelled = [t if set(t) <= chars else "".join(alphabet[b] for b in t.encode()) for t in tokens]
    vocab = {t: i for i, t in enumerate(spelled)}
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    # tokenizers refuses a merge of or into a string that is not a token (llama.cpp keeps it
    # and spells such a result in byte tokens): left out, so the file loads as llama.cpp's does
    usable = [(a, b) for a, b in pairs if a in vocab and b in vocab and a + b in vocab]
    if len(usable) < len(pairs):
        logger.warning(
            "GGUF tokenizer.ggml.merges: %d of %d merges name a string that is not a token; "
            "they are left out (text they would merge may tokenize differently from llama.cpp)",
            len(pairs) - len(usable),
            len(pairs),
        )
    bpe = models.BPE(
        vocab=vocab,
        merges=usable,
        fuse_unk=False,
        byte_fallback=False,
        ignore_merges=family.ignore_merges,
    )
    tok = Tokenizer(bpe)
    tok.pre_tokenizer = byte_level_pre_tokenizer(family)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([
        AddedToken(t, special=True, normalized=False)
        for t, ty in zip(tokens, types) if ty == CONTROL
    ])  # fmt: skip
    tok.add_tokens([
        AddedToken(t, special=False, normalized=False)
        for t, ty in zip(tokens, types) if ty == USER_DEFINED
    ])  # fmt: skip
    return tok
