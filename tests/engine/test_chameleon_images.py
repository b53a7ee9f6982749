"""Images through Chameleon checkpoints (multimodal/chameleon.py, models/chameleon.py) against HF.

A tiny random `ChameleonForConditionalGeneration`: a Llama-like decoder with per-head q / k
LayerNorms (weights and biases), a VQ-VAE of 16-pixel images (three levels, 32 / 64 / 64 channels,
an attention block at 8 pixels and in the middle; 32 codes) giving 4 x 4 = 16 codes an image, and a
vocabulary_map whose "IMGIMG*" tokens are the codes' token ids. `LLM.generate` with
`multi_modal_data` must give ChameleonProcessor's prompt ids (<racm3:break>, 16 <image>, <eoss> per
image; its default chat mode's sep token once at the end) and HF `generate`'s greedy tokens and
top-5 logprobs (1e-3, float32), HF's forward masking the image tokens' logits (the model never
emits an image code); text-only prompts too (tokenized as written, as vLLM does). Then the engine's
paths (chunks through images, prefix-cache hits, images processed ahead), bad input, swin_norm's
layers and a vocabulary_map short of codes.
"""

from __future__ import annotations

import pytest
import torch
from image_checks import (
    check_matches_hf,
    check_paths_and_refusals,
    check_tensor_parallel,
    engine,
    hf_cases,
    hf_refs,
    noise_image,
    path_prompts,
)
from safetensors.torch import load_file
from vlm_checkpoints import finish_checkpoint, load_hf_vlm, saved_tokenizer

from paged_engine import SamplingParams
from paged_engine.testing import _COMMON, _quiet_progress, _randomize

transformers = pytest.importorskip("transformers")
pytest.importorskip("transformers.models.chameleon")

SIDE, CODES, TOKENS = 16, 32, 16  # pixels, codebook size, codes an image
IMAGE, BOI, EOI, SEP = "<image>", "<racm3:break>", "<eoss>", "<reserved08706>"
PROMPT = f"{IMAGE}Describe it."
TWO = f"Compare {IMAGE} and {IMAGE}: which is brighter?"
TEXT = "Say something about the sea."


def _code_name(code: int) -> str:
    """The release's image token name of a codebook index: digits as letters A-J, then "Z"."""
    return "IMGIMG" + "".join(chr(ord("A") + int(d)) for d in str(code)) + "Z"


def write_tiny_chameleon(path, seed: int = 0, **overrides):
    """A tiny random Chameleon checkpoint with its processor (ChameleonProcessor)."""
    path.mkdir(parents=True, exist_ok=True)
    special = [IMAGE, BOI, EOI, SEP, *(_code_name(c) for c in range(CODES))]
    tokenizer = saved_tokenizer(
        path, special, "", seed, image_token=IMAGE, boi_token=BOI, eoi_token=EOI
    )
    tokenizer.sep_token = SEP  # the release's sep token (ChameleonProcessor's chat mode)
    vq = {"embed_dim": 8, "num_embeddings": CODES, "latent_channels": 8, "resolution": SIDE}
    vq |= {"base_channels": 32, "channel_multiplier": [1, 2, 2], "num_res_blocks": 1}
    vq |= {"attn_resolutions": [8]}
    config = transformers.ChameleonConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        vq_config=vq,
        vocabulary_map=tokenizer.get_vocab(),
        **_COMMON,
        **overrides,
    )
    torch.manual_seed(seed)
    model = transformers.ChameleonForConditionalGeneration(config).to(torch.float32)
    _randomize(model, seed)
    _redraw_vqvae(model.model.vqmodel, torch.Generator().manual_seed(seed))
    with _quiet_progress():
        model.save_pretrained(path)
    images = transformers.ChameleonImageProcessorPil(
        size={"shortest_edge": SIDE}, crop_size={"height": SIDE, "width": SIDE}
    )
    processor = transformers.ChameleonProcessor(
        image_processor=images, tokenizer=tokenizer, image_seq_length=TOKENS
    )
    return finish_checkpoint(path, processor)


def _redraw_vqvae(vq, gen: torch.Generator) -> None:
    """The VQ-VAE's convs at fan-in scale (`_randomize` scales by the kernel's last side: the
    activations then grow until the attention blocks' outputs vanish beside the residual, and a
    wrong attention path gives the same codes), then the codebook drawn among the latents of a
    noise image (each a latent plus a little noise), so images use many codes and a small change
    to the encoder moves some."""
    for m in vq.modules():
        if isinstance(m, torch.nn.Conv2d):
            m.weight.data.copy_(
                torch.randn(m.weight.shape, generator=gen) * m.weight[0].numel() ** -0.5
            )
    pixels = torch.randn(1, 3, 2 * SIDE, 2 * SIDE, generator=gen)
    with torch.no_grad():
        z = vq.quant_conv(vq.encoder(pixels))  # [1, E, 8, 8]
        latents = z.flatten(2).transpose(1, 2).reshape(-1, z.shape[1])  # [64, E]
        book = vq.quantize.embedding.weight
        picks = torch.randperm(len(latents), generator=gen)[: len(book)]
        book.copy_(latents[picks] + torch.randn(book.shape, generator=gen) * latents.std() * 0.1)


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return write_tiny_chameleon(tmp_path_factory.mktemp("chameleon"), seed=3)


def _refs(path, cases: list) -> list:
    """hf_refs of `cases` through HF's model and processor: its default chat mode (the sep
    token last) with images; text alone in completion mode (no sep: vLLM tokenizes a text-only
    prompt as written)."""
    model = load_hf_vlm(transformers.ChameleonForConditionalGeneration, path)
    processor = transformers.AutoProcessor.from_pretrained(path)

    def inputs(text: str, images: list) -> tuple[list[int], dict]:
        out = processor(
            text=[text],
            images=images or None,
            return_tensors="pt",
            return_for_text_completion=not images,
        )
        extra = {"pixel_values": out["pixel_values"]} if images else {}
        return out["input_ids"][0].tolist(), extra

    return hf_refs(model, cases, inputs)


def test_images_match_hf(path):
    """One image, text alone, two images; then HF's expanded ids as prompt_token_ids. The
    image tokens (masked) never come out, and the images' codes are not all one."""
    from paged_engine.multimodal.archs import build_encoder
    from paged_engine.multimodal.inputs import ImageInput

    cases = hf_cases(PROMPT, TEXT, TWO)
    refs = _refs(path, cases)
    config = transformers.AutoConfig.from_pretrained(path)
    image_ids = {config.vocabulary_map[_code_name(c)] for c in range(CODES)}
    assert refs[2][0].count(config.image_token_id) == 2 * TOKENS
    sep = config.vocabulary_map[SEP]
    assert [ids[-1] == sep for ids, _ in refs] == [True, False, True]
    assert [ids.count(sep) for ids, _ in refs] == [1, 0, 1]
    assert not image_ids & {t for _, ref in refs for t in ref.tokens}
    check_matches_hf(path, cases, refs, "chameleon")
    encoder = build_encoder(config)
    encoder.load_weights(load_file(path / "model.safetensors").items())
    pixels = transformers.AutoImageProcessor.from_pretrained(path)(
        images=cases[0][1], return_tensors="pt"
    )["pixel_values"]
    with torch.no_grad():
        codes = encoder.vqmodel(pixels)
        rows = encoder.encode([ImageInput(pixels[0], 0, TOKENS, "")])[0]
        hf = load_hf_vlm(transformers.ChameleonForConditionalGeneration, path)
        want = hf.model.get_image_features(pixels).pooler_output[0]
    assert len(set(codes[0].tolist())) > 8
    torch.testing.assert_close(rows, want, atol=0, rtol=0)


def test_engine_paths_match_the_plain_run(path):
    """image_checks' paths (8-token chunks through the images, prefix-cache hits, images
    processed ahead); bad input is a ValueError naming what is wrong, and the engine serves
    on."""

    def more(prompts: list[dict]) -> list:
        rows = {"prompt": PROMPT, "multi_modal_data": {"image": torch.zeros(TOKENS, 64)}}
        wide = {"crop_size": {"height": SIDE, "width": 2 * SIDE}}
        done = {"return_for_text_completion": True}  # (HF's completion-mode ids are taken)
        return [
            (rows, "embeddings are not supported"),
            ({**prompts[0], "mm_processor_kwargs": wide}, r"shape \(3, 16, 32\)"),
            ({**prompts[0], "mm_processor_kwargs": done}, r"\['return_for_text_completion'\]"),
        ]

    check_paths_and_refusals(path, PROMPT, TWO, more)


def test_swin_norm_matches_hf(tmp_path):
    """swin_norm (Chameleon-30B's layers: each sublayer normed before its residual add): one
    image and text alone against HF."""
    swin = write_tiny_chameleon(tmp_path / "swin", seed=5, swin_norm=True)
    cases = hf_cases(PROMPT, TEXT, TWO)[:2]
    check_matches_hf(swin, cases, _refs(swin, cases), "chameleon swin_norm")


def test_vocabulary_map_short_of_codes_is_refused(path):
    from paged_engine.multimodal.archs import build_encoder

    config = transformers.AutoConfig.from_pretrained(path)
    config.vocabulary_map = {
        k: v for k, v in config.vocabulary_map.items() if k != _code_name(CODES - 1)
    }
    with pytest.raises(ValueError, match="vocabulary_map has no image token"):
        build_encoder(config)


def test_tensor_parallel_matches_one_process(path):
    """TP=2: each rank's q / k heads take their own rows of the per-head norms' weights and
    biases (2 kv heads: one a rank); the one-process tokens and logprobs, chunks through the
    images."""
    check_tensor_parallel(path, path_prompts(PROMPT, TWO)[2:], 8)


def test_sep_token_once_at_the_end(path):
    """A prompt ending in the sep token already keeps just the one; HF's completion-mode ids
    (segments expanded, no sep) are taken as they are."""
    processor = transformers.AutoProcessor.from_pretrained(path)
    image = noise_image(1, (40, 56))
    chat = processor(text=[PROMPT], images=[image], return_tensors="pt")["input_ids"][0].tolist()
    done = processor(
        text=[PROMPT], images=[image], return_tensors="pt", return_for_text_completion=True
    )["input_ids"][0].tolist()
    prompts = [
        {"prompt": PROMPT + SEP, "multi_modal_data": {"image": image}},
        {"prompt_token_ids": done, "multi_modal_data": {"image": image}},
    ]
    outs = engine(path).generate(prompts, SamplingParams(max_tokens=1), use_tqdm=False)
    assert [o.prompt_token_ids for o in outs] == [chat, done]
