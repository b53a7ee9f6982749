"""Config variants that real checkpoints use, against HF transformers on the same weights.

Each supported architecture is tested elsewhere on one tiny config; here the other values of the
config fields real Hub models set (biases, explicit head_dim, MQA / MHA, tied or untied heads,
rope scalings, per-layer sliding windows, post-LayerNorm OPT with projections, GPT-2's attention
scalings, sequential-residual NeoX, partial rotary, MoE sparsity patterns). Greedy tokens must be
HF's and per-token logprobs within 1e-3 (float32), the method of test_llm_vs_hf.py. A config
value we cannot run must fail at load with a ValueError naming the config field.
"""

from __future__ import annotations

import random
import shutil

import pytest
from hf_reference import assert_matches, hf_greedy, load_hf_model

from paged_engine import LLM, SamplingParams
from paged_engine.testing import tiny_config, write_tiny_model

transformers = pytest.importorskip("transformers")

MAX_TOKENS = 12
PROMPT_LENS = (6, 30)  # both cross the sliding windows (8) below once decoding
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}
# name -> (arch, config overrides)
VARIANTS: dict[str, tuple[str, dict]] = {
    # HF's Llama attends to the whole context even when the config carries a sliding_window
    # (it used to be applied here).
    "llama-sliding_window-ignored": ("llama", {"sliding_window": 8}),
    # InternLM-style biases, Mistral-Nemo-style head_dim != hidden / heads, MQA, Llama 3.2's tied
    # head and rope.
    "llama-bias-head_dim-mqa-tied-llama3": (
        "llama",
        {
            "attention_bias": True,
            "mlp_bias": True,
            "head_dim": 24,
            "num_key_value_heads": 1,
            "tie_word_embeddings": True,
            "rope_theta": 500_000.0,
            "rope_scaling": LLAMA3_ROPE,
        },
    ),
    # Transformers 5 turns a Mistral config with layer_types into Ministral: per-layer windows.
    "mistral-layer_types-head_dim": (
        "mistral",
        {
            "sliding_window": 8,
            "head_dim": 32,
            "layer_types": ["full_attention", "sliding_attention"],
        },
    ),
    # Qwen2.5 with its window switched on: layers >= max_window_layers slide.
    "qwen2-max_window_layers": (
        "qwen2",
        {
            "use_sliding_window": True,
            "sliding_window": 8,
            "max_window_layers": 1,
            "tie_word_embeddings": False,
        },
    ),
    "qwen3-bias-sliding": (
        "qwen3",
        {
            "attention_bias": True,
            "use_sliding_window": True,
            "sliding_window": 8,
            "max_window_layers": 1,
        },
    ),
    # OPT-350m: post-LayerNorm, embeddings narrower than the decoder (project_in / project_out).
    "opt-350m": ("opt", {"do_layer_norm_before": False, "word_embed_proj_dim": 32}),
    "gpt2-scalings-n_inner-relu-untied": (
        "gpt2",
        {
            "scale_attn_by_inverse_layer_idx": True,
            "scale_attn_weights": False,
            "n_inner": 96,
            "activation_function": "relu",
            "tie_word_embeddings": False,
        },
    ),
    # Sequential residual, Pythia's quarter rotary with another base, no attention bias, tied.
    "gpt_neox-sequential-rotary_quarter": (
        "gpt_neox",
        {
            "use_parallel_residual": False,
            "rotary_pct": 0.25,
            "rotary_emb_base": 50_000,
            "attention_bias": False,
            "tie_word_embeddings": True,
        },
    ),
    # Gemma 2 9b / 27b style: head_dim != hidden / heads, query_pre_attn_scalar != head_dim.
    "gemma2-head_dim-qpas-untied": (
        "gemma2",
        {"head_dim": 32, "query_pre_attn_scalar": 24, "tie_word_embeddings": False},
    ),
    # Phi-4-mini's shapes scaled down: 6 heads of 16, 3/4 rotary, tied, no window.
    "phi3-phi4_mini": (
        "phi3",
        {
            "hidden_size": 96,
            "num_attention_heads": 6,
            "num_key_value_heads": 2,
            "partial_rotary_factor": 0.75,
            "sliding_window": None,
            "tie_word_embeddings": True,
        },
    ),
    "mixtral-sliding-head_dim": ("mixtral", {"sliding_window": 8, "head_dim": 32}),
    "qwen3_moe-sparse_step-unnormalized": (
        "qwen3_moe",
        {"decoder_sparse_step": 2, "norm_topk_prob": False},
    ),
    # SmolLM3 with sliding windows on its NoPE layers, attention and MLP biases, untied
    "smollm3-sliding-bias": (
        "smollm3",
        {
            "num_hidden_layers": 4,
            "use_sliding_window": True,
            "sliding_window": 8,
            "attention_bias": True,
            "mlp_bias": True,
            "tie_word_embeddings": False,
        },
    ),
    # gpt-oss without attention biases, every layer full, MQA, a tied head, plain rope, the
    # default SwiGLU limit, and a hidden_act its experts ignore (as HF's do)
    "gpt_oss-nobias-full-mqa-tied": (
        "gpt_oss",
        {
            "attention_bias": False,
            "layer_types": ["full_attention", "full_attention"],
            "num_key_value_heads": 1,
            "tie_word_embeddings": True,
            "rope_scaling": {"rope_type": "default"},
            "swiglu_limit": 7.0,
            "hidden_act": "gelu",
        },
    ),
    # gated MLPs with other activations than SiLU (HF's LlamaMLP gates with any of them)
    "llama-gelu": ("llama", {"hidden_act": "gelu"}),
    "qwen2-relu2": ("qwen2", {"hidden_act": "relu2"}),
    "olmo2-quick_gelu": ("olmo2", {"hidden_act": "quick_gelu"}),
    "gpt_neox-quick_gelu": ("gpt_neox", {"hidden_act": "quick_gelu"}),
    # DeepSeek-V3 / GLM-4.7-Flash configs with rope_interleave false: HF rotates NeoX halves
    "deepseek_v3-rope_not_interleaved": ("deepseek_v3", {"rope_interleave": False}),
    "glm4_moe_lite-rope_not_interleaved": ("glm4_moe_lite", {"rope_interleave": False}),
    # a dynamic rope's `alpha` is Hunyuan's alone: Llama's dynamic NTK ignores it (as HF's)
    "llama-dynamic-alpha-ignored": (
        "llama",
        {"rope_scaling": {"rope_type": "dynamic", "factor": 1.0, "alpha": 2.0}},
    ),
}
# HF's generate keeps only the last sliding_window keys of every layer whose config carries one,
# also for Llama, whose forward attends to everything; compare with the forward there.
NO_HF_CACHE = {"llama-sliding_window-ignored"}


@pytest.mark.parametrize("name", list(VARIANTS))
def test_config_variant_matches_hf(name, tmp_path):
    arch, overrides = VARIANTS[name]
    path = write_tiny_model(tmp_path, arch, seed=1, **overrides)
    rng = random.Random(name)
    prompts = [[rng.randrange(3, 512) for _ in range(n)] for n in PROMPT_LENS]
    llm = LLM(model=str(path), dtype="float32", max_model_len=128, block_size=16)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    hf = load_hf_model(path)
    for prompt, out in zip(prompts, outs, strict=True):
        ref = hf_greedy(hf, prompt, MAX_TOKENS, use_cache=name not in NO_HF_CACHE)
        assert_matches(name, out, ref)


# (arch, its HF class, the config field, a value HF runs and we refuse)
UNSUPPORTED = [
    ("llama", "LlamaForCausalLM", "hidden_act", "mish"),  # HF's Llama gates with any ACT2FN entry
    ("mixtral", "MixtralForCausalLM", "hidden_act", "gelu"),  # the fused experts gate SiLU only
    ("gpt2", "GPT2LMHeadModel", "activation_function", "mish"),
    ("gpt_neox", "GPTNeoXForCausalLM", "hidden_act", "mish"),
    ("gemma2", "Gemma2ForCausalLM", "hidden_activation", "mish"),
]


def test_an_odd_rotary_dimension_is_refused_naming_the_fields(model_dir, tmp_path):
    """head_dim 16 x partial_rotary_factor 0.6: 9 rotary dims (HF rotates 10 with 9's
    frequencies); refused with the fields that gave it."""
    path = tmp_path / "model"
    shutil.copytree(model_dir, path)
    config = tiny_config("phi3", partial_rotary_factor=0.6)
    config.architectures = ["Phi3ForCausalLM"]
    config.save_pretrained(path)
    with pytest.raises(ValueError, match=r"rotary dims 9 .*partial_rotary_factor"):
        LLM(model=str(path), dtype="float32", max_model_len=128)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """Tokenizer and weights for the refusals: each fails building the model, before weights."""
    return write_tiny_model(tmp_path_factory.mktemp("variants"), "llama")


@pytest.mark.parametrize(("arch", "hf_class", "field", "value"), UNSUPPORTED)
def test_unsupported_config_value_fails_at_load_naming_the_field(
    arch, hf_class, field, value, model_dir, tmp_path
):
    path = tmp_path / "model"
    shutil.copytree(model_dir, path)
    config = tiny_config(arch, **{field: value})
    assert getattr(config, field) == value  # HF keeps the value (and would run it)
    config.architectures = [hf_class]
    config.save_pretrained(path)  # replaces the llama config.json
    with pytest.raises(ValueError, match=rf"{field}\b.*{value}"):
        LLM(model=str(path), dtype="float32", max_model_len=128)


@pytest.mark.parametrize(
    ("arch", "scaling", "stretched"),
    [
        # Qwen's YaRN recipe scaled down: 64 positions x 4 from original_max_position_embeddings
        (
            "qwen2",
            {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
            256,
        ),
        ("llama", {"rope_type": "linear", "factor": 2.0}, 128),
    ],
)
def test_a_static_rope_scaling_stretches_the_context_as_vllm_does(
    arch, scaling, stretched, tmp_path
):
    """max_position_embeddings 64: the default max_model_len stays 64, an explicit one may reach
    the scaled context, and sequences past 64 positions keep HF's greedy tokens and logprobs."""
    path = write_tiny_model(
        tmp_path, arch, seed=1, max_position_embeddings=64, rope_scaling=scaling
    )
    assert LLM(model=str(path), dtype="float32").llm_engine.config.max_model_len == 64
    why = r"\(the config's max_position_embeddings=64, stretched by its rope scaling\)"
    with pytest.raises(ValueError, match=rf"context length {stretched} {why}"):
        LLM(model=str(path), dtype="float32", max_model_len=stretched + 1)
    llm = LLM(model=str(path), dtype="float32", max_model_len=stretched, block_size=16)
    rng = random.Random(arch)
    prompts = [[rng.randrange(3, 512) for _ in range(n)] for n in (stretched - 20, 70, 9)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    hf = load_hf_model(path)
    for prompt, out in zip(prompts, outs, strict=True):
        assert_matches(f"{arch}-stretched", out, hf_greedy(hf, prompt, 12))


def test_a_max_model_len_past_the_context_names_the_config_key(tmp_path):
    """No rope scaling: the limit is the config's own, and the refusal names its key (as vLLM)."""
    path = write_tiny_model(tmp_path, "llama", seed=1, max_position_embeddings=64)
    why = r"context length 64 \(the config's max_position_embeddings=64\)"
    with pytest.raises(ValueError, match=rf"max_model_len=65 exceeds .*{why}"):
        LLM(model=str(path), dtype="float32", max_model_len=65)
