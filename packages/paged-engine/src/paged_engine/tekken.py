"""A fast tokenizer for Mistral checkpoints that ship only `tekken.json` (vLLM's
`tokenizer_mode="mistral"` reads the same file through mistral_common, not needed here).

    if tekken_only(path):
        tokenizer = tekken_tokenizer(path)

tekken.json is a tiktoken vocabulary: `vocab` lists byte strings (base64 `token_bytes`) by
`rank`, the first 256 being the single bytes; `special_tokens` (or, in files of version <= v7
without that list, mistral_common's 20 historical ones) take ids 0 .. S-1 with S =
`config.default_num_special_tokens`, unnamed ones filled as `<SPECIAL_i>`; a vocab entry of
rank r has id S + r, and only the first `default_vocab_size - S` entries count. Text is split
by `config.pattern`, then each piece is one token if it is in the vocab, else byte pairs are
merged lowest rank first. That is rebuilt here as a `tokenizers` byte-level BPE whose merges
are every split of a token into two vocab tokens, ordered by the merged token's rank.

Where it differs from the engines it stands in for:
- transformers (5.x) converts a tekken-only directory too, but names no BOS / EOS / UNK / PAD
  token and adds no BOS; here `<s>` is put before a prompt (add_special_tokens=True), as
  mistral_common's `encode(text, bos=True)` does for vLLM's text prompts.
- mistral_common's raw `encode` reads a special token's text (`[INST]`) as plain bytes; here,
  as in HF tokenizers, the text of a special token is that token (paged's Voxtral prompts are
  written that way: "[INST][AUDIO]...[/INST]").
- there is no chat template (mistral_common builds chats in code, per tokenizer version): a
  sibling chat_template.jinja / chat_template.json is used where there is one; else the
  tokenizer carries `mistral_chat` (mistral_chat.py), which LLM.chat and paged-server's chat
  routes render with, as vLLM's mistral mode does (an explicit `chat_template` still wins).
A malformed file is refused with a ValueError naming the tekken.json field.
"""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import TYPE_CHECKING

from paged_engine.gguf.tokenizer import _bytes_to_unicode, _Pre, byte_level_pre_tokenizer

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

TEKKEN_FILE = "tekken.json"
# Any of these and the repo's own HF tokenizer is used instead.
_HF_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
# mistral_common's specials for tekken files that predate the `special_tokens` list (<= v7).
_OLD_SPECIALS = (
    "<unk>", "<s>", "</s>", "[INST]", "[/INST]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]",
    "[TOOL_RESULTS]", "[/TOOL_RESULTS]", "[TOOL_CALLS]", "[IMG]", "<pad>", "[IMG_BREAK]",
    "[IMG_END]", "[PREFIX]", "[MIDDLE]", "[SUFFIX]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]",
    "[TOOL_CONTENT]",
)  # fmt: skip
_ROLES = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "pad_token": "<pad>"}


def tekken_only(path: Path) -> bool:
    """Whether `path` holds tekken.json and no HF tokenizer files."""
    return (path / TEKKEN_FILE).is_file() and not any(
        (path / name).exists() for name in _HF_TOKENIZER_FILES
    )


def read_tekken(file: Path) -> tuple[str, list[str], list[bytes]]:
    """(split pattern, specials by id, vocab bytes by rank) of a tekken.json; a vocab token of
    rank r has id len(specials) + r."""
    return _parse(json.loads(Path(file).read_text(encoding="utf-8")), file)


def _parse(data: dict, file: Path) -> tuple[str, list[str], list[bytes]]:
    config = data.get("config") if isinstance(data, dict) else None
    if not isinstance(config, dict) or not isinstance(config.get("pattern"), str):
        raise ValueError(f"{file}: tekken.json config.pattern is missing")
    specials = _specials(data, config, file)
    entries = data.get("vocab")
    if not isinstance(entries, list):
        raise ValueError(f"{file}: tekken.json vocab is missing")
    size = config.get("default_vocab_size", len(specials) + len(entries))
    if not isinstance(size, int) or not len(specials) <= size <= len(specials) + len(entries):
        raise ValueError(
            f"{file}: tekken.json config.default_vocab_size={size!r} must lie between "
            f"{len(specials)} special tokens and that plus {len(entries)} vocab entries"
        )
    ranks = []
    for rank, entry in enumerate(entries[: size - len(specials)]):
        token = base64.b64decode(entry["token_bytes"])
        if entry.get("rank") != rank or (rank < 256 and token != bytes([rank])):
            raise ValueError(
                f"{file}: tekken.json vocab[{rank}] must have rank {rank}"
                + (f" and be the byte {rank}" if rank < 256 else "")
            )
        ranks.append(token)
    if len(set(ranks)) != len(ranks) or len(ranks) < 256:
        raise ValueError(f"{file}: tekken.json vocab must hold 256 bytes and no duplicates")
    return config["pattern"], specials, ranks


def _specials(data: dict, config: dict, file: Path) -> list[str]:
    listed = data.get("special_tokens")
    if listed is None:
        version = str(config.get("version", "v0"))
        if not version[1:].isdigit() or int(version[1:]) > 7:
            raise ValueError(f"{file}: tekken.json special_tokens is missing (version {version})")
        names = list(_OLD_SPECIALS)
    else:
        by_rank = sorted((t["rank"], str(t["token_str"])) for t in listed)
        if [rank for rank, _ in by_rank] != list(range(len(by_rank))):
            raise ValueError(f"{file}: tekken.json special_tokens ranks must be 0 .. n-1")
        names = [name for _, name in by_rank]
    count = config.get("default_num_special_tokens", len(names))
    if len(set(names)) != len(names) or not isinstance(count, int) or count < len(names):
        raise ValueError(
            f"{file}: tekken.json special_tokens must be distinct and at most "
            f"config.default_num_special_tokens={count!r}"
        )
    return names + [f"<SPECIAL_{i}>" for i in range(len(names), count)]


def bpe_model(
    specials: list[str], ranks: list[bytes]
) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """(vocab, merges) of a `tokenizers` BPE that encodes as tiktoken does with `ranks`:
    ignore_merges keeps a whole piece in the vocab as one token, and a merge's priority is
    the rank of the token it makes (ties between two splits of one token break by the left
    part's rank, where tiktoken takes the leftmost pair)."""
    table = _bytes_to_unicode()  # code point 0 .. 255 -> its byte-level character

    def text(token: bytes) -> str:
        return token.decode("latin-1").translate(table)

    rank_of = {token: rank for rank, token in enumerate(ranks)}
    vocab = {text(token): len(specials) + rank for rank, token in enumerate(ranks)}
    vocab |= {name: i for i, name in enumerate(specials)}
    splits = []
    for rank, token in enumerate(ranks):
        for cut in range(1, len(token)):
            left = rank_of.get(token[:cut])
            right = rank_of.get(token[cut:])
            if left is not None and right is not None:
                splits.append((rank, left, right))
    splits.sort()
    return vocab, [(text(ranks[left]), text(ranks[right])) for _, left, right in splits]


def tekken_tokenizer(path: Path) -> PreTrainedTokenizerFast:
    """A PreTrainedTokenizerFast for `path`'s tekken.json (see the module docstring)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models
    from tokenizers.processors import TemplateProcessing
    from transformers import PreTrainedTokenizerFast

    from paged_engine.models.multimodal_text import processor_chat_template

    file = path / TEKKEN_FILE
    data = json.loads(file.read_text(encoding="utf-8"))
    pattern, specials, ranks = _parse(data, file)
    vocab, merges = bpe_model(specials, ranks)
    bpe = models.BPE(vocab, merges, fuse_unk=False, ignore_merges=True)
    tok = Tokenizer(bpe)
    tok.pre_tokenizer = byte_level_pre_tokenizer(_Pre((pattern,)))  # as a GGUF's tekken split
    tok.decoder = decoders.ByteLevel()
    # Already in the BPE vocab: each keeps its id 0 .. S-1 and is matched in text first.
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials])
    roles = {role: name for role, name in _ROLES.items() if name in specials}
    if "bos_token" in roles:
        bos = roles["bos_token"]
        tok.post_processor = TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A $B", special_tokens=[(bos, vocab[bos])]
        )
    jinja = path / "chat_template.jinja"
    template = jinja.read_text(encoding="utf-8") if jinja.is_file() else None
    template = template or processor_chat_template(path)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, chat_template=template, **roles)
    if template is None:  # chats as mistral_common builds them for this tekken.json version
        from paged_engine.mistral_chat import MistralChat

        version = str(data["config"].get("version", ""))
        ids = {name: i for i, name in enumerate(specials)}
        fast.mistral_chat = MistralChat(version, ids, Tokenizer.from_str(tok.to_str()))
    return fast
