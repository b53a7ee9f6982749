"""GGUF files of Falcon (7B's and 40B's layouts), StarCoder (GPT-BigCode), Nemotron, DBRX and
InternLM3 (written as "llama"), laid out as llama.cpp's converter (FalconModel, StarCoderModel,
NemotronModel, DbrxModel, InternLM3Model) does (gguf_writer.py): our loader must give back HF's
weights (after undoing Falcon's qkv reordering, Nemotron's +1 on norms, DBRX's expert views) and
the config fields the model reads, and LLM(model=<file>.gguf) HF's greedy tokens; a Q8_0 Falcon
file its dequantized weights bit for bit and HF's tokens on them.

What the format cannot carry: Falcon's context (2048 written) and MLP width (4 x hidden written;
read off ffn_up instead); Falcon-RW's sequential layers and ALiBi (llama.cpp has neither).
Nemotron's rope.dimension_count is partial_rotary_factor x hidden / heads, so a head_dim other
than hidden / heads would rotate the wrong width in llama.cpp: the tiny one keeps hidden / heads.
GPT-J: not covered (see the report)."""

from __future__ import annotations

import pytest
import torch

from paged_engine.gguf import GGUFFile, gguf_to_hf_config, gguf_weights
from paged_engine.layers.rotary import rope_config
from paged_engine.loader import load_hf_config, resolve_model

gguf = pytest.importorskip("gguf")

from gguf_writer import write_case, write_metadata_only  # noqa: E402  (needs gguf)
from hf_reference import assert_file_greedy_matches_hf  # noqa: E402
from test_models import load_hf  # noqa: E402

# name -> (tiny arch, overrides)
CASES = {
    "falcon40b": ("falcon", {}),  # new decoder architecture, 2 KV groups, ln_attn + ln_mlp
    "falcon7b": (  # multi-query, one norm
        "falcon",
        {"new_decoder_architecture": False, "multi_query": True, "num_kv_heads": None},
    ),
    "gpt_bigcode": ("gpt_bigcode", {}),
    "nemotron": ("nemotron", {"head_dim": 16}),  # hidden / heads (see above)
    "dbrx": ("dbrx", {}),
    "internlm3": ("internlm3", {}),
}
# config fields the models read (beyond architectures and the vocab)
CONFIG_KEYS = {
    "falcon": ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_kv_heads",
               "new_decoder_architecture", "multi_query", "num_ln_in_parallel_attn",
               "parallel_attn", "alibi", "bias", "ffn_hidden_size", "layer_norm_epsilon",
               "tie_word_embeddings"),
    "gpt_bigcode": ("n_embd", "n_layer", "n_head", "n_inner", "n_positions", "multi_query",
                    "layer_norm_epsilon", "tie_word_embeddings"),
    "nemotron": ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                 "num_key_value_heads", "head_dim", "max_position_embeddings", "norm_eps",
                 "hidden_act", "attention_bias", "mlp_bias", "tie_word_embeddings"),
    "dbrx": ("d_model", "n_heads", "n_layers", "max_seq_len", "tie_word_embeddings"),
    "internlm3": ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                  "num_key_value_heads", "head_dim", "max_position_embeddings",
                  "tie_word_embeddings"),
}  # fmt: skip


# Q8_0 matrices: Falcon's reordered qkv rows (whole rows move, so the rounding is HF's own);
# HF runs on the file's dequantized weights
QUANTIZED = {"falcon40b_q8_0": "falcon40b"}


@pytest.fixture(scope="module", params=[*CASES, *QUANTIZED])
def case(request, tiny_model_factory, tmp_path_factory):
    """(case name, tiny arch, gguf path, HF reference model dir, expected weights)."""
    return write_case(request.param, CASES, QUANTIZED, tiny_model_factory, tmp_path_factory)


def _sub(config, name: str, key: str):
    sub = getattr(config, name)
    return sub.get(key) if isinstance(sub, dict) else getattr(sub, key)


def test_weights_and_config_match_hf(case):
    name, arch, path, src, expected = case
    got = dict(gguf_weights(GGUFFile(path)))
    assert got.keys() == expected.keys()
    for key, want in expected.items():
        torch.testing.assert_close(got[key].float(), want, atol=0, rtol=0, msg=key)

    ref = load_hf(src).config
    config = load_hf_config(resolve_model(str(path)))
    assert config.architectures == ref.architectures
    assert config.vocab_size == ref.vocab_size
    for key in CONFIG_KEYS[arch]:
        if name == "falcon7b" and key in ("num_kv_heads", "num_ln_in_parallel_attn"):
            continue  # unused by the old layout
        if "eps" in key:  # float32 in the file
            assert getattr(config, key) == pytest.approx(getattr(ref, key), rel=1e-6), key
        else:
            assert getattr(config, key) == getattr(ref, key), key
    if arch == "dbrx":
        for sub, key in (("attn_config", "kv_n_heads"), ("attn_config", "clip_qkv"),
                         ("attn_config", "rope_theta"), ("ffn_config", "ffn_hidden_size"),
                         ("ffn_config", "moe_num_experts"), ("ffn_config", "moe_top_k"),
                         ("ffn_config", "moe_normalize_expert_weights")):  # fmt: skip
            assert _sub(config, sub, key) == _sub(ref, sub, key), f"{sub}.{key}"
    if arch in ("falcon", "nemotron", "internlm3", "dbrx"):
        assert rope_config(config) == rope_config(ref)


def test_llm_generates_hf_greedy_tokens(case):
    """End to end: LLM(model=<file>.gguf) (config, tokenizer, weights from the file)."""
    _, _, path, src, _ = case
    assert_file_greedy_matches_hf(path, load_hf(src), 23, (9, 30))


def test_bad_old_arch_metadata_is_a_value_error(tmp_path):
    # GPT-BigCode has one KV head or one per head
    f = write_metadata_only(
        tmp_path / "a.gguf", "starcoder", 2, kv=2, tensors={"position_embd.weight": (16, 64)}
    )
    with pytest.raises(ValueError, match=r"starcoder\.attention\.head_count_kv"):
        gguf_to_hf_config(f)
    f = write_metadata_only(tmp_path / "b.gguf", "starcoder", 2, kv=1)
    with pytest.raises(ValueError, match=r"position_embd\.weight"):
        gguf_to_hf_config(f)
    f = write_metadata_only(tmp_path / "c.gguf", "dbrx", 2, kv=2, expert_used_count=2)
    with pytest.raises(ValueError, match=r"dbrx\.expert_count"):
        gguf_to_hf_config(f)
