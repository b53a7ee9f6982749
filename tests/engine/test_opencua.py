"""OpenCUA as the Hub ships it (`OpenCUAForConditionalGeneration`, remote code:
multimodal/opencua.py, models/opencua_config.py) against a reference composed here from
transformers' modules.

OpenCUA is Qwen2.5-VL with its M-RoPE replaced by 1-D RoPE: Qwen2.5-VL's vision tower and
merger (transformers' Qwen2_5_VisionTransformerPretrainedModel, one windowed and one
full-attention block) feeding Qwen2 (transformers' Qwen2ForCausalLM fed inputs_embeds, plain
1-D positions), Qwen2-VL's image processor, and vLLM's prompt replacement: each
"<|media_placeholder|>" repeated once per merged patch. The same random weights are saved under
the release's names (`vision_tower.*`, `language_model.model.*`, `language_model.lm_head.*`)
with a config.json shaped as the release's (text_config, vision_config with model_type
"qwen2_5_vl" and `in_chans`, media_placeholder_token_id 151664: past the tiny vocabulary, so
the tokenizer's id must win, as vLLM looks the text up first) and a preprocessor_config.json
with top-level min_pixels / max_pixels. paged must give the reference's prompt ids, greedy
tokens and top-5 logprobs (1e-3, float32) with one image, two images and text alone.
"""

from __future__ import annotations

import json

import pytest
import torch
from hf_reference import hf_greedy_with_tower_runs
from image_checks import check_config_refused, check_engine_matches_hf, engine, greedy, noise_image
from vlm_checkpoints import finish_checkpoint, tiny_qwen2_text, tokenizer_with

from paged_engine.testing import _randomize

transformers = pytest.importorskip("transformers")
safetensors = pytest.importorskip("safetensors.torch")
qwen25 = pytest.importorskip("transformers.models.qwen2_5_vl.modeling_qwen2_5_vl")

PAD = "<|media_placeholder|>"
IMAGE = f"<|media_begin|>{PAD}<|media_end|>"
MARKS = [PAD, "<|media_begin|>", "<|media_end|>", "<|im_user|>", "<|im_assistant|>"]
MARKS += ["<|im_middle|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'user' %}<|im_user|>user"
    "{% else %}<|im_assistant|>assistant{% endif %}<|im_middle|>{{ m['content'] }}<|im_end|>"
    "{% endfor %}{% if add_generation_prompt %}<|im_assistant|>assistant<|im_middle|>{% endif %}"
)
ONE = f"<|im_user|>user<|im_middle|>{IMAGE}Click the button.<|im_end|><|im_assistant|>"
TWO = f"<|im_user|>user<|im_middle|>{IMAGE}{IMAGE}What changed?<|im_end|><|im_assistant|>"
TEXT = "<|im_user|>user<|im_middle|>Open the browser.<|im_end|><|im_assistant|>"
PATCH, MERGE, TEMPORAL, HIDDEN = 4, 2, 2, 64
# the release's vision_config keys (tiny values): one windowed block, one full-attention block
VISION = {"model_type": "qwen2_5_vl", "depth": 2, "hidden_size": 32, "num_heads": 4}
VISION |= {"intermediate_size": 48, "out_hidden_size": HIDDEN, "patch_size": PATCH}
VISION |= {"spatial_patch_size": PATCH, "spatial_merge_size": MERGE, "in_chans": 3}
VISION |= {"temporal_patch_size": TEMPORAL, "window_size": 2 * PATCH * MERGE}
VISION |= {"fullatt_block_indexes": [1], "hidden_act": "silu", "tokens_per_second": 2}
PIXELS = {"image_processor_type": "Qwen2VLImageProcessor", "min_pixels": 64, "max_pixels": 4096}
PIXELS |= {"patch_size": PATCH, "merge_size": MERGE, "temporal_patch_size": TEMPORAL}
PIXELS |= {"image_mean": [0.48145466, 0.4578275, 0.40821073]}
PIXELS |= {"image_std": [0.26862954, 0.26130258, 0.27577711]}


def release_config(text: dict) -> dict:
    """config.json as OpenCUA writes it (its fields, tiny values)."""
    top = {"architectures": ["OpenCUAForConditionalGeneration"], "model_type": "opencua"}
    top |= {"auto_map": {"AutoConfig": "configuration_opencua.OpenCUAConfig"}}
    top |= {"media_placeholder_token_id": 151664, "ignore_index": -100, "pad_token_id": 0}
    top |= {"torch_dtype": "float32", "tie_word_embeddings": False}
    text = {**text, "model_type": "qwen2", "head_dim": HIDDEN // 4, "use_cache": True}
    return top | {"text_config": text, "vision_config": dict(VISION)}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """(the release-layout dir, the reference: Qwen2, the tower, tokenizer, pixels, pad id)."""
    path = tmp_path_factory.mktemp("opencua")
    tokenizer, ids = tokenizer_with(MARKS, 11)
    text = tiny_qwen2_text(len(tokenizer), HIDDEN, rope_theta=1000000.0)
    llm = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**text)).float().eval()
    fields = {k: v for k, v in VISION.items() if k not in ("model_type", "in_chans")}
    tower = qwen25.Qwen2_5_VisionTransformerPretrainedModel(
        transformers.Qwen2_5_VLVisionConfig(**fields)
    )
    with torch.no_grad():
        _randomize(llm, 12)
        _randomize(tower, 13)
    tower.float().eval()
    state = {f"language_model.{k}": v for k, v in llm.state_dict().items()}
    state |= {f"vision_tower.{k}": v for k, v in tower.state_dict().items()}
    safetensors.save_file(
        {k: v.contiguous() for k, v in state.items()}, str(path / "model.safetensors")
    )
    (path / "config.json").write_text(json.dumps(release_config(text)))
    (path / "preprocessor_config.json").write_text(json.dumps(PIXELS))
    finish_checkpoint(path, tokenizer, CHAT_TEMPLATE)
    llm.generation_config.eos_token_id = None
    pixels = transformers.AutoImageProcessor.from_pretrained(path)
    return path, (llm, tower, tokenizer, pixels, ids[PAD])


def reference(ref, text: str, images: list):
    """(the expanded prompt ids, Qwen2's greedy with top-5 on the scattered tower rows)."""
    return hf_greedy_with_tower_runs(ref, text, images, PAD, MERGE)


def test_images_match_reference(ckpt):
    """One image, two differently sized images, text alone; the images again with the
    expanded ids as prompt_token_ids; a chat turn's image part as vLLM's placeholder text."""
    path, ref = ckpt
    a, b = noise_image(1, (40, 56)), noise_image(2, (72, 24))
    cases = [(ONE, [a]), (TWO, [a, b]), (TEXT, [])]
    llm = engine(path, limit_mm_per_prompt={"image": 2})
    refs = [reference(ref, t, im) for t, im in cases]
    assert refs[0][0].count(ref[4]) == 10 * 14 // MERGE**2  # 40 x 56 pixels: 10 x 14 patches
    check_engine_matches_hf(llm, cases, refs, "opencua")
    parts = [{"type": "image_pil", "image_pil": a}, {"type": "text", "text": "Click it."}]
    (chat,) = llm.chat([{"role": "user", "content": parts}], greedy(0), use_tqdm=False)
    turn = f"<|im_user|>user<|im_middle|>{PAD}\nClick it.<|im_end|>"
    ids, want = reference(ref, turn + "<|im_assistant|>assistant<|im_middle|>", [a])
    assert chat.prompt_token_ids == ids and chat.outputs[0].token_ids == want.tokens


@pytest.mark.parametrize(
    ("field", "change"),
    [
        ("text_config.model_type", {"model_type": "llama"}),
        ("text_config.head_dim", {"head_dim": 8}),
        ("rope_scaling", {"rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]}}),
        ("vision_config.model_type", {"vision": {**VISION, "model_type": "qwen2_vl"}}),
        ("vision_config.out_hidden_size", {"vision": {**VISION, "out_hidden_size": 32}}),
        ("image_token_id", {"top": {"image_token_id": 10**6}}),
        ("rms_norm_eps", {"top": {"rms_norm_eps": 1e-5}}),
    ],
)
def test_configs_refused_by_name(ckpt, tmp_path, field, change):
    path, _ = ckpt
    config = json.loads((path / "config.json").read_text())
    top = change.pop("top", {})
    if "vision" in change:
        config["vision_config"] = change.pop("vision")
    config["text_config"] |= change
    check_config_refused(path, tmp_path, config | top, field)
