"""ERNIE 4.5 VL (multimodal/ernie4_5_vl.py, models/ernie4_5_vl_moe.py) against HF on tiny random
weights.

The tiny checkpoint: a Qwen2-VL-style tower of 2 blocks (width 32, 2 heads of 16: 4 rope
frequencies per axis, theta 100), 4-pixel patches, quick GELU, LayerNorm eps 0.05; the resampler
merging 2 x 2 patches and the image's two "frames". The decoder: ERNIE 4.5 with biased
projections (use_bias), head_dim 16, ERNIE's 3-D rope with sections (3, 3, 2), theta 100; layer
0 dense, layers 1 and 2 sparse (a sparse layer before the last, so the routing of image rows
reaches later tokens): 4 text experts of 32 and 4 vision experts of 16, top 2, one shared
expert. The image processor (Ernie4_5_VLMoeImageProcessorPil) resizes to 256 - 4096 pixels in
multiples of 8.

`LLM.generate` with `multi_modal_data` (one image, two, none) gives HF's processor's prompt ids
and HF `generate`'s greedy tokens and top-5 logprobs (HF given the processor's
moe_mm_token_type_ids); our host side gives HF's ids, pixel values and get_rope_index table; the
tower and resampler give HF's image features (1e-5) from the Hub's names (what transformers
saves) and from transformers' in-memory names; a text-only prompt holding the image markers
routes them to the vision experts as HF does; the engine's paths (chunks through images,
prefix-cache hits, images processed ahead), bad input and refused configs.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hf_reference import assert_matches, hf_greedy
from image_checks import (
    check_engine_paths,
    check_grid_host_side_and_encoder,
    check_matches_hf,
    check_refused,
    check_tensor_parallel,
    check_vision_fields_refused,
    engine,
    greedy,
    grid_path_prompts,
    hf_cases,
    hf_refs,
    noise_image,
    processor_inputs,
    usual_refusals,
)
from vlm_checkpoints import finish_checkpoint, load_hf_vlm, tokenizer_with

from paged_engine.testing import _COMMON, _save_random

transformers = pytest.importorskip("transformers")
pytest.importorskip("transformers.models.ernie4_5_vl_moe")

_START, _IMAGE, _END = "<|IMAGE_START|>", "<|IMAGE_PLACEHOLDER|>", "<|IMAGE_END|>"
_VSTART, _VIDEO, _VEND = "<|VIDEO_START|>", "<|VIDEO_PLACEHOLDER|>", "<|VIDEO_END|>"
SPECIAL = ["<|begin_of_sentence|>", _START, _IMAGE, _END, _VSTART, _VIDEO, _VEND]
IMAGE = f"Picture 1:{_START}{_IMAGE}{_END}"
PROMPT = f"<|begin_of_sentence|>User: {IMAGE}Describe it.\nAssistant: "
TWO = f"<|begin_of_sentence|>User: {IMAGE}{IMAGE}Compare them.\nAssistant: "
TEXT = "<|begin_of_sentence|>User: Say something about the sea.\nAssistant: "
# markers without an image: HF's processor still routes them to the vision experts
MARKERS = f"<|begin_of_sentence|>User: {_START}{_END} and the sea.\nAssistant: "
_TEXT_CONFIG = {
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 3,
    "mlp_layer_types": ["dense", "sparse", "sparse"],
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "use_bias": True,
    "moe_intermediate_size": [32, 16],
    "moe_k": 2,
    "moe_num_experts": 4,
    "moe_num_shared_experts": 1,
    "max_position_embeddings": 1024,
    "rms_norm_eps": 1e-5,
    "rope_parameters": {"rope_type": "default", "rope_theta": 100.0, "mrope_section": [3, 3, 2]},
    **_COMMON,
}
_VISION_CONFIG = {
    "depth": 2,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_heads": 2,
    "patch_size": 4,
    "spatial_merge_size": 2,
    "rms_norm_eps": 0.05,
    "rope_parameters": {"rope_type": "axial", "rope_theta": 100.0},
}


def write_tiny_ernie4_5_vl(path: Path, seed: int = 0) -> Path:
    """A tiny random Ernie4_5_VLMoeForConditionalGeneration checkpoint with its PIL image
    processor (4-pixel patches merged 2 x 2; 256 to 4096 pixels an image) and tokenizer."""
    path.mkdir(parents=True, exist_ok=True)
    tokenizer, ids = tokenizer_with(SPECIAL, seed)
    config = transformers.Ernie4_5_VLMoeConfig(
        text_config={**_TEXT_CONFIG, "vocab_size": len(tokenizer)},
        vision_config=_VISION_CONFIG,
        image_token_id=ids[_IMAGE],
        image_start_token_id=ids[_START],
        image_end_token_id=ids[_END],
        video_token_id=ids[_VIDEO],
        video_start_token_id=ids[_VSTART],
        video_end_token_id=ids[_VEND],
        tie_word_embeddings=False,
        **_COMMON,
    )
    _save_random(transformers.Ernie4_5_VLMoeForConditionalGeneration, config, seed, path)
    transformers.Ernie4_5_VLMoeImageProcessorPil(
        patch_size=4, merge_size=2, size={"shortest_edge": 256, "longest_edge": 4096}
    ).save_pretrained(path)
    return finish_checkpoint(path, tokenizer)


@pytest.fixture(scope="module")
def ernie_dir(tmp_path_factory) -> Path:
    path = write_tiny_ernie4_5_vl(tmp_path_factory.mktemp("ernie4_5_vl"), seed=4)
    _random_router_biases(path)
    return path


def _random_router_biases(path: Path) -> None:
    """Nonzero e_score_correction_bias rows (HF initializes them to zero), so a swapped text /
    vision row or an ignored bias shows."""
    from safetensors.torch import load_file, save_file

    weights = load_file(path / "model.safetensors")
    g = torch.Generator().manual_seed(3)
    for k, v in weights.items():
        if k.endswith("e_score_correction_bias"):
            weights[k] = torch.rand(v.shape, generator=g) * 0.3
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})


@pytest.fixture(scope="module")
def hf_model(ernie_dir):
    return load_hf_vlm(transformers.Ernie4_5_VLMoeForConditionalGeneration, ernie_dir)


def _processor(path: Path):
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    for attr, token in (
        ("image", _IMAGE),
        ("image_start", _START),
        ("image_end", _END),
        ("video", _VIDEO),
        ("video_start", _VSTART),
        ("video_end", _VEND),
    ):
        setattr(tokenizer, f"{attr}_token", token)
        setattr(tokenizer, f"{attr}_token_id", tokenizer.convert_tokens_to_ids(token))
    images = transformers.Ernie4_5_VLMoeImageProcessorPil.from_pretrained(path)
    with pytest.MonkeyPatch.context() as mp:
        mixin = transformers.ProcessorMixin
        mp.setattr(mixin, "check_argument_for_proper_class", lambda *a: None, raising=False)
        return transformers.Ernie4_5_VLMoeProcessor(image_processor=images, tokenizer=tokenizer)


_KEYS = ("pixel_values", "image_grid_thw", "mm_token_type_ids", "moe_mm_token_type_ids")


def _hf_inputs(processor, text: str, images: list) -> tuple[list[int], dict]:
    ids, extra = processor_inputs(processor, text, images, _KEYS if images else ())
    if not images:  # HF's processor marks the image markers of any prompt
        extra = {"moe_mm_token_type_ids": processor.create_moe_mm_token_type_ids([ids])}
        extra["moe_mm_token_type_ids"] = torch.tensor(extra["moe_mm_token_type_ids"])
    return ids, extra


def test_ernie4_5_vl_matches_hf(ernie_dir, hf_model):
    processor = _processor(ernie_dir)
    cases = [*hf_cases(PROMPT, TEXT, TWO), (MARKERS, [])]
    refs = hf_refs(hf_model, cases, lambda *case: _hf_inputs(processor, *case))
    check_matches_hf(ernie_dir, cases, refs, "ernie4_5_vl")


def test_ernie4_5_vl_routing_matters(ernie_dir, hf_model):
    """The markers of a text-only prompt go to the vision experts: routing them as text gives
    other logprobs in HF (so the previous test tells the two apart)."""
    processor = _processor(ernie_dir)
    ids, extra = _hf_inputs(processor, MARKERS, [])
    assert extra["moe_mm_token_type_ids"].any()
    routed = hf_greedy(hf_model, ids, 4, 5, **extra)
    plain = hf_greedy(hf_model, ids, 4, 5)
    assert routed != plain


def test_ernie4_5_vl_host_side_and_encoder_match_hf(ernie_dir, hf_model):
    """Our processing gives HF's processor's ids and pixel values and get_rope_index's table
    and delta; the encoder's rows equal HF's image features (1e-5), loaded from the Hub's names
    (what transformers saves) and from transformers' in-memory ones; those rows as image_embeds
    (with image_grid_thw) give the images' tokens."""
    from safetensors.torch import load_file

    from paged_engine.multimodal.archs import build_encoder

    images = [noise_image(20, (40, 56)), noise_image(21, (72, 24))]
    ids, extra = _hf_inputs(_processor(ernie_dir), TWO, images)
    hub = load_file(ernie_dir / "model.safetensors")
    memory = {k: v for k, v in hf_model.state_dict().items() if "language_model" not in k}
    pixels = extra["pixel_values"]
    check_grid_host_side_and_encoder(
        engine(ernie_dir), hf_model, TWO, images, ids, extra, pixels, [hub, memory], build_encoder
    )


def test_ernie4_5_vl_engine_paths(ernie_dir):
    """image_checks' paths (8-token chunks through the images and their M-RoPE rows,
    prefix-cache hits, images processed ahead); bad input is a ValueError naming what is
    wrong, and the engine serves on."""
    prompts = grid_path_prompts(PROMPT, TWO)
    cached = check_engine_paths(ernie_dir, prompts, TWO)
    one = noise_image(10, (32, 32))
    refused = usual_refusals(PROMPT, TWO, one, bare=True)
    check_refused(ernie_dir, cached, refused, prompts)


def test_ernie4_5_vl_refused_configs(ernie_dir):
    from paged_engine.models.ernie4_5_vl_moe import Ernie4_5_VLMoeTextForCausalLM
    from paged_engine.multimodal.archs import build_encoder
    from paged_engine.multimodal.ernie4_5_vl import ErnieLayout

    def config():
        return transformers.AutoConfig.from_pretrained(ernie_dir)

    cases = [
        ("model_type", "qwen2_vl", r"vision_config\.model_type='qwen2_vl'"),
        ("temporal_merge_size", 3, r"vision_config\.temporal_merge_size=3"),
        ("rope_parameters", {"rope_type": "yarn"}, r"rope_parameters\.rope_type='yarn'"),
    ]
    check_vision_fields_refused(ernie_dir, cases, build_encoder)
    text = config().text_config
    text.rope_parameters = {**text.rope_parameters, "mrope_section": [4, 2, 2]}
    with pytest.raises(ValueError, match=r"mrope_section=\[4, 2, 2\]"):
        Ernie4_5_VLMoeTextForCausalLM(text)
    text = config().text_config
    text.mlp_layer_types = ["dense", "moe", "sparse"]
    with pytest.raises(ValueError, match="mlp_layer_types"):
        Ernie4_5_VLMoeTextForCausalLM(text)
    layout = ErnieLayout(config(), 0, None)
    with pytest.raises(ValueError, match=r"image_size \(2, 4, 4\) is not \(1, h, w\)"):
        layout.length((2, 4, 4))
    with pytest.raises(ValueError, match=r"multiples of vision_config\.spatial_merge_size 2"):
        layout.length((1, 4, 5))


def test_ernie4_5_vl_generated_markers_are_text(ernie_dir, tmp_path):
    """Generated image markers go to the text experts, as HF's generate drops the routing ids
    after the prefill: a head that favours <|IMAGE_START|> (its row times 4) generates it
    among other tokens, and the tokens after it match HF's."""
    import shutil

    from safetensors.torch import load_file, save_file

    path = Path(shutil.copytree(ernie_dir, tmp_path / "ckpt"))
    processor = _processor(path)
    start = processor.tokenizer.convert_tokens_to_ids(_START)
    weights = load_file(path / "model.safetensors")
    weights["lm_head.weight"][start] *= 4
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    model = load_hf_vlm(transformers.Ernie4_5_VLMoeForConditionalGeneration, path)
    cases = [(TEXT, []), (PROMPT, [noise_image(1, (40, 56))])]
    refs = hf_refs(model, cases, lambda *case: _hf_inputs(processor, *case))
    assert all(start in ref.tokens[:-1] for _, ref in refs)
    check_matches_hf(path, cases, refs, "ernie4_5_vl")


def test_ernie4_5_vl_text_only_serving(ernie_dir, hf_model):
    """limit_mm_per_prompt={'image': 0}: the tower is not loaded, the text model serves HF's
    tokens, its prompt markers still routed to the vision experts."""
    ids, extra = _hf_inputs(_processor(ernie_dir), MARKERS, [])
    ref = hf_greedy(hf_model, ids, 8, 5, **extra)
    llm = engine(ernie_dir, limit_mm_per_prompt={"image": 0})
    assert llm.llm_engine.input_processor.images is None
    out = llm.generate([{"prompt_token_ids": ids}], greedy(), use_tqdm=False)[0]
    assert_matches("ernie4_5_vl text-only", out, ref)


def test_ernie4_5_vl_tensor_parallel(ernie_dir):
    """TP=2 (the encoder on every rank, each rank's share of both expert sets and the shared
    experts summed once; 8-token chunks through the images) gives the one-process tokens and
    top-5 logprobs."""
    prompts = [{"prompt": TWO, "multi_modal_data": {"image": [noise_image(11, (32, 48))] * 2}}]
    check_tensor_parallel(ernie_dir, prompts, 8)


def test_ernie4_5_vl_text_weight_names(ernie_dir, hf_model):
    """The decoder loads the same parameters from the Hub's names (one expert list, [H, E]
    routers, a [2, E] bias: what transformers saves) and from transformers' in-memory ones
    (text_moe / vision_moe, fused experts)."""
    from safetensors.torch import load_file

    from paged_engine.models.ernie4_5_vl_moe import Ernie4_5_VLMoeTextForCausalLM
    from paged_engine.models.multimodal_text import text_model_weights, text_only_config

    text = text_only_config(transformers.AutoConfig.from_pretrained(ernie_dir))
    loaded = []
    for names in (load_file(ernie_dir / "model.safetensors"), hf_model.state_dict()):
        model = Ernie4_5_VLMoeTextForCausalLM(text)
        model.load_weights(text_model_weights(names.items(), text))
        loaded.append(model.state_dict())
    assert loaded[0].keys() == loaded[1].keys()
    for key, value in loaded[0].items():
        torch.testing.assert_close(value, loaded[1][key], atol=0, rtol=0, msg=key)
