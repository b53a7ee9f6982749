"""CLIP (`CLIPModel`) and SigLIP (`SiglipModel`) as multimodal embedding models, as vLLM
serves them (CLIPEmbeddingModel / SiglipEmbeddingModel: models/dual_encoder_text.py,
multimodal/dual_encoder.py): `LLM.embed` of a text gives the text tower's projected feature,
of `{"prompt": "", "multi_modal_data": {"image": img}}` the vision tower's, L2-normalized.

Reference: transformers' CLIPModel / SiglipModel get_text_features / get_image_features on
tiny random checkpoints saved with save_pretrained (CLIP's text pooled at its EOS, SigLIP's at
its last token: the EOS the test's tokenizer appends, as theirs do; unpadded, as vLLM runs
them), their image processors (the PIL variants: no torchvision here) on images of several
sizes; a mixed batch of texts and images; the refusals vLLM makes.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from image_checks import noise_image
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import Whitespace
from tokenizers.processors import TemplateProcessing

from paged_engine import LLM, SamplingParams

transformers = pytest.importorskip("transformers")

TEXTS = ["a photo of a cat", "hi", "the quick brown fox jumps over the lazy dog, twice over"]
SIZES = [(40, 40), (23, 57), (64, 31)]  # (height, width): resized and cropped to 32
BOS, EOS = "<|startoftext|>", "<|endoftext|>"


def _tokenizer(bos: bool):
    """A word-level tokenizer of TEXTS' words closing each text with EOS (CLIP's: BOS ...
    EOS; SigLIP's: ... EOS); id 0 ("!", as in CLIP's vocabulary) is an ordinary token."""
    words = sorted({w for t in TEXTS for w in t.replace(",", " ,").split()} - {"!"})
    vocab = {w: i for i, w in enumerate(["!", *words, "<unk>", BOS, EOS])}
    tok = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = Whitespace()
    tok.post_processor = TemplateProcessing(
        single=f"{BOS} $A {EOS}" if bos else f"$A {EOS}",
        special_tokens=[(BOS, vocab[BOS]), (EOS, vocab[EOS])],
    )
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=EOS, unk_token="<unk>"
    )


def _clip(tok):
    config = transformers.CLIPConfig(
        text_config={**_text(tok), "bos_token_id": tok.bos_token_id},
        vision_config=VISION,
        projection_dim=24,  # narrower than the text width: the rows are padded
    )
    processor = transformers.CLIPImageProcessorPil(
        size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32}
    )
    return transformers.CLIPModel(config), processor


def _siglip(tok):
    config = transformers.SiglipConfig(
        text_config={**_text(tok), "projection_size": VISION["hidden_size"]},
        vision_config=VISION,
    )
    processor = transformers.SiglipImageProcessorPil(size={"height": 32, "width": 32})
    return transformers.SiglipModel(config), processor


def _text(tok) -> dict:
    return {
        "vocab_size": len(tok),
        "hidden_size": 32,
        "max_position_embeddings": 64,
        "eos_token_id": tok.eos_token_id,  # CLIP pools the first EOS: the last token here
        "pad_token_id": tok.eos_token_id,
        **LAYERS,
    }


LAYERS = {"num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 64}
VISION = {"hidden_size": 48, "image_size": 32, "patch_size": 8, **LAYERS}
FAMILIES = {"clip": (_clip, True), "siglip": (_siglip, False)}


def save_tiny(name: str, path: Path) -> tuple:
    """(HF model, HF image processor, tokenizer) of the tiny FAMILIES[name], saved in `path`."""
    build, bos = FAMILIES[name]
    tok = _tokenizer(bos)
    torch.manual_seed(0)
    model, processor = build(tok)
    model.eval().save_pretrained(path)
    tok.save_pretrained(path)
    processor.save_pretrained(path)
    return model, processor, tok


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory):
    """(checkpoint dir, HF model, HF image processor, tokenizer) of a tiny CLIP / SigLIP."""
    path = tmp_path_factory.mktemp(request.param)
    return path, *save_tiny(request.param, path)


def _hf_text(model, tok, text: str) -> torch.Tensor:
    ids = torch.tensor([tok(text)["input_ids"]])
    with torch.no_grad():
        f = model.get_text_features(input_ids=ids)
    f = getattr(f, "pooler_output", f)[0]
    return torch.nn.functional.normalize(f, dim=-1)


def _hf_image(model, processor, image) -> torch.Tensor:
    pixels = processor(images=[image], return_tensors="pt")["pixel_values"]
    with torch.no_grad():
        f = model.get_image_features(pixel_values=pixels)
    f = getattr(f, "pooler_output", f)[0]
    return torch.nn.functional.normalize(f, dim=-1)


def _close(got, want) -> None:
    got = torch.tensor(got.outputs.embedding)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


@pytest.fixture(scope="module")
def llm(family):
    return LLM(
        model=str(family[0]),
        device="cpu",
        dtype="float32",
        max_model_len=64,
        num_gpu_blocks_override=32,
    )


def test_text_and_image_embeddings_match_hf(family, llm):
    _, model, processor, tok = family
    images = [noise_image(i, size) for i, size in enumerate(SIZES)]
    prompts = [*TEXTS, *({"prompt": "", "multi_modal_data": {"image": im}} for im in images)]
    mixed = [prompts[3], prompts[0], prompts[4], prompts[1], prompts[5], prompts[2]]
    outs = llm.embed(mixed, use_tqdm=False)  # one batch, texts and images interleaved
    want = [_hf_text(model, tok, t) for t in TEXTS] + [
        _hf_image(model, processor, im) for im in images
    ]
    for o, w in zip(outs, [want[3], want[0], want[4], want[1], want[5], want[2]], strict=True):
        _close(o, w)
    assert outs[0].prompt_token_ids == [0]  # an image prompt: vLLM's one placeholder
    # alone, each the same (no row of another request leaks in)
    _close(llm.embed([TEXTS[2]], use_tqdm=False)[0], want[2])
    _close(llm.embed([prompts[4]], use_tqdm=False)[0], want[4])


def test_refusals(family, llm):
    image = noise_image(9, (32, 32))
    for text in ("a cat", "!"):  # "!": the placeholder's own id, as text
        with pytest.raises(ValueError, match="not both"):
            llm.embed([{"prompt": text, "multi_modal_data": {"image": image}}], use_tqdm=False)
    with pytest.raises(ValueError, match="one image a prompt"):
        llm.embed([{"prompt": "", "multi_modal_data": {"image": [image, image]}}], use_tqdm=False)
    with pytest.raises(ValueError, match="image embeddings are not supported"):
        llm.embed([{"prompt": "", "multi_modal_data": {"image": torch.zeros(1, 24)}}])
    with pytest.raises(ValueError, match="does not generate"):
        llm.generate(["a cat"], SamplingParams(max_tokens=2), use_tqdm=False)
    # the engine still serves after the refusals
    _close(llm.embed([TEXTS[1]], use_tqdm=False)[0], _hf_text(family[1], family[3], TEXTS[1]))


def test_dimensions_is_the_projected_width(family, llm):
    """`dimensions` is checked against the embedding's width (CLIP's projection_dim, SigLIP's
    projection_size), not the text tower's hidden size (both differ from it here)."""
    from paged_engine import PoolingParams

    _, model, _, tok = family
    want = _hf_text(model, tok, TEXTS[0])
    (out,) = llm.embed([TEXTS[0]], PoolingParams(dimensions=want.numel()), use_tqdm=False)
    _close(out, want)
    hidden = model.config.text_config.hidden_size
    with pytest.raises(ValueError, match=f"dimensions={hidden} is not supported"):
        llm.embed([TEXTS[0]], PoolingParams(dimensions=hidden), use_tqdm=False)
