"""HyperCLOVA X SEED Vision v1 (`HCXVisionForCausalLM`, remote code: naver-hyperclovax/
HyperCLOVAX-SEED-Vision-Instruct-3B) served on text (models/hcx_vision_v1_config.py,
text_wrappers' row) against transformers.

The reference is transformers' own decoder, which the release's text model is (vLLM builds it
from text_config): a tiny random `LlamaForCausalLM` (tied head) and `HyperCLOVAXForCausalLM`
(its own head, muP scalars, Peri-LN). Each is re-saved in the release's layout: its tensors under
`language_model.`, beside stand-ins of the SigLIP tower (`vision_model.vision_model.*`), the
C-Abstractor (`mm_projector.*`) and `image_newline`, with a config.json of the release's fields
(model_type "hyperclovax_vlm", text_config, vision_config, mm_projector_type "cabstractor",
anyres, possible_resolutions ...). `LLM.generate` must give HF's greedy tokens and top-5
logprobs (1e-3, float32); an image is refused (multi_modal_data), the engine serving on; a
text_config the path does not serve is refused by name.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from hf_parity import assert_llm_matches, load_hf_as_saved, write_hf_checkpoint
from hf_reference import hf_greedy, random_token_prompts

from paged_engine import LLM, SamplingParams
from paged_engine.testing import tiny_config

transformers = pytest.importorskip("transformers")
safetensors = pytest.importorskip("safetensors.torch")

_VISION = {  # the release's tower kind, tiny (never built: images are not served)
    "model_type": "siglip_vision_model",
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "image_size": 28,
    "patch_size": 14,
}
# the release's text models: Llama with its head tied (set against the wrapper's top-level
# flag: the text model's own wins), HyperCLOVA X with its own head
CASES = {
    "llama": {"tie_word_embeddings": True},
    "hyperclovax": {},
}


def _release_config(text: dict) -> dict:
    """config.json as the release writes it (vLLM's HCXVisionConfig fields)."""
    return {
        "architectures": ["HCXVisionForCausalLM"],
        "model_type": "hyperclovax_vlm",
        "auto_map": {"AutoConfig": "configuration_hyperclovax.HCXVisionConfig"},
        "text_config": text,
        "vision_config": _VISION,
        "mm_projector_type": "cabstractor",
        "anyres": True,
        "unpad": True,
        "max_num_grids": 9,
        "use_1x1_grid": False,
        "possible_resolutions": [[28, 56], [56, 28], [56, 56]],
        "num_queries_vis_abstractor_image": 4,
        "num_queries_vis_abstractor_video_slow": 4,
        "num_queries_vis_abstractor_video_fast": 1,
        "first_last_frames_slow": False,
        "proj_pos_emb": True,
        "proj_prenorm": False,
        "use_nth_layer": -2,
        "img_start_id": 7,
        "decoder_max_length": 4096,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
    }


def _write_release(hf_dir: Path, path: Path, seed: int) -> Path:
    """`hf_dir`'s decoder re-saved in the release's layout (module doc) into `path`."""
    gen = torch.Generator().manual_seed(seed)
    weights = safetensors.load_file(str(hf_dir / "model.safetensors"))
    state = {f"language_model.{k}": v for k, v in weights.items()}
    fakes = {
        "vision_model.vision_model.embeddings.patch_embedding.weight": (32, 3, 14, 14),
        "vision_model.vision_model.encoder.layers.0.self_attn.q_proj.weight": (32, 32),
        "mm_projector.pos_emb": (1, 4, 32),
        "mm_projector.net.0.b1.conv.conv.weight": (32, 32, 1, 1),
        "mm_projector.readout.0.weight": (64, 32),
        "image_newline": (64,),
    }
    state.update({k: torch.randn(s, generator=gen) for k, s in fakes.items()})
    path.mkdir(parents=True, exist_ok=True)
    safetensors.save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    text = json.loads((hf_dir / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(_release_config(text)))
    for name in hf_dir.iterdir():
        if name.name not in ("config.json", "model.safetensors"):
            (path / name.name).write_bytes(name.read_bytes())
    return path


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    cache: dict[str, tuple[Path, Path]] = {}

    def make(case: str) -> tuple[Path, Path]:
        if case not in cache:
            seed = 41 + len(cache)
            root = tmp_path_factory.mktemp(f"hcx-v1-{case}")
            config = tiny_config(case, **CASES[case])
            cls = getattr(
                transformers, type(config).__name__.removesuffix("Config") + "ForCausalLM"
            )
            hf_dir = write_hf_checkpoint(root / "hf", cls, config, seed)
            cache[case] = (hf_dir, _write_release(hf_dir, root / "release", seed))
        return cache[case]

    return make


def _llm(path: Path) -> LLM:
    return LLM(model=str(path), dtype="float32", max_model_len=128, block_size=16)


@pytest.mark.parametrize("case", list(CASES))
def test_text_matches_hf(checkpoints, case):
    hf_dir, path = checkpoints(case)
    hf = load_hf_as_saved(hf_dir)
    prompts = random_token_prompts(f"hcx-v1-{case}", 3)
    refs = [hf_greedy(hf, p, 8, 5) for p in prompts]
    llm = _llm(path)
    assert_llm_matches(f"hcx-v1-{case}", llm, prompts, refs)
    assert llm.get_stats().num_used_blocks == 0
    if case == "llama":  # images are not served: refused by name, the engine serves on
        from PIL import Image

        image = {
            "prompt_token_ids": prompts[0],
            "multi_modal_data": {"image": Image.new("RGB", (28, 28))},
        }
        with pytest.raises(ValueError, match="multi_modal_data is not supported"):
            llm.generate([image], use_tqdm=False)
        params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
        out = llm.generate([{"prompt_token_ids": prompts[0]}], params, use_tqdm=False)[0]
        assert list(out.outputs[0].token_ids) == refs[0].tokens


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ({"model_type": "gpt2", "n_embd": 64}, r"text_config\.model_type'='gpt2'"),
        (None, "'text_config' must be an object"),
    ],
    ids=["gpt2", "missing"],
)
def test_unserved_text_config_is_refused_by_name(checkpoints, tmp_path, text, match):
    from paged_engine.models.remote_aliases import remote_config

    _, path = checkpoints("llama")
    config = json.loads((path / "config.json").read_text())
    config["text_config"] = text
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=match):
        remote_config(tmp_path)


def test_null_mup_scalars_take_the_remote_defaults(checkpoints, tmp_path):
    """The remote HyperCLOVAXConfig's nulls: 1.0 multipliers, an attention scale of
    head_dim^-0.5 (vLLM's vendored config), which transformers' class refuses as given."""
    from paged_engine.models.remote_aliases import remote_config

    _, path = checkpoints("hyperclovax")
    config = json.loads((path / "config.json").read_text())
    for name in ("embedding_multiplier", "logits_scaling", "attention_multiplier"):
        config["text_config"][name] = None
    (tmp_path / "config.json").write_text(json.dumps(config))
    text = remote_config(tmp_path).text_config
    assert (text.embedding_multiplier, text.logits_scaling) == (1.0, 1.0)
    assert text.attention_multiplier == text.head_dim**-0.5
    assert text.residual_multiplier == 0.5  # set: kept
