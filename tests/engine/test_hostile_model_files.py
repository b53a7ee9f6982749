"""Broken or hostile model files (GGUF, safetensors, index, config.json, tokenizer files): each
fails fast with a ValueError / OSError naming the file and what is wrong, before any large
allocation; nothing outside the model directory is read."""

from __future__ import annotations

import json
import re
import shutil
import struct
import time
from pathlib import Path

import pytest
import torch

from paged_engine import LLM, SamplingParams, loader
from paged_engine.gguf import GGUFFile

# -- raw GGUF writing: any header, valid or not ----------------------------------------------


def _s(text: str | bytes) -> bytes:
    raw = text.encode() if isinstance(text, str) else text
    return struct.pack("<Q", len(raw)) + raw


def _value(v) -> tuple[int, bytes]:
    """(GGUF value type, bytes): bool, u32 / i32 / u64 ints, f32, string, arrays of those."""
    if isinstance(v, bool):
        return 7, struct.pack("<?", v)
    if isinstance(v, int):
        if v < 0:
            return 5, struct.pack("<i", v)
        return (4, struct.pack("<I", v)) if v < 2**32 else (10, struct.pack("<Q", v))
    if isinstance(v, float):
        return 6, struct.pack("<f", v)
    if isinstance(v, str):
        return 8, _s(v)
    items = [_value(x) for x in v]
    etype = items[0][0] if items else 4
    return 9, struct.pack("<IQ", etype, len(v)) + b"".join(b for _, b in items)


def raw_gguf(meta, tensors, data: bytes, *, counts=None, align: int = 32) -> bytes:
    """meta: (key, value); tensors: (name, dims innermost first, ggml type, data offset)."""
    n_tensors, n_kv = counts or (len(tensors), len(meta))
    out = b"GGUF" + struct.pack("<IQQ", 3, n_tensors, n_kv)
    for key, value in meta:
        vtype, raw = _value(value)
        out += _s(key) + struct.pack("<I", vtype) + raw
    for name, dims, ggml_type, offset in tensors:
        out += _s(name) + struct.pack("<I", len(dims))
        out += b"".join(struct.pack("<Q", d) for d in dims) + struct.pack("<IQ", ggml_type, offset)
    return out + b"\0" * (-len(out) % align) + data


def _small(**changes) -> bytes:
    """Two F32 tensors a[4] at 0 and b[2, 4] at 32."""
    meta = [("general.architecture", "llama"), ("general.alignment", 32)]
    meta = [(k, changes.pop(k, v)) for k, v in meta]
    tensors = changes.pop("tensors", [("a", [4], 0, 0), ("b", [4, 2], 0, 32)])
    return raw_gguf(meta + changes.pop("extra", []), tensors, b"\1" * 64, **changes)


def _one_kv(body: bytes) -> bytes:
    """A header of one key "k" whose type and value are `body`."""
    return b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + _s("k") + body


def _write(tmp_path: Path, blob: bytes, name: str = "m.gguf") -> Path:
    path = tmp_path / name
    path.write_bytes(blob)
    return path


_BAD_HEADERS = {
    "string array count 2**62": (_one_kv(struct.pack("<IIQ", 9, 8, 2**62) + _s("x")), "trunc"),
    "string of 2**62 bytes in an array": (
        _one_kv(struct.pack("<IIQ", 9, 8, 2) + struct.pack("<Q", 2**62) + b"x" * 16),
        "trunc",
    ),
    "array of 2**62 arrays": (_one_kv(struct.pack("<IIQ", 9, 9, 2**62) + b"\0" * 48), "trunc"),
    "u32 array count 2**62": (_one_kv(struct.pack("<IIQ", 9, 4, 2**62)), "trunc"),
    "key of 2**62 bytes": (b"GGUF" + struct.pack("<IQQQ", 3, 0, 1, 2**62) + b"ab", "trunc"),
    "kv count 2**63": (_small(counts=(2, 2**63)), "trunc"),
    "tensor count 2**63": (_small(counts=(2**63, 2)), "trunc"),
    "2**31 dimensions": (
        b"GGUF" + struct.pack("<IQQ", 3, 1, 0) + _s("t") + struct.pack("<I", 2**31) + b"\0" * 64,
        "dimensions",
    ),
    "alignment 0": (_small(**{"general.alignment": 0}), "power of two"),
    "alignment 3": (_small(**{"general.alignment": 3}, align=3), "power of two"),
    "alignment a string": (_small(**{"general.alignment": "x"}), "power of two"),
    "duplicate key": (_small(extra=[("general.alignment", 32)]), "duplicate GGUF metadata"),
    "duplicate tensor": (
        _small(tensors=[("a", [4], 0, 0), ("a", [4], 0, 32)]),
        "duplicate GGUF tensor 'a'",
    ),
    "unknown ggml type": (_small(tensors=[("a", [4], 99, 0)]), "'a' has unknown ggml type 99"),
    "unaligned offset": (_small(tensors=[("a", [4], 0, 4)]), "not a multiple of the alignment"),
    "overlapping tensors": (
        _small(tensors=[("a", [4], 0, 0), ("b", [4, 2], 0, 0)]),
        "'a' and 'b' overlap",
    ),
    "offset past the end": (_small(tensors=[("a", [4], 0, 2**40)]), "past the end"),
    "dims product past the end": (_small(tensors=[("a", [2**40, 2**40], 0, 0)]), "past the end"),
    "empty file": (b"", "not a GGUF file"),
    "bad magic": (b"GGUX" + _small()[4:], "bad magic"),
}


@pytest.mark.parametrize("blob,match", _BAD_HEADERS.values(), ids=list(_BAD_HEADERS))
def test_gguf_reader_refuses_malformed_headers_fast(tmp_path, blob, match):
    path = _write(tmp_path, blob)
    start = time.perf_counter()
    with pytest.raises(ValueError, match=match) as err:
        GGUFFile(path)
    assert str(path) in str(err.value)
    assert time.perf_counter() - start < 2


def test_gguf_reader_refuses_every_truncation(tmp_path):
    blob = _small(extra=[("tokenizer.ggml.tokens", ["a", "bc"]), ("x.scores", [0.5, 1.5])])
    GGUFFile(_write(tmp_path, blob))  # whole: reads
    for cut in range(len(blob)):
        path = _write(tmp_path, blob[:cut], f"cut{cut}.gguf")
        with pytest.raises(ValueError, match=str(path)):
            GGUFFile(path)


# -- GGUF model files: a tiny Llama written as llama.cpp does, then its metadata changed ----


@pytest.fixture(scope="module")
def gguf_parts(tiny_model_factory, tmp_path_factory):
    """(metadata items, tensors, data) of a valid tiny Llama GGUF file."""
    pytest.importorskip("gguf")
    from gguf_writer import write_gguf

    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    write_gguf(tiny_model_factory("llama"), path, "llama")
    f = GGUFFile(path)
    tensors, data = [], b""
    for name, info in f.tensors.items():
        data += b"\0" * (-len(data) % 32)
        tensors.append((name, list(reversed(info.shape)), info.ggml_type, len(data)))
        data += bytes(f.raw(name))
    return list(f.metadata.items()), tensors, data


def _gguf_model(tmp_path, parts, drop=(), **changes) -> loader.ResolvedModel:
    meta, tensors, data = parts
    meta = [(k, v) for k, v in meta if k not in changes]
    meta += [(k, v) for k, v in changes.items()]
    tensors = [t for t in tensors if t[0] not in drop]
    path = _write(tmp_path, raw_gguf(meta, tensors, data))
    return loader.resolve_model(path)


def test_gguf_rewritten_file_loads(tmp_path, gguf_parts):
    resolved = _gguf_model(tmp_path, gguf_parts)
    config = loader.load_hf_config(resolved)
    loader.load_tokenizer(resolved)
    loader.load_model(resolved, config, dtype=torch.float32, device="cpu")


_BAD_GGUF_CONFIGS = {
    # a billion layers: minutes of module building before
    "block_count 10**9": ({"llama.block_count": 10**9}, "at least .* weights"),
    "embedding_length 10**12": ({"llama.embedding_length": 10**12}, "llama.embedding_length"),
    "feed_forward_length 10**9": ({"llama.feed_forward_length": 10**9}, "feed_forward_length"),
    "block_count 0": ({"llama.block_count": 0}, "num_hidden_layers=0"),
    "head_count 0": ({"llama.attention.head_count": 0}, "head_count=0 is not positive"),
    "head_count -4": ({"llama.attention.head_count": -4}, "head_count=-4 is not positive"),
    "head_count_kv 5": ({"llama.attention.head_count_kv": 5}, "attn_k.weight .*head_count_kv"),
    "freq_base a string": ({"llama.rope.freq_base": "x"}, "llama.rope.freq_base: expected a"),
}


@pytest.mark.parametrize("changes,match", _BAD_GGUF_CONFIGS.values(), ids=list(_BAD_GGUF_CONFIGS))
def test_gguf_config_refused_before_the_model_is_built(tmp_path, gguf_parts, changes, match):
    resolved = _gguf_model(tmp_path, gguf_parts, **changes)
    start = time.perf_counter()
    with pytest.raises(ValueError, match=match):
        loader.load_hf_config(resolved)
    assert time.perf_counter() - start < 5


_BAD_GGUF_VOCABS = {
    "scores shorter than tokens": ({"tokenizer.ggml.scores": [0.0] * 3}, "scores has 3 entries"),
    "types shorter than tokens": ({"tokenizer.ggml.token_type": [1] * 3}, "token_type has 3"),
    "tokens a string": ({"tokenizer.ggml.tokens": "abc"}, "tokens is not an array of strings"),
    "merges without a space": ({"tokenizer.ggml.merges": ["ab"]}, "merges is not an array"),
}


@pytest.mark.parametrize("changes,match", _BAD_GGUF_VOCABS.values(), ids=list(_BAD_GGUF_VOCABS))
def test_gguf_vocabulary_arrays_checked(tmp_path, gguf_parts, changes, match):
    resolved = _gguf_model(tmp_path, gguf_parts, **changes)
    with pytest.raises(ValueError, match=match) as err:
        loader.load_tokenizer(resolved)
    assert str(resolved.gguf_file) in str(err.value)


def test_gguf_missing_shard_of_a_fused_weight_refused(tmp_path, gguf_parts):
    resolved = _gguf_model(tmp_path, gguf_parts, drop={"blk.1.attn_q.weight"})
    config = loader.load_hf_config(resolved)
    with pytest.raises(
        ValueError, match=r"layers\.1\.self_attn\.qkv_proj\.weight \(shards \['q'\]"
    ):
        loader.load_model(resolved, config, dtype=torch.float32, device="cpu")


# -- safetensors / index / config.json / tokenizer files of an HF directory -----------------


@pytest.fixture
def model_dir(tiny_model_factory, tmp_path) -> Path:
    """A copy of the tiny Llama directory, free to break."""
    return Path(shutil.copytree(tiny_model_factory("llama"), tmp_path / "model"))


def _header(path: Path) -> tuple[dict, bytes]:
    blob = path.read_bytes()
    (n,) = struct.unpack("<Q", blob[:8])
    return json.loads(blob[8 : 8 + n]), blob[8 + n :]


def _rewrite(path: Path, header, data: bytes, header_len: int | None = None) -> None:
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw) if header_len is None else header_len) + raw + data)


def _load(path: Path) -> None:
    resolved = loader.resolve_model(path)
    config = loader.load_hf_config(resolved)
    loader.load_tokenizer(resolved)
    loader.load_model(resolved, config, dtype=torch.float32, device="cpu")


_EMBED, _Q0 = "model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight"


def _entry(h: dict, key: str, **fields) -> dict:
    h[key] = {**h[key], **fields}
    return h


def _shift(h: dict, key: str, by: int) -> dict:
    begin, end = h[key]["data_offsets"]
    return _entry(h, key, data_offsets=[begin + by, end + by])


_BAD_SAFETENSORS = {
    "header length past the file": (lambda h, d: (h, d, 10**6), "header length 1000000"),
    "header length 2**63": (lambda h, d: (h, d, 2**63), "header length"),
    "header not JSON": (lambda h, d: (b"{nope", d), "not UTF-8 JSON"),
    "header not UTF-8": (lambda h, d: (b'{"\xff": 1}', d), "not UTF-8 JSON"),
    "header a list": (lambda h, d: (b"[1]", d), "not a JSON object"),
    "entry without dtype": (lambda h, d: ({**h, _EMBED: {"shape": [1]}}, d), "lacks a dtype"),
    "offsets past the data": (lambda h, d: (_shift(h, _EMBED, len(d)), d), "lie outside"),
    "offsets negative": (lambda h, d: (_shift(h, _EMBED, -(10**6)), d), "lie outside"),
    "offsets strings": (lambda h, d: (_entry(h, _EMBED, data_offsets=["0", "4"]), d), "outside"),
    "offsets overlap": (lambda h, d: (_shift(h, _EMBED, 4), d), "overlap"),
    "shape not its bytes": (lambda h, d: (_entry(h, _EMBED, shape=[3, 4]), d), "needs 48 bytes"),
    "shape negative": (lambda h, d: (_entry(h, _EMBED, shape=[-1, 4]), d), "invalid shape"),
    "data truncated": (lambda h, d: (h, d[: len(d) // 2]), "lie outside"),
    "7-byte file": (lambda h, d: (b"", b"", None), "under its 8-byte header"),
}


@pytest.mark.parametrize("mutate,match", _BAD_SAFETENSORS.values(), ids=list(_BAD_SAFETENSORS))
def test_malformed_safetensors_named(model_dir, mutate, match):
    file = model_dir / "model.safetensors"
    header, data = _header(file)
    out = mutate(header, data)
    if out == (b"", b"", None):  # the 7-byte file
        file.write_bytes(b"\1" * 7)
    else:
        _rewrite(file, *out)
    with pytest.raises(ValueError, match=match) as err:
        _load(model_dir)
    assert str(file) in str(err.value)


def test_unknown_safetensors_dtype_named(model_dir):
    file = model_dir / "model.safetensors"
    header, data = _header(file)
    _rewrite(file, _entry(header, _EMBED, dtype="F13"), data)
    with pytest.raises(ValueError, match=f"{_EMBED}' has unsupported dtype F13"):
        _load(model_dir)


def test_missing_and_misshapen_weights_named(model_dir, tmp_path):
    file = model_dir / "model.safetensors"
    header, data = _header(file)
    rows, cols = header[_Q0]["shape"]
    _rewrite(file, _entry(header, _Q0, shape=[rows // 2, cols * 2]), data)
    with pytest.raises(ValueError, match=rf"{_Q0}' of shape \[{rows // 2}, {cols * 2}\] into"):
        _load(model_dir)
    header.pop(_Q0)
    _rewrite(file, header, data)
    with pytest.raises(ValueError, match=r"missing weights .*qkv_proj\.weight \(shards \['q'\]"):
        _load(model_dir)


@pytest.mark.parametrize(
    ("arch", "dropped", "match"),
    [
        # one expert's up (w3) gone: its rows of the fused gate_up would stay uninitialized
        (
            "mixtral",
            ["0.block_sparse_moe.experts.1.w3"],
            r"experts.gate_up_proj \(shards \['\(1, 1\)'\]",
        ),
        # every expert's up gone (GGUF's missing ffn_up_exps, in safetensors)
        (
            "olmoe",
            [f"1.mlp.experts.{e}.up_proj" for e in range(4)],
            r"layers.1.mlp.experts.gate_up_proj",
        ),
        ("qwen2_moe", ["0.mlp.experts.2.down_proj"], r"experts.down_proj \(shards \['2'\]"),
    ],
    ids=["one-expert-up", "every-expert-up", "one-expert-down"],
)
def test_an_expert_missing_from_a_moe_checkpoint_is_named(
    tiny_model_factory, tmp_path, arch, dropped, match
):
    """Experts come one HF matrix at a time into fused parameters: a checkpoint lacking one
    expert's matrix loaded before, that expert running on uninitialized memory."""
    model = Path(shutil.copytree(tiny_model_factory(arch), tmp_path / "model"))
    file = model / "model.safetensors"
    header, data = _header(file)
    for name in dropped:
        header.pop(f"model.layers.{name}.weight")
    _rewrite(file, header, data)
    with pytest.raises(ValueError, match=rf"missing weights .*{match}"):
        _load(model)


def _index(model_dir: Path, shard, raw: str | None = None) -> Path:
    header, _ = _header(model_dir / "model.safetensors")
    index = model_dir / "model.safetensors.index.json"
    index.write_text(
        raw if raw is not None else json.dumps({"weight_map": dict.fromkeys(header, shard)})
    )
    return index


@pytest.mark.parametrize(
    "shard", ["../outside.safetensors", "../../../../../../etc/passwd", "ABSOLUTE", "a/../../x"]
)
def test_index_never_reads_outside_the_model_dir(model_dir, shard):
    outside = model_dir.parent / "outside.safetensors"
    shutil.copy(model_dir / "model.safetensors", outside)  # loads fine, if it were read
    shard = str(outside) if shard == "ABSOLUTE" else shard
    index = _index(model_dir, shard)
    with pytest.raises(ValueError, match="is not a file inside the model directory") as err:
        _load(model_dir)
    assert str(index) in str(err.value)


@pytest.mark.parametrize(
    "raw,match",
    [
        ("{nope", "not a JSON object"),
        ("{}", "weight_map is not an object"),
        ('{"weight_map": [1]}', "weight_map is not an object"),
        ('{"weight_map": {"a": 3}}', "weight_map is not an object"),
    ],
)
def test_malformed_index_named(model_dir, raw, match):
    index = _index(model_dir, None, raw)
    with pytest.raises(ValueError, match=match) as err:
        _load(model_dir)
    assert str(index) in str(err.value)


def test_index_missing_shard_named(model_dir):
    index = _index(model_dir, "model-00002-of-00002.safetensors")
    with pytest.raises(FileNotFoundError, match="model-00002-of-00002") as err:
        _load(model_dir)
    assert str(index) in str(err.value)


def test_symlinked_shard_loads(model_dir):
    """The Hub cache's layout: shards are links into its blobs folder, outside the snapshot."""
    blob = model_dir.parent / "blob"
    (model_dir / "model.safetensors").rename(blob)
    (model_dir / "model.safetensors").symlink_to(blob)
    _load(model_dir)


def _config(model_dir: Path, **changes) -> None:
    path = model_dir / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


_BAD_CONFIGS = {
    "a billion layers": ({"num_hidden_layers": 10**9}, "at least .* weights"),
    "hidden 10**9": ({"hidden_size": 10**9}, "at least .* weights"),
    "vocab 10**12": ({"vocab_size": 10**12}, "at least .* weights"),
    "intermediate 10**12": ({"intermediate_size": 10**12}, "at least .* weights"),
    "head_dim 10**6": ({"head_dim": 10**6}, "at least .* weights"),
    "no layers": ({"num_hidden_layers": 0}, "num_hidden_layers=0 must be a positive"),
    "hidden 0": ({"hidden_size": 0}, "hidden_size=0 must be a positive"),
    "hidden negative": ({"hidden_size": -64}, "hidden_size=-64 must be a positive"),
    "vocab 0": ({"vocab_size": 0}, "vocab_size=0 must be a positive"),
    "head_dim 0": ({"head_dim": 0}, "head_dim=0 must be a positive"),
    "positions negative": (
        {"max_position_embeddings": -5},
        "max_position_embeddings=-5 must be a positive",
    ),
    "no attention heads": ({"num_attention_heads": 0}, "ZeroDivisionError"),
    "no KV heads": ({"num_key_value_heads": 0}, "num_key_value_heads=0 must be between"),
    "more KV heads than heads": ({"num_key_value_heads": 8}, "num_key_value_heads=8"),
    "KV heads not dividing": ({"num_key_value_heads": 3}, "num_key_value_heads=3"),
    "linear rope without factor": ({"rope_scaling": {"rope_type": "linear"}}, "factor"),
    "architectures a string": ({"architectures": "LlamaForCausalLM"}, "not a list of class"),
}


@pytest.mark.parametrize("changes,match", _BAD_CONFIGS.values(), ids=list(_BAD_CONFIGS))
def test_config_refused_before_the_model_is_built(model_dir, changes, match):
    _config(model_dir, **changes)
    start = time.perf_counter()
    with pytest.raises(ValueError, match=match) as err:
        loader.load_hf_config(loader.resolve_model(model_dir))
    assert str(model_dir / "config.json") in str(err.value)
    assert time.perf_counter() - start < 5


_BAD_AT_BUILD = {  # (architecture, config changes, the error): what only building reads
    "rope factor 0": ("llama", {"rope_scaling": {"rope_type": "linear", "factor": 0.0}}, "0.0"),
    "rope factor < 0": (
        "llama",
        {"rope_scaling": {"rope_type": "dynamic", "factor": -2.0}},
        "-2.0",
    ),
    "query_pre_attn_scalar 0": ("gemma2", {"query_pre_attn_scalar": 0}, "query_pre_attn_scalar"),
}


@pytest.mark.parametrize("arch,changes,match", _BAD_AT_BUILD.values(), ids=list(_BAD_AT_BUILD))
def test_config_values_refused_when_the_model_is_built(
    tiny_model_factory, tmp_path, arch, changes, match
):
    """Values that gave NaN logits (a rope factor of 0) or a ZeroDivisionError (Gemma's
    query_pre_attn_scalar 0) are ValueErrors naming them."""
    path = Path(shutil.copytree(tiny_model_factory(arch), tmp_path / arch))
    _config(path, **changes)
    with pytest.raises(ValueError, match=re.escape(match) + ".* must be positive"):
        _load(path)


_LONGROPE = {  # Phi-3's tiny head: 12 rotated dims, 6 factors each
    "rope_type": "longrope",
    "rope_theta": 10000.0,
    "partial_rotary_factor": 0.75,
    "long_factor": [1.0] * 6,
    "original_max_position_embeddings": 64,
}
_NEOX_ROPE = {"rope_type": "default", "rope_theta": 10000.0}
_BAD_ARCH_CONFIGS = {  # (architecture, config changes, the error): refused by check_config
    "NaN eps (NaN logits)": ("llama", {"rms_norm_eps": float("nan")}, "rms_norm_eps is NaN"),
    "NaN routed_scaling_factor": (
        "deepseek_v2",
        {"routed_scaling_factor": float("nan")},
        "routed_scaling_factor is NaN",
    ),
    "NaN in the rope dict": (
        "deepseek_v3",
        {
            "rope_parameters": {
                "rope_type": "yarn",
                "rope_theta": 10000.0,
                "factor": 4.0,
                "original_max_position_embeddings": 64,
                "mscale": 0.0,
                "mscale_all_dim": float("nan"),
            }
        },
        "rope_parameters.mscale_all_dim is NaN",
    ),
    "negative eps (NaN logits)": ("olmo2", {"rms_norm_eps": -1.0}, "rms_norm_eps=-1.0 must not"),
    "negative kv_lora_rank": ("deepseek_v2", {"kv_lora_rank": -8}, "kv_lora_rank=-8 must not"),
    "negative n_inner": ("gpt2", {"n_inner": -4}, "n_inner=-4 must not be negative"),
    "negative ffn_dim": ("opt", {"ffn_dim": -1}, "ffn_dim=-1 must not be negative"),
    "negative rotary fraction": (
        "gpt_neox",
        {"rope_parameters": {**_NEOX_ROPE, "partial_rotary_factor": -0.5}},
        "partial_rotary_factor=-0.5 must be a number from 0 to 1",
    ),
    "LongRoPE factor 0 (NaN logits)": (
        "phi3",
        {
            "rope_parameters": {**_LONGROPE, "short_factor": [0.0] * 6},
            "original_max_position_embeddings": 64,
        },
        "short_factor must be a list of positive numbers",
    ),
    "LongRoPE original context 0": (
        "phi3",
        {
            "rope_parameters": {
                **_LONGROPE,
                "short_factor": [1.0] * 6,
                "original_max_position_embeddings": 0,
            },
            "original_max_position_embeddings": 0,
        },
        "original_max_position_embeddings=0 must be positive",
    ),
}


@pytest.mark.parametrize(
    "arch,changes,match", _BAD_ARCH_CONFIGS.values(), ids=list(_BAD_ARCH_CONFIGS)
)
def test_config_numbers_refused_before_the_model_is_built(
    tiny_model_factory, tmp_path, arch, changes, match
):
    """NaN anywhere, a negative width, eps or rotated fraction, a LongRoPE factor or original
    context of 0: each gave NaN logits or torch's 'negative dimension' RuntimeError."""
    path = Path(shutil.copytree(tiny_model_factory(arch), tmp_path / arch))
    _config(path, **changes)
    with pytest.raises(ValueError, match=re.escape(match)) as err:
        loader.load_hf_config(loader.resolve_model(path))
    assert str(path / "config.json") in str(err.value)


_BAD_MODEL_CONFIGS = {  # (architecture, config changes, the error): refused building the model
    "GPT-2 heads not dividing": ("gpt2", {"n_head": 5}, "n_head=5 must be positive and divide"),
    "OPT heads not dividing": (
        "opt",
        {"num_attention_heads": 5},
        "num_attention_heads=5 must be positive and divide",
    ),
    "BLOOM no heads": ("bloom", {"n_head": 0}, "n_head=0 must be positive and divide"),
    "BLOOM heads not dividing": ("bloom", {"n_head": 5}, "n_head=5 must be positive and divide"),
    "MPT heads not dividing": ("mpt", {"n_heads": 5}, "n_heads=5 must be positive and divide"),
    "Falcon no KV heads": ("falcon", {"num_kv_heads": 0}, "num_kv_heads=0 must be positive"),
    "Mamba2 no groups": ("mamba2", {"n_groups": 0}, "n_groups=0 must be positive"),
    "Mamba2 one time_step_limit": (
        "mamba2",
        {"time_step_limit": [0.1]},
        "time_step_limit=[0.1] must be two numbers",
    ),
    "GatedDeltaNet no key heads": (
        "qwen3_next",
        {"linear_num_key_heads": 0},
        "linear_num_key_heads=0 (a positive integer)",
    ),
    # a config width below the checkpoint's: its leading rows were loaded, silently
    "MLP narrower than the checkpoint": ("llama", {"intermediate_size": 64}, "expected 64 along"),
    "MLP width 0": ("opt", {"ffn_dim": 0}, "expected 0 along"),
    "GPT-2 n_inner below the checkpoint": ("gpt2", {"n_inner": 128}, "expected 128 along"),
    "MLA v_head_dim below the checkpoint": ("deepseek_v2", {"v_head_dim": 8}, "expected 32 along"),
    "shared expert narrower": (
        "qwen2_moe",
        {"shared_expert_intermediate_size": 32},
        "expected 32 along",
    ),
}


@pytest.mark.parametrize(
    "arch,changes,match", _BAD_MODEL_CONFIGS.values(), ids=list(_BAD_MODEL_CONFIGS)
)
def test_config_shapes_refused_when_the_model_is_built(
    tiny_model_factory, tmp_path, arch, changes, match
):
    """Heads that do not divide the hidden size (a matmul RuntimeError at the first request),
    0 heads / groups (a TypeError, a ZeroDivisionError), a malformed dt limit (an IndexError),
    and widths the checkpoint's tensors do not have are ValueErrors naming them."""
    path = Path(shutil.copytree(tiny_model_factory(arch), tmp_path / arch))
    _config(path, **changes)
    with pytest.raises(ValueError, match=re.escape(match)):
        _load(path)


def test_positions_past_memory_are_refused_naming_max_model_len(model_dir):
    """max_model_len defaults to the config's max_position_embeddings: 10**15 of them ask the
    rope tables for petabytes, refused with the option to lower instead of the allocator's
    error; with max_model_len given the model serves."""
    _config(model_dir, max_position_embeddings=10**15)
    with pytest.raises(ValueError, match=r"1,000,000,000,000,000 positions .* max_model_len"):
        LLM(model=str(model_dir))
    llm = LLM(model=str(model_dir), max_model_len=64)
    (out,) = llm.generate(["hi"], SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 2


@pytest.mark.parametrize(
    "name,raw,match",
    [
        ("config.json", "{oops", "is not valid JSON"),
        ("config.json", "[1]", "is not a JSON object"),
        ("tokenizer.json", "{oops", "is not valid JSON"),
        ("tokenizer.json", "[]", "is not a JSON object"),
        ("tokenizer_config.json", "{oops", "is not valid JSON"),
    ],
)
def test_json_files_that_are_not_json_objects_named(model_dir, name, raw, match):
    (model_dir / name).write_text(raw)
    with pytest.raises(ValueError, match=match) as err:
        _load(model_dir)
    assert str(model_dir / name) in str(err.value)


def test_broken_chat_template_loads_and_is_refused_when_applied(model_dir):
    """As vLLM: the model serves; a chat request is refused (the server: a 400)."""
    broken = "{% for m in messages %}{{ m.content }"
    path = model_dir / "tokenizer_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "chat_template": broken}))
    (model_dir / "chat_template.jinja").write_text(broken)  # (transformers 5 reads this one)
    tokenizer = loader.load_tokenizer(loader.resolve_model(model_dir))
    from jinja2 import TemplateError

    with pytest.raises(TemplateError):
        tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
