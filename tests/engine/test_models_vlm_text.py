"""Vision-language checkpoints served text-only (models/multimodal_text.py) against HF.

Tiny random wrapper models (`*ForConditionalGeneration`, a small vision tower included) saved
by transformers: `LLM.generate` on them must give the wrapper's HF `generate` greedy tokens and
top-5 logprobs (1e-3, float32) on text prompts. The cases make the mapping's details bite:
Gemma 3's text config sets a final soft-cap that its wrapper does not apply (Gemma 4's does,
and its per-layer inputs come from the token ids as in the text model); Mistral 3 ties by
its top-level flag (not text_config's), and a Mistral-Small-style config that omits the flag
(transformers 5 then defaults to tied) still loads the checkpoint's own head; Qwen's M-RoPE
sections (contiguous for Qwen2-VL / 2.5-VL, interleaved for Qwen3-VL) are the plain rope on
text; Qwen3-VL-MoE's router renormalizes although its config says norm_topk_prob False, and its
fused experts load in transformers 5's layout and in the Hub's transpose (where
hidden_size == 2 * moe_intermediate_size both have one shape: config.json's
transformers_version decides); LLaVA-NeXT's image_newline and Idefics3 / SmolVLM's connector
are dropped, their decoder (under `model.text_model` for Idefics3) loaded. Also: either weight
naming loads (transformers 5's
`model.language_model.` and the older `language_model.model.` / Qwen's `model.`), weight
updates take the wrapper's names, an unsupported text model is a clear error, and images are
refused (an image content part in a chat request: a 400; vLLM's multi_modal_data in an
`LLM.generate` prompt: a ValueError).
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from hf_parity import assert_serves_like_hf, checkpoint_dirs, write_hf_checkpoint
from hf_parity import load_hf_as_saved as load_hf_wrapper  # the name test_lora_hybrid imports
from hf_reference import assert_tp_matches_one_process, hf_greedy

from paged_engine import LLM, SamplingParams
from paged_engine.loader import load_hf_config, load_tokenizer, resolve_model
from paged_engine.models.multimodal_text import hub_layout, text_model_weights, text_only_config
from paged_engine.testing import _COMMON, build_tiny_tokenizer, tiny_config

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

MAX_TOKENS = 10
TOP = 5
VOCAB = 512
# Prompt ids stay below the special / image ids the wrappers reserve at the top of the vocab.
PROMPT_IDS = range(3, 500)
_LLAMA_LIKE = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 1024,
    "rms_norm_eps": 1e-5,
    "vocab_size": VOCAB,
    **_COMMON,
}


def _text(arch: str, **overrides) -> dict:
    return tiny_config(arch, **overrides).to_dict()


# a one-layer vision encoder of two 14-pixel patches a side: CLIP / SigLIP-style fields
_SMALL_VISION = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "image_size": 28,
    "patch_size": 14,
}


def _gemma3(**top) -> tuple[type, object]:
    vision = transformers.SiglipVisionConfig(**_SMALL_VISION)
    # final_logit_softcapping: Gemma3ForCausalLM applies it, the wrapper does not
    text = _text("gemma3", final_logit_softcapping=3.0)
    config = transformers.Gemma3Config(
        text_config=text,
        vision_config=vision.to_dict(),
        mm_tokens_per_image=4,
        boi_token_index=509,
        eoi_token_index=510,
        image_token_index=511,
        **top,
    )
    return transformers.Gemma3ForConditionalGeneration, config


def _gemma4(**top) -> tuple[type, object]:
    """Gemma 4's wrapper around the E2B-style text model (per-layer inputs, KV sharing), with
    a vision tower and its embedder (no audio tower)."""
    vision = transformers.Gemma4VisionConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=16,
    )
    config = transformers.Gemma4Config(
        text_config=_text("gemma4"), vision_config=vision.to_dict(), audio_config=None, **top
    )
    return transformers.Gemma4ForConditionalGeneration, config


def _llama4(**top) -> tuple[type, object]:
    """Llama 4's wrapper (Scout / Maverick) around the tiny Llama 4 text model."""
    widths = {"vision_output_dim": 32, "projector_input_dim": 32, "projector_output_dim": 32}
    vision = transformers.Llama4VisionConfig(**_SMALL_VISION, **widths)
    config = transformers.Llama4Config(
        text_config=_text("llama4"), vision_config=vision.to_dict(), **top
    )
    return transformers.Llama4ForConditionalGeneration, config


def _llava(name: str, text: dict, **top) -> tuple[type, object]:
    """LLaVA 1.5 (`Llava`) or NeXT (`LlavaNext`, an image_newline parameter beside the
    projector) around a text model with a CLIP vision tower."""
    vision = transformers.CLIPVisionConfig(**_SMALL_VISION, projection_dim=32).to_dict()
    config = getattr(transformers, f"{name}Config")(
        text_config=text, vision_config=vision, image_token_index=500, **top
    )
    return getattr(transformers, f"{name}ForConditionalGeneration"), config


def _idefics3(name: str, **top) -> tuple[type, object]:
    """Idefics3 / SmolVLM: a Llama decoder under model.text_model, a SigLIP-style encoder and
    a pixel-shuffle connector."""
    vision = {**_SMALL_VISION, "model_type": f"{name.lower()}_vision"}
    config = getattr(transformers, f"{name}Config")(
        text_config=_text("llama"), vision_config=vision, image_token_id=500, scale_factor=2, **top
    )
    return getattr(transformers, f"{name}ForConditionalGeneration"), config


def _internvl(**top) -> tuple[type, object]:
    vision = {**_SMALL_VISION, "image_size": [28, 28], "patch_size": [14, 14]}
    config = transformers.InternVLConfig(
        text_config=_text("qwen3"), vision_config=vision, image_token_id=500, **top
    )
    return transformers.InternVLForConditionalGeneration, config


def _lfm2_vl(**top) -> tuple[type, object]:
    vision = {**_SMALL_VISION, "model_type": "siglip2_vision_model"}
    del vision["image_size"]
    config = transformers.Lfm2VlConfig(
        text_config=_text("lfm2"), vision_config=vision, image_token_id=500, **top
    )
    return transformers.Lfm2VlForConditionalGeneration, config


_PIXTRAL_VISION = {
    "model_type": "pixtral",
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "head_dim": 16,
    "image_size": 56,
    "patch_size": 14,
}


def _mistral3(text: dict, **top) -> tuple[type, object]:
    config = transformers.Mistral3Config(
        text_config=text, vision_config=_PIXTRAL_VISION, image_token_index=511, **top
    )
    return transformers.Mistral3ForConditionalGeneration, config


_QWEN_VISION = {
    "depth": 1,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_heads": 2,
    "out_hidden_size": 64,
    "patch_size": 14,
    "spatial_merge_size": 2,
    "temporal_patch_size": 2,
}


def _qwen2_vl(**top) -> tuple[type, object]:
    rope = {"rope_type": "default", "rope_theta": 10_000.0, "mrope_section": [2, 3, 3]}
    text = transformers.Qwen2VLTextConfig(**_LLAMA_LIKE, rope_parameters=rope)
    vision = {"depth": 1, "embed_dim": 32, "hidden_size": 64, "num_heads": 2, "mlp_ratio": 2}
    vision |= {"patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2}
    config = transformers.Qwen2VLConfig(text_config=text.to_dict(), vision_config=vision, **top)
    return transformers.Qwen2VLForConditionalGeneration, config


def _qwen2_5_vl(**top) -> tuple[type, object]:
    # head_dim 16: sections of 2, 3, 3 frequencies (temporal, height, width)
    rope = {"rope_type": "default", "rope_theta": 10_000.0, "mrope_section": [2, 3, 3]}
    text = transformers.Qwen2_5_VLTextConfig(**_LLAMA_LIKE, rope_parameters=rope)
    vision = {**_QWEN_VISION, "fullatt_block_indexes": [0], "window_size": 56}
    config = transformers.Qwen2_5_VLConfig(text_config=text.to_dict(), vision_config=vision, **top)
    return transformers.Qwen2_5_VLForConditionalGeneration, config


def _qwen3_vl(**top) -> tuple[type, object]:
    # head_dim 32: 16 frequencies, height / width ones interleaved with the temporal ones
    rope = {
        "rope_type": "default",
        "rope_theta": 10_000.0,
        "mrope_section": [6, 5, 5],
        "mrope_interleaved": True,
    }
    text = transformers.Qwen3VLTextConfig(
        **_LLAMA_LIKE, head_dim=32, attention_bias=True, rope_parameters=rope
    )
    vision = {**_QWEN_VISION, "depth": 2, "num_position_embeddings": 16}
    vision["deepstack_visual_indexes"] = [0]
    config = transformers.Qwen3VLConfig(text_config=text.to_dict(), vision_config=vision, **top)
    return transformers.Qwen3VLForConditionalGeneration, config


def _qwen3_vl_moe(moe_intermediate_size: int, **top) -> tuple[type, object]:
    rope = {
        "rope_type": "default",
        "rope_theta": 10_000.0,
        "mrope_section": [6, 5, 5],
        "mrope_interleaved": True,
    }
    text = transformers.Qwen3VLMoeTextConfig(
        **{**_LLAMA_LIKE, "num_hidden_layers": 3},
        head_dim=32,
        rope_parameters=rope,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=moe_intermediate_size,
        mlp_only_layers=[1],  # layers 0 and 2 sparse, 1 dense (intermediate_size 128)
        norm_topk_prob=False,  # stored in config.json; transformers 5's router ignores it
    )
    vision = {**_QWEN_VISION, "depth": 2, "num_position_embeddings": 16}
    vision["deepstack_visual_indexes"] = [0]
    config = transformers.Qwen3VLMoeConfig(text_config=text.to_dict(), vision_config=vision, **top)
    return transformers.Qwen3VLMoeForConditionalGeneration, config


def _qwen3_5(moe: bool, **top) -> tuple[type, object]:
    """Qwen3.5's hybrid decoder (linear and full attention, tiny_config's layout) in its VLM
    wrapper; the M-RoPE sections interleaved as Qwen3-VL's over the 4 rotary frequencies."""
    text = tiny_config("qwen3_5_moe" if moe else "qwen3_5").to_dict()
    text["rope_parameters"] = {
        "rope_type": "default",
        "rope_theta": 10_000.0,
        "partial_rotary_factor": 0.25,
        "mrope_section": [2, 1, 1],
        "mrope_interleaved": True,
    }
    vision = {**_QWEN_VISION, "num_position_embeddings": 16}
    name = "Qwen3_5Moe" if moe else "Qwen3_5"
    config = getattr(transformers, f"{name}Config")(text_config=text, vision_config=vision, **top)
    return getattr(transformers, f"{name}ForConditionalGeneration"), config


# name -> (builder of (wrapper class, config), the text class we serve it with)
CASES = {
    "gemma3": (lambda: _gemma3(), "Gemma3ForCausalLM"),
    # the wrapper soft-caps its logits and computes the per-layer inputs as the text model does
    "gemma4": (lambda: _gemma4(), "Gemma4ForCausalLM"),
    # chunked / NoPE attention and router-scaled experts behind `language_model.`
    "llama4": (lambda: _llama4(), "Llama4ForCausalLM"),
    # Pixtral-12B's HF form: LLaVA around a Mistral decoder (sliding window 32)
    "llava-mistral": (
        lambda: _llava("Llava", _text("mistral"), tie_word_embeddings=False),
        "MistralForCausalLM",
    ),
    "llava_next": (lambda: _llava("LlavaNext", _text("llama")), "LlamaForCausalLM"),
    "idefics3": (lambda: _idefics3("Idefics3"), "LlamaForCausalLM"),
    "smolvlm": (lambda: _idefics3("SmolVLM"), "LlamaForCausalLM"),
    "internvl": (lambda: _internvl(tie_word_embeddings=False), "Qwen3ForCausalLM"),
    "lfm2_vl": (lambda: _lfm2_vl(), "Lfm2ForCausalLM"),
    # top-level tie False beats text_config's True (the tiny ministral3 ties)
    "mistral3-ministral3": (
        lambda: _mistral3(_text("ministral3"), tie_word_embeddings=False),
        "Ministral3ForCausalLM",
    ),
    # top-level tie True beats text_config's False (no lm_head saved); sliding window 32 <
    # the longer prompts + continuations
    "mistral3-mistral": (
        lambda: _mistral3(_text("mistral"), tie_word_embeddings=True),
        "MistralForCausalLM",
    ),
    # Mistral Small 4: MLA and DeepSeek's MoE inside the same wrapper
    "mistral3-mistral4": (
        lambda: _mistral3(_text("mistral4"), tie_word_embeddings=False),
        "Mistral4ForCausalLM",
    ),
    "qwen2_vl": (lambda: _qwen2_vl(tie_word_embeddings=True), "Qwen2ForCausalLM"),
    "qwen2_5_vl": (lambda: _qwen2_5_vl(tie_word_embeddings=False), "Qwen2ForCausalLM"),
    "qwen3_vl": (lambda: _qwen3_vl(tie_word_embeddings=True), "Qwen3ForCausalLM"),
    # hidden 64, experts' I 48: each fused expert tensor's layout shows in its shape
    "qwen3_vl_moe": (lambda: _qwen3_vl_moe(48), "Qwen3MoeForCausalLM"),
    # hidden 64 == 2 * 32: gate_up [8, 64, 64] in both layouts
    "qwen3_vl_moe-square": (
        lambda: _qwen3_vl_moe(32, tie_word_embeddings=True),
        "Qwen3MoeForCausalLM",
    ),
    # hybrid linear-attention decoders (models/qwen3_next.py)
    "qwen3_5": (lambda: _qwen3_5(False, tie_word_embeddings=False), "Qwen3_5ForCausalLM"),
    "qwen3_5_moe": (lambda: _qwen3_5(True, tie_word_embeddings=False), "Qwen3_5MoeForCausalLM"),
}


def write_tiny_vlm(path: Path, name: str, seed: int = 0) -> Path:
    """A tiny random wrapper checkpoint (as transformers saves it), tokenizer and
    generation config in `path`."""
    return write_hf_checkpoint(path, *CASES[name][0](), seed)


def _prompts(seed: str, n: int = 3) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.choice(PROMPT_IDS) for _ in range(rng.randint(12, 40))] for _ in range(n)]


def _generate(path: Path, prompts: list[list[int]]):
    llm = LLM(model=str(path), dtype="float32", max_model_len=128, block_size=16)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=TOP)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return llm, outs


@pytest.fixture(scope="module")
def vlm_dirs(tmp_path_factory):
    """name -> a tiny wrapper checkpoint, written once per module."""
    return checkpoint_dirs(tmp_path_factory, lambda path, name: write_tiny_vlm(path, name, 1))


@pytest.mark.parametrize("name", list(CASES))
def test_text_only_generation_matches_hf_wrapper(name, vlm_dirs):
    path = vlm_dirs(name)
    config = load_hf_config(resolve_model(path))
    assert config.architectures == [CASES[name][1]]
    hf = load_hf_wrapper(path)
    # transformers 5.24's Llama 4 wrapper fails on any input in its forward's return (it reads
    # `image_outputs` off the language model's output); on text that forward is its
    # language_model's on the token embeddings, so the reference is that model, as loaded.
    ref_model = hf.language_model if name == "llama4" else hf
    llm = assert_serves_like_hf(name, path, _prompts(name), MAX_TOKENS, hf=ref_model)
    model = llm.llm_engine.model_runner.model
    assert model.tie_word_embeddings == bool(hf.config.tie_word_embeddings)


def test_tensor_parallel_matches_one_process(vlm_dirs):
    """TP=2 (worker processes get the text config, its wrapper marker with it)."""
    assert_tp_matches_one_process(vlm_dirs("gemma3"), _prompts("tp", 2), 6, max_model_len=64)


def _rename(path: Path, rules: list[tuple[str, str]]) -> None:
    """Rewrite path/model.safetensors with each name's first matching prefix replaced."""
    file = path / "model.safetensors"
    state = safetensors_torch.load_file(str(file))
    renamed = {}
    for name, tensor in state.items():
        for old, new in rules:
            if name.startswith(old):
                name = new + name[len(old) :]
                break
        renamed[name] = tensor
    assert renamed.keys() != state.keys()
    safetensors_torch.save_file(renamed, str(file), metadata={"format": "pt"})


# transformers 5 saves Gemma 3 / Mistral 3 in the older naming and Qwen2.5-VL with its text
# model as `model.`: rewrite each into the other naming checkpoints use.
OTHER_NAMING = {
    "gemma3": [
        ("language_model.model.", "model.language_model."),
        ("vision_tower.", "model.vision_tower."),
        ("multi_modal_projector.", "model.multi_modal_projector."),
    ],
    "mistral3-ministral3": [
        ("language_model.model.", "model.language_model."),
        ("language_model.lm_head.", "lm_head."),
        ("vision_tower.", "model.vision_tower."),
        ("multi_modal_projector.", "model.multi_modal_projector."),
    ],
    "qwen2_5_vl": [("model.", "model.language_model."), ("visual.", "model.visual.")],
    # Qwen3-VL saves the new naming: its text model in the older llava-style one
    "qwen3_vl": [("model.language_model.", "language_model.model.")],
}


def _outputs_equal(got, want) -> None:
    for a, b in zip(got, want, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        outs = (a.outputs[0], b.outputs[0])
        lps = [[e[t].logprob for e, t in zip(o.logprobs, o.token_ids)] for o in outs]
        assert lps[0] == pytest.approx(lps[1], abs=1e-5)


@pytest.mark.parametrize("name", list(OTHER_NAMING))
def test_either_weight_naming_loads(name, vlm_dirs, tmp_path):
    original = vlm_dirs(name)
    saved = set(safetensors_torch.load_file(str(original / "model.safetensors")))
    path = write_tiny_vlm(tmp_path, name, seed=1)
    _rename(path, OTHER_NAMING[name])
    prompts = _prompts(name, 2)
    _, want = _generate(original, prompts)
    _, got = _generate(path, prompts)
    _outputs_equal(got, want)
    renamed = set(safetensors_torch.load_file(str(path / "model.safetensors")))
    assert renamed != saved


@pytest.mark.parametrize("name", ["qwen3_vl_moe", "qwen3_vl_moe-square"])
def test_hub_expert_layout_loads(name, vlm_dirs, tmp_path):
    """transformers 5 saves the fused experts as [E, 2I, H] / [E, H, I]; the published
    Qwen3-VL-MoE checkpoints (transformers 4.57) hold [E, H, 2I] / [E, I, H]. Rewritten to the
    Hub's layout (and writer), the checkpoint gives the same outputs; the square case
    (gate_up [8, 64, 64]) needs the writer's version to tell."""
    original = vlm_dirs(name)
    path = write_tiny_vlm(tmp_path, name, seed=1)
    file = path / "model.safetensors"
    state = safetensors_torch.load_file(str(file))
    fused = [n for n in state if n.endswith((".experts.gate_up_proj", ".experts.down_proj"))]
    assert len(fused) == 4  # two sparse layers
    for n in fused:
        state[n] = state[n].transpose(1, 2).contiguous()
    safetensors_torch.save_file(state, str(file), metadata={"format": "pt"})
    cfg_file = path / "config.json"
    raw = json.loads(cfg_file.read_text())
    assert raw["transformers_version"].startswith("5.")
    raw["transformers_version"] = "4.57.1"
    cfg_file.write_text(json.dumps(raw))
    prompts = _prompts(name, 2)
    _, want = _generate(original, prompts)
    _, got = _generate(path, prompts)
    _outputs_equal(got, want)


def test_expert_layout_rule():
    h, i = 64, 48
    gate_up, down = (2 * i, h), (h, i)
    assert not hub_layout((8, 2 * i, h), gate_up, square_is_hub=True)  # ours
    assert hub_layout((8, h, 2 * i), gate_up, square_is_hub=False)  # the Hub's: shape decides
    assert not hub_layout((8, h, i), down, square_is_hub=True)
    assert hub_layout((8, i, h), down, square_is_hub=False)
    assert not hub_layout((8, 7, 9), down, square_is_hub=True)  # neither: the loader reports
    assert not hub_layout((2 * i, h), gate_up, square_is_hub=True)  # not fused
    for square in ((64, 64), (48, 48)):  # H == 2I (gate_up), H == I (down)
        assert hub_layout((8, *square), square, square_is_hub=True)
        assert not hub_layout((8, *square), square, square_is_hub=False)
    # The writer: transformers 5 saves ours, older versions (or none named) the Hub's.
    _, config = _qwen3_vl_moe(32)
    config.architectures = ["Qwen3VLMoeForConditionalGeneration"]
    for version, square_is_hub in (("5.24.0", False), ("4.57.1", True), (None, True)):
        config.transformers_version = version
        text = text_only_config(config)
        assert text.text_only_square_experts_hub is square_is_hub
        assert text.norm_topk_prob is True
        w = torch.arange(8 * 64 * 64.0).reshape(8, 64, 64)
        name = "model.language_model.layers.0.mlp.experts.gate_up_proj"
        ((got_name, got),) = text_model_weights([(name, w)], text)
        assert got_name == "model.layers.0.mlp.experts.gate_up_proj"
        assert torch.equal(got, w.transpose(1, 2) if square_is_hub else w)


def test_head_kept_where_the_config_omits_tie(vlm_dirs, tmp_path):
    """Mistral-Small-3.x style: config.json has no top-level tie_word_embeddings (transformers
    5's Mistral3Config then says True) but the checkpoint has its own lm_head: HF keeps it
    untied, and so do we."""
    path = write_tiny_vlm(tmp_path, "mistral3-ministral3", seed=3)
    cfg_file = path / "config.json"
    raw = json.loads(cfg_file.read_text())
    raw.pop("tie_word_embeddings")
    cfg_file.write_text(json.dumps(raw))
    assert transformers.AutoConfig.from_pretrained(path).tie_word_embeddings
    names = set(safetensors_torch.load_file(str(path / "model.safetensors")))
    assert "language_model.lm_head.weight" in names
    llm = assert_serves_like_hf("mistral3 untied head", path, _prompts("small", 2), MAX_TOKENS)
    assert not llm.llm_engine.model_runner.model.tie_word_embeddings


def test_update_weights_takes_wrapper_names(vlm_dirs, tmp_path):
    """collective_rpc("update_weights") with a wrapper checkpoint's tensors (vision ones
    included, dropped): the engine then generates what HF does on those weights."""
    a = vlm_dirs("qwen3_vl")
    b = write_tiny_vlm(tmp_path, "qwen3_vl", seed=4)
    b_weights = safetensors_torch.load_file(str(b / "model.safetensors"))
    assert any(n.startswith("model.visual.") for n in b_weights)
    llm = LLM(model=str(a), dtype="float32", max_model_len=128, block_size=16)
    updated = llm.collective_rpc("update_weights", args=(list(b_weights.items()),))
    assert updated == [len(dict(llm.llm_engine.model_runner.model.named_parameters()))]
    llm.reset_prefix_cache()
    prompts = _prompts("update", 2)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    hf_b = load_hf_wrapper(b)
    want = [hf_greedy(hf_b, p, MAX_TOKENS).tokens for p in prompts]
    assert [list(o.outputs[0].token_ids) for o in outs] == want


def test_weight_names_mapped_and_vision_dropped():
    marker = SimpleNamespace(text_only_of="Gemma3ForConditionalGeneration")
    names = [
        "model.language_model.layers.0.mlp.up_proj.weight",
        "language_model.model.norm.weight",
        "language_model.lm_head.weight",
        "lm_head.weight",
        "model.vision_tower.vision_model.post_layernorm.weight",
        "vision_tower.vision_model.post_layernorm.weight",
        "multi_modal_projector.mm_input_projection_weight",
        "model.multi_modal_projector.mm_soft_emb_norm.weight",
    ]
    got = [n for n, _ in text_model_weights(((n, None) for n in names), marker)]
    want = ["model.layers.0.mlp.up_proj.weight", "model.norm.weight"] + ["lm_head.weight"] * 2
    assert got == want
    qwen = SimpleNamespace(text_only_of="Qwen2_5_VLForConditionalGeneration")
    names = ["model.layers.1.self_attn.q_proj.bias", "visual.blocks.0.attn.qkv.weight"]
    got = [n for n, _ in text_model_weights(((n, None) for n in names), qwen)]
    assert got == ["model.layers.1.self_attn.q_proj.bias"]
    plain = [("model.vision_tower.x", None)]  # not a wrapper: passed through untouched
    assert text_model_weights(plain, SimpleNamespace()) is plain


def test_older_mrope_type_is_the_default_rope():
    _, config = _qwen2_5_vl()
    config.text_config.rope_parameters = {"type": "mrope", "mrope_section": [2, 3, 3]}
    config.architectures = ["Qwen2_5_VLForConditionalGeneration"]
    text = text_only_config(config)
    assert text.rope_parameters["rope_type"] == "default"
    assert config.text_config.rope_parameters["type"] == "mrope"  # the wrapper's is untouched


def test_unsupported_text_model_is_a_clear_error():
    """Idefics3 keeps a fixed table (vLLM's wrapper builds a Llama decoder whatever
    text_config says, though transformers' builds any): another text model is refused."""
    vision = {**_SMALL_VISION, "model_type": "idefics3_vision"}
    config = transformers.Idefics3Config(text_config=_text("qwen2"), vision_config=vision)
    config.architectures = ["Idefics3ForConditionalGeneration"]
    with pytest.raises(ValueError, match=r"Idefics3ForConditionalGeneration .* 'qwen2'"):
        text_only_config(config)


def test_processor_chat_template_used_when_the_tokenizer_has_none(tmp_path):
    tok = build_tiny_tokenizer(VOCAB)
    tok.chat_template = None
    tok.save_pretrained(tmp_path)
    (tmp_path / "config.json").write_text("{}")
    template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    (tmp_path / "chat_template.json").write_text(json.dumps({"chat_template": template}))
    assert load_tokenizer(resolve_model(tmp_path)).chat_template == template


def test_multi_modal_data_is_refused(vlm_dirs):
    llm = LLM(model=str(vlm_dirs("gemma3")), dtype="float32", max_model_len=64)
    prompt = {"prompt_token_ids": [5, 6, 7], "multi_modal_data": {"image": object()}}
    with pytest.raises(ValueError, match="multi_modal_data is not supported"):
        llm.generate([prompt], SamplingParams(max_tokens=2), use_tqdm=False)


def test_server_refuses_image_content_parts():
    from paged_server.chat_messages import chat_message
    from paged_server.errors import APIError

    message = {
        "role": "user",
        "content": [
            {"type": "text", "text": "what is this?"},
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
        ],
    }
    with pytest.raises(APIError) as e:
        chat_message(0, message)
    assert e.value.status == 400
    assert e.value.param == "messages[0].content"
    assert "'image_url' is not supported" in e.value.message
    assert "text only" in e.value.message
