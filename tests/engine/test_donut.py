"""Donut (multimodal/donut.py, donut_swin.py, donut_prompt.py) against HF.

A tiny random VisionEncoderDecoderModel: a two-stage DonutSwin (embed_dim 16, 3 x 3 windows)
over 40 x 24 images, so the first stage's 10 x 6 map is padded to whole windows and its odd
block shifted, and the second stage's 5 x 3 map is one window wide (no shift); its 32-wide rows
go through enc_to_dec_proj into an MBartForCausalLM of d_model 48 (2 layers). Saved with the
tiny tokenizer and a 40 x 24 DonutImageProcessor. `LLM.generate` over a batch of images with
the simple, explicit and token-id prompt forms must give HF `generate`'s greedy tokens and
top-5 logprobs (1e-3, float32) for the same pixels and decoder_input_ids (HF takes Donut's as
given), also with chunked prefill; then bad input refused by name while the engine serves.
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
from tokenizers.processors import TemplateProcessing

transformers = pytest.importorskip("transformers")

from paged_engine import LLM  # noqa: E402
from paged_engine.multimodal.donut_swin import swin_grid  # noqa: E402
from paged_engine.testing import (  # noqa: E402
    BOS_ID,
    EOS_ID,
    PAD_ID,
    TINY_VOCAB_SIZE,
    _quiet_progress,
    _randomize,
    build_tiny_tokenizer,
)

ROWS = 5 * 3  # the 40 x 24 image's last map


def write_tiny(path: Path, seed: int = 5) -> Path:
    tokenizer = build_tiny_tokenizer(TINY_VOCAB_SIZE, 0)
    # <s> text </s> with special tokens, as Donut's XLM-RoBERTa tokenizer: task prompts must
    # be tokenized without them
    bos, eos = tokenizer.bos_token, tokenizer.eos_token
    tokenizer.backend_tokenizer.post_processor = TemplateProcessing(
        single=f"{bos} $A {eos}", special_tokens=[(bos, BOS_ID), (eos, EOS_ID)]
    )
    encoder = transformers.DonutSwinConfig(
        image_size=[40, 24],
        patch_size=4,
        embed_dim=16,
        depths=[2, 2],
        num_heads=[2, 4],
        window_size=3,
        drop_path_rate=0.0,
    )
    decoder = transformers.MBartConfig(
        vocab_size=len(tokenizer),
        d_model=48,
        decoder_layers=2,
        decoder_attention_heads=4,
        decoder_ffn_dim=64,
        encoder_layers=3,  # unused: MBartConfig's num_hidden_layers names it
        max_position_embeddings=64,
        scale_embedding=True,
        is_decoder=True,
        add_cross_attention=True,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
        decoder_start_token_id=BOS_ID,
    )
    config = transformers.VisionEncoderDecoderConfig.from_encoder_decoder_configs(encoder, decoder)
    torch.manual_seed(seed)
    model = transformers.VisionEncoderDecoderModel(config).float()
    _randomize(model, seed)
    with _quiet_progress():
        model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    transformers.DonutImageProcessor(size={"height": 40, "width": 24}).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return write_tiny(tmp_path_factory.mktemp("donut"))


@pytest.fixture(scope="module")
def hf(tiny):
    return transformers.VisionEncoderDecoderModel.from_pretrained(tiny).float().eval()


@pytest.fixture(scope="module")
def llm(tiny) -> LLM:
    return LLM(model=str(tiny), dtype="float32", block_size=16, enable_prefix_caching=True)


def hf_generate(hf, tiny: Path, image, dec: list[int], n: int = 8) -> Greedy:
    pixels = processor_pixels(tiny, image)
    return hf_generate_enc_dec(hf, n, pixel_values=pixels, decoder_input_ids=torch.tensor([dec]))


def test_matches_hf_batched(tiny, hf, llm):
    tok = llm.get_tokenizer()
    task = "what is the total"
    task_ids = tok.encode(task, add_special_tokens=False)
    assert tok.encode(task) == [BOS_ID, *task_ids, EOS_ID]
    images = [noise_image(1, (40, 24)), noise_image(2, (30, 50)), noise_image(3, (64, 20))]
    ids = [BOS_ID, 19, 40, 11]
    refs = [
        hf_generate(hf, tiny, images[0], task_ids),
        hf_generate(hf, tiny, images[1], ids),
        hf_generate(hf, tiny, images[2], task_ids),
        hf_generate(hf, tiny, images[0], [BOS_ID]),
    ]
    assert refs[0].tops != refs[2].tops and refs[0].tops != refs[3].tops
    prompts = [
        {"prompt": task, "multi_modal_data": {"image": images[0]}},
        {"prompt_token_ids": ids, "multi_modal_data": {"image": [images[1]]}},
        {
            "encoder_prompt": {"prompt": "", "multi_modal_data": {"image": images[2]}},
            "decoder_prompt": task,
        },
        {"encoder_prompt": {"prompt": "$$", "multi_modal_data": {"image": images[0]}}},
    ]
    outs = llm.generate(prompts, greedy(), use_tqdm=False)
    for i, (out, ref) in enumerate(zip(outs, refs, strict=True)):
        assert_matches(f"donut prompt {i}", out, ref)
    assert [o.prompt_token_ids for o in outs] == [task_ids, ids, task_ids, [BOS_ID]]
    assert [o.encoder_prompt for o in outs] == [None, None, "", "$$"]
    assert all(o.encoder_prompt_token_ids == [PAD_ID] * ROWS for o in outs)
    assert llm.get_stats().num_used_blocks == 0
    # the same decoder ids after another image: no decoder block shared with the first's
    again = llm.generate([prompts[2], prompts[0]], greedy(), use_tqdm=False)
    assert_matches("donut again", again[0], refs[2])
    assert_matches("donut again", again[1], refs[0])


def test_chunked_prefill(tiny, hf):
    """A decoder prompt longer than the step's token budget, prefilled over several steps;
    the checkpoint named as vLLM 0.10's example names it (hf_overrides' architecture)."""
    image = noise_image(7, (40, 24))
    ids = [BOS_ID, *range(20, 50)]
    ref = hf_generate(hf, tiny, image, ids)
    llm = LLM(
        model=str(tiny),
        dtype="float32",
        block_size=16,
        enable_chunked_prefill=True,
        max_num_batched_tokens=8,
        max_num_seqs=2,
        hf_overrides={"architectures": ["DonutForConditionalGeneration"]},
    )
    try:
        out = llm.generate(
            [{"prompt_token_ids": ids, "multi_modal_data": {"image": image}}] * 2,
            greedy(),
            use_tqdm=False,
        )
    finally:
        llm.llm_engine.shutdown()
    assert_matches("donut chunked", out[0], ref)
    assert_matches("donut chunked", out[1], ref)


def test_refused(llm):
    image = noise_image(4, (40, 24))
    cases = [
        *one_image_refusals("Donut", image),
        (
            {"encoder_prompt": {"prompt": ""}, "decoder_prompt": "hi"},
            r"multi_modal_data: Donut prompts need an image",
        ),
        (
            {"prompt_token_ids": [5, TINY_VOCAB_SIZE], "multi_modal_data": {"image": image}},
            r"prompt token ids must be ints",
        ),
        (
            {
                "encoder_prompt": {"prompt": "", "multi_modal_data": {"image": image}},
                "decoder_prompt": {"prompt": "x", "lora": 1},
            },
            r"decoder_prompt: 'lora' is not supported",
        ),
    ]
    assert_numpy_image_same(llm, "hi", noise_image(6, (40, 24)))
    assert_refused_while_serving(llm, cases, {"prompt": "ok", "multi_modal_data": {"image": image}})


def test_untied_head(tiny, tmp_path):
    """decoder.tie_word_embeddings=False: the checkpoint's decoder.lm_head serves."""
    from safetensors.torch import load_file, save_file

    path = edited_sub_config(tiny, tmp_path / "untied", "decoder", tie_word_embeddings=False)
    weights = load_file(path / "model.safetensors")
    embed = weights["decoder.model.decoder.embed_tokens.weight"]
    head = torch.randn(embed.shape, generator=torch.Generator().manual_seed(9)) * 0.5
    save_file({**weights, "decoder.lm_head.weight": head}, path / "model.safetensors")
    hf = transformers.VisionEncoderDecoderModel.from_pretrained(path).float().eval()
    assert torch.equal(hf.decoder.lm_head.weight, head)
    image = noise_image(8, (40, 24))
    ref = hf_generate(hf, path, image, [BOS_ID, 30])
    llm = LLM(model=str(path), dtype="float32", block_size=16)
    try:
        prompt = {"prompt_token_ids": [BOS_ID, 30], "multi_modal_data": {"image": image}}
        out = llm.generate([prompt], greedy(), use_tqdm=False)[0]
    finally:
        llm.llm_engine.shutdown()
    assert_matches("donut untied", out, ref)


def test_checkpoint_and_options_refused(tiny, tmp_path):
    other = edited_sub_config(tiny, tmp_path / "trocr", "decoder", model_type="trocr")
    with pytest.raises(ValueError, match=r"decoder.model_type='trocr' is not supported"):
        LLM(model=str(other), dtype="float32")
    assert_image_limit_refused(tiny)
    with pytest.raises(ValueError, match=r"decoder.max_position_embeddings=64"):
        LLM(model=str(tiny), dtype="float32", max_model_len=100)
    # a map under the window at a stage: refused on the host (transformers' tower cannot run it)
    encoder = transformers.AutoConfig.from_pretrained(tiny).encoder
    assert swin_grid(40, 24, encoder) == (5, 3)
    with pytest.raises(ValueError, match=r"2x2 map at Swin stage 1, under encoder.window_size=3"):
        swin_grid(16, 16, encoder)
