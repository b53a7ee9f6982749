"""Mistral Large 3's native format (params.json with MLA, mistral_large3.py): a tiny HF
Mistral 4 (transformers' class for the same network: DeepSeek-V3's MLA and MoE, a softmax
router, Llama-4 query scaling) is rewritten here as Large 3 ships it (vLLM's
MistralLarge3ForCausalLM names, params.json's moe / llama_4_scaling / yarn sections, experts
one by one), its HF files deleted, and served: HF's greedy tokens and logprobs on the original.
Also: the YaRN magnitude rule both ways, a dense MLA model, refusals by name."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from hf_reference import assert_matches, hf_greedy, load_hf_model
from safetensors.torch import load_file, save_file
from test_mistral_format import _to_interleaved

from paged_engine import LLM, SamplingParams
from paged_engine.loader import iter_weights, load_hf_config, resolve_model
from paged_engine.mistral_format import mistral_hf_config
from paged_engine.testing import write_tiny_model

ORIGINAL = 16  # YaRN's and the Llama-4 scaling's original context: the prompts run past it
# YaRN x16 without its magnitude correction (Large 3's apply_scale: false), q scaled by position
_ROPE = {
    "rope_type": "yarn",
    "rope_theta": 10_000.0,
    "factor": 16.0,
    "original_max_position_embeddings": ORIGINAL,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "attention_factor": 1.0,
    "llama_4_scaling_beta": 0.5,
}
# HF name (after `model.layers.N.`) -> Large 3's, as vLLM's MistralLarge3ForCausalLM maps back
_NATIVE = (
    ("input_layernorm", "attention_norm"),
    ("post_attention_layernorm", "ffn_norm"),
    ("self_attn.q_a_proj", "attention.wq_a"),
    ("self_attn.q_a_layernorm", "attention.q_a_norm"),
    ("self_attn.q_b_proj", "attention.wq_b"),
    ("self_attn.kv_a_proj_with_mqa", "attention.wkv_a_with_mqa"),
    ("self_attn.kv_a_layernorm", "attention.kv_a_norm"),
    ("self_attn.kv_b_proj", "attention.wkv_b"),
    ("self_attn.o_proj", "attention.wo"),
    ("mlp.shared_experts.gate_proj", "shared_experts.w1"),
    ("mlp.shared_experts.down_proj", "shared_experts.w2"),
    ("mlp.shared_experts.up_proj", "shared_experts.w3"),
    ("mlp.gate.", "gate."),
    ("mlp.gate_proj", "feed_forward.w1"),
    ("mlp.down_proj", "feed_forward.w2"),
    ("mlp.up_proj", "feed_forward.w3"),
)
_TOP = {"model.embed_tokens.weight": "tok_embeddings.weight", "model.norm.weight": "norm.weight"}
_TOP["lm_head.weight"] = "output.weight"


def _native_weights(hf: dict[str, torch.Tensor], inter: int) -> dict[str, torch.Tensor]:
    """model.safetensors (transformers 5's fused experts) -> Large 3's consolidated tensors."""
    out = {}
    for name, w in hf.items():
        if name in _TOP:
            out[_TOP[name]] = w
            continue
        prefix, _, sub = name.removeprefix("model.").partition(".")
        layer, _, sub = sub.partition(".")
        head = f"{prefix}.{layer}"
        if sub == "mlp.experts.gate_up_proj":  # [E, 2I, H]: gate rows, then up rows
            for e, rows in enumerate(w):
                out[f"{head}.experts.{e}.w1.weight"] = rows[:inter].clone()
                out[f"{head}.experts.{e}.w3.weight"] = rows[inter:].clone()
        elif sub == "mlp.experts.down_proj":  # [E, H, I]
            for e, rows in enumerate(w):
                out[f"{head}.experts.{e}.w2.weight"] = rows.clone()
        else:
            for hf_part, ours in _NATIVE:
                if sub.startswith(hf_part):
                    sub = ours + sub[len(hf_part) :]
                    break
            else:
                raise AssertionError(name)
            out[f"{head}.{sub}"] = w
    return out


def native_params(cfg: dict[str, Any], apply_scale: bool = False) -> dict[str, Any]:
    """params.json as Mistral writes it for the HF Mistral 4 config `cfg` (config.json)."""
    rope = cfg["rope_parameters"]
    return {
        "dim": cfg["hidden_size"],
        "n_layers": cfg["num_hidden_layers"],
        "head_dim": cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"],
        "hidden_dim": cfg["intermediate_size"],
        "n_heads": cfg["num_attention_heads"],
        "n_kv_heads": cfg["num_key_value_heads"],
        "norm_eps": cfg["rms_norm_eps"],
        "vocab_size": cfg["vocab_size"],
        "rope_theta": rope["rope_theta"],
        "max_position_embeddings": cfg["max_position_embeddings"],
        "tied_embeddings": False,
        **{k: cfg[k] for k in ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim")},
        **{k: cfg[k] for k in ("qk_rope_head_dim", "v_head_dim")},
        "moe": {
            "num_experts": cfg["n_routed_experts"],
            "num_experts_per_tok": cfg["num_experts_per_tok"],
            "expert_hidden_dim": cfg["moe_intermediate_size"],
            "first_k_dense_replace": cfg["first_k_dense_replace"],
            "num_shared_experts": cfg["n_shared_experts"],
            "routed_scale": cfg["routed_scaling_factor"],
            "num_expert_groups": cfg["n_group"],
            "num_expert_groups_per_tok": cfg["topk_group"],
            "route_every_n": 1,
            "expert_parallel": 1,
        },
        "llama_4_scaling": {
            "beta": rope["llama_4_scaling_beta"],
            "original_max_position_embeddings": ORIGINAL,
        },
        "yarn": {
            "factor": rope["factor"],
            "original_max_position_embeddings": ORIGINAL,
            "beta": rope["beta_fast"],
            "alpha": rope["beta_slow"],
            "apply_scale": apply_scale,
        },
    }


def write_native(hf_dir: Path, out: Path) -> Path:
    shutil.copytree(hf_dir, out)
    cfg = json.loads((out / "config.json").read_text())
    (out / "params.json").write_text(json.dumps(native_params(cfg)))
    weights = load_file(out / "model.safetensors")
    save_file(
        _native_weights(weights, cfg["moe_intermediate_size"]), out / "consolidated.safetensors"
    )
    for name in ("config.json", "model.safetensors"):
        (out / name).unlink()
    return out


@pytest.fixture(scope="module")
def dirs(tmp_path_factory) -> tuple[Path, Path]:
    """(a tiny HF Mistral 4 as Large 3 is shaped: one expert group, a dense first layer, a
    shared expert; its native rewrite)."""
    hf_dir = write_tiny_model(
        tmp_path_factory.mktemp("hf"),
        "mistral4",
        seed=1,
        n_group=1,
        topk_group=1,
        routed_scaling_factor=1.5,
        rope_parameters=dict(_ROPE),
    )
    return hf_dir, write_native(hf_dir, tmp_path_factory.mktemp("native") / "large3")


def test_native_large3_serves_like_hf(dirs):
    hf_dir, native = dirs
    hf = load_hf_model(hf_dir)
    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, 512, (n,), generator=gen).tolist() for n in (9, 40)]
    refs = [hf_greedy(hf, p, 6) for p in prompts]
    llm = LLM(model=str(native), dtype="float32", max_model_len=64, block_size=16)
    assert llm.llm_engine.hf_config.architectures == ["Mistral4ForCausalLM"]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for out, ref in zip(outs, refs, strict=True):
        assert_matches("mistral large 3 native", out, ref, abs_tol=1e-4)
    llm.llm_engine.shutdown()


def test_weights_and_config_equal_the_hf_checkpoint(dirs):
    hf_dir, native = dirs
    got = dict(iter_weights(resolve_model(native), "mistral"))
    want = load_file(hf_dir / "model.safetensors")
    inter = json.loads((hf_dir / "config.json").read_text())["moe_intermediate_size"]
    for name, w in want.items():
        if ".mlp.experts." in name:  # ours come expert by expert, as the checkpoint has them
            head = name.rpartition(".mlp.experts.")[0] + ".mlp.experts"
            parts = ("gate_proj", "up_proj") if name.endswith("gate_up_proj") else ("down_proj",)
            for e in range(w.shape[0]):
                mine = torch.cat([got.pop(f"{head}.{e}.{p}.weight") for p in parts])
                assert torch.equal(mine, w[e]), (name, e, inter)
        else:
            assert torch.equal(got.pop(name), w), name
    assert not got
    ours, theirs = mistral_hf_config(native), load_hf_config(resolve_model(hf_dir))
    for field in ("n_group", "topk_group", "routed_scaling_factor", "first_k_dense_replace"):
        assert getattr(ours, field) == getattr(theirs, field), field
    drop = ("partial_rotary_factor",)
    assert {k: v for k, v in ours.rope_parameters.items() if k not in drop} == _ROPE


def _params_with(native: Path, out: Path, **fields) -> Path:
    out.mkdir()
    (out / "consolidated.safetensors").symlink_to(native / "consolidated.safetensors")
    params = json.loads((native / "params.json").read_text())
    for key, value in fields.items():  # "moe.x" edits the moe section
        section, _, sub = key.partition("__")
        if sub:
            params[section] = {**params[section], sub: value}
        else:
            params[key] = value
    (out / "params.json").write_text(json.dumps(params))
    return out


def test_yarn_magnitude_as_vllm_applies_it(dirs, tmp_path):
    """apply_scale true (the default): DeepSeek's softmax mscale^2, cos / sin unscaled."""
    _, native = dirs
    config = mistral_hf_config(_params_with(native, tmp_path / "s", yarn__apply_scale=True))
    rope = config.rope_parameters
    assert rope["mscale"] == rope["mscale_all_dim"] == 1.0 and "attention_factor" not in rope


def test_dense_mla_without_moe(dirs, tmp_path):
    _, native = dirs
    config = mistral_hf_config(_params_with(native, tmp_path / "d", moe=None))
    assert config.first_k_dense_replace == config.num_hidden_layers == 3


@pytest.mark.parametrize(
    "fields, match",
    [
        ({"quantization_config": {"quant_method": "compressed-tensors"}}, "quantization_config"),
        ({"head_dim": 32}, "head_dim=32"),
        ({"q_lora_rank": None}, r"\['q_lora_rank'\]"),
        ({"moe__num_expert_groups": 4, "moe__num_expert_groups_per_tok": 2}, "groups_per_tok"),
        ({"moe__route_every_n": 2}, "route_every_n"),
        ({"moe__mystery": 1}, "mystery"),
        ({"llama_4_scaling": {"beta": 0.1, "original_max_position_embeddings": 8}}, "differs"),
        ({"sliding_window": 8}, "sliding_window"),
    ],
)
def test_refusals_name_what_they_refuse(dirs, tmp_path, fields, match):
    _, native = dirs
    with pytest.raises(ValueError, match=match):
        mistral_hf_config(_params_with(native, tmp_path / "r", **fields))


def _write_vision_native(hf_dir: Path, out: Path) -> Path:
    """A tiny HF Mistral 3 wrapper around Mistral 4 (Mistral Small 4's HF layout) as Large 3
    ships it: the text part as above, the Pixtral tower and patch-merge projector under
    Mistral's names, tekken.json with its image section."""
    from test_mistral_format_vision import _VISION, BREAK, END, IMG, write_byte_tekken

    cfg = json.loads((hf_dir / "config.json").read_text())
    text, vision = cfg["text_config"], cfg["vision_config"]
    encoder = {k: vision[k] for k in ("hidden_size", "num_channels", "image_size", "patch_size")}
    encoder |= {k: vision[k] for k in ("intermediate_size", "num_hidden_layers")}
    encoder |= {"num_attention_heads": vision["num_attention_heads"]}
    encoder |= {"rope_theta": vision["rope_parameters"]["rope_theta"], "image_token_id": IMG}
    encoder |= {"image_break_token_id": BREAK, "image_end_token_id": END, "adapter_bias": False}
    encoder |= {"mm_projector_id": "patch_merge", "spatial_merge_size": 2}
    encoder |= {"add_pre_mm_projector_layer_norm": True, "max_image_size": vision["image_size"]}
    out.mkdir(parents=True)
    params = {**native_params(text), "vision_encoder": encoder}
    (out / "params.json").write_text(json.dumps(params))
    weights = load_file(hf_dir / "model.safetensors")
    towers = {}
    for name in [n for n in weights if n.startswith(("vision_tower.", "multi_modal_projector."))]:
        w = weights.pop(name)
        for hf, ours in _VISION:
            name = name.replace(hf, ours)
        if name.endswith(("attention.wq.weight", "attention.wk.weight")):
            w = _to_interleaved(w, vision["num_attention_heads"])
        towers[name] = w.contiguous()
    text_weights = {k.removeprefix("language_model."): v for k, v in weights.items()}
    native = {**_native_weights(text_weights, text["moe_intermediate_size"]), **towers}
    save_file(native, out / "consolidated.safetensors")
    size = vision["image_size"]
    write_byte_tekken(out, {"image_patch_size": vision["patch_size"], "max_image_size": size,
                            "spatial_merge_size": 2})  # fmt: skip
    return out


def test_native_large3_with_vision_serves_images_like_hf(tmp_path):
    """Large 3's vision encoder: the Pixtral-format path (mistral_vision.py) around the MLA
    text model, as transformers' Mistral 3 wrapper holds Mistral Small 4."""
    import transformers
    from hf_parity import write_hf_checkpoint
    from image_checks import check_matches_hf, hf_refs, noise_image
    from test_mistral_format_vision import NUM_SPECIAL, PROMPT, TEXT, _reference_inputs

    from paged_engine.mistral_format import mistral_wrapper_config
    from paged_engine.multimodal.pixtral import _Projector
    from paged_engine.testing import tiny_config

    text = tiny_config(
        "mistral4", vocab_size=NUM_SPECIAL + 256, n_group=1, topk_group=1,
        rope_parameters=dict(_ROPE), max_position_embeddings=1024, rms_norm_eps=1e-6,
    )  # fmt: skip
    tower = transformers.PixtralVisionConfig(
        hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        head_dim=8, patch_size=4, image_size=64, hidden_act="silu",
        rope_parameters={"rope_type": "axial", "rope_theta": 300.0},
    )  # fmt: skip
    config = transformers.Mistral3Config(
        text_config=text, vision_config=tower, vision_feature_layer=-1, image_token_index=10,
        spatial_merge_size=2, multimodal_projector_bias=False, tie_word_embeddings=False,
    )  # fmt: skip
    cls = transformers.Mistral3ForConditionalGeneration
    hf_dir = write_hf_checkpoint(tmp_path / "hf", cls, config, seed=3)
    native = _write_vision_native(hf_dir, tmp_path / "native")
    model = cls.from_pretrained(hf_dir, dtype=torch.float32)
    model.eval().generation_config.eos_token_id = None
    # vLLM's pre_mm_projector_norm: eps 1e-5 whatever the text's (Large 3's 1e-6; HF's takes it)
    model.model.multi_modal_projector.norm.variance_epsilon = 1e-5
    cases = [(PROMPT, [noise_image(1, (40, 56))]), (TEXT, [])]
    refs = hf_refs(model, cases, lambda t, imgs: _reference_inputs(2, t, imgs))
    check_matches_hf(native, cases, refs, "native large 3 with vision")
    wrapper = mistral_wrapper_config(native)
    assert wrapper.text_config.rms_norm_eps == 1e-6
    assert _Projector(wrapper, True, 1).norm.eps == 1e-5
