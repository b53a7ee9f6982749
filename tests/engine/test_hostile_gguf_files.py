"""GGUF files that are well-formed byte by byte but whose metadata, tensors or vocabulary
contradict each other: each loads as llama.cpp would load it, or fails at load with a
ValueError naming the GGUF key or tensor (never a raw TypeError / RuntimeError, never a model
that runs with a layer, an expert matrix or a rope setting silently lost)."""

from __future__ import annotations

import struct

import pytest
import torch
from test_hostile_model_files import raw_gguf

from paged_engine import loader
from paged_engine.gguf import GGUFFile


def _parts(path) -> tuple[dict, list, bytes]:
    """(metadata, tensors as (name, dims innermost first, ggml type, offset), data) of a file."""
    f = GGUFFile(path)
    tensors, data = [], b""
    for name, info in f.tensors.items():
        data += b"\0" * (-len(data) % 32)
        tensors.append((name, list(reversed(info.shape)), info.ggml_type, len(data)))
        data += bytes(f.raw(name))
    return dict(f.metadata), tensors, data


@pytest.fixture(scope="module")
def llama_parts(tiny_model_factory, tmp_path_factory):
    """A tiny Llama GGUF (2 layers, 4 heads, 2 KV heads of 16, hidden 64, F32)."""
    pytest.importorskip("gguf")
    from gguf_writer import write_gguf

    path = tmp_path_factory.mktemp("gguf") / "llama.gguf"
    write_gguf(tiny_model_factory("llama"), path, "llama")
    return _parts(path)


@pytest.fixture(scope="module")
def mixtral_parts(tiny_model_factory, tmp_path_factory):
    pytest.importorskip("gguf")
    from gguf_writer import write_gguf

    path = tmp_path_factory.mktemp("gguf") / "mixtral.gguf"
    write_gguf(tiny_model_factory("mixtral"), path, "mixtral")
    return _parts(path)


def _resolved(tmp_path, parts, set=None, drop=(), tensors=None, extra=()):
    """The file `parts` with keys set, tensors dropped or replaced, extra F32 tensors added."""
    meta, infos, data = parts
    meta = {**meta, **(set or {})}
    infos = [t for t in infos if t[0] not in drop]
    infos = [(n, *tensors[n]) if tensors and n in tensors else t for t in infos for n in [t[0]]]
    for name, dims, values in extra:
        data += b"\0" * (-len(data) % 32)
        infos.append((name, dims, 0, len(data)))
        data += struct.pack(f"<{len(values)}f", *values)
    path = tmp_path / "m.gguf"
    path.write_bytes(raw_gguf(list(meta.items()), infos, data))
    loader._open_gguf.cache_clear()
    return loader.resolve_model(path)


def _load(resolved) -> torch.nn.Module:
    config = loader.load_hf_config(resolved)
    loader.load_tokenizer(resolved)
    return loader.load_model(resolved, config, dtype=torch.float32, device="cpu")


def _info(parts, name):
    return next(t for t in parts[1] if t[0] == name)


_BAD_CONFIGS = {
    # rope: 0 / inf leave every frequency 0 or 1, a negative base gives NaN logits
    "freq_base 0": ({"llama.rope.freq_base": 0.0}, r"llama\.rope\.freq_base=0\.0"),
    "freq_base -1": ({"llama.rope.freq_base": -1.0}, r"llama\.rope\.freq_base=-1\.0"),
    "freq_base inf": ({"llama.rope.freq_base": float("inf")}, r"llama\.rope\.freq_base=inf"),
    # rotary dims past the head, odd, or a part of the head of a whole-head rope model (which
    # ran the whole head, where llama.cpp refuses a Llama file with n_rot != head size)
    "rope dims past the head": ({"llama.rope.dimension_count": 64}, "dimension_count=64"),
    "rope dims odd": ({"llama.rope.dimension_count": 7}, "dimension_count=7"),
    "rope dims half on llama": ({"llama.rope.dimension_count": 8}, "llama rotates whole heads"),
    # int("2") and int(2.5) passed; True is an int to Python
    "head_count_kv a string": ({"llama.attention.head_count_kv": "2"}, "head_count_kv"),
    "head_count_kv a float": ({"llama.attention.head_count_kv": 2.5}, "head_count_kv"),
    "head_count_kv a bool": ({"llama.attention.head_count_kv": True}, "head_count_kv"),
    # sizes against the first layer's tensors, before a model of other sizes is built
    "embedding_length x2": ({"llama.embedding_length": 128}, r"token_embd\.weight .*embedding"),
    "head_count x2": ({"llama.attention.head_count": 8}, r"blk\.0\.attn_q\.weight .*head_count"),
    "head_count_kv x2": ({"llama.attention.head_count_kv": 4}, r"blk\.0\.attn_k\.weight"),
    "feed_forward_length + 8": ({"llama.feed_forward_length": 136}, r"blk\.0\.ffn_up\.weight"),
    "architecture an array": ({"general.architecture": ["llama"]}, "general.architecture"),
    # llama.cpp takes a per-layer array of one entry per layer only
    "head_count of 3 for 2 layers": ({"llama.attention.head_count": [4] * 3}, "head_count"),
}


@pytest.mark.parametrize("changes,match", _BAD_CONFIGS.values(), ids=list(_BAD_CONFIGS))
def test_contradicting_metadata_named(tmp_path, llama_parts, changes, match):
    resolved = _resolved(tmp_path, llama_parts, set=changes)
    with pytest.raises(ValueError, match=match):
        loader.load_hf_config(resolved)


def test_unchanged_and_per_layer_head_count_load(tmp_path, llama_parts):
    """The rewritten file loads, and so does a per-layer head_count (llama.cpp reads arrays)."""
    _load(_resolved(tmp_path, llama_parts))
    _load(_resolved(tmp_path, llama_parts, set={"llama.attention.head_count": [4, 4]}))


def _norm(parts, layer: int):
    return (f"blk.{layer}.attn_norm.weight", [64], [1.0] * 64)


_BAD_TENSORS = {
    # block_count below the file's layers: the last layer was dropped and the model ran
    "block_count 1 of 2": (
        dict(set={"llama.block_count": 1}),
        r"blk\.1\..* past llama\.block_count=1",
    ),
    # block_count above the file's layers: a layer no tensor fills
    "block_count 3 of 2": (dict(set={"llama.block_count": 3}), r"block_count=3, .* no blk\.2\."),
    "a layer past block_count": (
        dict(extra=[("blk.5.attn_norm.weight", [64], [1.0] * 64)]),
        r"'blk\.5\.attn_norm\.weight' is past llama\.block_count=2",
    ),
    # layer 0's q of three dimensions: named against the config; a later layer's was a raw
    # reshape error in the q / k row permutation
    "layer 0 q of three dimensions": (
        dict(tensors={"blk.0.attn_q.weight": ([64, 64, 1], 0, None)}),
        r"blk\.0\.attn_q\.weight has shape \[1, 64, 64\], but llama\.attention\.head_count",
    ),
    "layer 1 q of three dimensions": (
        dict(tensors={"blk.1.attn_q.weight": ([64, 64, 1], 0, None)}),
        r"'blk\.1\.attn_q\.weight' of shape \(1, 64, 64\) is not 4 heads",
    ),
}


@pytest.mark.parametrize("changes,match", _BAD_TENSORS.values(), ids=list(_BAD_TENSORS))
def test_tensors_contradicting_metadata_named(tmp_path, llama_parts, changes, match):
    if "tensors" in changes:  # keep each replaced tensor's offset
        changes["tensors"] = {
            n: (dims, t, _info(llama_parts, n)[3]) for n, (dims, t, _) in changes["tensors"].items()
        }
    resolved = _resolved(tmp_path, llama_parts, **changes)
    with pytest.raises(ValueError, match=match):
        _load(resolved)


def test_rows_of_partial_quant_blocks_refused(tmp_path, llama_parts):
    """A Q8_0 tensor of 2 rows of 48 is 3 whole blocks in all, but ggml needs whole blocks per
    row (the last block would straddle two rows)."""
    offset = _info(llama_parts, "blk.0.attn_q.weight")[3]
    resolved = _resolved(
        tmp_path, llama_parts, tensors={"blk.0.attn_q.weight": ([48, 2], 8, offset)}
    )
    with pytest.raises(ValueError, match=r"'blk\.0\.attn_q\.weight' has rows of 48 values"):
        GGUFFile(resolved.gguf_file)


@pytest.mark.parametrize("ggml_type,name", [(26, "I32"), (24, "I8")])
def test_tensor_of_a_type_we_cannot_dequantize_named(tmp_path, llama_parts, ggml_type, name):
    """A norm stored as integers (a type the reader knows, the dequantizer refuses)."""
    dims, _, offset = _info(llama_parts, "blk.0.attn_norm.weight")[1:]
    resolved = _resolved(
        tmp_path, llama_parts, tensors={"blk.0.attn_norm.weight": (dims, ggml_type, offset)}
    )
    match = rf"'blk\.0\.attn_norm\.weight': cannot dequantize ggml type {name}"
    with pytest.raises(ValueError, match=match):
        _load(resolved)


def test_missing_expert_matrices_named(tmp_path, mixtral_parts):
    """A router without its experts' up matrices: the fused experts weight was left half set."""
    resolved = _resolved(tmp_path, mixtral_parts, drop={"blk.1.ffn_up_exps.weight"})
    with pytest.raises(
        ValueError, match=r"blk\.1\.ffn_gate_inp\.weight but lacks blk\.1\.ffn_up_exps"
    ):
        _load(resolved)


def test_expert_under_two_names_named(tmp_path, mixtral_parts):
    """An old-style per-expert tensor beside the merged one: whichever came last won."""
    dims = _info(mixtral_parts, "blk.0.ffn_gate_exps.weight")[1][:2]
    extra = [("blk.0.ffn_gate.0.weight", dims, [5.0] * (dims[0] * dims[1]))]
    resolved = _resolved(tmp_path, mixtral_parts, extra=extra)
    with pytest.raises(
        ValueError, match=r"'blk\.0\.ffn_gate_exps\.weight' and 'blk\.0\.ffn_gate\.0"
    ):
        _load(resolved)


_BAD_VOCABS = {
    "eos id an array": ({"tokenizer.ggml.eos_token_id": [2, 3]}, "eos_token_id=\\[2, 3\\]"),
    "pre an array": ({"tokenizer.ggml.pre": ["llama-bpe"]}, r"tokenizer\.ggml\.pre="),
    "pre an int": ({"tokenizer.ggml.pre": 7}, r"tokenizer\.ggml\.pre=7"),
    "chat_template an int": ({"tokenizer.chat_template": 5}, r"tokenizer\.chat_template"),
    "chat_template an array": ({"tokenizer.chat_template": ["a"]}, r"tokenizer\.chat_template"),
    # bool("false") is True: BOS was added
    "add_bos_token a string": ({"tokenizer.ggml.add_bos_token": "false"}, "add_bos_token"),
}


@pytest.mark.parametrize("changes,match", _BAD_VOCABS.values(), ids=list(_BAD_VOCABS))
def test_bad_vocabulary_keys_named(tmp_path, llama_parts, changes, match):
    resolved = _resolved(tmp_path, llama_parts, set=changes)
    with pytest.raises(ValueError, match=match) as err:
        loader.load_tokenizer(resolved)
    assert str(resolved.gguf_file) in str(err.value)


def test_tokens_past_the_embedding_refused(tmp_path, llama_parts):
    """Token ids past token_embd's rows (llama.cpp refuses the file; the text "zz0" became an
    id the embedding has no row for)."""
    meta = llama_parts[0]
    n = len(meta["tokenizer.ggml.tokens"])
    grow = {"tokenizer.ggml.tokens": meta["tokenizer.ggml.tokens"] + ["zz0", "zz1"]}
    for key, fill in (("tokenizer.ggml.scores", 0.0), ("tokenizer.ggml.token_type", 1)):
        if key in meta:
            grow[key] = meta[key] + [fill] * 2
    resolved = _resolved(tmp_path, llama_parts, set=grow)
    with pytest.raises(ValueError, match=f"{n + 2} tokens but token_embd.weight only {n} rows"):
        loader.load_tokenizer(resolved)


def test_merges_of_unknown_strings_left_out(tmp_path, llama_parts):
    """Merges naming strings that are not tokens (llama.cpp loads such a file; tokenizers
    refused it) are left out: the rest tokenize as before."""
    text = "Hello world, the cat sat on the mat"
    want = loader.load_tokenizer(_resolved(tmp_path, llama_parts)).encode(text)
    merges = ["zzq qqz", "Ġ zzz"] + llama_parts[0]["tokenizer.ggml.merges"]
    resolved = _resolved(tmp_path, llama_parts, set={"tokenizer.ggml.merges": merges})
    assert loader.load_tokenizer(resolved).encode(text) == want
