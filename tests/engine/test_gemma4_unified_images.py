"""Images through Gemma 4 Unified checkpoints (multimodal/gemma4_unified.py) against HF.

A tiny random `Gemma4UnifiedForConditionalGeneration`: the tiny Gemma 4 Unified text model
(sliding window 8, shorter than an image's run; KV-shared layers, k_eq_v full layers) with
use_bidirectional_attention="vision", and the encoder-free embedder over 6-pixel model patches
(2-pixel patches merged 3 x 3) with a position table of 24 a side; LayerNorm weights and biases,
the dense bias and the position table random; images kept within 70 soft tokens. `LLM.generate`
with `multi_modal_data` must give Gemma4UnifiedProcessor's prompt ids and HF `generate`'s
greedy tokens and top-5 logprobs (1e-3, float32). Then the engine's paths against its plain
run, TP=2, the server's chat path with a data: URL, and bad input.

transformers' Gemma4UnifiedImageProcessor is torchvision only (no PIL class): HF's processor
runs on the engine's image processor (transformers' class where torchvision imports, else our
torch copy, multimodal/torch_processors.py), which is checked against transformers' own
`patches_merge` on the same resized image.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from image_checks import (
    WIDE_TALL_SMALL,
    check_chat_data_url,
    check_engine_paths,
    check_matches_hf,
    check_tensor_parallel,
    engine,
    greedy,
    hf_cases,
    hf_refs,
    noise_image,
    path_prompts,
)
from vlm_checkpoints import load_hf_vlm

from paged_engine.testing import (
    _COMMON,
    TINY_VOCAB_SIZE,
    _quiet_progress,
    _randomize,
    build_tiny_tokenizer,
    tiny_config,
)

transformers = pytest.importorskip("transformers")
pytest.importorskip("transformers.models.gemma4_unified")
pytest.importorskip("PIL.Image")
if not hasattr(transformers, "Gemma4UnifiedForConditionalGeneration"):
    pytest.skip("transformers lacks Gemma 4 Unified", allow_module_level=True)

from test_gemma4_images import CHAT_TEMPLATE, NEAR, PROMPT, TEXT, TOKENS, TWO  # noqa: E402

SOFT_TOKENS = 70  # the image processor's max_soft_tokens (its smallest allowed)
# the sliding window holds an image's run (a longer one is refused) but not the prompts of two
WINDOW = 72
PROCESSOR = {
    "image_processor_type": "Gemma4UnifiedImageProcessor",
    "patch_size": 2,
    "pooling_kernel_size": 3,
    "max_soft_tokens": SOFT_TOKENS,
    "do_resize": True,
    "resample": 3,
    "do_rescale": True,
    "rescale_factor": 1 / 255,
    "do_normalize": False,
    "image_mean": [0.0, 0.0, 0.0],
    "image_std": [1.0, 1.0, 1.0],
    "do_convert_rgb": True,
}


def write_tiny_gemma4_unified_vlm(path: Path, seed: int = 0) -> Path:
    """The checkpoint of the module doc, with its image processor settings and tokenizer."""
    path.mkdir(parents=True, exist_ok=True)
    base = build_tiny_tokenizer(TINY_VOCAB_SIZE, seed)
    specials = [*TOKENS.values(), "<|video|>", "<|turn>", "<turn|>"]
    base.add_special_tokens({"additional_special_tokens": specials})
    base.save_pretrained(path)
    tok = transformers.AutoTokenizer.from_pretrained(path, extra_special_tokens=TOKENS)
    ids = {k: tok.convert_tokens_to_ids(v) for k, v in TOKENS.items()}
    text = tiny_config(
        "gemma4_unified",
        vocab_size=len(tok),
        use_bidirectional_attention="vision",
        sliding_window=WINDOW,
    ).to_dict()
    vision = {
        "patch_size": 2,
        "pooling_kernel_size": 3,
        "mm_embed_dim": 48,
        "output_proj_dims": 48,
        "mm_posemb_size": 24,
        "rms_norm_eps": 1e-6,
    }
    config = transformers.Gemma4UnifiedConfig(
        text_config=text,
        vision_config=vision,
        audio_config=None,
        image_token_id=ids["image_token"],
        boi_token_id=ids["boi_token"],
        eoi_token_id=ids["eoi_token"],
        audio_token_id=ids["audio_token"],
        boa_token_id=ids["boa_token"],
        eoa_token_index=ids["eoa_token"],
        video_token_id=tok.convert_tokens_to_ids("<|video|>"),
        **_COMMON,
    )
    torch.manual_seed(seed)
    model = transformers.Gemma4UnifiedForConditionalGeneration(config).to(torch.float32)
    _randomize(model, seed)
    with _quiet_progress():
        model.save_pretrained(path)
    (path / "preprocessor_config.json").write_text(json.dumps(PROCESSOR))
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(path)
    transformers.GenerationConfig(**_COMMON).save_pretrained(path)
    return path


class _Processor(transformers.Gemma4UnifiedProcessor):
    """Gemma4UnifiedProcessor without a video processor (torchvision) and, where torchvision
    is missing, on the engine's torch copy of its image processor."""

    def check_argument_for_proper_class(self, name, arg):
        if name in ("video_processor", "image_processor"):
            return None
        return super().check_argument_for_proper_class(name, arg)


def hf_processor(path):
    from paged_engine.multimodal.torch_processors import image_processor

    images = image_processor(path, transformers.AutoConfig.from_pretrained(path))
    if not hasattr(images, "fetch_images"):  # the torch copy: PIL images are taken as they are
        images.fetch_images = lambda found: found
    return _Processor(
        feature_extractor=transformers.Gemma4UnifiedAudioFeatureExtractor(),
        image_processor=images,
        tokenizer=transformers.AutoTokenizer.from_pretrained(path),
        video_processor=None,
        image_seq_length=SOFT_TOKENS,
    )


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return write_tiny_gemma4_unified_vlm(tmp_path_factory.mktemp("gemma4u"), seed=3)


def _hf_inputs(path, text: str, images: list) -> tuple[list[int], dict]:
    processor = hf_processor(path)
    if not images:
        return processor.tokenizer.encode(text, add_special_tokens=False), {}
    out = processor(text=[text], images=[images], return_tensors="pt")
    keys = ("pixel_values", "image_position_ids", "mm_token_type_ids")
    return out["input_ids"][0].tolist(), {k: out[k] for k in keys}


def test_images_match_hf(path):
    """A wide image, text alone, a tall and a small one (each its own grid and run), and an
    image just before the last token; the prompts given as text and as HF's expanded ids."""
    model = load_hf_vlm(transformers.Gemma4UnifiedForConditionalGeneration, path)
    cases = hf_cases(PROMPT, TEXT, TWO, WIDE_TALL_SMALL)
    cases.append((NEAR, [noise_image(4, (50, 50))]))
    refs = hf_refs(model, cases, lambda *case: _hf_inputs(path, *case))
    check_matches_hf(path, cases, refs, "gemma4_unified")


def _hf_patch_functions() -> SimpleNamespace:
    """transformers' `convert_image_to_patches` and `patches_merge` (plain torch, in a module
    that imports torchvision), taken from its source."""
    import ast

    from transformers.models import gemma4_unified

    where = Path(gemma4_unified.__file__).parent
    source = (where / "image_processing_gemma4_unified.py").read_text()
    wanted = {"convert_image_to_patches", "patches_merge"}
    tree = ast.parse(source)
    tree.body = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name in wanted]
    namespace: dict = {"torch": torch, "math": math}
    exec(compile(tree, "image_processing_gemma4_unified.py", "exec"), namespace)
    return SimpleNamespace(**{k: namespace[k] for k in wanted})


def test_torch_processor_matches_patches_merge(path):
    """The torch copy's rows are transformers' `patches_merge` of the teacher patches of the
    same resized image (and its positions); where torchvision imports, transformers' class
    gives the same output bit for bit."""
    hf = _hf_patch_functions()
    from paged_engine.multimodal import torch_processors
    from paged_engine.multimodal.gemma4 import gemma4_size

    config = transformers.AutoConfig.from_pretrained(path)
    ours = torch_processors.torch_processor(path, config)
    assert type(ours).__name__ == "Gemma4UnifiedTorchProcessor"
    for i, size in enumerate([(40, 90), (100, 30), (7, 5), (1, 200)]):
        image = noise_image(40 + i, size)
        got = ours(images=[image])
        x = torch_processors.resize(
            torch_processors.to_uint8(image), gemma4_size(*size, 2, SOFT_TOKENS * 9, 3), 3
        )
        x = torch_processors.normalize(x, ours.settings)
        h, w = x.shape[1] // 2, x.shape[2] // 2
        teacher = hf.convert_image_to_patches(x, 2)
        cols, rows = torch.meshgrid(torch.arange(w), torch.arange(h), indexing="xy")
        where = torch.stack([cols, rows], -1).reshape(-1, 2)
        n = h * w // 9
        merged, pos = hf.patches_merge(teacher[None], where[None], n)
        assert int(got["num_soft_tokens_per_image"][0]) == n
        assert torch.equal(got["pixel_values"][0][:n], merged[0])
        assert torch.equal(got["image_position_ids"][0][:n], pos[0])
        assert bool((got["image_position_ids"][0][n:] == -1).all())
        if torch_processors.torchvision_available():
            want = transformers.AutoImageProcessor.from_pretrained(path)(
                images=[image], return_tensors="pt"
            )
            for key in got:
                assert torch.equal(got[key], want[key]), (size, key)


def test_engine_paths_and_bad_input(path):
    """Chunks that must move to an image's edges, prefix-cache hits, images processed ahead
    (image_checks); too many images, features instead of an image, audio, video and an image
    longer than the position table are ValueErrors naming what is wrong, and so are an image
    longer than a step's budget or than the sliding window; the engine keeps serving."""
    prompts = path_prompts(PROMPT, TWO, narrow=0)
    cached = check_engine_paths(path, prompts, TWO, chunk=SOFT_TOKENS + 4)
    pics = prompts[-1]["multi_modal_data"]["image"]
    for bad, match in [
        ({"prompt": PROMPT, "multi_modal_data": {"image": pics}}, "2 image"),
        ({"prompt": PROMPT, "multi_modal_data": {"image": torch.zeros(16, 64)}}, "embeddings"),
        ({"prompt": PROMPT, "multi_modal_data": {"audio": [0.0] * 160}}, "'audio'"),
        ({"prompt": PROMPT, "multi_modal_data": {"video": [pics[0]] * 2}}, "video"),
        ({"prompt": PROMPT, "multi_modal_data": {"image": noise_image(9, (4, 300))}}, "table"),
    ]:
        with pytest.raises(ValueError, match=match):
            cached.generate([bad], greedy(0), use_tqdm=False)
    out = cached.generate([prompts[0]], greedy(0), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 8
    small = engine(path, max_num_batched_tokens=40, enable_chunked_prefill=True)
    with pytest.raises(ValueError, match=r"multi_modal_data.*max_num_batched_tokens=40"):
        small.generate([prompts[2]], greedy(0), use_tqdm=False)
    assert len(small.generate([TEXT], greedy(0), use_tqdm=False)[0].outputs[0].token_ids) == 8
    # 121 soft tokens (max_soft_tokens 140) run past the sliding window (72): refused by name
    wide = engine(path, mm_processor_kwargs={"max_soft_tokens": 140})
    big = {"prompt": PROMPT, "multi_modal_data": {"image": noise_image(10, (60, 60))}}
    with pytest.raises(ValueError, match=r"121 soft tokens.*sliding_window=72"):
        wide.generate([big], greedy(0), use_tqdm=False)


def test_tensor_parallel_matches_one_process(path):
    prompts = [{"prompt": TWO, "multi_modal_data": {"image": [noise_image(11, (30, 50))] * 2}}]
    check_tensor_parallel(path, prompts, 80)


def test_chat_data_url_gives_the_offline_tokens(path):
    """The server's chat path: an image_url part with a data: URL gives the offline tokens and
    prompt (the chat template's <|image|> expanded by the image's grid)."""
    question = [{"type": "text", "text": "What is in it?"}, {"type": "image"}]
    assert check_chat_data_url(engine(path), question, noise_image(12, (40, 72))).text == PROMPT


def test_config_refusals(path):
    """An embedder width the projection does not read is refused by the field's name."""
    from paged_engine.multimodal.gemma4_unified import Gemma4UnifiedImageEncoder

    config = transformers.AutoConfig.from_pretrained(path)
    config.vision_config.output_proj_dims = 40
    with pytest.raises(ValueError, match="output_proj_dims"):
        Gemma4UnifiedImageEncoder(config)
