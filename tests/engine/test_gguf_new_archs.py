"""GGUF files of EXAONE 4, Apertus, Arcee, Granite 3.x, gpt-oss, SmolLM3, OLMoE, Llama 4,
DeepSeek-V2 / V3, MiniMax-M2, Hunyuan (dense and MoE) and dots.llm1, written from tiny HF models
as llama.cpp's converter lays them out (gguf_writer.py): our loader must give back HF's weights
(after undoing the converter's transforms) and the config fields the model reads, and the model
HF's logits and greedy tokens."""

from __future__ import annotations

import pytest
import torch

from paged_engine.gguf import GGUFFile, gguf_to_hf_config, gguf_weights
from paged_engine.gguf.dequant import type_name
from paged_engine.layers.rotary import rope_config
from paged_engine.loader import load_hf_config, load_model, resolve_model
from paged_engine.models.llama import llama_head_dim

gguf = pytest.importorskip("gguf")

from gguf_writer import (  # noqa: E402  (needs gguf)
    dequantized_reference,
    write_case,
    write_gguf,
    write_metadata_only,
)
from hf_reference import assert_file_greedy_matches_hf  # noqa: E402
from test_models import PagedRunner, load_hf  # noqa: E402

# name -> (tiny arch, config overrides): the overrides keep the tiny model within what the
# converter accepts (Hunyuan's asserts) and what the format carries (dots1's groups and window)
CASES = {
    "exaone4": ("exaone4", {}),  # sliding + NoPE global layers, Llama 3 rope as rope_freqs
    "apertus": ("apertus", {}),  # xIELU scalars as metadata, Llama 3 rope as rope_freqs
    "arcee": ("arcee", {}),  # q/k permuted, YaRN
    "granite": ("granite", {}),  # q/k permuted, every multiplier away from 1
    # llama.cpp's granitemoe: fused [gate; up] experts split in two; loaded as GraniteMoeShared
    "granitemoe": ("granitemoe", {}),
    "granitemoeshared": ("granitemoeshared", {}),  # with a shared MLP, its rows split too
    # gpt-oss: llama.cpp's fixed SwiGLU limit (7; the tiny model's 1 is not recorded) and YaRN
    # with its correction range truncated (as llama.cpp computes it)
    "gpt_oss": (
        "gpt_oss",
        {
            "swiglu_limit": 7.0,
            "rope_scaling": {
                "rope_type": "yarn",
                "factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        },
    ),
    # llama.cpp's NoPE layers are every 4th, HF's default (the tiny model's own is every 2nd)
    "smollm3": ("smollm3", {"num_hidden_layers": 4, "no_rope_layer_interval": 4}),
    "olmoe": ("olmoe", {}),
    # llama.cpp's Llama 4 graph: chunks of 8192, NoPE every 4th layer with the temperature of
    # floor 8192 (the tiny model's 12 / 4 / 0.5 are not recorded); dense and MoE layers
    "llama4": (
        "llama4",
        {"attention_chunk_size": 8192, "floor_scale": 8192, "attn_scale": 0.1},
    ),
    # MLA as llama.cpp writes it (kv_b split per head into k_b / v_b), expert groups; V3 with a
    # low-rank q, sigmoid routing, yarn and an MTP layer appended (not loaded), V2 (no q LoRA)
    # with softmax routing
    "deepseek_v3": (
        "deepseek_v3",
        {
            "rope_scaling": {
                "rope_type": "yarn",
                "factor": 4.0,
                "original_max_position_embeddings": 64,
                "mscale": 0.707,
                "mscale_all_dim": 0.707,
            },
        },
    ),
    "deepseek_v2": ("deepseek_v2", {}),
    "minimax_m2": ("minimax_m2", {}),
    # HunYuanModel asserts the released context (32k or 256k) for its NTK-alpha rope
    "hunyuan_v1_dense": ("hunyuan_v1_dense", {"max_position_embeddings": 32768}),
    # HunYuanMoEModel asserts per-layer lists with equal entries and reads
    # moe_intermediate_size / num_shared_expert; its alpha rope assumes hidden / heads per
    # head (not the tiny model's head_dim), so the tiny one keeps a plain rope
    "hunyuan_v1_moe": (
        "hunyuan_v1_moe",
        {
            "moe_topk": [2, 2],
            "moe_intermediate_size": [32, 32],
            "num_shared_expert": [1, 1],
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        },
    ),
    # llama.cpp's dots1 routes without expert groups and attends without a window (as the
    # released checkpoints: one group, no window)
    "dots1": (
        "dots1",
        {"n_group": 1, "topk_group": 1, "sliding_window": None, "layer_types": None},
    ),
}
# Q8_0 matrices (merged experts, permuted q / k): HF runs on the file's dequantized weights
QUANTIZED = {"minimax_m2_q8_0": "minimax_m2", "arcee_q8_0": "arcee"}
CONFIG_KEYS = {
    "exaone4": ("head_dim", "sliding_window", "layer_types"),
    "apertus": ("head_dim", "hidden_act"),
    "arcee": ("head_dim", "hidden_act", "attention_bias", "mlp_bias"),
    "granite": ("head_dim", "attention_multiplier", "embedding_multiplier",
                "residual_multiplier", "logits_scaling", "attention_bias", "mlp_bias"),
    "smollm3": ("no_rope_layers", "attention_bias", "mlp_bias"),
    "gpt_oss": ("head_dim", "num_local_experts", "num_experts_per_tok", "sliding_window",
                "layer_types", "attention_bias", "swiglu_limit"),
    **dict.fromkeys(("granitemoe", "granitemoeshared"), (
        "head_dim", "attention_multiplier", "embedding_multiplier", "residual_multiplier",
        "logits_scaling", "attention_bias", "num_local_experts", "num_experts_per_tok",
    )),
    "olmoe": ("num_experts", "num_experts_per_tok", "norm_topk_prob", "clip_qkv"),
    "llama4": ("head_dim", "num_local_experts", "num_experts_per_tok", "intermediate_size_mlp",
               "moe_layers", "no_rope_layers", "layer_types", "attention_chunk_size",
               "attn_temperature_tuning", "floor_scale", "attn_scale", "use_qk_norm"),
    "minimax_m2": ("head_dim", "num_local_experts", "num_experts_per_tok", "rotary_dim"),
    **dict.fromkeys(("deepseek_v2", "deepseek_v3"), (
        "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
        "n_routed_experts", "num_experts_per_tok", "n_shared_experts", "moe_intermediate_size",
        "first_k_dense_replace", "routed_scaling_factor", "norm_topk_prob", "n_group",
        "topk_group",
    )),
    "hunyuan_v1_dense": ("head_dim", "attention_bias"),
    "hunyuan_v1_moe": ("head_dim", "num_experts", "attention_bias"),
    "dots1": ("n_routed_experts", "num_experts_per_tok", "moe_intermediate_size",
              "first_k_dense_replace", "n_shared_experts", "routed_scaling_factor",
              "norm_topk_prob", "n_group", "topk_group", "sliding_window"),
}  # fmt: skip
LLAMA3 = ("exaone4", "apertus")  # Llama 3 scaling stored as per-frequency divisors


@pytest.fixture(scope="module", params=[*CASES, *QUANTIZED])
def case(request, tiny_model_factory, tmp_path_factory):
    """(case name, gguf path, HF reference model dir, expected weights)."""
    _, _, path, src, expected = write_case(
        request.param, CASES, QUANTIZED, tiny_model_factory, tmp_path_factory
    )
    return request.param, path, src, expected


def _check_config(name, config, ref) -> None:
    if name == "granitemoe":  # llama.cpp's granitemoe loads as GraniteMoeShared, no shared MLP
        assert config.architectures == ["GraniteMoeSharedForCausalLM"]
        assert config.shared_intermediate_size == 0
    else:
        assert config.architectures == ref.architectures
    if name == "granitemoeshared":
        assert config.shared_intermediate_size == ref.shared_intermediate_size
    common = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
              "num_key_value_heads", "vocab_size", "tie_word_embeddings")  # fmt: skip
    for key in (*common, *CONFIG_KEYS[name]):
        if key == "head_dim":  # HF's configs may leave it to hidden / heads
            assert llama_head_dim(config) == llama_head_dim(ref), key
        else:
            assert getattr(config, key) == getattr(ref, key), key
    assert config.rms_norm_eps == pytest.approx(ref.rms_norm_eps, rel=1e-6)
    theta, scaling, partial = rope_config(config)
    want_theta, want_scaling, want_partial = rope_config(ref)
    assert partial == want_partial
    if name == "hunyuan_v1_dense":  # the NTK-alpha base, baked in (float32), a plain rope
        head_dim = llama_head_dim(ref)
        alpha = want_scaling["alpha"]
        assert theta == pytest.approx(want_theta * alpha ** (head_dim / (head_dim - 2)), rel=1e-6)
        assert (scaling or {}).get("rope_type", "default") == "default"
        assert config.max_position_embeddings == 256 * 1024  # what the converter writes
        return
    assert config.max_position_embeddings == ref.max_position_embeddings
    assert theta == want_theta
    if name in LLAMA3:  # a default rope with one divisor per rotary frequency
        assert (scaling or {}).get("rope_type", "default") == "default"
        assert len(config.rope_freq_factors) == llama_head_dim(ref) // 2
        return
    keys = ("rope_type", "factor", "original_max_position_embeddings")
    assert {k: (scaling or {}).get(k) for k in keys} == {
        k: (want_scaling or {}).get(k) for k in keys
    }


def test_weights_config_and_logits_match_hf(case):
    name, path, src, expected = case
    name = QUANTIZED.get(name, name)
    got = dict(gguf_weights(GGUFFile(path)))
    assert got.keys() == expected.keys()
    for key, want in expected.items():
        torch.testing.assert_close(got[key].float(), want, atol=0, rtol=0, msg=key)

    hf = load_hf(src)
    resolved = resolve_model(str(path))
    config = load_hf_config(resolved)
    _check_config(name, config, hf.config)

    model = load_model(resolved, config, dtype=torch.float32, device="cpu", max_model_len=128)
    tokens = torch.randint(3, 512, (40,), generator=torch.Generator().manual_seed(7)).tolist()
    ours = torch.log_softmax(PagedRunner(model).step([(0, tokens, 0)]), -1)
    with torch.no_grad():
        want = torch.log_softmax(hf(torch.tensor([tokens])).logits[0].float(), -1)
    assert torch.equal(ours.argmax(-1), want.argmax(-1)), f"{name}: greedy tokens differ"
    torch.testing.assert_close(ours, want, atol=1e-3, rtol=0)


def test_llm_generates_hf_greedy_tokens(case):
    """End to end: LLM(model=<file>.gguf) (config, tokenizer, weights from the file)."""
    _, path, src, _ = case
    assert_file_greedy_matches_hf(path, load_hf(src), 23, (9, 30))


def test_gpt_oss_with_mxfp4_experts(tiny_model_factory, tmp_path):
    """gpt-oss as ggml-org's files hold it: the experts' matrices MXFP4 (blocks along the rows
    the converter's split and transpose made), the rest as is. The loader gives back the
    dequantized values bit for bit in HF's layout, and LLM HF's greedy tokens on them."""
    src = tiny_model_factory("gpt_oss", **CASES["gpt_oss"][1])
    path = tmp_path / "gpt-oss-mxfp4.gguf"
    expected = write_gguf(src, path, "gpt_oss", quant="mxfp4")
    f = GGUFFile(path)
    stored = {n: type_name(i.ggml_type) for n, i in f.tensors.items()}
    assert {stored[n] for n in stored if n.endswith("_exps.weight")} == {"MXFP4"}
    got = dict(gguf_weights(f))
    assert got.keys() == expected.keys()
    for key, want in expected.items():
        assert torch.equal(got[key].float(), want.float()), key
    ref = dequantized_reference(src, tmp_path / "hf", expected)
    assert_file_greedy_matches_hf(path, load_hf(ref), 23, (9, 30))


# -- metadata edge cases: files with no tensor data beyond the embedding ------------------------
def test_exaone4_layer_pattern_forms(tmp_path):
    # an integer pattern: every n-th layer global; no window: every layer global (and rotating)
    f = write_metadata_only(
        tmp_path / "a.gguf", "exaone4", 8, **{"attention.sliding_window": 16,
                                               "attention.sliding_window_pattern": 4}
    )  # fmt: skip
    cfg = gguf_to_hf_config(f)
    assert cfg.layer_types == (["sliding_attention"] * 3 + ["full_attention"]) * 2
    assert cfg.sliding_window == 16
    cfg = gguf_to_hf_config(write_metadata_only(tmp_path / "b.gguf", "exaone4", 4))
    assert cfg.sliding_window is None and cfg.layer_types == ["full_attention"] * 4


def test_granite_multipliers_left_out_read_as_llama_cpp_does(tmp_path):
    """GraniteModel writes a multiplier only when set: without one llama.cpp scales by 1 and
    attention by 1 / sqrt(head_dim); a head size other than hidden / heads is refused."""
    cfg = gguf_to_hf_config(write_metadata_only(tmp_path / "a.gguf", "granite", 2))
    assert cfg.attention_multiplier == 16**-0.5  # hidden 64 over 4 heads
    assert cfg.embedding_multiplier == cfg.residual_multiplier == cfg.logits_scaling == 1.0
    f = write_metadata_only(tmp_path / "b.gguf", "granite", 2, head_len=32)
    with pytest.raises(ValueError, match=r"granite\.attention\.key_length=32"):
        gguf_to_hf_config(f)


def test_olmo3_files_are_refused_by_their_window(tmp_path):
    """OLMo 3 is written as arch olmo2 plus a sliding window: refused, naming the key, rather
    than run as OLMo 2 (whose files carry no window and load)."""
    assert gguf_to_hf_config(write_metadata_only(tmp_path / "a.gguf", "olmo2", 2)).architectures
    f = write_metadata_only(tmp_path / "b.gguf", "olmo2", 2, **{"attention.sliding_window": 8})
    with pytest.raises(ValueError, match=r"olmo2\.attention\.sliding_window.*OLMo 3"):
        gguf_to_hf_config(f)


def test_bad_new_arch_metadata_is_a_value_error(tmp_path):
    # a softmax router where the model has only sigmoid scores
    f = write_metadata_only(
        tmp_path / "a.gguf", "minimax-m2", 2, expert_count=4, expert_used_count=2,
        expert_feed_forward_length=32, expert_gating_func=1,
    )  # fmt: skip
    with pytest.raises(ValueError, match=r"minimax-m2\.expert_gating_func"):
        gguf_to_hf_config(f)
    # Apertus without its xIELU arrays
    f = write_metadata_only(tmp_path / "b.gguf", "apertus", 2)
    with pytest.raises(ValueError, match=r"xielu\.alpha_p"):
        list(gguf_weights(f))
    f = write_metadata_only(
        tmp_path / "c.gguf", "exaone4", 4, **{"attention.sliding_window": 16,
                                               "attention.sliding_window_pattern": [True] * 3}
    )  # fmt: skip
    with pytest.raises(ValueError, match=r"exaone4\.attention\.sliding_window_pattern"):
        gguf_to_hf_config(f)
