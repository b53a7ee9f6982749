"""A transformers `PreTrainedTokenizerFast` built from GGUF tokenizer metadata.

Supported: `tokenizer.ggml.model == "gpt2"` (byte-level BPE: tokens, merges, token types).
Token type 3 (control) becomes a special added token, type 4 (user defined) a plain added
token, so both are matched whole. `tokenizer.ggml.pre` picks the split regex the merges were
learned with, as llama.cpp does.
"""

from __future__ import annotations

from paged_engine.gguf.reader import GGUFFile

CONTROL, USER_DEFINED = 3, 4

_GPT2_SPLIT = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = _LLAMA3_SPLIT.replace(r"\p{N}{1,3}", r"\p{N}")
# tokenizer.ggml.pre -> (split regex, digits split one by one first)
_PRE_TOKENIZERS: dict[str, tuple[str, bool]] = {
    "default": (_GPT2_SPLIT, False),
    "gpt-2": (_GPT2_SPLIT, False),
    "smollm": (_GPT2_SPLIT, True),  # SmolLM: Digits(individual) + GPT-2 byte-level
    "starcoder": (_GPT2_SPLIT, True),
    "llama3": (_LLAMA3_SPLIT, False),
    "llama-bpe": (_LLAMA3_SPLIT, False),
    "llama-v3": (_LLAMA3_SPLIT, False),
    "smaug-bpe": (_LLAMA3_SPLIT, False),
    "qwen2": (_QWEN2_SPLIT, False),
}


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
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.processors import TemplateProcessing
    from transformers import PreTrainedTokenizerFast

    kind = f.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise ValueError(f"unsupported GGUF tokenizer model {kind!r} (only 'gpt2' byte-level BPE)")
    tokens: list[str] = f.get("tokenizer.ggml.tokens")
    merges: list[str] = f.get("tokenizer.ggml.merges") or []
    types: list[int] = f.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    alphabet = _bytes_to_unicode()
    chars = set(alphabet.values())
    # Tokens are stored byte-level spelled; respell the rare one that is not (raw UTF-8 text).
    spelled = [t if set(t) <= chars else "".join(alphabet[b] for b in t.encode()) for t in tokens]
    vocab = {t: i for i, t in enumerate(spelled)}
    bpe = models.BPE(
        vocab=vocab,
        merges=[tuple(m.split(" ", 1)) for m in merges],
        fuse_unk=False,
        byte_fallback=False,
    )
    tok = Tokenizer(bpe)
    pre = f.get("tokenizer.ggml.pre", "default")
    split, digits = _PRE_TOKENIZERS.get(pre, _PRE_TOKENIZERS["default"])
    steps = [pre_tokenizers.Digits(individual_digits=True)] if digits else []
    steps += [
        pre_tokenizers.Split(Regex(split), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ]
    tok.pre_tokenizer = pre_tokenizers.Sequence(steps)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([
        AddedToken(t, special=True, normalized=False)
        for t, ty in zip(tokens, types) if ty == CONTROL
    ])  # fmt: skip
    tok.add_tokens([
        AddedToken(t, special=False, normalized=False)
        for t, ty in zip(tokens, types) if ty == USER_DEFINED
    ])  # fmt: skip

    def token(key: str) -> str | None:
        idx = f.get(f"tokenizer.ggml.{key}_token_id")
        return tokens[idx] if idx is not None and 0 <= idx < len(tokens) else None

    bos = token("bos")
    if f.get("tokenizer.ggml.add_bos_token", False) and bos is not None:
        tok.post_processor = TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, vocab[bos])]
        )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=bos,
        eos_token=token("eos"),
        unk_token=token("unknown"),
        pad_token=token("padding"),
        chat_template=f.get("tokenizer.chat_template"),
        clean_up_tokenization_spaces=False,
        model_max_length=int(f.get(f"{f.get('general.architecture')}.context_length", 2048)),
    )
