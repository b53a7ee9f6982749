"""dots.ocr as the Hub ships it (`DotsOCRForCausalLM`, remote code: multimodal/dots_ocr.py,
models/dots_ocr_config.py) against a reference composed here from transformers' modules.

transformers has no dots.ocr class. Its parts are: Qwen2-VL's image processor (patch rows and
grid_thw), a NaViT tower whose blocks are Qwen2.5-VL's (RMSNorms, 2-D rope, SwiGLU; here every
block full attention, so its window order is only a permutation the attention does not see,
undone after the merger), Qwen2-VL's LayerNorm PatchMerger, and Qwen2 (transformers'
Qwen2ForCausalLM fed inputs_embeds, 1-D positions). The glue written here from vLLM's
dots_ocr.py: the patchifier (a biased Conv2d over each row's first temporal frame, then an
RMSNorm), the post-trunk RMSNorm before the merger, the tower's norms' eps (rms_norm_eps, where
Qwen2.5-VL hard-codes 1e-6), bias-free linears (use_bias false: the reference's biases zeroed),
and the processor's prompt: each <|imgpad|> repeated once per merged patch between <|img|> and
<|endofimg|>. The same random weights are saved under the release's names (`vision_tower.*`,
`model.*`, `lm_head.*`) with a config.json shaped as the release's; paged must give the
reference's prompt ids, greedy tokens and top-5 logprobs (1e-3, float32) with one and two
images.
"""

from __future__ import annotations

import json

import pytest
import torch
from hf_reference import hf_greedy_with_tower_runs
from image_checks import (
    check_config_refused,
    check_engine_matches_hf,
    engine,
    greedy,
    noise_image,
)
from vlm_checkpoints import (
    finish_checkpoint,
    save_grid_image_processor,
    tiny_qwen2_text,
    tokenizer_with,
)

from paged_engine.testing import _randomize

transformers = pytest.importorskip("transformers")
safetensors = pytest.importorskip("safetensors.torch")
qwen25 = pytest.importorskip("transformers.models.qwen2_5_vl.modeling_qwen2_5_vl")
qwen2_vl = pytest.importorskip("transformers.models.qwen2_vl.modeling_qwen2_vl")
qwen2 = pytest.importorskip("transformers.models.qwen2.modeling_qwen2")

IMAGE = "<|img|><|imgpad|><|endofimg|>"
MARKS = ["<|img|>", "<|imgpad|>", "<|endofimg|>", "<|video_pad|>", "<|user|>", "<|endofuser|>"]
MARKS += ["<|assistant|>", "<|endofassistant|>", "<|system|>", "<|endofsystem|>"]
# the release's turn format, its content a string (vLLM's placeholder text put in for images)
CHAT_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'system' %}"
    "<|system|>{{ m['content'] }}<|endofsystem|>\n"
    "{% elif m['role'] == 'user' %}<|user|>{{ m['content'] }}<|endofuser|>"
    "{% else %}<|assistant|>{{ m['content'] }}<|endofassistant|>{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
ONE = f"<|user|>{IMAGE}Read the text.<|endofuser|><|assistant|>"
TWO = f"<|user|>{IMAGE}{IMAGE}Which page is first?<|endofuser|><|assistant|>"
TEXT = "<|user|>Say something about the sea.<|endofuser|><|assistant|>"
PATCH, MERGE, EPS = 4, 2, 0.1  # eps large enough to matter (the release: 1e-5)
VISION = {"embed_dim": 32, "hidden_size": 64, "intermediate_size": 48, "num_hidden_layers": 2}
VISION |= {"num_attention_heads": 4, "num_channels": 3, "patch_size": PATCH}
VISION |= {"spatial_merge_size": MERGE, "temporal_patch_size": 1, "rms_norm_eps": EPS}
VISION |= {"use_bias": False, "post_norm": True, "is_causal": False}
VISION |= {"attn_implementation": "flash_attention_2", "initializer_range": 0.02}


class _Patchifier(torch.nn.Module):
    """The release's patch embedding: Conv2d (biased) on each row's first frame, RMSNorm."""

    def __init__(self) -> None:
        super().__init__()
        dim = VISION["embed_dim"]
        self.proj = torch.nn.Conv2d(3, dim, PATCH, stride=PATCH)
        self.norm = qwen2.Qwen2RMSNorm(dim, eps=EPS)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = VISION["temporal_patch_size"]
        x = x.view(-1, 3, t, PATCH, PATCH)[:, :, 0]
        return self.norm(self.proj(x).view(x.shape[0], -1))


def _tower() -> torch.nn.Module:
    """Qwen2.5-VL's tower, all blocks full attention, its patch embedding and merger swapped
    for the release's (the post-trunk norm runs row-wise before the merger)."""
    config = transformers.Qwen2_5_VLVisionConfig(
        depth=VISION["num_hidden_layers"],
        hidden_size=VISION["embed_dim"],
        num_heads=VISION["num_attention_heads"],
        intermediate_size=VISION["intermediate_size"],
        out_hidden_size=VISION["hidden_size"],
        patch_size=PATCH,
        spatial_merge_size=MERGE,
        temporal_patch_size=VISION["temporal_patch_size"],
        window_size=PATCH * MERGE,  # one merged token a window: a real permutation
        fullatt_block_indexes=list(range(VISION["num_hidden_layers"])),
        hidden_act="silu",
    )
    tower = qwen25.Qwen2_5_VisionTransformerPretrainedModel(config)
    tower.patch_embed = _Patchifier()
    merger = qwen2_vl.PatchMerger(VISION["hidden_size"], VISION["embed_dim"], MERGE)
    post = qwen2.Qwen2RMSNorm(VISION["embed_dim"], eps=EPS)
    tower.merger = torch.nn.Sequential(post, merger)
    for block in tower.blocks:
        block.norm1.variance_epsilon = block.norm2.variance_epsilon = EPS
    return tower


def _release_names(tower: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The tower's weights under the release's names (no biases: use_bias false)."""
    renames = [("patch_embed.", "patch_embed.patchifier."), ("merger.0.", "post_trunk_norm.")]
    renames += [("merger.1.", "merger."), (".gate_proj.", ".fc1."), (".up_proj.", ".fc3.")]
    renames += [(".down_proj.", ".fc2.")]
    out = {}
    for name, value in tower.state_dict().items():
        if name.startswith("blocks.") and name.endswith(".bias"):
            continue  # zeroed in the reference
        for old, new in renames:
            name = name.replace(old, new)
        out[f"vision_tower.{name}"] = value
    return out


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """(the release-layout dir, the reference: Qwen2, the composed tower, tokenizer, pixels)."""
    path = tmp_path_factory.mktemp("dots_ocr")
    tokenizer, ids = tokenizer_with(MARKS, 3)
    text = tiny_qwen2_text(len(tokenizer), 64, rope_theta=1000000.0)
    llm = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**text)).float().eval()
    tower = _tower()
    with torch.no_grad():
        _randomize(llm, 4)
        _randomize(tower, 5)
        for block in tower.blocks:  # use_bias false
            for name, p in block.named_parameters():
                if name.endswith(".bias"):
                    p.zero_()
    tower.float().eval()
    state = {k: v for k, v in llm.state_dict().items()} | _release_names(tower)
    safetensors.save_file(
        {k: v.contiguous() for k, v in state.items()}, str(path / "model.safetensors")
    )
    (path / "config.json").write_text(json.dumps(release_config(text, ids)))
    save_grid_image_processor(
        transformers.Qwen2VLImageProcessorPil, path, VISION["temporal_patch_size"], 16
    )
    finish_checkpoint(path, tokenizer, CHAT_TEMPLATE)
    llm.generation_config.eos_token_id = None
    pixels = transformers.AutoImageProcessor.from_pretrained(path)
    return path, (llm, tower, tokenizer, pixels, ids["<|imgpad|>"])


def release_config(text: dict, ids: dict[str, int]) -> dict:
    """config.json as dots.ocr writes it (its fields, tiny values)."""
    top = {"architectures": ["DotsOCRForCausalLM"], "model_type": "dots_ocr"}
    top |= {"auto_map": {"AutoConfig": "configuration_dots.DotsOCRConfig"}}
    top |= {"attention_bias": True, "hidden_act": "silu", "use_sliding_window": False}
    top |= {"sliding_window": 1024, "max_window_layers": 2, "rope_scaling": None}
    top |= {"image_token_id": ids["<|imgpad|>"], "video_token_id": ids["<|video_pad|>"]}
    top |= {"vision_config": dict(VISION), "torch_dtype": "float32", "use_cache": True}
    return {**text, **top}


def reference(ref, text: str, images: list):
    """(the processor's prompt ids, Qwen2's greedy with top-5 on the scattered tower rows)."""
    return hf_greedy_with_tower_runs(ref, text, images, "<|imgpad|>", MERGE)


def test_images_match_reference(ckpt):
    """One image, two differently sized images, text alone; the images again with the
    expanded ids as prompt_token_ids; a chat turn's image part as vLLM's placeholder text."""
    path, ref = ckpt
    a, b = noise_image(1, (40, 56)), noise_image(2, (72, 24))
    cases = [(ONE, [a]), (TWO, [a, b]), (TEXT, [])]
    llm = engine(path, limit_mm_per_prompt={"image": 2})
    check_engine_matches_hf(llm, cases, [reference(ref, t, im) for t, im in cases], "dots_ocr")
    parts = [{"type": "image_pil", "image_pil": a}, {"type": "text", "text": "Read the text."}]
    (chat,) = llm.chat([{"role": "user", "content": parts}], greedy(0), use_tqdm=False)
    text = f"<|user|>{IMAGE}\nRead the text.<|endofuser|><|assistant|>"
    ids, want = reference(ref, text, [a])
    assert chat.prompt_token_ids == ids and chat.outputs[0].token_ids == want.tokens


@pytest.mark.parametrize(
    ("field", "change"),
    [
        ("is_causal", {"vision_config": {**VISION, "is_causal": True}}),
        ("vision_config.hidden_size", {"vision_config": {**VISION, "hidden_size": 32}}),
        ("use_bias", {"vision_config": {**VISION, "use_bias": True}}),
        ("post_norm", {"vision_config": {**VISION, "post_norm": False}}),
        ("rope_scaling", {"rope_scaling": {"type": "linear", "factor": 2.0}}),
        ("use_sliding_window", {"use_sliding_window": True}),
    ],
)
def test_configs_refused_by_name(ckpt, tmp_path, field, change):
    path, _ = ckpt
    config = json.loads((path / "config.json").read_text())
    check_config_refused(path, tmp_path, config | change, field)
