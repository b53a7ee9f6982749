"""Images through Molmo2 checkpoints (multimodal/molmo2.py, molmo2_encoder.py, models/molmo2.py)
against HF.

A tiny random `Molmo2ForConditionalGeneration` (its Qwen3-style decoder with the image tokens
in an extra vocabulary past vocab_size; a 3-layer ViT of 4-pixel patches read at layers -1 and
0; a grouped-query attention pooling adapter over 2 x 2 windows; 28-pixel crops with 1-patch
overlap margins, up to 4 of them): `LLM.generate` with `multi_modal_data` must give HF's prompt
ids (Molmo2Processor's grids of <im_patch> and <im_col>, its bos token first) and HF
`generate`'s greedy tokens and top-5 logprobs (1e-3, float32) with HF's bidirectional mask over
the image tokens (mm_token_type_ids). transformers' Molmo2ImageProcessor needs torchvision for
its resize and normalize alone: the test runs transformers' own processor with those two calls
in torch, against the engine's copy, bit for bit. Then the encoder against get_image_features,
the engine's paths (chunks ending at the image, prefix-cache hits, an image processed ahead),
and refusals (text between two images, videos, config fields). Images side by side
(<|image|><|image|>) run as one span, as HF's mask has them; Molmo2-O's OLMo-style decoder
and rope scaling on some layers only have checkpoints of their own.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from hf_reference import assert_matches, assert_same_greedy, hf_greedy
from image_checks import (
    check_chunks_and_prefix_hits,
    check_matches_hf,
    check_tensor_parallel,
    engine,
    greedy,
    noise_image,
)

transformers = pytest.importorskip("transformers")
pytest.importorskip("transformers.models.molmo2")
pytest.importorskip("PIL.Image")

MAX_TOKENS = 8
MARKS = [
    "<im_patch>",
    "<im_col>",
    "<im_start>",
    "<low_res_im_start>",
    "<frame_start>",
    "<im_end>",
    "<frame_end>",
    "<im_low>",
    "<|image|>",
    "<|video|>",
]
MM_TOKENS = MARKS[:8]  # Molmo2Processor's image_token_ids: mm_token_type_ids 1
PROMPT = "<|im_start|>user\n<|image|>What is in it?<|im_end|>\n<|im_start|>assistant\n"
SIDE = PROMPT.replace("<|image|>", "<|image|><|image|>")
TEXT = "<|im_start|>user\nSay something about the sea.<|im_end|>\n<|im_start|>assistant\n"
PROCESSOR = {
    "image_processor_type": "Molmo2ImageProcessor",
    "size": {"height": 28, "width": 28},
    "patch_size": 4,
    "max_crops": 4,
    "overlap_margins": [1, 1],
    "pooling_size": [2, 2],
    "image_mean": [0.48, 0.45, 0.4],
    "image_std": [0.27, 0.26, 0.28],
}


def write_tiny_molmo2(path: Path, seed: int = 0, **text_changes) -> Path:
    from paged_engine.testing import _COMMON, _save_random, build_tiny_tokenizer

    path.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tiny_tokenizer(seed=seed)
    base = len(tokenizer)
    tokenizer.add_special_tokens({"additional_special_tokens": MARKS})
    ids = dict(zip(MARKS, tokenizer.convert_tokens_to_ids(MARKS), strict=True))
    text = {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2}
    text |= {"head_dim": 16, "vocab_size": base, "additional_vocab_size": len(MARKS)}
    text |= {"num_hidden_layers": 2, "intermediate_size": 96, "max_position_embeddings": 1024}
    text |= {"attention_bias": True, **text_changes}
    vision = {"hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 3}
    vision |= {"num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 16}
    vision |= {"image_size": [28, 28], "patch_size": 4}
    adapter = {"vision_feature_layer": [-1, 0], "hidden_size": 32, "num_attention_heads": 4}
    adapter |= {"num_key_value_heads": 2, "head_dim": 8, "intermediate_size": 40}
    adapter |= {"text_hidden_size": 64}
    config = transformers.Molmo2Config(
        text_config=text,
        vision_config=vision,
        adapter_config=adapter,
        image_start_token_id=ids["<im_start>"],
        low_res_image_start_token_id=ids["<low_res_im_start>"],
        image_end_token_id=ids["<im_end>"],
        image_patch_id=ids["<im_patch>"],
        frame_start_token_id=ids["<frame_start>"],
        frame_end_token_id=ids["<frame_end>"],
        **_COMMON,
    )
    _save_random(transformers.Molmo2ForConditionalGeneration, config, seed, path)
    (path / "preprocessor_config.json").write_text(json.dumps(PROCESSOR))
    tokenizer.save_pretrained(path)
    transformers.GenerationConfig(**_COMMON).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return write_tiny_molmo2(tmp_path_factory.mktemp("molmo2"), seed=3)


def _hf_processor(**changes):
    """transformers' Molmo2ImageProcessor, its two torchvision calls (a float32 bilinear
    resize without antialias, normalize) in torch: every other step is its own."""
    from transformers.models.molmo2.image_processing_molmo2 import Molmo2ImageProcessor

    kw = {k: v for k, v in PROCESSOR.items() if k != "image_processor_type"} | changes
    hf = Molmo2ImageProcessor(**kw)

    def resize(image, size, resample=None, antialias=True, **_):
        shape = (size.height, size.width)
        return F.interpolate(
            image, shape, mode="bilinear", align_corners=False, antialias=antialias
        )

    def normalize(image, mean, std, inplace=False, **_):
        mean, std = torch.as_tensor(mean).view(-1, 1, 1), torch.as_tensor(std).view(-1, 1, 1)
        return (image - mean) / std

    hf.resize, hf.normalize = resize, normalize
    return hf


def _hf_inputs(path, text: str, images: list, **changes) -> tuple[list[int], dict]:
    """HF's prompt ids (Molmo2Processor: bos first, each <|image|> replaced by its
    replace_image_token) and generate inputs (mm_token_type_ids: HF's two-way image mask)."""
    from transformers.models.molmo2.processing_molmo2 import Molmo2Processor

    tok = transformers.AutoTokenizer.from_pretrained(path)
    if not images:  # a text prompt: the tokenizer's ids (the engine adds no bos to it)
        return tok.encode(text, add_special_tokens=False), {}
    text = text if text.startswith(tok.bos_token) else tok.bos_token + text
    extra: dict = {}
    if images:
        extra = dict(_hf_processor(**changes)(images=images, return_tensors="pt"))
        me = SimpleNamespace(
            image_use_col_tokens=True,
            use_single_crop_col_tokens=None,
            use_single_crop_start_token=True,
        )
        pieces = text.split("<|image|>")
        text = pieces[0] + "".join(
            Molmo2Processor.replace_image_token(me, extra, i) + piece
            for i, piece in enumerate(pieces[1:])
        )
    ids = tok.encode(text, add_special_tokens=False)
    mm = torch.isin(torch.tensor([ids]), torch.tensor(tok.convert_tokens_to_ids(MM_TOKENS)))
    return ids, {**extra, "mm_token_type_ids": mm.long()}


def _hf_model(path):
    model = transformers.Molmo2ForConditionalGeneration.from_pretrained(path, dtype=torch.float32)
    model.eval().generation_config.eos_token_id = None
    return model


CASES = [
    (PROMPT, [(1, (40, 70))]),  # 1 x 3 crops
    (TEXT, []),
    (PROMPT, [(2, (90, 30))]),  # 3 x 1 crops
    (PROMPT, [(3, (12, 9))]),  # one crop, upscaled
    (SIDE, [(4, (40, 70)), (5, (12, 9))]),  # side by side: one run, both ways
]


def _cases():
    return [(text, [noise_image(s, size) for s, size in imgs]) for text, imgs in CASES]


def test_images_match_hf(path):
    """One image at three tilings, text alone, and two images side by side (one run)."""
    model = _hf_model(path)
    refs = []
    for text, images in _cases():
        ids, extra = _hf_inputs(path, text, images)
        refs.append((ids, hf_greedy(model, ids, MAX_TOKENS, 5, **extra)))
    check_matches_hf(path, _cases(), refs, "molmo2")


def test_processor_kwargs_match_hf(path):
    """mm_processor_kwargs that change the crops (max_crops, overlap_margins, pooling_size)
    give HF's prompt and tokens: the geometry is read back from the processor's output."""
    model = _hf_model(path)
    image = noise_image(40, (50, 90))
    llm = engine(path)
    for changes in ({"max_crops": 2, "overlap_margins": [2, 1]}, {"pooling_size": [3, 2]}):
        ids, extra = _hf_inputs(path, PROMPT, [image], **changes)
        ref = hf_greedy(model, ids, MAX_TOKENS, 5, **extra)
        prompt = {"prompt": PROMPT, "multi_modal_data": {"image": image}}
        out = llm.generate([{**prompt, "mm_processor_kwargs": changes}], greedy(), use_tqdm=False)
        assert out[0].prompt_token_ids == ids
        assert_matches("molmo2", out[0], ref)


def test_pixels_and_windows_equal_transformers(path):
    """The engine's processor (torch_processors' copy) against transformers' own steps, bit
    for bit, over tilings 1 x 1 to 2 x 2 and 1 x 4 / 4 x 1."""
    from paged_engine.multimodal.torch_processors import torch_processor

    ours = torch_processor(path, transformers.AutoConfig.from_pretrained(path))
    hf = _hf_processor()
    for i, size in enumerate([(40, 70), (28, 28), (100, 20), (9, 13), (64, 64), (20, 120)]):
        image = noise_image(20 + i, size)
        want, got = hf(images=[image], return_tensors="pt"), ours(images=[image])
        for key in ("pixel_values", "image_token_pooling", "image_grids", "image_num_crops"):
            assert torch.equal(got[key], want[key]), (size, key)


def test_encoder_matches_hf_features(path):
    """Each <im_patch> row is the token's embedding plus get_image_features' row; the other
    rows of the segment are the tokens' own embeddings."""
    from safetensors.torch import load_file

    from paged_engine.multimodal.inputs import ImageInput
    from paged_engine.multimodal.molmo2_encoder import Molmo2ImageEncoder

    model = _hf_model(path)
    config = transformers.AutoConfig.from_pretrained(path)
    ours = Molmo2ImageEncoder(config)
    ours.load_weights(load_file(Path(path) / "model.safetensors").items())
    llm_layout = _layout(path)
    table = model.model.language_model.embed_tokens.weight
    for i, size in enumerate([(40, 70), (12, 9)]):
        image = noise_image(30 + i, size)
        _, extra = _hf_inputs(path, "<|image|>", [image])
        pixels, geometry = llm_layout.load(lambda imgs, **_: _hf_processor()(imgs), image, 1)
        ids = torch.tensor(llm_layout.segment((pixels, geometry)))
        m = ImageInput(pixels, 0, len(ids), "x", geometry, bidirectional=True)
        with torch.no_grad():
            rows = ours.encode([m])[0]
            keys = ("pixel_values", "image_token_pooling", "image_grids", "image_num_crops")
            want = model.model.get_image_features(*(extra[k] for k in keys)).pooler_output[0]
        patch = ids == config.image_patch_id
        torch.testing.assert_close(rows[patch] - table[ids[patch]], want, atol=1e-5, rtol=1e-5)
        assert torch.equal(rows[~patch], table[ids[~patch]])


def _layout(path):
    from paged_engine.multimodal.molmo2 import Molmo2Layout

    config = transformers.AutoConfig.from_pretrained(path)
    tok = transformers.AutoTokenizer.from_pretrained(path)
    return Molmo2Layout(config, config.image_patch_id, tok)


def test_engine_paths_match_the_plain_run(path):
    """Chunks of 80 tokens (an image's run in one step, the text around it cut), a prefix-cache
    hit on the same image and none past the text for another; the image processed ahead and
    handed over with the expanded ids, and moved one token (refused)."""
    prompts = [
        {"prompt": PROMPT, "multi_modal_data": {"image": noise_image(i, (30 + 20 * i, 60))}}
        for i in range(3)
    ]
    params = greedy(0, 16)
    plain, cached, run = check_chunks_and_prefix_hits(
        path, prompts, params, 80, lambda proc: proc.images.layout.first
    )
    images = cached.llm_engine.input_processor.images
    pic = prompts[2]["multi_modal_data"]["image"]
    expanded, done = images.process(cached.get_tokenizer().encode(PROMPT), [pic])
    ahead = {"prompt_token_ids": expanded, "multi_modal_data": {"image": list(done)}}
    assert_same_greedy(plain[2:], run(cached, [ahead]))
    moved = {"prompt_token_ids": [5, *expanded], "multi_modal_data": {"image": list(done)}}
    with pytest.raises(ValueError, match="do not fit"):
        cached.generate([moved], params, use_tqdm=False)
    two = PROMPT.replace("<|image|>", "<|image|> and <|image|>")
    one = noise_image(9, (20, 20))
    refused = [
        ({"prompt": two, "multi_modal_data": {"image": [one, one]}}, "text between them"),
        ({"prompt": PROMPT, "multi_modal_data": {"image": [one, one]}}, "1 <\\|image\\|>"),
        ({"prompt": PROMPT, "multi_modal_data": {"image": "a cat"}}, "PIL.Image.Image"),
        ({"prompt": "<im_patch>" + PROMPT, "multi_modal_data": {"image": one}}, "<im_patch>"),
        ({"prompt": PROMPT, "multi_modal_data": {"video": [one]}}, "takes no videos"),
    ]
    for bad, match in refused:
        with pytest.raises(ValueError, match=match):
            cached.generate([bad], greedy(0), use_tqdm=False)
    small = engine(path, max_num_batched_tokens=32, max_num_seqs=2)
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        small.generate([prompts[0]], greedy(0), use_tqdm=False)
    out = cached.generate([prompts[0]], params, use_tqdm=False)[0]
    assert out.outputs[0].token_ids == plain[0].token_ids


def test_in_memory_weight_names_load(path, tmp_path):
    """A checkpoint under transformers' in-memory names (`model.language_model.*`,
    `model.vision_tower.layers.N.self_attn.*`, one `embed_tokens` table) gives the same tokens
    as the Hub's names."""
    import shutil

    from safetensors.torch import save_file

    state = {k: v.contiguous() for k, v in _hf_model(path).state_dict().items()}
    assert "model.language_model.embed_tokens.weight" in state
    for f in Path(path).iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, tmp_path / f.name)
    save_file(state, tmp_path / "model.safetensors", metadata={"format": "pt"})
    prompt = {"prompt": PROMPT, "multi_modal_data": {"image": noise_image(13, (40, 70))}}
    want = engine(path).generate([prompt], greedy(), use_tqdm=False)[0].outputs[0]
    got = engine(tmp_path).generate([prompt], greedy(), use_tqdm=False)[0].outputs[0]
    assert got.token_ids == want.token_ids


def test_tensor_parallel_matches_one_process(path):
    """TP=2: the tower on every rank; the table (extra vocabulary included) and the head (its
    -inf columns padded after the gather) split over the vocabulary."""
    prompts = [{"prompt": PROMPT, "multi_modal_data": {"image": noise_image(11, (60, 30))}}]
    check_tensor_parallel(path, prompts, 96, 8)


# the decoder's other forms: rope scaling on some layers only (the rest plain, same theta),
# and Molmo2-O's OLMo-style layers (whole-projection q / k norms, norm_after)
VARIANTS = {
    "qwen3_partial_rope": {"rope_scaling_layers": [1]},
    "olmo": {"qk_norm_type": "olmo", "norm_after": True, "rope_scaling_layers": [0]},
}
_LINEAR = {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_decoder_variants_match_hf(variant, tmp_path):
    path = write_tiny_molmo2(tmp_path, seed=5, rope_parameters=_LINEAR, **VARIANTS[variant])
    model = _hf_model(path)
    cases = [(PROMPT, [noise_image(12, (60, 30))]), (TEXT, [])]
    refs = []
    for text, images in cases:
        ids, extra = _hf_inputs(path, text, images)
        refs.append((ids, hf_greedy(model, ids, MAX_TOKENS, 5, **extra)))
    check_matches_hf(path, cases, refs, f"molmo2 {variant}")


def test_config_refusals(path):
    """What the decoder does not run is refused by the text_config field's name."""
    from paged_engine.models.molmo2 import check_text_config

    for changes, match in [
        ({"qk_norm_type": "olmo"}, "qk_norm_type"),
        ({"norm_after": True}, "norm_after"),
        ({"tie_word_embeddings": True}, "tie_word_embeddings"),
        ({"rope_scaling_layers": [0, 2]}, "rope_scaling_layers"),
    ]:
        text = transformers.AutoConfig.from_pretrained(path).text_config
        for field, value in changes.items():
            setattr(text, field, value)
        with pytest.raises(ValueError, match=match):
            check_text_config(text)
