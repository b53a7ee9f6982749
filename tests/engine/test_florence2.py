"""Florence-2 (multimodal/florence2.py, florence2_prompt.py) against HF.

A tiny random transformers-native Florence2ForConditionalGeneration (a two-stage DaViT of
16 / 24 channels with 3 x 3 windows, so a 32 x 32 image's 8 x 8 map is padded to whole windows;
a BART of d_model 32, 2 layers a stack) saved with a tiny tokenizer and a 32 x 32
CLIPImageProcessor. `LLM.generate` over images of different sizes with task-token, free-text and
token-id prompts in one batch must give HF `generate`'s greedy tokens and top-5 logprobs (1e-3,
float32) for HF's processor inputs ([<image>] * rows + <s> text </s>, the same pixels) and the
same decoder prompt (vLLM's default [eos] = HF's [decoder_start]). Then bad input refused by
name while the engine keeps serving.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hf_parity import (
    assert_image_limit_refused,
    assert_numpy_image_same,
    assert_refused_while_serving,
    edited_sub_config,
    one_image_refusals,
    processor_pixels,
)
from hf_reference import Greedy, assert_matches, hf_generate_enc_dec
from image_checks import greedy, noise_image
from vlm_checkpoints import tiny_bart_fields

transformers = pytest.importorskip("transformers")

from paged_engine import LLM, SamplingParams  # noqa: E402
from paged_engine.testing import (  # noqa: E402
    BOS_ID,
    EOS_ID,
    PAD_ID,
    TINY_VOCAB_SIZE,
    _quiet_progress,
    _randomize,
    build_tiny_tokenizer,
)

IMAGE_ID = TINY_VOCAB_SIZE - 1  # HF's <image> placeholder (paged reads none)
ROWS = 4 * 4 + 1  # the 32 x 32 image's 4 x 4 last map and its mean
START = EOS_ID  # as Florence-2's: the decoder starts from </s>


def write_tiny(path: Path, seed: int = 3) -> Path:
    tokenizer = build_tiny_tokenizer(TINY_VOCAB_SIZE, 0)
    text = transformers.BartConfig(**tiny_bart_fields(len(tokenizer), 96))  # starts from START
    vision = transformers.Florence2VisionConfig(
        depths=(1, 1),
        patch_size=(7, 3),
        patch_stride=(4, 2),
        patch_padding=(3, 1),
        patch_prenorm=(False, True),
        embed_dim=(16, 24),
        num_heads=(2, 3),
        num_groups=(2, 3),
        window_size=3,
        projection_dim=32,
        drop_path_rate=0.0,
    )
    config = transformers.Florence2Config(
        text_config=text.to_dict(),
        vision_config=vision.to_dict(),
        image_token_id=IMAGE_ID,
        architectures=["Florence2ForConditionalGeneration"],
    )
    torch.manual_seed(seed)
    model = transformers.Florence2ForConditionalGeneration(config).float()
    _randomize(model, seed)
    with _quiet_progress():
        model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    transformers.CLIPImageProcessor(
        size={"height": 32, "width": 32},
        do_center_crop=False,
        resample=3,
        image_mean=[0.485, 0.456, 0.406],
        image_std=[0.229, 0.224, 0.225],
    ).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return write_tiny(tmp_path_factory.mktemp("florence2"))


@pytest.fixture(scope="module")
def hf(tiny):
    return transformers.Florence2ForConditionalGeneration.from_pretrained(tiny).float().eval()


@pytest.fixture(scope="module")
def llm(tiny) -> LLM:
    return LLM(model=str(tiny), dtype="float32", block_size=16, enable_prefix_caching=True)


def hf_generate(hf, tiny: Path, image, text_ids: list[int], dec: list[int], n: int = 8) -> Greedy:
    """HF generate's greedy tokens for the processor's inputs, with no extra generation rule."""
    return hf_generate_enc_dec(
        hf,
        n,
        input_ids=torch.tensor([[IMAGE_ID] * ROWS + text_ids]),
        pixel_values=processor_pixels(tiny, image),
        decoder_input_ids=torch.tensor([dec]),
    )


def test_matches_hf_batched(tiny, hf, llm):
    tok = llm.get_tokenizer()

    def wrapped(text: str) -> list[int]:  # the processor's <s>{text}</s>
        return [BOS_ID, *tok.encode(text, add_special_tokens=False), EOS_ID]

    images = [noise_image(1, (32, 32)), noise_image(2, (20, 45)), noise_image(3, (50, 30))]
    ids = [7, 19, 40, 11]
    dec = [START, 21, 8]
    refs = [
        hf_generate(hf, tiny, images[0], wrapped("What does the image describe?"), [START]),
        hf_generate(hf, tiny, images[1], wrapped("Locate red cat in the image."), [START]),
        hf_generate(hf, tiny, images[2], ids, [START]),
        hf_generate(hf, tiny, images[0], wrapped("a photo of"), dec),
    ]
    assert refs[0].tops != refs[3].tops
    prompts = [
        {"prompt": "<CAPTION>", "multi_modal_data": {"image": images[0]}},
        {"prompt": "<OPEN_VOCABULARY_DETECTION>red cat", "multi_modal_data": {"image": images[1]}},
        {"prompt_token_ids": ids, "multi_modal_data": {"image": [images[2]]}},
        {
            "encoder_prompt": {"prompt": "a photo of", "multi_modal_data": {"image": images[0]}},
            "decoder_prompt": {"prompt_token_ids": dec[1:]},  # its start token put in front
        },
    ]
    outs = llm.generate(prompts, greedy(), use_tqdm=False)
    for i, (out, ref) in enumerate(zip(outs, refs, strict=True)):
        assert out.prompt_token_ids == ([START] if i < 3 else dec)
        assert_matches(f"florence2 prompt {i}", out, ref)
    # as vLLM 0.10's RequestOutput: the encoder text as given; the ids the encoder reads, each
    # image row as pad_token_id (vLLM's placeholders), then the text's
    texts = ["<CAPTION>", "<OPEN_VOCABULARY_DETECTION>red cat", None, "a photo of"]
    enc_texts = [wrapped("What does the image describe?"), wrapped("Locate red cat in the image.")]
    enc_texts += [ids, wrapped("a photo of")]
    for out, text, enc in zip(outs, texts, enc_texts, strict=True):
        assert out.encoder_prompt == text
        assert out.encoder_prompt_token_ids == [PAD_ID] * 17 + enc  # 17 rows (test_refused)
    assert llm.get_stats().num_used_blocks == 0
    # the same decoder ids after another image: no decoder block shared with the first's
    again = llm.generate(prompts[:1] + prompts[3:], greedy(), use_tqdm=False)
    assert_matches("florence2 again", again[0], refs[0])
    assert_matches("florence2 again", again[1], refs[3])


@pytest.mark.slow  # (two spawned ranks: most of its ~6 s)
def test_tensor_parallel(tiny, hf, llm):
    """TP=2: BART's heads split over the ranks, the tower and projector whole on each."""
    image = noise_image(6, (40, 30))
    prompt = {"prompt": "<CAPTION>", "multi_modal_data": {"image": image}}
    ref = llm.generate([prompt], greedy(), use_tqdm=False)[0]  # (matched HF above)
    tok = llm.get_tokenizer()
    ids = [BOS_ID, *tok.encode("What does the image describe?", add_special_tokens=False), EOS_ID]
    want = hf_generate(hf, tiny, image, ids, [START])
    assert_matches("florence2 tp=1", ref, want)
    tp = LLM(model=str(tiny), dtype="float32", block_size=16, tensor_parallel_size=2)
    try:
        out = tp.generate([prompt], greedy(), use_tqdm=False)[0]
    finally:
        tp.llm_engine.shutdown()
    assert_matches("florence2 tp=2", out, want)


def test_refused(tiny, llm):
    image = noise_image(4, (32, 32))
    ok = {"prompt": "<OD>", "multi_modal_data": {"image": image}}
    cut = SamplingParams(max_tokens=2, truncate_prompt_tokens=3)
    with pytest.raises(ValueError, match=r"truncate_prompt_tokens=3 would cut Florence-2's"):
        llm.generate([ok], cut, use_tqdm=False)
    cases = [
        *one_image_refusals("Florence-2", image),
        ({"prompt": "<CAPTION> now", "multi_modal_data": {"image": image}}, r"task token"),
        (
            {"prompt_token_ids": "5 6", "multi_modal_data": {"image": image}},
            r"prompt_token_ids must be a list",
        ),
        (
            {"prompt_token_ids": [5, TINY_VOCAB_SIZE], "multi_modal_data": {"image": image}},
            r"encoder_prompt token ids must be ints",
        ),
        (
            {"prompt_token_ids": [5] * 80, "multi_modal_data": {"image": image}},
            r"encoder_prompt is too long: 17 image rows and 80 tokens",
        ),
    ]
    assert_numpy_image_same(llm, "<OD>", noise_image(6, (32, 32)))
    assert_refused_while_serving(llm, cases, ok)


def test_checkpoint_and_options_refused(tiny, tmp_path):
    path = edited_sub_config(tiny, tmp_path / "remote", "vision_config", model_type="davit")
    with pytest.raises(ValueError, match=r"vision_config.model_type='davit'"):
        LLM(model=str(path), dtype="float32")
    assert_image_limit_refused(tiny)
