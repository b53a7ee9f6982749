"""Step 3.7, Hy-V4-VL and Cosmos3 Edge served text-only (models/text_wrappers.py) against HF.

As tests/engine/test_models_vlm_text.py: a tiny random wrapper (`*ForConditionalGeneration`,
a one-layer vision tower included) saved by transformers; `LLM.generate` on text prompts must
give the wrapper's HF `generate` greedy tokens and top-5 logprobs (1e-3, float32). What bites:

    step3p7   Gemma norms everywhere, 8 query heads on the sliding layers (window 8) and 4 on
              the full one (half of each head rotated, its own theta), query_pre_attn_scalar
              64 (not head_dim 16), a sigmoid gate a head, a dense layer and two MoE layers
              (sigmoid top-3 of 8 plus a balance bias, times 2.5, a shared expert) with the
              routed experts clamped on layer 1 and the dense / shared MLPs on layers 0 and 2;
              q / k / v / o and dense / shared MLP biases
    hy_v4_vl  Hy-V4's decoder with rms_norm_eps 0.3, which its MLA latent norms read (Hy-V4's
              do not); M-RoPE sections over the rotary dims, YaRN
    cosmos3   a relu^2 MLP without a gate (`fc1` / `fc2`, biased), q / k / v / o biases,
              head_dim 32 with hidden 64 and 4 heads, M-RoPE sections

transformers 5.25 saves each release's own naming (Step 3.7's experts stacked per layer under
`moe.`, Hy-V4-VL's `model.` / `vit.`, Cosmos3 Edge's top-level decoder with `to_q` ...); its
in-memory naming loads to the same outputs, the weights it drops at load (MTP layers, Cosmos3
Edge's generator) are dropped, Step 3.7 under TP=2 gives the one-process results, and what
transformers cannot run is refused by name.
"""

from __future__ import annotations

import copy
import shutil

import pytest
import torch
from hf_parity import checkpoint_dirs, load_hf_as_saved, write_hf_checkpoint
from hf_reference import assert_matches, assert_tp_matches_one_process, hf_greedy
from test_models_vlm_text import MAX_TOKENS, VOCAB, _generate, _outputs_equal, _prompts

from paged_engine.testing import _ARCH_DEFAULTS, _COMMON

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

TOP = 5
_TEXT = {"vocab_size": VOCAB, "max_position_embeddings": 256, "rms_norm_eps": 1e-5, **_COMMON}


def _step3p7_text(**overrides) -> dict:
    return {
        **_TEXT,
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "num_sliding_attention_heads": 8,
        "head_dim": 16,
        "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
        "sliding_window": 8,
        "rope_theta": [500.0, 10_000.0, 500.0],
        "partial_rotary_factors": [1.0, 0.5, 1.0],
        "query_pre_attn_scalar": 64,
        "mlp_layer_types": ["dense", "sparse", "sparse"],
        "n_routed_experts": 8,
        "num_experts_per_tok": 3,
        "moe_intermediate_size": 16,
        "share_expert_dim": 24,
        "moe_router_scaling_factor": 2.5,
        "swiglu_limits": [0, 0.4, 0],
        "swiglu_limits_shared": [0.5, 0, 0.3],
        "attention_bias": True,
        "mlp_bias": True,  # the dense MLP's and the shared expert's (the routed experts have none)
        **overrides,
    }


def _step3p7() -> tuple[str, object]:
    vision = {"hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2}
    vision |= {"image_size": 56, "patch_size": 14, "mlp_ratio": 2.0}
    config = transformers.Step3p7Config(
        text_config=_step3p7_text(),
        vision_config=vision,
        image_token_id=500,
        tie_word_embeddings=False,
    )
    return "Step3p7ForConditionalGeneration", config


def _hy_v4_vl() -> tuple[str, object]:
    text = copy.deepcopy(_ARCH_DEFAULTS["hy_v4"][1])
    text |= {**_TEXT, "rms_norm_eps": 0.3}
    rotary = int(text["qk_rope_head_dim"])
    text["rope_parameters"] = {**text["rope_parameters"], "mrope_section": [rotary // 2 - 2, 1, 1]}
    vision = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1}
    vision |= {"num_attention_heads": 2, "out_hidden_size": 64, "max_image_size": 64}
    config = transformers.HYV4VLConfig(
        text_config=text,
        vision_config=vision,
        image_token_id=500,
        video_token_id=501,
        tie_word_embeddings=False,
    )
    return "HYV4VLForConditionalGeneration", config


def _cosmos3_edge() -> tuple[str, object]:
    text = {
        **_TEXT,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "attention_bias": True,
        "mlp_bias": True,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 10_000.0,
            "mrope_section": [8, 4, 4],
        },
    }
    vision = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1}
    vision |= {"num_attention_heads": 2, "patch_size": 14, "num_patches": 16}
    config = transformers.Cosmos3EdgeConfig(
        text_config=text,
        vision_config=vision,
        projector_hidden_size=64,
        image_token_id=500,
        video_token_id=501,
        vision_start_token_id=502,
        vision_end_token_id=503,
        tie_word_embeddings=False,
    )
    return "Cosmos3EdgeForConditionalGeneration", config


# name -> (wrapper config, our text class, the transformers config class it needs)
CASES = {
    "step3p7": (_step3p7, "Step3p7TextForCausalLM", "Step3p7Config"),
    "hy_v4_vl": (_hy_v4_vl, "HYV4VLTextForCausalLM", "HYV4VLConfig"),
    "cosmos3_edge": (_cosmos3_edge, "Cosmos3EdgeTextForCausalLM", "Cosmos3EdgeConfig"),
}


def _write(path, name: str, seed: int = 1):
    if not hasattr(transformers, CASES[name][2]):
        pytest.skip(f"transformers {transformers.__version__} has no {CASES[name][2]}")
    cls_name, config = CASES[name][0]()
    return write_hf_checkpoint(path, getattr(transformers, cls_name), config, seed)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    """name -> a tiny wrapper checkpoint, written once per module."""
    return checkpoint_dirs(tmp_path_factory, _write)


@pytest.fixture(scope="module")
def outputs(dirs):
    """name -> (prompts, our outputs on the saved checkpoint), computed once per module."""
    cache: dict = {}

    def run(name: str):
        if name not in cache:
            prompts = _prompts(name)
            llm, outs = _generate(dirs(name), prompts)
            assert type(llm.llm_engine.model_runner.model).__name__ == CASES[name][1]
            cache[name] = (prompts, outs)
        return cache[name]

    return run


@pytest.mark.parametrize("name", list(CASES))
def test_text_only_generation_matches_hf_wrapper(name, dirs, outputs):
    hf = load_hf_as_saved(dirs(name))
    prompts, outs = outputs(name)
    for prompt, out in zip(prompts, outs, strict=True):
        assert_matches(name, out, hf_greedy(hf, prompt, MAX_TOKENS, TOP))


# Weights transformers drops at load, in each naming: Step 3.7's trailing MTP layer (layer 3
# of 3), Hy-V4's MTP layers, Cosmos3 Edge's image / video generator
_EXTRAS = {
    "step3p7": ["model.layers.3.self_attn.q_proj.weight", "model.layers.3.moe.gate.weight"],
    "hy_v4_vl": ["model.mtp_layers.0.input_layernorm.weight"],
    "cosmos3_edge": [
        "layers.0.mlp_moe_gen.fc1.weight",
        "layers.1.self_attn.add_q_proj.weight",
        "time_embedder.linear.weight",
        "action_modality_embed",
    ],
}
_MEMORY_EXTRAS = {
    "step3p7": ["model.language_model.layers.3.self_attn.q_proj.weight"],
    "hy_v4_vl": ["model.language_model.mtp_layers.0.input_layernorm.weight"],
    "cosmos3_edge": [
        "model.language_model.layers.0.input_layernorm_moe_gen.weight",
        "model.language_model.norm_moe_gen.weight",
        "model.language_model.action_modality_embed",
    ],
}


def _copy(src, dst, state: dict, extras: list[str]) -> None:
    """dst: src's files with model.safetensors holding `state` and `extras` (ones)."""
    shutil.copytree(src, dst)
    state = {n: t.contiguous() for n, t in state.items()} | {n: torch.ones(4) for n in extras}
    safetensors_torch.save_file(state, str(dst / "model.safetensors"), metadata={"format": "pt"})


@pytest.mark.parametrize("name", list(CASES))
def test_dropped_weights_are_skipped(name, dirs, outputs, tmp_path):
    """transformers saves each release's naming; what it drops at load is dropped here too."""
    saved = safetensors_torch.load_file(str(dirs(name) / "model.safetensors"))
    _copy(dirs(name), tmp_path / "m", saved, _EXTRAS[name])
    prompts, want = outputs(name)
    _outputs_equal(_generate(tmp_path / "m", prompts)[1], want)


@pytest.mark.parametrize("name", list(CASES))
def test_in_memory_naming_loads(name, dirs, outputs, tmp_path):
    """transformers' in-memory names (`model.language_model.`, Step 3.7's fused experts,
    Cosmos3 Edge's `mlp.fc1` / `q_proj`, Hy-V4's `attn_hc` / `sinks`) load to the same model."""
    hf = load_hf_as_saved(dirs(name))
    _copy(dirs(name), tmp_path / "m", hf.state_dict(), _MEMORY_EXTRAS[name])
    prompts, want = outputs(name)
    _outputs_equal(_generate(tmp_path / "m", prompts)[1], want)


def test_step3p7_tensor_parallel_matches_one_process(dirs):
    """TP=2 (gloo): the per-layer query heads and their gates, the biased shared expert and
    the experts split; Step 3.7 is the one new decoder here."""
    assert_tp_matches_one_process(dirs("step3p7"), _prompts("step3p7", 2), 4, max_model_len=128)


def _text_config(**overrides):
    return transformers.Step3p7TextConfig(**_step3p7_text(**overrides))


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        ({"use_bidirectional_attention": True}, "use_bidirectional_attention"),
        (
            {"layer_types": ["minimax_m3_sparse", "full_attention", "full_attention"]},
            "minimax_m3_sparse",
        ),
        ({"sliding_window": None}, "sliding_window"),
        ({"gating": "per-element"}, "gating"),
    ],
)
def test_step3p7_refusals(overrides, match):
    if not hasattr(transformers, "Step3p7TextConfig"):
        pytest.skip("this transformers has no Step3p7TextConfig")
    from paged_engine.models.step3p7 import Step3p7TextForCausalLM

    config = _text_config(**overrides)
    config.allow_global_per_layer_attribute_access = True  # as paged's loader sets it
    for key, value in overrides.items():  # fields transformers' config keeps off its dataclass
        setattr(config, key, value)
    with pytest.raises(ValueError, match=match):
        Step3p7TextForCausalLM(config)


def test_cosmos3_edge_other_activation_refused():
    if not hasattr(transformers, "Cosmos3EdgeTextConfig"):
        pytest.skip("this transformers has no Cosmos3EdgeTextConfig")
    from paged_engine.models.cosmos3_edge import Cosmos3EdgeTextForCausalLM

    text = _cosmos3_edge()[1].text_config
    text.hidden_act = "gelu"
    with pytest.raises(ValueError, match="hidden_act='gelu'"):
        Cosmos3EdgeTextForCausalLM(text)
