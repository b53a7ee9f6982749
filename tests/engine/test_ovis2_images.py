"""Images through Ovis2 checkpoints (multimodal/ovis2.py, ovis2_layout.py) against HF.

A tiny random `Ovis2ForConditionalGeneration` (a tied Qwen2 decoder; an AIMv2-style tower of
24-pixel tiles, 6 x 6 patches merged 2 x 2 into 9 image tokens a tile, SwiGLU with biases off;
a 40-entry visual vocabulary whose last 5 rows are the indicators; the tokenizer has the
<IMG_*> tokens and no <image> token, as transformers' conversion writes it; the processor tiles
with crop_to_patches up to 6 tiles plus the thumbnail): `LLM.generate` with `multi_modal_data`
must give HF's prompt ids (Ovis2Processor's expansion of the text's "<image>") and HF
`generate`'s greedy tokens and top-5 logprobs (1e-3, float32) for wide, tall and one-tile
images and two images in a prompt. Then the encoder against get_image_features (softmax and
st_argmax), the engine's paths (chunks through images, prefix caching), the server's chat
path and bad input (hostile mm_processor_kwargs, config fields).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from image_checks import (
    WIDE_TALL_SMALL,
    check_chat_data_url,
    check_matches_hf,
    check_paths_and_refusals,
    check_vision_fields_refused,
    engine,
    greedy,
    hf_cases,
    hf_refs,
    noise_image,
)
from vlm_checkpoints import chatml_template, finish_checkpoint, load_hf_vlm, saved_tokenizer

transformers = pytest.importorskip("transformers")
pytest.importorskip("transformers.models.ovis2")

SPECIAL = ["<IMG_ATOM>", "<IMG_START>", "<IMG_GRID>", "<IMG_COL>", "<IMG_ROW>", "<IMG_END>"]
PROMPT = "<|im_start|>user\n<image>\nWhat is in it?<|im_end|>\n<|im_start|>assistant\n"
TWO = "<|im_start|>user\n<image> and <image>\nWhich is brighter?<|im_end|>\n<|im_start|>assistant\n"
TEXT = "<|im_start|>user\nSay something about the sea.<|im_end|>\n<|im_start|>assistant\n"
CHAT_TEMPLATE = chatml_template("<image>\n")
SIDE, PER_TILE = 24, 9
PROCESSOR = {  # the Hub's Ovis2ImageProcessor settings, its tile scaled down
    "image_processor_type": "Ovis2ImageProcessor",  # the PIL backend without torchvision
    "size": {"height": SIDE, "width": SIDE},
    "crop_to_patches": True,
    "max_patches": 6,
    "image_mean": [0.48, 0.45, 0.4],
    "image_std": [0.27, 0.26, 0.28],
}


def write_tiny_ovis2(path: Path, seed: int = 0) -> Path:
    from paged_engine.testing import _COMMON, _save_random, tiny_config

    path.mkdir(parents=True, exist_ok=True)
    tok = saved_tokenizer(path, SPECIAL, CHAT_TEMPLATE, seed)
    ids = tok.convert_tokens_to_ids(SPECIAL)
    text = tiny_config("qwen2", vocab_size=len(tok)).to_dict()
    vision = {
        "hidden_size": 32,
        "intermediate_size": 48,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "image_size": SIDE,
        "patch_size": 4,
        "hidden_stride": 2,
        "vocab_size": 40,  # not the text width: a transposed table shows
        "num_visual_indicator_tokens": 5,
        "qkv_bias": True,
        "rms_norm_eps": 1e-5,
    }
    config = transformers.Ovis2Config(
        text_config=text,
        vision_config=vision,
        image_token_id=ids[0],
        visual_indicator_token_ids=ids[1:],
        hidden_size=text["hidden_size"],
        vocab_size=len(tok),
        **_COMMON,
    )
    config.architectures = ["Ovis2ForConditionalGeneration"]
    _save_random(transformers.Ovis2ForConditionalGeneration, config, seed, path)
    (path / "preprocessor_config.json").write_text(json.dumps(PROCESSOR))
    return finish_checkpoint(path, tok)


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return write_tiny_ovis2(tmp_path_factory.mktemp("ovis2"), seed=3)


def _hf_inputs(path, text: str, images: list, **kwargs) -> tuple[list[int], dict]:
    """HF's prompt ids (Ovis2Processor on the text) and pixels."""
    from transformers.models.ovis2.image_processing_pil_ovis2 import Ovis2ImageProcessorPil
    from transformers.models.ovis2.processing_ovis2 import Ovis2Processor

    tok = transformers.AutoTokenizer.from_pretrained(path)
    if not images:
        return tok.encode(text, add_special_tokens=False), {}
    proc = Ovis2Processor(
        image_processor=Ovis2ImageProcessorPil.from_pretrained(path),
        tokenizer=tok,
        image_seq_length=PER_TILE,
    )
    out = proc(text=[text], images=images, return_tensors="pt", **kwargs)
    return out["input_ids"][0].tolist(), {"pixel_values": out["pixel_values"]}


def test_images_match_hf(path):
    # 40 x 90 and 100 x 30: six tiles and the thumbnail; 20 x 24: one tile
    cases = hf_cases(PROMPT, TEXT, TWO, WIDE_TALL_SMALL)
    model = load_hf_vlm(transformers.Ovis2ForConditionalGeneration, path)
    refs = hf_refs(model, cases, lambda *case: _hf_inputs(path, *case))
    atom = transformers.AutoConfig.from_pretrained(path).image_token_id
    assert [ids.count(atom) // PER_TILE for ids, _ in refs] == [7, 0, 8]  # 6 + 1, 0, 7 + 1
    check_matches_hf(path, cases, refs, "ovis2")


def test_encoder_matches_hf_features(path):
    """The tower, visual tokenizer and table alone: each image's atom rows equal HF's
    get_image_features, its indicator rows HF's visual_indicator_features; with softmax and
    with st_argmax (the same weights)."""
    from safetensors.torch import load_file

    from paged_engine.multimodal.inputs import ImageInput
    from paged_engine.multimodal.ovis2 import INDICATORS, Ovis2ImageEncoder, segment_kinds

    weights = load_file(Path(path) / "model.safetensors")
    pictures = [noise_image(5, (40, 90)), noise_image(6, (20, 24))]
    from transformers.models.ovis2.image_processing_pil_ovis2 import Ovis2ImageProcessorPil

    out = Ovis2ImageProcessorPil.from_pretrained(path)(pictures, return_tensors="pt")
    tiles, grids = out["pixel_values"], [tuple(g) for g in out["grids"].tolist()]
    # (transformers reads its covering grid as (cols, rows): this wide image gets 3 rows)
    assert grids == [(3, 2), (1, 1)] and tiles.shape[0] == 8  # a thumbnail and 6 tiles, 1
    images = [
        ImageInput(part, 0, len(segment_kinds(*g, PER_TILE)), str(g), g)
        for part, g in zip(tiles.split([7, 1]), grids, strict=True)
    ]
    for function in ("softmax", "st_argmax"):
        config = transformers.AutoConfig.from_pretrained(path)
        config.vision_config.tokenize_function = function
        model = transformers.Ovis2ForConditionalGeneration(config).float().eval()
        model.load_state_dict(weights, strict=False)
        ours = Ovis2ImageEncoder(config)
        ours.load_weights(weights.items())
        with torch.no_grad():
            got = ours.encode(images)
            out = model.model.get_image_features(pixel_values=tiles)
        want = out.pooler_output.flatten(0, 1)
        marks = out.visual_indicator_features
        rows = torch.cat([g[torch.tensor(segment_kinds(*m.image_size, PER_TILE)) < 0]
                          for g, m in zip(got, images, strict=True)])  # fmt: skip
        torch.testing.assert_close(rows, want, atol=1e-5, rtol=1e-5)
        kinds = segment_kinds(3, 2, PER_TILE)
        for i in range(len(INDICATORS)):
            at = [j for j, k in enumerate(kinds) if k == i]
            assert at, INDICATORS[i]  # a 3 x 2 grid holds every indicator
            for j in at:
                torch.testing.assert_close(got[0][j], marks[i])
        if function == "st_argmax":  # one-hot rows: each atom row is one visual table row
            table = ours.visual_embeddings_table.weight[: ours.visual].detach()
            gap = (rows[:, None] - table[None]).abs().amax(-1).amin(-1)
            assert float(gap.max()) < 1e-5


def test_engine_paths_match_the_plain_run(path):
    """image_checks' paths (8-token chunks through the images and their indicators,
    prefix-cache hits, images processed ahead); bad input a ValueError naming what is wrong,
    hostile mm_processor_kwargs refused before any pixel."""
    one = noise_image(9, (20, 20))
    rows = {"prompt": PROMPT, "multi_modal_data": {"image": torch.zeros(12, 64)}}
    own = PROMPT.replace("What", "<IMG_START>What")  # an indicator in the user's text
    refused = [
        (rows, "embeddings"),
        ({"prompt": own, "multi_modal_data": {"image": one}}, "of its own"),
    ]
    for kwargs, match in [
        ({"max_patches": 10**9}, "max_patches"),
        ({"max_patches": 1000}, "max_patches"),
        ({"max_patches": 2.5}, "max_patches"),
        ({"size": {"height": 48, "width": 48}}, "size"),
        ({"crop_to_patches": "yes"}, "crop_to_patches"),
        ({"max_partition": 9}, "max_partition"),  # vLLM's remote-code Ovis knob: not HF's
    ]:
        bad = {"prompt": PROMPT, "multi_modal_data": {"image": one}}
        refused.append(({**bad, "mm_processor_kwargs": kwargs}, match))
    cached = check_paths_and_refusals(path, PROMPT, TWO, lambda _: refused)
    # a request's own tiling (max_patches=2) gives HF's ids with the same kwargs
    wide = noise_image(4, (30, 90))
    want, _ = _hf_inputs(path, PROMPT, [wide], max_patches=2)
    prompt = {"prompt": PROMPT, "multi_modal_data": {"image": wide}}
    out = cached.generate(
        [{**prompt, "mm_processor_kwargs": {"max_patches": 2}}, prompt],
        greedy(0, 2),
        use_tqdm=False,
    )
    assert out[0].prompt_token_ids == want != out[1].prompt_token_ids


def test_chat_data_url_gives_the_offline_tokens(path):
    """The server's chat path: an image_url part with a data: URL gives the offline tokens and
    prompt (the chat template's "<image>" text expanded as Ovis2Processor does)."""
    question = [{"type": "image"}, {"type": "text", "text": "What is in it?"}]
    want = check_chat_data_url(engine(path), question, noise_image(12, (60, 30)))
    assert want.text == PROMPT


def test_config_refusals(path):
    """What the path does not run is refused by the config field's name."""
    from paged_engine.multimodal.ovis2 import Ovis2ImageEncoder

    bad = [
        ("tokenize_function", "gumbel_argmax"),
        ("hidden_stride", 4),  # 6 x 6 patches: transformers' padding fails
        ("num_visual_indicator_tokens", 4),
        ("image_size", [24, 32]),
        ("hidden_act", "nope"),
    ]
    cases = [(field, value, field) for field, value in bad]  # each named in its error
    check_vision_fields_refused(path, cases, Ovis2ImageEncoder)
    config = transformers.AutoConfig.from_pretrained(path)
    config.hidden_size = 32
    with pytest.raises(ValueError, match="hidden_size"):
        Ovis2ImageEncoder(config)
