"""Emu3 (multimodal/emu3.py, emu3_vqvae.py; its decoder Llama's) against HF.

A tiny random `Emu3ForConditionalGeneration` (saved as the Hub's: `text_model.model.`,
`text_model.lm_head.`, `vqmodel.`): a Llama decoder, a VQ-VAE of four levels (factor 8 pixels a
code, 32 channels, 2-head attention at level 3 and in the middle, 32 codes) with its temporal stack
(4 equal frames -> 1: two causal 3-D downsamples, a BatchNorm3d ResnetBlock whose running
statistics are random), and a vocabulary_map whose "<|visual tokenNNNNNN|>" tokens are the codes'
ids. `LLM.generate` with `multi_modal_data` must give Emu3Processor's prompt ids (its bos first,
added where the prompt has none; <|image start|>, "h*w", <|image token|>, h * (w + 1) <image>,
<|extra_201|>, <|image end|> per image) and HF `generate`'s greedy tokens and top-5 logprobs (1e-3,
float32); the encoder's rows equal HF's get_image_features bit for bit (the end-of-line token's row
after each row of codes). Text alone through the wrapper and through `Emu3ForCausalLM`. Then the
engine's paths (chunks through images, prefix-cache hits, images processed ahead), bad input and
vocabulary_maps short of a code or of <|extra_200|>.
"""

from __future__ import annotations

import pytest
import torch
from hf_reference import assert_matches, hf_greedy, random_token_prompts
from image_checks import (
    check_matches_hf,
    check_paths_and_refusals,
    engine,
    greedy,
    hf_cases,
    hf_refs,
)
from safetensors.torch import load_file
from vlm_checkpoints import finish_checkpoint, saved_tokenizer

from paged_engine.testing import (
    _COMMON,
    BOS_ID,
    SPECIAL_TOKENS,
    _quiet_progress,
    _randomize,
    _save_random,
    build_tiny_tokenizer,
)

transformers = pytest.importorskip("transformers")
pytest.importorskip("transformers.models.emu3")

CODES, FACTOR = 32, 8  # codebook size, pixels a code
IMAGE, BOI, EOI = "<image>", "<|image start|>", "<|image end|>"
WRAP, EOF, EOL = "<|image token|>", "<|extra_201|>", "<|extra_200|>"
BOS = SPECIAL_TOKENS[BOS_ID]  # the tiny tokenizer's bos token (Emu3Processor prepends it)
PROMPT = f"{IMAGE}Describe it."  # (paged adds the bos, as HF's processor does)
TWO = f"{BOS}Compare {IMAGE} and {IMAGE}: which is brighter?"  # (the bos written: kept once)
TEXT = f"{BOS}Say something about the sea."  # (text alone: taken as written)
# HF pads a batch's images to the largest and encodes the padding: two images of one size
SIZES = ((40, 56), (24, 72), (26, 70))  # -> 40 x 56, 24 x 72, 24 x 72 pixels


def _code_name(code: int) -> str:
    return f"<|visual token{code:06d}|>"


def _text_config(vocab: int) -> dict:
    return {
        "vocab_size": vocab,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 512,
        **_COMMON,
    }


def write_tiny_emu3(path, seed: int = 0):
    """A tiny random Emu3 checkpoint with its processor (Emu3Processor); the VQ-VAE's convs
    redrawn at fan-in scale (`_randomize` scales by the kernel's last side, and activations
    then grow ~10^5-fold, drowning the attention blocks), the temporal BatchNorms' running
    statistics random too (`_randomize` leaves buffers alone)."""
    path.mkdir(parents=True, exist_ok=True)
    special = [IMAGE, BOI, EOI, WRAP, EOF, EOL, *(_code_name(c) for c in range(CODES))]
    names = {"image_token": IMAGE, "boi_token": BOI, "eoi_token": EOI}
    names |= {"image_wrapper_token": WRAP, "eof_token": EOF}
    tokenizer = saved_tokenizer(path, special, "", seed, **names)
    vq = {"codebook_size": CODES, "embed_dim": 8, "latent_channels": 8, "base_channels": 32}
    vq |= {"channel_multiplier": [1, 1, 1, 1], "num_res_blocks": 1, "attn_resolutions": [3]}
    vq |= {"hidden_size": 32, "num_attention_heads": 2}
    config = transformers.Emu3Config(
        vq_config=vq,
        text_config=_text_config(len(tokenizer)),
        vocabulary_map=tokenizer.get_vocab(),
    )
    torch.manual_seed(seed)
    model = transformers.Emu3ForConditionalGeneration(config).to(torch.float32)
    _randomize(model, seed)
    gen = torch.Generator().manual_seed(seed)
    for m in model.model.vqmodel.modules():  # convs at fan-in scale: activations stay O(1),
        if isinstance(m, (torch.nn.Conv2d, torch.nn.Conv3d)):  # so attention counts
            fan_in = m.weight[0].numel()
            m.weight.data.copy_(torch.randn(m.weight.shape, generator=gen) * fan_in**-0.5)
    _spread_codebook(model.model.vqmodel, gen)
    for name, b in model.named_buffers():
        if name.endswith("running_mean"):
            b.copy_(torch.randn(b.shape, generator=gen) * 0.2)
        elif name.endswith("running_var"):
            b.copy_(0.5 + torch.rand(b.shape, generator=gen))
    with _quiet_progress():
        model.save_pretrained(path)
    images = transformers.Emu3ImageProcessor(
        min_pixels=16 * 16, max_pixels=48 * 48, spatial_factor=FACTOR
    )
    processor = transformers.Emu3Processor(image_processor=images, tokenizer=tokenizer)
    return finish_checkpoint(path, processor)


def _spread_codebook(vq, gen: torch.Generator) -> None:
    """The codebook redrawn among the latents of a 64 x 64 noise image (each a latent plus a
    little noise), so images use many codes and a small change to the encoder moves some."""
    pixels = torch.randn(1, 1, 3, 64, 64, generator=gen).expand(-1, 4, -1, -1, -1)
    with torch.no_grad():
        z = vq.quant_conv(vq.encoder(pixels).permute(0, 2, 1, 3, 4))  # [1, E, 1, 8, 8]
        latents = z.flatten(2).transpose(1, 2).reshape(-1, z.shape[1])  # [64, E]
        book = vq.quantize.embedding.weight
        picks = torch.randperm(len(latents), generator=gen)[: len(book)]
        noise = torch.randn(book.shape, generator=gen) * latents.std() * 0.1
        book.copy_(latents[picks] + noise)


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return write_tiny_emu3(tmp_path_factory.mktemp("emu3"), seed=3)


def _hf(path):
    model = transformers.Emu3ForConditionalGeneration.from_pretrained(path, dtype=torch.float32)
    model.eval().generation_config.eos_token_id = None
    return model


def _refs(path, cases: list) -> list:
    """hf_refs of `cases` through HF's model and processor (the processor writes the bos)."""
    processor = transformers.AutoProcessor.from_pretrained(path)

    def inputs(text: str, images: list) -> tuple[list[int], dict]:
        out = processor(text=[text.removeprefix(BOS)], images=images or None, return_tensors="pt")
        extra = {k: out[k] for k in ("pixel_values", "image_sizes")} if images else {}
        return out["input_ids"][0].tolist(), extra

    return hf_refs(_hf(path), cases, inputs)


def test_images_match_hf(path):
    """One image, text alone, two images (of one size); then HF's expanded ids as
    prompt_token_ids. The encoder's rows are HF's image features exactly, its codes not all
    one, the end-of-line row closing each row of codes."""
    from paged_engine.multimodal.archs import build_encoder
    from paged_engine.multimodal.inputs import ImageInput

    cases = hf_cases(PROMPT, TEXT, TWO, SIZES)
    refs = _refs(path, cases)
    config = transformers.AutoConfig.from_pretrained(path)
    assert refs[0][0].count(config.image_token_id) == 5 * (7 + 1)
    assert refs[2][0].count(config.image_token_id) == 2 * 3 * (9 + 1)
    assert [ids[:2].count(BOS_ID) for ids, _ in refs] == [1, 1, 1]  # one bos, first
    assert [ids[0] for ids, _ in refs] == [BOS_ID] * 3
    check_matches_hf(path, cases, refs, "emu3")
    encoder = build_encoder(config)
    encoder.load_weights(load_file(path / "model.safetensors").items())
    out = transformers.AutoImageProcessor.from_pretrained(path)(
        images=cases[0][1], return_tensors="pt"
    )
    pixels, sizes = out["pixel_values"], out["image_sizes"]
    with torch.no_grad():
        codes = encoder.vqmodel(pixels)
        rows = encoder.encode([ImageInput(pixels[0], 0, 40, "", (40, 56))])[0]
        hf = _hf(path)
        want = hf.model.get_image_features(pixels, sizes).pooler_output[0]
        eol = hf.model.get_input_embeddings().weight[config.vocabulary_map[EOL]]
    assert len(set(codes.flatten().tolist())) > 8
    torch.testing.assert_close(rows, want, atol=0, rtol=0)
    torch.testing.assert_close(rows.view(5, 8, -1)[:, -1], eol.expand(5, -1), atol=0, rtol=0)


def test_engine_paths_match_the_plain_run(path):
    """image_checks' paths (8-token chunks through the images, prefix-cache hits, images
    processed ahead); bad input is a ValueError naming what is wrong, and the engine serves
    on."""

    def more(prompts: list[dict]) -> list:
        rows = {"prompt": PROMPT, "multi_modal_data": {"image": torch.zeros(20, 64)}}
        raw = {**prompts[0], "mm_processor_kwargs": {"do_resize": False}}  # 30 x 80 pixels
        return [
            (rows, "embeddings are not supported"),
            (raw, r"\(30, 80\) is not whole 8 x 8-pixel codes"),
        ]

    check_paths_and_refusals(path, PROMPT, TWO, more)


def test_text_model_matches_hf(tmp_path):
    """Emu3ForCausalLM (model_type emu3_text_model: Llama) served alone."""
    config = transformers.Emu3TextConfig(**_text_config(512))
    config.architectures = ["Emu3ForCausalLM"]
    _save_random(transformers.Emu3ForCausalLM, config, 1, tmp_path)
    finish_checkpoint(tmp_path, build_tiny_tokenizer())
    hf = transformers.Emu3ForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None  # (no Auto class maps emu3_text_model)
    prompts = random_token_prompts("emu3", 3)
    refs = [hf_greedy(hf, p, 8, 5) for p in prompts]
    llm = engine(tmp_path)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy(), use_tqdm=False)
    for out, ref in zip(outs, refs, strict=True):
        assert_matches("emu3 text", out, ref)


@pytest.mark.parametrize(
    ("dropped", "match"),
    [(_code_name(CODES - 1), "no image token"), (EOL, r"no <\|extra_200\|>")],
)
def test_vocabulary_map_short_is_refused(path, dropped, match):
    from paged_engine.multimodal.archs import build_encoder

    config = transformers.AutoConfig.from_pretrained(path)
    config.vocabulary_map = {k: v for k, v in config.vocabulary_map.items() if k != dropped}
    with pytest.raises(ValueError, match=match):
        build_encoder(config)
