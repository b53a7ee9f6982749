"""Keye-VL (`KeyeForConditionalGeneration`, remote code; models/keye_config.py, multimodal/keye.py,
multimodal/paddleocr_vl.py) against a reference composed of transformers' modules, on a tiny
random checkpoint.

The checkpoint: transformers' Qwen3ForCausalLM (Keye's LM: the same weight names, `model.*`,
`lm_head.*`; head_dim 16, theta 100) and the tower and projector of a tiny
PaddleOCRVLForConditionalGeneration (PaddleOCR-VL's are Keye's: SigLIP layers with 2-D rope at
theta 10000, the learned 8 x 8 position table resized to the grid, LayerNorm per patch, 2 x 2
patches merged, linear, GELU, linear) saved under the Hub's `visual.vision_model.*` / `mlp_AR.*`
(with the SigLIP head and packing table the release carries), beside a config.json and
preprocessor_config.json in the release's form (rope_scaling mrope sections 2, 3, 3; 4-pixel
patches; 256 to 4096 pixels an image) and a tokenizer holding Qwen's vision tokens.

The reference, for a prompt and its images: pixels and grids from PaddleOCRVLImageProcessorPil
(the remote SiglipImageProcessor's steps) with the grids checked against smart_resize worked by
hand; the ids with each lone <|image_pad|> repeated h*w / 4 times; the rows from HF Paddle's
get_image_features; the positions from its get_rope_index (Qwen2-VL's, one temporal patch),
turned into cos / sin over the sections and given to HF's Qwen3 layers in place of its 1-D
rotary embedding; 8 greedy steps over the whole sequence. `LLM.generate` must give those ids,
tokens and top-5 logprobs (1e-3, float32).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from hf_reference import Greedy, assert_matches
from image_checks import (
    check_chat_data_url,
    check_config_refused,
    check_engine_paths,
    engine,
    greedy,
    grid_path_prompts,
    noise_image,
)
from test_isaac import hf_greedy_with_mrope
from vlm_checkpoints import chatml_template, finish_checkpoint, saved_tokenizer

transformers = pytest.importorskip("transformers")
pytest.importorskip("transformers.models.paddleocr_vl")

START, PAD, END, VIDEO = "<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "<|video_pad|>"
IMAGE = f"{START}{PAD}{END}"
PROMPT = f"<|im_start|>user\n{IMAGE}What is in it?<|im_end|>\n<|im_start|>assistant\n"
TWO = f"<|im_start|>user\n{IMAGE} and {IMAGE}Which is brighter?<|im_end|>\n<|im_start|>assistant\n"
TEXT = "<|im_start|>user\nSay something about the sea.<|im_end|>\n<|im_start|>assistant\n"
SECTION = [2, 3, 3]  # unequal: each axis's frequencies told apart
# (height, width) -> smart_resize's (factor 8, 256 .. 4096 pixels) patch grid: 20 x 28 rounds
# half to even, to 16 x 32; 5 x 30 widens to 8 x 48 (the short side up to the factor); 900 x 400
# shrinks by 9.375 (sqrt(360000 / 4096)) to 8 floor(96 / 8) x 8 floor(42.7 / 8) = 96 x 40
GRIDS = {(20, 28): (4, 8), (5, 30): (2, 12), (900, 400): (24, 10)}
VISION = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "image_size": 32,
    "patch_size": 4,
    "layer_norm_eps": 0.05,
}
PREPROCESSOR = {  # the release's form (its class remote code)
    "min_pixels": 256,
    "max_pixels": 4096,
    "patch_size": 4,
    "temporal_patch_size": 1,
    "merge_size": 2,
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
    "processor_class": "KeyeProcessor",
    "auto_map": {"AutoImageProcessor": "image_processing_keye.SiglipImageProcessor"},
}


def write_tiny_keye(path: Path, seed: int = 0):
    """The checkpoint (see the module) and its parts: (raw config, Qwen3 LM, HF Paddle model)."""
    from safetensors.torch import save_file

    from paged_engine.testing import _randomize, tiny_config

    tok = saved_tokenizer(path, [START, PAD, END, VIDEO], chatml_template(IMAGE), seed)
    ids = dict(zip((START, PAD, END, VIDEO), tok.convert_tokens_to_ids([START, PAD, END, VIDEO])))
    vocab = max(ids.values()) + 8
    text = tiny_config("qwen3", vocab_size=vocab, head_dim=16, rope_theta=100.0)
    torch.manual_seed(seed)
    lm = transformers.Qwen3ForCausalLM(text).float().eval()
    _randomize(lm, seed)
    paddle_config = transformers.PaddleOCRVLConfig(
        text_config={"hidden_size": text.hidden_size, "vocab_size": vocab, "num_hidden_layers": 1},
        vision_config={**VISION, "spatial_merge_size": 2, "hidden_act": "gelu_pytorch_tanh"},
        image_token_id=ids[PAD],
        video_token_id=ids[VIDEO],
        vision_start_token_id=ids[START],
        vision_end_token_id=ids[END],
    )
    paddle = transformers.PaddleOCRVLForConditionalGeneration(paddle_config).float().eval()
    _randomize(paddle, seed + 1)
    state = dict(lm.state_dict())
    for k, v in paddle.state_dict().items():
        if k.startswith("model.visual."):
            state[k.removeprefix("model.")] = v
        elif k.startswith("model.projector."):
            state["mlp_AR." + k.removeprefix("model.projector.")] = v
    state["visual.vision_model.head.probe"] = torch.zeros(1, 1, VISION["hidden_size"])
    state["visual.vision_model.embeddings.packing_position_embedding.weight"] = torch.zeros(4, 32)
    save_file({k: v.contiguous().clone() for k, v in state.items()}, path / "model.safetensors")
    llm = {k: v for k, v in text.to_dict().items() if k not in ("rope_parameters", "dtype")}
    raw = {
        **llm,
        "architectures": ["KeyeForConditionalGeneration"],
        "model_type": "Keye",
        "rope_theta": 100.0,
        "rope_scaling": {"type": "mrope", "mrope_section": SECTION},
        "vision_config": {
            **VISION,
            "model_type": "siglip_vision_model",
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "tokens_per_second": 2,
        },
        "image_token_id": ids[PAD],
        "video_token_id": ids[VIDEO],
        "vision_start_token_id": ids[START],
        "vision_end_token_id": ids[END],
        "torch_dtype": "float32",
    }
    (path / "config.json").write_text(json.dumps(raw))
    (path / "preprocessor_config.json").write_text(json.dumps(PREPROCESSOR))
    finish_checkpoint(path, tok)
    return raw, lm, paddle


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("keye")
    return path, *write_tiny_keye(path, seed=4)


def _processor():
    kept = ("min_pixels", "max_pixels", "patch_size", "merge_size", "image_mean", "image_std")
    return transformers.PaddleOCRVLImageProcessorPil(
        temporal_patch_size=1, **{k: PREPROCESSOR[k] for k in kept}
    )


def _reference(tiny, tok, text: str, images: list) -> tuple[list[int], Greedy, torch.Tensor]:
    """(the prompt ids, the reference's greedy result, its [3, T] positions)."""
    _, _, lm, paddle = tiny
    pad = tok.convert_tokens_to_ids(PAD)
    ids = tok.encode(text, add_special_tokens=False)
    rows: list[torch.Tensor] = []
    grid = None
    if images:
        out = _processor()(images=images, return_tensors="pt")
        grid = out["image_grid_thw"]
        for (t, h, w), image in zip(grid.tolist(), images, strict=True):
            assert (t, h, w) == (1, *GRIDS[(image.height, image.width)])
        with torch.no_grad():
            rows = list(paddle.model.get_image_features(out["pixel_values"], grid).pooler_output)
        counts = iter(len(r) for r in rows)
        ids = [x for i in ids for x in ([i] * next(counts) if i == pad else [i])]
    tensor = torch.tensor([ids])
    if images:
        table, delta = paddle.model.get_rope_index(tensor, (tensor == pad).int(), grid)
        table, delta = table[:, 0], int(delta)
    else:
        table, delta = torch.arange(len(ids)).expand(3, -1), 0
    more = torch.arange(len(ids), len(ids) + 8) + delta
    full = torch.cat([table, more.expand(3, -1)], dim=1)
    with torch.no_grad():
        embeds = lm.get_input_embeddings()(tensor)
        if rows:
            embeds[0, tensor[0] == pad] = torch.cat(rows)
    return ids, hf_greedy_with_mrope(lm, embeds, full, SECTION), table


@pytest.fixture(scope="module")
def llm(tiny):
    return engine(tiny[0])


def test_images_and_text_match_the_reference(tiny, llm):
    """Text, one image and two give the reference's ids (each image's run of h*w / 4
    <|image_pad|>), tokens and logprobs; the layout's positions are get_rope_index's; the
    expanded ids given with the images take the runs as they are."""
    from paged_engine.models.remote_aliases import remote_config
    from paged_engine.multimodal.inputs import ImageInput
    from paged_engine.multimodal.keye import KeyeLayout

    tok = transformers.AutoTokenizer.from_pretrained(tiny[0])
    pad = tok.convert_tokens_to_ids(PAD)
    images = [noise_image(1, (20, 28)), noise_image(2, (900, 400)), noise_image(3, (5, 30))]
    cases = [(PROMPT, images[:1]), (TEXT, []), (TWO, images[1:])]
    refs = [_reference(tiny, tok, text, imgs) for text, imgs in cases]
    assert [r[0].count(pad) for r in refs] == [8, 0, 60 + 6]
    ids, _, table = refs[2]
    starts = [i for i in range(len(ids)) if ids[i] == pad and ids[i - 1] != pad]
    runs = (
        ImageInput(None, starts[0], 60, "", (1, 24, 10)),
        ImageInput(None, starts[1], 6, "", (1, 2, 12)),
    )
    positions = KeyeLayout(remote_config(tiny[0]), pad, None).positions(len(ids), runs)
    assert torch.equal(torch.as_tensor(positions.table), table)
    prompts = [{"prompt": t, "multi_modal_data": {"image": m}} if m else t for t, m in cases]
    for (ids, ref, _), out in zip(refs, llm.generate(prompts, greedy(), use_tqdm=False)):
        assert out.prompt_token_ids == ids
        assert_matches("Keye-VL", out, ref)
    ahead = [
        {"prompt_token_ids": ids, "multi_modal_data": {"image": m}}
        for (ids, _, _), (_, m) in zip(refs, cases, strict=True)
        if m
    ]
    outs = llm.generate(ahead, greedy(), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [refs[0][1].tokens, refs[2][1].tokens]


def test_bad_input_and_config_refused(tiny, llm, tmp_path):
    """A video and a placeholder count unlike the images' are ValueErrors naming them (the
    engine serves on); config and preprocessor fields the remote model does not run as served
    are refused by name at load."""
    image = noise_image(5, (16, 16))
    with pytest.raises(ValueError, match="video"):
        llm.generate({"prompt": PROMPT, "multi_modal_data": {"video": [image]}}, greedy())
    with pytest.raises(ValueError, match="image"):
        llm.generate({"prompt": TWO, "multi_modal_data": {"image": [image]}}, greedy())
    assert len(llm.generate(TEXT, greedy(), use_tqdm=False)[0].outputs[0].token_ids) == 8
    raw = tiny[1]
    vision = raw["vision_config"]
    cases = [
        ({"rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 2]}}, "mrope_section"),
        ({"rope_scaling": {"mrope_section": SECTION, "mrope_interleaved": True}}, "interleaved"),
        ({"vision_config": {**vision, "spatial_merge_size": 4}}, "spatial_merge_size=4"),
        ({"vision_config": {**vision, "model_type": "siglip2"}}, "vision_config.model_type"),
        ({"use_sliding_window": True}, "use_sliding_window"),
    ]
    for i, (change, match) in enumerate(cases):
        check_config_refused(tiny[0], tmp_path / str(i), {**raw, **change}, match)
    out = tmp_path / "pre"
    out.mkdir()
    for f in tiny[0].iterdir():
        if f.name != "preprocessor_config.json":
            (out / f.name).symlink_to(f)
    (out / "preprocessor_config.json").write_text(json.dumps({**PREPROCESSOR, "patch_size": 8}))
    with pytest.raises(ValueError, match="patch_size=8"):
        engine(out).generate({"prompt": PROMPT, "multi_modal_data": {"image": image}}, greedy())


def test_engine_paths_and_chat(tiny):
    """image_checks' paths (8-token chunks through the images and their M-RoPE rows, prefix-cache
    hits, images processed ahead); the server's chat path with an image_url data: URL gives the
    offline prompt (the chat template's vision tokens) and tokens."""
    check_engine_paths(tiny[0], grid_path_prompts(PROMPT, TWO), TWO)
    question = [{"type": "image"}, {"type": "text", "text": "What is in it?"}]
    want = check_chat_data_url(engine(tiny[0]), question, noise_image(12, (40, 72)))
    assert want.text == PROMPT
