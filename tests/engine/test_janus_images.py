"""Images through Janus checkpoints (multimodal/janus.py) against HF.

A tiny random `JanusForConditionalGeneration`: its SigLIP-style tower on 16-pixel images in 4-pixel
patches (16 rows an image), a two-layer aligner, a Llama decoder, and the image generation half (a
one-level VQ-VAE, generation embeddings / aligner / head) that paged never loads. `LLM.generate`
with `multi_modal_data` must give JanusProcessor's prompt ids (its default system prompt first,
use_default_system_prompt=True as in transformers' converted checkpoints; <begin_of_image>, 16
<image_placeholder>, <end_of_image>) and HF `generate`'s greedy tokens and top-5 logprobs (1e-3,
float32); text alone as written. Then the engine's paths (chunks through images, prefix-cache hits,
images processed ahead), bad input and image generation refused by name.
"""

from __future__ import annotations

import pytest
import torch
from image_checks import (
    check_paths_and_refusals,
    check_processor_matches_hf,
    check_vision_fields_refused,
    engine,
    greedy,
    hf_cases,
    noise_image,
)

# DeepSeek-VL's prompts and inputs: Janus reads images as it does (SigLIP, padded square)
from test_deepseek_vl_images import IMAGE, PROMPT, ROWS, SIZES, TEXT, TWO
from vlm_checkpoints import encoder_from_checkpoint, finish_checkpoint, load_hf_vlm, saved_tokenizer

from paged_engine.testing import _COMMON, _save_random, tiny_config

DEFAULT_SYSTEM_PROMPT = pytest.importorskip(
    "transformers.models.janus.processing_janus"
).DEFAULT_SYSTEM_PROMPT

transformers = pytest.importorskip("transformers")
pytest.importorskip("transformers.models.janus")

SIDE, PATCH = 16, 4
BOI, EOI = "<begin_of_image>", "<end_of_image>"


def write_tiny_janus(path, seed: int = 0):
    """A tiny random Janus checkpoint with its processor (JanusProcessor)."""
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = saved_tokenizer(
        path, [IMAGE, BOI, EOI], "", seed, image_token=IMAGE, boi_token=BOI, eoi_token=EOI
    )
    text = tiny_config("llama", vocab_size=len(tokenizer)).to_dict()
    hidden = text["hidden_size"]
    vision = {"hidden_size": 32, "mlp_ratio": 1.5, "num_hidden_layers": 2}
    vision |= {"num_attention_heads": 4, "image_size": SIDE, "patch_size": PATCH}
    vision |= {"projection_dim": hidden, "depth": 2, "num_image_tokens": (SIDE // PATCH) ** 2}
    vq = {"base_channels": 32, "channel_multiplier": [1], "num_res_blocks": 1}
    vq |= {"latent_channels": 32, "num_embeddings": 16, "embed_dim": 8}
    vq |= {"projection_dim": hidden, "image_token_embed_dim": hidden}
    config = transformers.JanusConfig(
        text_config=text,
        vision_config=vision,
        vq_config=vq,
        image_token_id=tokenizer.convert_tokens_to_ids(IMAGE),
        **_COMMON,
    )
    _save_random(transformers.JanusForConditionalGeneration, config, seed, path)
    images = transformers.JanusImageProcessor(size={"height": SIDE, "width": SIDE})
    processor = transformers.JanusProcessor(
        image_processor=images,
        tokenizer=tokenizer,
        num_image_tokens=(SIDE // PATCH) ** 2,
        use_default_system_prompt=True,  # as transformers' converted checkpoints save it
    )
    return finish_checkpoint(path, processor)


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return write_tiny_janus(tmp_path_factory.mktemp("janus"), seed=5)


def test_images_match_hf(path):
    """One image, text alone, two images (wide and tall: padded square); then HF's expanded
    ids as prompt_token_ids. The image prompts start with the default system prompt's tokens;
    text alone is tokenized as written."""
    model = load_hf_vlm(transformers.JanusForConditionalGeneration, path)
    processor = transformers.AutoProcessor.from_pretrained(path)
    cases = hf_cases(PROMPT, TEXT, TWO, SIZES)
    keys = ("pixel_values",)
    refs = check_processor_matches_hf(path, model, processor, cases, keys, "janus")
    system = processor.tokenizer.encode(DEFAULT_SYSTEM_PROMPT, add_special_tokens=False)
    starts = [ids[: len(system) - 1] == system[:-1] for ids, _ in refs]  # (the last may merge)
    assert starts == [True, False, True]
    written = {"prompt": DEFAULT_SYSTEM_PROMPT + PROMPT, "multi_modal_data": {"image": cases[0][1]}}
    out = engine(path).generate([written], greedy(n=1), use_tqdm=False)[0]  # kept once
    assert out.prompt_token_ids == refs[0][0]
    boi, eoi = processor.tokenizer.convert_tokens_to_ids([BOI, EOI])
    assert refs[2][0].count(model.config.image_token_id) == 2 * 16
    assert refs[2][0].count(boi) == refs[2][0].count(eoi) == 2


def test_engine_paths_and_refusals(path):
    """image_checks' paths (8-token chunks through the images, prefix-cache hits, images
    processed ahead); bad input and image generation are ValueErrors naming what is wrong,
    and the engine serves on."""
    one = {"prompt": PROMPT, "multi_modal_data": {"image": noise_image(9, (20, 20))}}
    image_out = {**one, "mm_processor_kwargs": {"generation_mode": "image"}}
    big = {**one, "mm_processor_kwargs": {"size": {"height": 64, "width": 64}}}
    refused = [
        ({"prompt": PROMPT, "multi_modal_data": {"image": ROWS}}, "hidden size"),
        (image_out, r"generation_mode'\]: Janus' image generation is not served"),
        (big, "size"),
    ]
    cached = check_paths_and_refusals(path, PROMPT, TWO, lambda _: refused)
    _check_rows_as_embeds(path, cached)


def _check_rows_as_embeds(path, llm) -> None:
    """The encoder's rows of an image given as image embeddings (vLLM's features input) give
    the image's prompt ids (the run between boi and eoi), tokens and top-5 logprobs (1e-4)."""
    images = llm.llm_engine.input_processor.images
    picture = noise_image(5, (30, 50))
    _, (placed,) = images.process(llm.get_tokenizer().encode(PROMPT), [picture])
    encoder = encoder_from_checkpoint(path, images.config)
    with torch.no_grad():
        (rows,) = encoder.encode([placed])
    as_image, as_rows = (
        llm.generate(
            [{"prompt": PROMPT, "multi_modal_data": {"image": x}}], greedy(), use_tqdm=False
        )[0].outputs[0]
        for x in (picture, rows)
    )
    assert as_rows.token_ids == as_image.token_ids
    for a, b in zip(as_rows.logprobs, as_image.logprobs, strict=True):
        assert {t: p.logprob for t, p in a.items()} == pytest.approx(
            {t: p.logprob for t, p in b.items()}, abs=1e-4
        )
    ids = llm.get_tokenizer().encode(PROMPT)
    assert images.process(ids, rows)[0] == images.process(ids, [picture])[0]


def test_encoder_rows_and_config_refusals(path):
    """The encoder's rows equal HF's image features (the aligner's output); vision_config
    fields it does not run are refused by name."""
    from paged_engine.multimodal.archs import build_encoder
    from paged_engine.multimodal.inputs import ImageInput

    model = load_hf_vlm(transformers.JanusForConditionalGeneration, path)
    pixels = transformers.AutoProcessor.from_pretrained(path).image_processor(
        images=[noise_image(3, (30, 50)), noise_image(4, (50, 30))], return_tensors="pt"
    )["pixel_values"]
    encoder = encoder_from_checkpoint(path, model.config)
    with torch.no_grad():
        want = model.model.get_image_features(pixels).pooler_output
        got = torch.stack(encoder.encode([ImageInput(p, 0, 16, "") for p in pixels]))
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    cases = [
        ("model_type", "siglip_vision_model", "model_type"),
        ("image_size", 18, "image_size=18"),
        ("use_qk_norm", True, "use_qk_norm"),
        ("attention_bias", False, "attention_bias"),
        ("projection_dim", 48, "projection_dim"),
    ]
    check_vision_fields_refused(path, cases, build_encoder)


def _merging_tokenizer(path, adds_bos: bool):
    """A byte-level tokenizer whose one merge is "\\n\\n" (the default system prompt's end),
    with Janus' image tokens, saved at `path`: the system prompt tokenized with the text (as
    HF's processor does) differs from its ids put before the text's. `adds_bos`: encoding puts
    the bos first (as Janus' Llama tokenizer does)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {c: i for i, c in enumerate(alphabet)} | {"ĊĊ": len(alphabet)}
    tok = Tokenizer(models.BPE(vocab, [("Ċ", "Ċ")]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    if adds_bos:
        bos = len(vocab)  # (the id "<bos>" gets below)
        tok.post_processor = processors.TemplateProcessing(
            single="<bos> $A", special_tokens=[("<bos>", bos)]
        )
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>")
    fast.add_special_tokens({"additional_special_tokens": [IMAGE, BOI, EOI]})
    fast.save_pretrained(path)
    names = {"image_token": IMAGE, "boi_token": BOI, "eoi_token": EOI}
    return transformers.AutoTokenizer.from_pretrained(path, extra_special_tokens=names)


@pytest.mark.parametrize("adds_bos", [False, True])
def test_system_prompt_tokenized_with_the_text(path, tmp_path, adds_bos):
    """With a tokenizer that merges across the system prompt's end, the layout's prompt is
    JanusProcessor's ids (the system prompt and the text encoded as one; a bos written in the
    text after the system prompt, as HF's string concatenation puts it)."""
    from paged_engine.multimodal.janus import JanusLayout

    tok = _merging_tokenizer(tmp_path, adds_bos)
    assert (tok.encode("a")[0] == tok.bos_token_id) == adds_bos
    layout = JanusLayout(
        transformers.AutoConfig.from_pretrained(path), tok.convert_tokens_to_ids(IMAGE), tok
    )
    layout.read_saved(path)  # (the checkpoint's processor_config.json: the default prompt on)
    processor = transformers.JanusProcessor(
        image_processor=transformers.AutoImageProcessor.from_pretrained(path),
        tokenizer=tok,
        num_image_tokens=(SIDE // PATCH) ** 2,
        use_default_system_prompt=True,
    )
    for text in (PROMPT, tok.bos_token + PROMPT):
        want = processor(text=[text], images=[noise_image(1, (20, 20))])["input_ids"][0]
        got, starts = layout.splice(tok.encode(text), [layout.segment(None)])  # type: ignore[arg-type]
        assert got == list(want)
        assert got[starts[0] + 1] == layout.placeholder
