"""A fast tokenizer for Grok-2 checkpoints that ship only xAI's `tokenizer.tok.json` (vLLM's
`Grok2Tokenizer`, vllm/tokenizers/grok2.py, which builds a `tiktoken.Encoding`; not needed here).

    if grok2_only(path):
        tokenizer = grok2_tokenizer(path)

tokenizer.tok.json is a tiktoken vocabulary: `regular_tokens` and `special_tokens` list
{"bytes": [0..255, ...], "token": id}, the regular tokens' ids being their merge ranks;
`word_split` "V1" names xAI's split pattern (below), which a `pat_str` replaces; `vocab_size`,
where given, is the number of ids (tiktoken's explicit_n_vocab: every id 0 .. n-1 used once);
`default_allowed_special` lists more specials (as bytes) that text may contain. Text is split
by the pattern, then each piece is one token if it is a regular token, else its byte pairs
merge lowest rank first. That is rebuilt here as tekken.py rebuilds Mistral's tiktoken files: a
`tokenizers` byte-level BPE whose merges are every split of a token into two regular tokens,
ordered by the merged token's rank.

As vLLM reads it:
- specials are found in text only where vLLM's encode allows them: <|pad|>, <|separator|>,
  <|eos|>, <|control1|> .. <|control704|>, <|reserved_3|> .. <|reserved_127|> and the file's
  `default_allowed_special`; any other special's text is encoded as plain text (its id still
  decodes to its text, and here is not skipped by skip_special_tokens, where vLLM skips it).
- no BOS or EOS is ever added to a prompt; the BOS id is <|separator|>'s (else <|pad|>'s, else
  <|eos|>'s, else id 0), EOS <|eos|> (else BOS), PAD <|pad|> (else EOS), UNK PAD.
- the chat template is tokenizer_config.json's `chat_template` where the directory has one,
  else vLLM's default Grok-2 layout (GROK2_CHAT_TEMPLATE): "Human: " / "System: " + stripped
  content, "Assistant: " + content, each closed by "<|separator|>\\n\\n"; "Assistant:" opens
  the reply.
Where it differs: vLLM picks this tokenizer for every `Grok1ForCausalLM` under tokenizer_mode
"auto"; paged picks it by the files, where a directory has tokenizer.tok.json and no
tokenizer.json / tokenizer.model (Grok-1 releases converted to HF keep theirs).
convert_ids_to_tokens gives byte-level strings ("Ġthe", as HF BPE tokenizers do), where vLLM's
gives each token's bytes decoded as UTF-8.
A malformed file is refused with a ValueError naming the tokenizer.tok.json field.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from paged_engine.gguf.tokenizer import _bytes_to_unicode, _Pre, byte_level_pre_tokenizer

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

GROK2_FILE = "tokenizer.tok.json"
# Either of these and the repo's own HF tokenizer is used instead.
_HF_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model")
PAD, SEP, EOS = "<|pad|>", "<|separator|>", "<|eos|>"
# The specials vLLM's encode lets text contain, besides the file's default_allowed_special.
_ALLOWED = frozenset(
    [PAD, SEP, EOS]
    + [f"<|control{i}|>" for i in range(1, 705)]
    + [f"<|reserved_{i}|>" for i in range(3, 128)]
)
# word_split "V1": GPT-4's split with each digit a piece of its own.
V1_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"
    r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# vLLM's default Grok-2 chat layout (messages of other roles write nothing).
GROK2_CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'user' -%}"
    "{{- 'Human: ' + message['content'].strip() + '<|separator|>\\n\\n' -}}"
    "{%- elif message['role'] == 'system' -%}"
    "{{- 'System: ' + message['content'].strip() + '<|separator|>\\n\\n' -}}"
    "{%- elif message['role'] == 'assistant' -%}"
    "{{- 'Assistant: ' + message['content'] + '<|separator|>\\n\\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- 'Assistant:' -}}{%- endif -%}"
)


@dataclass(slots=True)
class Grok2Vocab:
    """A parsed tokenizer.tok.json: regular tokens' bytes -> id (= merge rank), specials'
    text -> id, the split pattern and the specials text may contain."""

    regular: dict[bytes, int]
    specials: dict[str, int]
    pattern: str
    allowed: frozenset[str]


def grok2_only(path: Path) -> bool:
    """Whether `path` holds tokenizer.tok.json and no HF tokenizer files."""
    return (path / GROK2_FILE).is_file() and not any(
        (path / name).exists() for name in _HF_TOKENIZER_FILES
    )


def read_grok2(file: Path) -> Grok2Vocab:
    """The vocabulary of a tokenizer.tok.json (see the module docstring)."""
    try:
        data = json.loads(Path(file).read_text(encoding="utf-8"))
    except ValueError as error:
        raise ValueError(f"{file}: tokenizer.tok.json is not JSON ({error})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{file}: tokenizer.tok.json must hold a JSON object")
    return _parse(data, file)


def _parse(data: dict, file: Path) -> Grok2Vocab:
    def bad(field: str, what: str) -> ValueError:
        return ValueError(f"{file}: tokenizer.tok.json {field} {what}")

    if data.get("word_split") != "V1":
        raise bad("word_split", f"is {data.get('word_split')!r}; only 'V1' is known")
    pattern = data.get("pat_str", V1_PATTERN)
    if not isinstance(pattern, str):
        raise bad("pat_str", "must be a string")
    regular = {bytes(b): i for b, i in _entries(data, "regular_tokens", bad)}
    if len(regular) != len(data["regular_tokens"]):
        raise bad("regular_tokens", "has a byte string twice")
    if any(bytes([b]) not in regular for b in range(256)):
        raise bad("regular_tokens", "must hold all 256 single bytes")
    specials = {}
    for b, i in _entries(data, "special_tokens", bad):
        specials[bytes(b).decode("utf-8", errors="replace")] = i
    if len(specials) != len(data.get("special_tokens") or []):
        raise bad("special_tokens", "has a token twice")
    ids = sorted([*regular.values(), *specials.values()])
    if len(set(ids)) != len(ids):
        raise bad("token", "ids must be distinct across regular_tokens and special_tokens")
    size = data.get("vocab_size", ids[-1] + 1)
    if size != ids[-1] + 1 or ("vocab_size" in data and size != len(ids)):
        raise bad(f"vocab_size={size!r}", f"must count the {len(ids)} ids 0 .. {len(ids) - 1}")
    extra = data.get("default_allowed_special") or []
    if not isinstance(extra, list) or not all(_is_bytes(b) for b in extra):
        raise bad("default_allowed_special", "must list byte arrays")
    allowed = _ALLOWED | {bytes(b).decode("utf-8", errors="replace") for b in extra}
    return Grok2Vocab(regular, specials, pattern, frozenset(allowed & specials.keys()))


def _entries(data: dict, field: str, bad) -> list[tuple[list[int], int]]:
    entries = data.get(field, [] if field == "special_tokens" else None)
    if not isinstance(entries, list) or (field == "regular_tokens" and not entries):
        raise bad(field, "must be a list of {bytes, token} entries")
    out = []
    for n, entry in enumerate(entries):
        token = entry.get("token") if isinstance(entry, dict) else None
        if not (isinstance(entry, dict) and _is_bytes(entry.get("bytes"))):
            raise bad(f"{field}[{n}].bytes", "must be a non-empty list of byte values")
        if not isinstance(token, int) or isinstance(token, bool) or token < 0:
            raise bad(f"{field}[{n}].token", f"={token!r} must be a non-negative id")
        out.append((entry["bytes"], token))
    return out


def _is_bytes(value: object) -> bool:
    return (
        isinstance(value, list)
        and bool(value)
        and all(isinstance(b, int) and 0 <= b < 256 for b in value)
    )


def bpe_model(vocab: Grok2Vocab) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """(vocab, merges) of a `tokenizers` BPE that encodes as tiktoken does: ignore_merges keeps
    a piece that is a regular token whole, and a merge's priority is the rank of the token it
    makes (ties between two splits of one token break by the left part's rank). Specials are
    in the vocab under their text, so each decodes to it."""
    table = _bytes_to_unicode()  # byte 0 .. 255 -> its byte-level character

    def text(token: bytes) -> str:
        return token.decode("latin-1").translate(table)

    merged = {text(token): rank for token, rank in vocab.regular.items()}
    splits = []
    for token, rank in vocab.regular.items():
        for cut in range(1, len(token)):
            left, right = vocab.regular.get(token[:cut]), vocab.regular.get(token[cut:])
            if left is not None and right is not None:
                splits.append((rank, left, token[:cut], token[cut:]))
    splits.sort()
    # A special outside the allowed set is plain text in a prompt: its byte-level form keeps it
    # from matching as a token (unless a whole split piece spells it, as tiktoken's would not).
    for name, i in vocab.specials.items():
        key = name if name in vocab.allowed else text(name.encode())
        if key in merged:
            raise ValueError(f"{GROK2_FILE}: special token {name!r} is also a regular token")
        merged[key] = i
    return merged, [(text(left), text(right)) for _, _, left, right in splits]


def _chat_template(path: Path) -> str:
    """tokenizer_config.json's chat_template where there is one (as vLLM reads it), else the
    default Grok-2 layout."""
    file = path / "tokenizer_config.json"
    if file.is_file():
        template = json.loads(file.read_text(encoding="utf-8")).get("chat_template")
        if isinstance(template, str) and template:
            return template
    return GROK2_CHAT_TEMPLATE


def grok2_tokenizer(path: Path) -> PreTrainedTokenizerFast:
    """A PreTrainedTokenizerFast for `path`'s tokenizer.tok.json (see the module docstring)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    vocab = read_grok2(path / GROK2_FILE)
    table, merges = bpe_model(vocab)
    tok = Tokenizer(models.BPE(table, merges, fuse_unk=False, ignore_merges=True))
    tok.pre_tokenizer = byte_level_pre_tokenizer(_Pre((vocab.pattern,)))
    tok.decoder = decoders.ByteLevel()
    # Already in the BPE vocab: each keeps its file id and is matched in text before splitting.
    allowed = sorted(vocab.allowed, key=vocab.specials.__getitem__)
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in allowed])
    specials = vocab.specials
    bos = next((specials[s] for s in (SEP, PAD, EOS) if s in specials), 0)
    eos = specials.get(EOS, bos)
    pad = specials.get(PAD, eos)
    roles = {"bos_token": bos, "eos_token": eos, "pad_token": pad, "unk_token": pad}
    names = {role: tok.id_to_token(i) for role, i in roles.items()}
    if None in names.values():
        raise ValueError(f"{path / GROK2_FILE}: tokenizer.tok.json has no token of id {bos}")
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, chat_template=_chat_template(path), **names
    )
