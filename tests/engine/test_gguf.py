"""Our GGUF reader / dequantizers / converters against the `gguf` package and transformers."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from paged_engine.default_model import default_model_path
from paged_engine.gguf import GGML_TYPES, GGUFFile, dequantize, gguf_tokenizer, gguf_weights
from paged_engine.loader import load_hf_config, load_model, load_tokenizer, resolve_model

gguf = pytest.importorskip("gguf")

from gguf_writer import write_gguf  # noqa: E402  (needs gguf)

TEXTS = [
    "Hello world!",
    "The capital of France is Paris. The year 2024 had 366 days; 3.14159 is pi.",
    "  leading spaces\n\nnew lines\ttabs   trailing   ",
    "unicode: héllo wörld 世界 🚀 Ω≈ç√ — “quotes”",
    "<|im_start|>user\nWhat's up?<|im_end|>\n<|im_start|>assistant\n",
    "don't you'll I'M we've they'd",
    "def f(x):\n    return x ** 2  # comment\n",
    "a\r\nb\r\n\r\nc",
    "",
    " ",
]


# -- dequantizers --------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "ggml_type", [2, 3, 6, 7, 8, 10, 11, 12, 13, 14, 20, 23, 39], ids=lambda t: GGML_TYPES[t][0]
)
def test_dequantize_matches_gguf_package(ggml_type):
    _, block, nbytes = GGML_TYPES[ggml_type]
    rng = np.random.default_rng(ggml_type)
    nb = 48
    raw = rng.integers(0, 256, size=(nb, nbytes), dtype=np.uint8)
    scale_offsets = {
        2: [0],
        6: [0],
        8: [0],
        3: [0, 2],
        7: [0, 2],
        12: [0, 2],
        13: [0, 2],
        14: [208],
        10: [80, 82],
        11: [108],
        20: [0],
        23: [0],
        39: [],  # MXFP4: an E8M0 scale byte, set below
    }[ggml_type]
    if ggml_type == 39:  # finite scales, subnormal ones (e < 2) among them
        raw[:, 0] = rng.integers(0, 160, size=nb, dtype=np.uint8)
    for off in scale_offsets:  # finite float16 scales (random bytes may be inf / nan)
        scales = rng.uniform(-2, 2, size=(nb, 1)).astype(np.float16)
        raw[:, off : off + 2] = scales.view(np.uint8).reshape(nb, 2)
    shape = (3, nb * block // 3) if (nb * block) % 3 == 0 else (nb * block,)
    ours = dequantize(raw.reshape(-1), ggml_type, shape)
    ref = gguf.quants.dequantize(raw.reshape(-1), gguf.GGMLQuantizationType(ggml_type))
    assert ours.dtype == torch.float32
    np.testing.assert_array_equal(ours.numpy().reshape(-1), ref.reshape(-1))


def test_dequantize_float_types_keep_dtype():
    x = torch.randn(4, 8)
    for t, dt in ((0, torch.float32), (1, torch.float16), (30, torch.bfloat16)):
        raw = x.to(dt).view(torch.uint8 if dt == torch.float32 else torch.int16).numpy()
        got = dequantize(raw.view(np.uint8).reshape(-1), t, (4, 8))
        assert got.dtype == dt and torch.equal(got, x.to(dt))
    with pytest.raises(ValueError, match="cannot dequantize ggml type Q8_K"):
        dequantize(np.zeros(292, np.uint8), 15, (256,))
    # the lattice-codebook types parse (sizes as the gguf package has them) and are refused by name
    for t in (16, 17, 18, 19, 21, 22, 29, 34, 35):
        name, block, nbytes = GGML_TYPES[t]
        assert gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(t)] == (block, nbytes)
        with pytest.raises(ValueError, match=f"cannot dequantize ggml type {name};"):
            dequantize(np.zeros(nbytes, np.uint8), t, (block,))


def test_dequantize_asks_numpy_for_no_huge_pages_and_restores_its_setting(monkeypatch):
    """numpy's huge-page requests are off while a block type dequantizes, from any number of
    threads at once, and the process's setting (on or off) is back afterwards."""
    import threading

    from paged_engine.gguf import dequant

    if dequant._set_madvise_hugepage is None:
        pytest.skip("this numpy has no huge-page switch")
    seen = []
    q8 = dequant._BLOCK_DEQUANT[8]

    def probe(blocks):
        seen.append(dequant._set_madvise_hugepage(False))  # the setting inside: returned
        return q8(blocks)

    monkeypatch.setitem(dequant._BLOCK_DEQUANT, 8, probe)
    raw = np.zeros(34 * 64, np.uint8)
    initial = dequant._set_madvise_hugepage(True)
    for setting in (True, False):
        dequant._set_madvise_hugepage(setting)
        threads = [threading.Thread(target=dequantize, args=(raw, 8, (64, 32))) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert seen == [False] * 4
        assert dequant._set_madvise_hugepage(True) is setting
        seen.clear()
    dequant._set_madvise_hugepage(initial)


# -- a synthetic GGUF written from a tiny HF llama -------------------------------------------
@pytest.fixture(scope="module")
def synthetic_gguf(tiny_llama_dir, tmp_path_factory):
    """(gguf path, expected HF-named float32 weights after our dequantization)."""
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    return path, write_gguf(tiny_llama_dir, path, "llama", quant="mixed")


def test_reader_matches_gguf_package(synthetic_gguf):
    path, _ = synthetic_gguf
    ours, ref = GGUFFile(path), gguf.GGUFReader(str(path))
    assert set(ours.tensors) == {t.name for t in ref.tensors}
    for t in ref.tensors:
        info = ours.tensors[t.name]
        assert info.ggml_type == int(t.tensor_type)
        assert info.shape == tuple(int(d) for d in reversed(t.shape))
        assert bytes(ours.raw(t.name)) == t.data.tobytes()
    assert ours.get("llama.attention.head_count") == 4
    assert ours.get("tokenizer.ggml.tokens")[:3] == ["<|bos|>", "<|eos|>", "<|pad|>"]


def test_synthetic_gguf_weights_config_and_logits(synthetic_gguf, tiny_llama_dir):
    from test_models import PagedRunner, hf_logits, load_hf

    path, expected = synthetic_gguf
    got = dict(gguf_weights(GGUFFile(path)))
    assert got.keys() == expected.keys()
    for name, want in expected.items():
        torch.testing.assert_close(got[name].float(), want, atol=0, rtol=0, msg=name)
    resolved = resolve_model(str(path))
    config = load_hf_config(resolved)
    assert config.architectures == ["LlamaForCausalLM"] and not config.tie_word_embeddings
    assert (config.num_key_value_heads, config.num_hidden_layers) == (2, 2)
    model = load_model(resolved, config, dtype=torch.float32, device="cpu")
    hf = load_hf(tiny_llama_dir)
    hf.load_state_dict(expected)
    tokens = list(range(5, 40))
    torch.testing.assert_close(
        PagedRunner(model).step([(0, tokens, 0)]), hf_logits(hf, tokens), atol=1e-4, rtol=0
    )


def test_synthetic_qwen2_gguf(tiny_model_factory, tmp_path):
    """qwen2 arch: q/k/v biases, tied head, no q/k permutation."""
    from test_models import PagedRunner, hf_logits, load_hf

    src = tiny_model_factory("qwen2")
    path = tmp_path / "qwen2.gguf"
    expected = write_gguf(src, path, "qwen2", quant="mixed")
    resolved = resolve_model(str(path))
    config = load_hf_config(resolved)
    assert config.architectures == ["Qwen2ForCausalLM"] and config.tie_word_embeddings
    model = load_model(resolved, config, dtype=torch.float32, device="cpu")
    hf = load_hf(src)
    hf.load_state_dict(expected, strict=False)
    hf.tie_weights()
    tokens = list(range(5, 30))
    torch.testing.assert_close(
        PagedRunner(model).step([(0, tokens, 0)]), hf_logits(hf, tokens), atol=1e-4, rtol=0
    )


def llama_cpp_rope_factors(head_dim: int, base: float, scaling: dict) -> np.ndarray:
    """The `rope_freqs` tensor llama.cpp's converter writes for Llama 3.1 rope scaling."""
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old = scaling["original_max_position_embeddings"]
    out = []
    for freq in 1.0 / base ** (np.arange(0, head_dim, 2) / head_dim):
        wavelen = 2 * np.pi / freq
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out)


def test_synthetic_llama3_gguf_rope_freqs(tiny_model_factory, tmp_path):
    from test_models import PagedRunner, hf_logits, load_hf

    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}  # fmt: skip
    src = tiny_model_factory("llama", rope_scaling=scaling, tie_word_embeddings=True)
    path = tmp_path / "llama3.gguf"
    rope_freqs = llama_cpp_rope_factors(16, 1e4, scaling)
    expected = write_gguf(src, path, "llama", quant="mixed", rope_freqs=rope_freqs)
    resolved = resolve_model(str(path))
    model = load_model(resolved, load_hf_config(resolved), dtype=torch.float32, device="cpu")
    hf = load_hf(src)
    hf.load_state_dict(expected, strict=False)
    hf.tie_weights()
    tokens = list(range(5, 45))
    torch.testing.assert_close(
        PagedRunner(model).step([(0, tokens, 0)]), hf_logits(hf, tokens), atol=1e-4, rtol=0
    )


def test_synthetic_gguf_tokenizer_matches_original(synthetic_gguf, tiny_llama_dir):
    from transformers import AutoTokenizer

    path, _ = synthetic_gguf
    ours = gguf_tokenizer(GGUFFile(path))
    ref = AutoTokenizer.from_pretrained(tiny_llama_dir)
    for text in TEXTS:
        ids = ref(text)["input_ids"]
        assert ours(text)["input_ids"] == ids, text
        assert ours.decode(ids) == ref.decode(ids)
    assert (ours.bos_token_id, ours.eos_token_id, ours.pad_token_id) == (0, 1, 2)


def test_gguf_add_bos_token(synthetic_gguf, tmp_path):
    """tokenizer.ggml.add_bos_token (Llama 2/3 files) prepends BOS when encoding."""
    path, _ = synthetic_gguf
    ref = gguf.GGUFReader(str(path))
    w = gguf.GGUFWriter(str(tmp_path / "bos.gguf"), "llama")
    for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type"):
        field = ref.fields[key]
        values = field.contents()
        w.add_array(key, values)
    w.add_tokenizer_model("gpt2")
    w.add_bos_token_id(0)
    w.add_eos_token_id(1)
    w.add_add_bos_token(True)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    tok = gguf_tokenizer(GGUFFile(tmp_path / "bos.gguf"))
    ids = tok("hello world")["input_ids"]
    assert ids[0] == 0 and ids[1:] == gguf_tokenizer(GGUFFile(path))("hello world")["input_ids"]
    assert tok.decode(ids, skip_special_tokens=True) == "hello world"


@pytest.mark.parametrize(
    "pre, want_bos, want_abc",
    [("llama-bpe", True, ["abc"]), ("tekken", True, ["abc"]), ("smaug-bpe", False, ["ab", "c"])],
)
def test_gguf_ignore_merges_and_default_bos(tmp_path, pre, want_bos, want_abc):
    """llama.cpp's Llama 3 and Tekken families take a piece that is itself a token whole, though
    no merge makes it, and add BOS when the file does not say; Smaug splits as Llama 3 does,
    with neither."""
    from paged_engine.gguf.tokenizer import _bytes_to_unicode

    tokens = ["<s>", *_bytes_to_unicode().values(), "ab", "abc"]
    w = gguf.GGUFWriter(str(tmp_path / "t.gguf"), "llama")
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_merges(["a b"])  # "abc" is in the vocabulary, but no merge reaches it
    w.add_token_types([3] + [1] * (len(tokens) - 1))
    w.add_bos_token_id(0)  # no tokenizer.ggml.add_bos_token: the family's default
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    tok = gguf_tokenizer(GGUFFile(tmp_path / "t.gguf"))
    ids = tok("abc")["input_ids"]
    assert tok.convert_ids_to_tokens(ids) == ["<s>"] * want_bos + want_abc
    assert tok("abcab")["input_ids"][want_bos:] == [tokens.index(t) for t in ("ab", "c", "ab")]


# -- the default model (SmolLM2-135M-Instruct, Q4_1 / Q8_0) against transformers --------------
@pytest.fixture(scope="module")
def default_gguf() -> Path:
    try:
        return default_model_path()
    except RuntimeError as e:
        pytest.skip(str(e))


def test_default_model_tokenizer_matches_transformers(default_gguf):
    from transformers import AutoTokenizer

    ours = load_tokenizer(resolve_model(str(default_gguf)))
    ref = AutoTokenizer.from_pretrained(str(default_gguf.parent), gguf_file=default_gguf.name)
    assert len(ours) == len(ref) == 49152
    for text in TEXTS:
        ids = ref(text)["input_ids"]
        assert ours(text)["input_ids"] == ids, text
        assert ours.decode(ids) == ref.decode(ids)
        assert ours.decode(ids, skip_special_tokens=True) == ref.decode(
            ids, skip_special_tokens=True
        )
    for attr in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id"):
        assert getattr(ours, attr) == getattr(ref, attr), attr
    msgs = [{"role": "user", "content": "Hi there"}]
    assert ours.apply_chat_template(
        msgs, tokenize=False, add_generation_prompt=True
    ) == ref.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)


def test_default_model_splits_every_numeric_char_like_llama_cpp(default_gguf):
    """SmolLM's pre-tokenizer isolates each \\p{N} char (llama.cpp `smollm`, HF's Digits).
    transformers' GGUF path skips that step, so it differs on non-ASCII numerics such as "½"."""
    tok = load_tokenizer(resolve_model(str(default_gguf)))
    ids = tok(" 12 ½")["input_ids"]
    assert tok.convert_ids_to_tokens(ids) == ["Ġ", "1", "2", "Ġ", "Â½"]


@pytest.mark.slow
def test_default_model_weights_and_logits_match_transformers(default_gguf, hf_default_model):
    from test_models import PagedRunner

    ref, _ = hf_default_model  # transformers' own GGUF loading (session fixture, conftest.py)
    hf_config = ref.config
    ref_weights = ref.state_dict()
    ours = dict(gguf_weights(GGUFFile(default_gguf)))
    tied = {"lm_head.weight"} if hf_config.tie_word_embeddings else set()
    assert ours.keys() == ref_weights.keys() - tied
    for name, got in ours.items():
        assert torch.equal(got.float(), ref_weights[name].float()), name

    resolved = resolve_model(str(default_gguf))
    config = load_hf_config(resolved)
    for key in (
        "hidden_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "intermediate_size",
        "vocab_size",
        "tie_word_embeddings",
        "rms_norm_eps",
    ):
        assert getattr(config, key) == getattr(hf_config, key), key
    model = load_model(resolved, config, dtype=torch.float32, device="cpu")
    tok = load_tokenizer(resolved)
    ids = tok("The capital of France is Paris. The capital of Germany is")["input_ids"]
    got = PagedRunner(model).step([(0, ids, 0)])
    with torch.no_grad():
        want = ref(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(got, want, atol=2e-4, rtol=0)
    assert tok.decode(got[-1].argmax()) == " Berlin"


def test_pre_tokenizer_names_split_as_llama_cpp(caplog):
    """`tokenizer.ggml.pre` names grouped as llama.cpp groups them, each group's split regex;
    an unknown name splits as GPT-2 does and says so."""
    import logging

    from paged_engine.gguf.tokenizer import byte_level_pre_tokenizer

    def words(pre: str, text: str = "HelloWorld's 12345 x!!\n") -> list[str]:
        return [w for w, _ in byte_level_pre_tokenizer(pre).pre_tokenize_str(text)]

    o200k = ["Hello", "World's", "Ġ", "123", "45", "Ġx", "!!Ċ"]  # case change, 3-digit runs
    assert words("gpt-4o") == words("llama4") == words("minimax-m2") == o200k
    llama3 = ["HelloWorld", "'s", "Ġ", "123", "45", "Ġx", "!!Ċ"]
    assert words("glm4") == words("chatglm-bpe") == words("llama-bpe") == llama3
    qwen2 = ["HelloWorld", "'s", "Ġ", "1", "2", "3", "4", "5", "Ġx", "!!Ċ"]
    assert words("qwen2") == words("stablelm2") == qwen2
    assert words("seed-coder") == [*qwen2[:-1], "!!", "Ċ"]  # punctuation stops at a newline
    gpt2 = ["HelloWorld", "'s", "Ġ12345", "Ġx", "!!", "Ċ"]
    assert words("gpt-2") == words("olmo") == words("exaone4") == gpt2
    digits = ["HelloWorld", "'s", "Ġ", "1", "2", "3", "4", "5", "Ġx", "!!", "Ċ"]
    assert words("smollm") == words("command-r") == words("refact") == digits
    assert words("lfm2") == words("pixtral") == words("falcon3") == llama3
    assert words("tekken") == ["Hello", "World", "'s", *qwen2[2:]]  # case split, single digits
    assert words("grok-2") == qwen2
    # multi-regex families: each regex splits the pieces the one before it left
    assert words("deepseek-v3", "你好world 1234") == ["ä½łå¥½", "world", "Ġ", "123", "4"]
    assert words("deepseek-coder", "你好world 12") == ["ä½łå¥½", "world", "Ġ", "1", "2"]
    assert words("deepseek-llm", "你好world 1234") == ["ä½łå¥½", "world", "Ġ", "1234"]
    assert words("kimi-k2") == o200k
    # Han runs apart from kana and Latin letters (o200k keeps them in one word)
    assert words("kimi-k2", "日本語とカナabc你们") == ["æĹ¥æľ¬èªŀ", "ãģ¨ãĤ«ãĥĬabc", "ä½łä»¬"]
    # Greek capitals are one cased run; the ASCII letters after Ω are re-split by the
    # punctuation class, which spans them; fullwidth "！" runs; trailing spaces are a piece
    assert words("deepseek-llm", " ΑΒΓ Ωmega！！\nend  ") == [
        "ĠÎĳÎĴÎĵ", "ĠÎ©", "mega", "ï¼ģï¼ģ", "Ċ", "end", "ĠĠ"
    ]  # fmt: skip
    assert words("falcon", "x$=1234") == ["x", "$=", "123", "4"]
    assert words("llama-bpe", "你好world 1234") == ["ä½łå¥½world", "Ġ", "123", "4"]
    with caplog.at_level(logging.WARNING):
        assert words("no-such-pre") == gpt2
    assert "no-such-pre" in caplog.text
