"""Cohere Compass and dots3 note (text decoders, and their vision wrappers served text-only)
against HF transformers.

Tiny random checkpoints of the real HF classes, saved by transformers and loaded through
paged's loader: `LLM.generate` must give HF `generate`'s greedy tokens and top-5 logprobs
(1e-3, float32) on 12-40 token prompts.

Cohere Compass: windows of 8 keys on the sliding layers; a rope per layer type in NeoX halves,
a None entry NoPE (sliding layers rotating and global ones not in one case, the reverse with a
linear scaling and q / k / v / o biases in the other); logit_scale set and None; the
`CohereCompassForConditionalGeneration` wrapper (a one-block Qwen3-VL tower, DeepStack) on
text. dots3 note: MLA whose sliding layers have their own heads, ranks and head dims
(`per_layer_config`), the latent rows scaled by sqrt(hidden / rank), an RMSNorm of the shared
rotary key, a sigmoid gate a head, an indexer on the "indexed_attention" layers keeping 6
keys, DeepSeek-V3's MoE with a wider shared expert; the wrapper
`Dots3NoteForConditionalGeneration` on text, and the float32 torch window path CUDA takes for
rows too wide for the kernels. Also: chunked prefill with prefix caching and preemption gives
the plain engine's results, dots3's TP=2 the one-process results, its cache rows each layer's
width; images to dots3 note's wrapper and what is not run are refused by name (Cohere
Compass's images: test_cohere_compass_images.py).
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
from hf_parity import assert_serves_like_hf, checkpoint_dirs, write_hf_checkpoint
from hf_reference import (
    assert_chunks_prefix_hits_and_preemption_match_plain,
    assert_tp_matches_one_process,
    random_token_prompts,
)

from paged_engine import LLM, SamplingParams
from paged_engine.testing import _COMMON

transformers = pytest.importorskip("transformers")
pytest.importorskip("transformers.models.cohere_compass")

VOCAB = 512

_COMPASS_TEXT = {
    "vocab_size": VOCAB,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "sliding_window": 8,
    "layer_types": ["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
    **_COMMON,
}


def _compass_text(**over) -> tuple[type, object]:
    config = transformers.CohereCompassTextConfig(**{**_COMPASS_TEXT, **over})
    return transformers.CohereCompassForCausalLM, config


def _compass_vlm(**text_over) -> tuple[type, object]:
    vision = transformers.CohereCompassVisionConfig(
        depth=1,
        hidden_size=32,
        intermediate_size=64,
        num_heads=2,
        patch_size=14,
        spatial_merge_size=2,
        temporal_patch_size=2,
        out_hidden_size=64,
        num_position_embeddings=16,
        deepstack_visual_indexes=[0],
    )
    text = _compass_text(**text_over)[1]
    config = transformers.CohereCompassConfig(
        text_config=text.to_dict(),
        vision_config=vision.to_dict(),
        image_token_id=509,
        video_token_id=510,
        vision_start_token_id=507,
        vision_end_token_id=508,
    )
    return transformers.CohereCompassForConditionalGeneration, config


_DOTS3_TEXT = {
    "vocab_size": VOCAB,
    "hidden_size": 64,
    "intermediate_size": 96,
    "moe_intermediate_size": 32,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "n_routed_experts": 8,
    "n_group": 2,
    "topk_group": 1,
    "num_experts_per_tok": 2,
    "routed_scaling_factor": 2.0,
    "shared_experts_intermediate_size": 24,
    "kv_lora_rank": 32,
    "q_lora_rank": 48,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 16,
    "v_head_dim": 16,
    "head_dim": 32,  # the rope's partial factor: 8 / 32
    "index_topk": 6,
    "index_head_dim": 16,
    "index_n_heads": 8,
    "max_position_embeddings": 256,
    "sliding_window": 8,
    **_COMMON,
}
# the sliding layers' own attention shape (as the checkpoint's swa_* fields give it)
_DOTS3_SWA = {
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "q_lora_rank": 40,
    "kv_lora_rank": 24,
    "head_dim": 32,
    "qk_nope_head_dim": 24,
    "v_head_dim": 8,
    "qk_rope_head_dim": 8,
}


def _dots3_text(**over) -> tuple[type, object]:
    config = transformers.Dots3NoteTextConfig(**{**_DOTS3_TEXT, **over})
    return transformers.Dots3NoteForCausalLM, config


def _dots3_all_types() -> tuple[type, object]:
    """All three layer types, each with its own rope theta; a dense first layer."""
    return _dots3_text(
        layer_types=[
            "indexed_attention",
            "sliding_attention",
            "full_attention",
            "sliding_attention",
        ],
        mlp_layer_types=["dense", "sparse", "sparse", "sparse"],
        per_layer_config={1: _DOTS3_SWA, 3: _DOTS3_SWA},
        rope_parameters={
            "indexed_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 500.0},
            "full_attention": {"rope_type": "default", "rope_theta": 20000.0},
        },
        rms_norm_eps=0.05,  # the latent norms read it (DeepSeek's keep 1e-6)
    )


def _dots3_legacy(**over) -> tuple[type, object]:
    """The released checkpoint's fields: swa_* for the sliding layers, first_k_dense_replace,
    the default layout (layers 0, 1 global, then sliding)."""
    swa = {f"swa_{k}": v for k, v in _DOTS3_SWA.items() if k != "qk_rope_head_dim"}
    return _dots3_text(first_k_dense_replace=2, **swa, **over)


def _dots3_vlm() -> tuple[type, object]:
    vision = transformers.Dots3NoteVisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        patch_size=14, moe_intermediate_size=16, mlp_layer_types=["dense"],
        num_local_experts=4, adapter_in_dim=32, adapter_out_dim=64,
    )  # fmt: skip
    audio = transformers.Dots3NoteAudioConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        adapter_input_size=32, adapter_out_dim=64, feature_size=16, downsample_hidden_size=8,
        max_position_embeddings=64,
    )  # fmt: skip
    text = _dots3_legacy()[1]
    config = transformers.Dots3NoteConfig(
        text_config=text.to_dict(),
        vision_config=vision.to_dict(),
        audio_config=audio.to_dict(),
        image_token_id=509,
        video_token_id=510,
        audio_token_id=511,
    )
    return transformers.Dots3NoteForConditionalGeneration, config


_SLIDING_ROPE = {"sliding_attention": {"rope_type": "default", "rope_theta": 500.0}}
# name -> a (class, config) builder
CASES = {
    # Command-R7B-like: the sliding layers rotate, the global ones are NoPE
    "compass": lambda: _compass_text(
        rope_parameters={**_SLIDING_ROPE, "full_attention": None}, logit_scale=0.25
    ),
    # the reverse: global layers rotate (linear x2), sliding ones NoPE; biases; no logit_scale
    "compass-global-rope": lambda: _compass_text(
        rope_parameters={
            "sliding_attention": None,
            "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 2000.0},
        },
        attention_bias=True,
        tie_word_embeddings=False,
    ),
    "compass-vlm": lambda: _compass_vlm(
        rope_parameters={
            **_SLIDING_ROPE,
            "full_attention": {"rope_type": "default", "rope_theta": 10000.0},
        },
        logit_scale=0.5,
    ),
    "dots3": _dots3_all_types,
    # indexed then sliding layers (DSA by default), grouped routing renormalized
    "dots3-legacy": _dots3_legacy,
    # use_dsa False: plain MLA global layers; no renormalization, one expert group
    "dots3-no-dsa": lambda: _dots3_legacy(use_dsa=False, norm_topk_prob=False, n_group=1),
    "dots3-vlm": _dots3_vlm,
}


def write_model(path: Path, name: str, seed: int = 1) -> Path:
    """A tiny random checkpoint of case `name` as transformers saves it, with a tokenizer and
    generation config."""
    return write_hf_checkpoint(path, *CASES[name](), seed)


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    return checkpoint_dirs(tmp_path_factory, write_model)


def _prompts(name: str) -> list[list[int]]:
    # ids below the wrappers' special ids (505-511)
    return [[min(t, 500) for t in p] for p in random_token_prompts(name, 3)]


@pytest.mark.parametrize("name", list(CASES))
def test_greedy_tokens_and_logprobs_match_hf(name, model_dirs):
    _assert_matches_hf(name, model_dirs(name))


def test_dots3_wide_sliding_rows_in_torch_match_hf(model_dirs, monkeypatch):
    """The float32 torch window path (what CUDA runs for rows wider than the kernels take)
    gives HF's results too."""
    from paged_engine.models.dots3_note import WindowLatentAttention

    monkeypatch.setattr(WindowLatentAttention, "torch_path", True)
    _assert_matches_hf("dots3", model_dirs("dots3"))


def _assert_matches_hf(name: str, path: Path) -> None:
    assert_serves_like_hf(name, path, _prompts(name))


@pytest.mark.parametrize("name", ["compass", "dots3"])
def test_chunked_prefill_prefix_cache_and_preemption_match_plain(name, model_dirs):
    """Prefill in chunks of 8 over cached prefix blocks of 4, preempted in a small pool: the
    windows and NoPE layers give the plain engine's tokens and logprobs."""
    more = _prompts(name + "-stress")[:2]
    assert_chunks_prefix_hits_and_preemption_match_plain(model_dirs(name), more)


def test_compass_refusals():
    from paged_engine.models.cohere_compass import CohereCompassForCausalLM

    _, config = _compass_text(rope_parameters={**_SLIDING_ROPE, "full_attention": None})
    config.rope_parameters = dict(_SLIDING_ROPE)
    with pytest.raises(ValueError, match="rope_parameters has no entry"):
        CohereCompassForCausalLM(config)
    config.rope_parameters = {**_SLIDING_ROPE, "full_attention": None}
    config.layer_types = ["chunked_attention"] * 4
    with pytest.raises(ValueError, match="layer_types"):
        CohereCompassForCausalLM(config)


def test_dots3_tensor_parallel_matches_one_process(model_dirs):
    """TP=2 (gloo): each layer's own MLA heads (2 on the sliding layers: one a rank), their
    gates and the experts split; latents and indexers whole on both ranks."""
    assert_tp_matches_one_process(model_dirs("dots3"), _prompts("dots3-tp")[:2], 6, 64)


def test_dots3_cache_rows_have_each_layers_width(model_dirs):
    """[c | rope(k_pe)] of each layer's own rank, the indexed layer's with its indexer key."""
    llm = LLM(model=str(model_dirs("dots3")), dtype="float32", max_model_len=64)
    caches = llm.llm_engine.model_runner.cache.kv_caches
    assert [k.shape[-1] for k, _ in caches] == [32 + 8 + 16, 24 + 8, 32 + 8, 24 + 8]


class _LayerOverride:
    """A config whose `per_layer_config[layer]` has `field` = `value` (transformers' views
    resolve per layer and cannot be edited), everything else the config's."""

    def __init__(self, config, layer: int, field: str, value) -> None:
        self._config, self._layer, self._field, self._value = config, layer, field, value

    def __getattr__(self, name: str):
        if name == "per_layer_config":
            return self
        return getattr(self._config, name)

    def __getitem__(self, i: int):
        view = copy.copy(self._config.per_layer_config[i])
        if i == self._layer:
            setattr(view, self._field, self._value)
        return view


def test_dots3_refusals():
    from paged_engine.models.dots3_note import Dots3NoteForCausalLM

    _, config = _dots3_legacy()
    with pytest.raises(ValueError, match="layer 2 has q_lora_rank None"):
        Dots3NoteForCausalLM(_LayerOverride(config, 2, "q_lora_rank", None))
    config.layer_types = ["linear_attention"] * 4
    with pytest.raises(ValueError, match="layer_types"):
        Dots3NoteForCausalLM(config)


def test_dots3_wrapper_images_are_refused(model_dirs):
    """dots3 note's towers are not run: an image in vLLM's multi_modal_data is a ValueError
    (Cohere Compass's images: test_cohere_compass_images.py)."""
    llm = LLM(model=str(model_dirs("dots3-vlm")), dtype="float32", max_model_len=64)
    prompt = {"prompt_token_ids": [5, 6, 7], "multi_modal_data": {"image": object()}}
    with pytest.raises(ValueError, match="multi_modal_data is not supported"):
        llm.generate([prompt], SamplingParams(max_tokens=2), use_tqdm=False)
