"""GGUF files of Qwen3, Qwen3-MoE, Qwen2-MoE, Gemma 1 / 2 / 3, Phi-3, OLMo 2, Seed-OSS, GLM-4,
StarCoder2, ERNIE 4.5 and Mixtral (arch "llama" with experts), written from tiny HF models as
llama.cpp's converter lays them out (gguf_writer.py): our loader must give back HF's weights and
config, and the model HF's logits and greedy tokens."""

from __future__ import annotations

import pytest
import torch

from paged_engine import LLM, SamplingParams
from paged_engine.gguf import GGUFFile, gguf_to_hf_config, gguf_weights
from paged_engine.layers.rotary import rope_config
from paged_engine.loader import load_hf_config, load_model, resolve_model

gguf = pytest.importorskip("gguf")

from gguf_writer import dequantized_reference, write_gguf, write_metadata_only  # noqa: E402  (needs gguf)
from test_models import PagedRunner, load_hf  # noqa: E402

SHORT = [1.0, 1.25, 1.5, 2.0, 3.0, 4.0]  # Phi-3 longrope factors: rotary dim 12 -> 6
LONG = [1.0, 2.0, 4.0, 8.0, 16.0, 32.0]
# name -> (tiny arch, config overrides, write_gguf options, max_model_len)
CASES = {
    "qwen3": ("qwen3", {}, {}, None),
    "qwen3_moe": ("qwen3_moe", {}, {}, None),
    # every layer sparse (llama.cpp's qwen2moe has no dense layers), a gated shared expert
    "qwen2_moe": ("qwen2_moe", {"mlp_only_layers": []}, {}, None),
    "gemma": ("gemma", {}, {}, None),  # Gemma 1: (1 + w) norms, embeddings scaled, tied
    "gemma2": ("gemma2", {}, {}, None),
    # six layers: llama.cpp's fixed Gemma 3 pattern (five sliding, one global)
    "gemma3": ("gemma3", {"num_hidden_layers": 6, "layer_types": None}, {}, None),
    "phi3": ("phi3", {}, {}, None),
    "olmo2": ("olmo2", {}, {}, None),  # post-norms only, whole-projection q / k norms
    "seed_oss": ("seed_oss", {}, {}, None),  # q / k / v and MLP biases, no o_proj bias
    "glm4": ("glm4", {}, {}, None),  # four norms a layer, fused gate_up_proj, half rotary
    # LayerNorms and biases; no window (llama.cpp has none for it, so the file records none)
    "starcoder2": ("starcoder2", {"sliding_window": None}, {}, None),
    "ernie4_5": ("ernie4_5", {}, {}, None),  # a bias on every projection, explicit head_dim
    # longrope factors as rope_factors_{long,short}; max_model_len within the original context
    # picks the short set, as HF does for these prompts
    "phi3_longrope": (
        "phi3",
        {
            "max_position_embeddings": 256,
            "original_max_position_embeddings": 64,
            "rope_scaling": {"rope_type": "longrope", "short_factor": SHORT, "long_factor": LONG},
        },
        {},
        64,
    ),
    # Q8_0 matrices, merged [E, ...] experts: HF runs on the dequantized weights
    "mixtral_q8_0": ("mixtral", {}, {"quant": "q8_0"}, None),
    # older Mixtral files: one tensor per expert (blk.N.ffn_gate.M.weight)
    "mixtral_split_experts": ("mixtral", {}, {"merged_experts": False}, None),
}
CONFIG_KEYS = {
    "qwen3": ("head_dim",),
    "qwen3_moe": ("head_dim", "num_experts", "num_experts_per_tok", "moe_intermediate_size",
                  "norm_topk_prob"),
    "gemma": ("head_dim",),
    "gemma2": ("head_dim", "query_pre_attn_scalar", "sliding_window", "layer_types",
               "attn_logit_softcapping", "final_logit_softcapping"),
    "gemma3": ("head_dim", "query_pre_attn_scalar", "sliding_window", "layer_types",
               "final_logit_softcapping"),
    "phi3": ("sliding_window", "original_max_position_embeddings"),
    "mixtral": ("num_local_experts", "num_experts_per_tok"),
    "qwen2_moe": ("num_experts", "num_experts_per_tok", "moe_intermediate_size",
                  "shared_expert_intermediate_size", "norm_topk_prob"),
    "olmo2": (),
    "seed_oss": ("head_dim", "attention_bias", "attention_out_bias", "mlp_bias"),
    "glm4": ("head_dim", "attention_bias"),
    "starcoder2": ("use_bias", "sliding_window"),
    "ernie4_5": ("head_dim", "use_bias"),
}  # fmt: skip


@pytest.fixture(scope="module", params=list(CASES))
def case(request, tiny_model_factory, tmp_path_factory):
    """(name, gguf path, HF reference model, expected weights, max_model_len, tiny arch)."""
    name = request.param
    arch, overrides, options, max_len = CASES[name]
    src = tiny_model_factory(arch, **overrides)
    tmp = tmp_path_factory.mktemp(name)
    path = tmp / f"{name}.gguf"
    expected = write_gguf(src, path, arch, **options)
    ref_dir = src
    if options.get("quant", "f32") != "f32":  # HF on the file's dequantized weights
        ref_dir = dequantized_reference(src, tmp / "hf", expected)
    return name, path, load_hf(ref_dir), expected, max_len, arch


def test_weights_config_and_logits_match_hf(case):
    name, path, hf, expected, max_len, arch = case
    got = dict(gguf_weights(GGUFFile(path)))
    assert got.keys() == expected.keys()
    for key, want in expected.items():
        torch.testing.assert_close(got[key].float(), want, atol=0, rtol=0, msg=key)

    resolved = resolve_model(str(path))
    config, ref = load_hf_config(resolved), hf.config
    assert config.architectures == ref.architectures
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "vocab_size", "tie_word_embeddings",
                "max_position_embeddings", *CONFIG_KEYS[arch]):  # fmt: skip
        assert getattr(config, key) == getattr(ref, key), key
    eps = "norm_epsilon" if arch == "starcoder2" else "rms_norm_eps"  # float32 in the file
    assert getattr(config, eps) == pytest.approx(getattr(ref, eps), rel=1e-6)
    for layer_type in set(getattr(ref, "layer_types", None) or [None]):
        if arch != "gemma3":
            layer_type = None  # one rope for all layers
        theta, scaling, partial = rope_config(config, layer_type)
        want_theta, want_scaling, want_partial = rope_config(ref, layer_type)
        assert (theta, partial) == (want_theta, want_partial)
        keys = ("rope_type", "factor", "long_factor", "short_factor")
        assert {k: (scaling or {}).get(k) for k in keys} == {
            k: (want_scaling or {}).get(k) for k in keys
        }

    model = load_model(resolved, config, dtype=torch.float32, device="cpu", max_model_len=max_len)
    tokens = torch.randint(3, 512, (40,), generator=torch.Generator().manual_seed(7)).tolist()
    ours = torch.log_softmax(PagedRunner(model).step([(0, tokens, 0)]), -1)
    with torch.no_grad():
        want = torch.log_softmax(hf(torch.tensor([tokens])).logits[0].float(), -1)
    assert torch.equal(ours.argmax(-1), want.argmax(-1)), f"{name}: greedy tokens differ"
    torch.testing.assert_close(ours, want, atol=1e-3, rtol=0)


@pytest.mark.parametrize("name", ["gemma2", "qwen3_moe"])
def test_llm_generates_hf_greedy_tokens(name, tiny_model_factory, tmp_path):
    """End to end: LLM(model=<file>.gguf) (config, tokenizer, weights from the file)."""
    arch, overrides, options, _ = CASES[name]
    src = tiny_model_factory(arch, **overrides)
    path = tmp_path / f"{name}.gguf"
    write_gguf(src, path, arch, **options)
    hf = load_hf(src)
    prompt = torch.randint(3, 512, (30,), generator=torch.Generator().manual_seed(3)).tolist()
    with torch.no_grad():
        out = hf.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=8,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
            output_logits=True,
            return_dict_in_generate=True,
        )
    ref_tokens = out.sequences[0, len(prompt) :].tolist()
    ref_lp = [torch.log_softmax(s[0], -1)[t].item() for s, t in zip(out.logits, ref_tokens)]
    llm = LLM(model=str(path), dtype="float32", max_model_len=128, block_size=16)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=0)
    (res,) = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    got = res.outputs[0]
    assert got.token_ids == ref_tokens
    assert [e[t].logprob for e, t in zip(got.logprobs, got.token_ids)] == pytest.approx(
        ref_lp, abs=1e-3
    )


# -- metadata edge cases: files with no tensor data beyond the embedding ------------------------
def _metadata_only(path, arch: str, layers: int = 4, **keys) -> GGUFFile:
    return write_metadata_only(path, arch, layers, head_len=16, **keys)


def test_gemma_layer_pattern_and_scale_follow_llama_cpp(tmp_path):
    # Gemma 3 default: every 6th layer global; the 27B (62 layers) scales by hidden / heads
    cfg = gguf_to_hf_config(_metadata_only(tmp_path / "a.gguf", "gemma3", layers=62))
    assert cfg.layer_types[:6] == ["sliding_attention"] * 5 + ["full_attention"]
    assert cfg.query_pre_attn_scalar == 64 // 4 and cfg.head_dim == 16
    assert cfg.sliding_window is None and cfg.final_logit_softcapping is None
    # an explicit per-layer pattern (true = sliding) and Gemma 2's default soft-caps
    f = _metadata_only(
        tmp_path / "b.gguf", "gemma2", **{"attention.sliding_window_pattern": [True, False] * 2}
    )
    cfg = gguf_to_hf_config(f)
    assert cfg.layer_types == ["sliding_attention", "full_attention"] * 2
    assert (cfg.attn_logit_softcapping, cfg.final_logit_softcapping) == (50.0, 30.0)
    assert cfg.sliding_window == 4096


def test_bad_metadata_is_a_value_error_naming_the_key(tmp_path):
    f = _metadata_only(tmp_path / "a.gguf", "qwen3moe", expert_used_count=2)
    with pytest.raises(ValueError, match=r"qwen3moe\.expert_count"):
        gguf_to_hf_config(f)
    f = _metadata_only(tmp_path / "b.gguf", "qwen3", **{"rope.scaling.type": "su"})
    with pytest.raises(ValueError, match=r"qwen3\.rope\.scaling\.type"):
        gguf_to_hf_config(f)
    f = _metadata_only(tmp_path / "c.gguf", "gptj")  # declared by llama.cpp, never converted
    with pytest.raises(ValueError, match=r"general\.architecture 'gptj'"):
        gguf_to_hf_config(f)
    # Mixtral: arch "llama" with experts
    f = _metadata_only(tmp_path / "d.gguf", "llama", expert_count=4, expert_used_count=2)
    cfg = gguf_to_hf_config(f)
    assert cfg.architectures == ["MixtralForCausalLM"] and cfg.num_local_experts == 4
    assert cfg.num_experts_per_tok == 2 and cfg.intermediate_size == 128
