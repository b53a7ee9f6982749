"""Inkling 2 and Inkling 2 Loop (models/inkling2.py, inkling2_layers.py) against HF transformers.

Tiny random models: Inkling 2 of three layers (full, sliding with its own head geometry and a
window of 8, full) in blocks of two, so a full layer without and one with block-residual inputs,
a boundary restart and a residual add all run; the full layers' relative bias reaches 12 keys
back and their q and bias are log-scaled past position 4; clip thresholds, MLP softcaps and a
logit softcap small enough to bite; a head of 500 rows under a 512-token table. Inkling 2 Loop
of four layers in blocks of one whose layers 1 and 2 (full, sliding) run three passes, each with
its own KV caches and conv windows, passes 2 and 3 gated by messages from the pass before.
`LLM.generate` must give HF `generate`'s greedy tokens and top-5 logprobs (1e-3, float32),
whole (Inkling 2) and in prefill chunks of 16 (Loop: KV, static and dynamic conv windows of
every pass carry across chunks);
prefix caching resumes from state snapshots with the outputs of an engine without it; the
wrappers (`Inkling2ForConditionalGeneration`, `Inkling2LoopForConditionalGeneration`, Inkling
1's `InklingForConditionalGeneration`) serve their text model text-only as HF's wrapper runs
it; a stack without a full layer is refused naming layer_types.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from hf_parity import assert_serves_like_hf, checkpoint_dirs, load_hf_as_saved, write_hf_checkpoint
from hybrid_checks import assert_greedy_matches_hf, assert_snapshots_keep_outputs, random_prompts

from paged_engine.testing import _COMMON

transformers = pytest.importorskip("transformers")
pytest.importorskip("transformers.models.inkling2_loop")

VOCAB = 512
TEXT = {
    "vocab_size": VOCAB,
    "unpadded_vocab_size": 500,
    "hidden_size": 32,
    "num_hidden_layers": 3,
    "layer_types": ["hybrid", "hybrid_sliding", "hybrid"],
    "n_layers_per_attn_res_block": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "swa_num_attention_heads": 2,
    "swa_num_key_value_heads": 1,
    "swa_head_dim": 16,
    "sliding_window_size": 8,
    "d_rel": 4,
    "rel_extent": 12,
    "log_scaling_n_floor": 4,
    "log_scaling_alpha": 0.3,
    "qk_l2_clip_threshold": 1.5,
    "rel_l2_clip_threshold": 0.8,
    "conv_kernel_size": 3,
    "moe_intermediate_size": 16,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "route_scale": 2.5,
    "mlp_gate_softcap": 1.0,
    "mlp_up_softcap": 2.0,
    "final_logit_softcapping": 4.0,
    "max_position_embeddings": 1024,
    "rms_norm_eps": 1e-5,
    **_COMMON,
}
LOOP = {
    **TEXT,
    "num_hidden_layers": 4,
    "layer_types": ["hybrid_sliding", "hybrid", "hybrid_sliding", "hybrid"],
    "n_layers_per_attn_res_block": 1,
    "loop_layer_index_start": 1,
    "loop_layer_index_end": 3,
    "loop_num_passes": 3,
    "loop_gate_rank": 8,
}
_VISION = {
    "hidden_size": 16,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "patch_size": 4,
    "posemb_grid_size": 4,
    "projection_hidden_dim": 16,
}


def _inkling1_wrapper():
    from paged_engine.testing import tiny_config

    text = tiny_config("inkling").to_dict()
    return transformers.InklingConfig(
        text_config=text,
        # as many tower layers as scales: transformers plans them without scipy
        vision_config={"patch_size": 2, "temporal_patch_size": 2, "num_hidden_layers": 3},
        audio_config={"hidden_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2},
    )


# name -> (HF class, config factory)
CASES = {
    "inkling2": ("Inkling2ForCausalLM", lambda: transformers.Inkling2TextConfig(**TEXT)),
    "inkling2_loop": (
        "Inkling2LoopForCausalLM",
        lambda: transformers.Inkling2LoopTextConfig(**LOOP),
    ),
    "inkling2_vl": (
        "Inkling2ForConditionalGeneration",
        lambda: transformers.Inkling2Config(
            text_config=TEXT, vision_config={**_VISION, "text_hidden_size": 32}
        ),
    ),
    "inkling2_loop_vl": (
        "Inkling2LoopForConditionalGeneration",
        lambda: transformers.Inkling2LoopConfig(
            text_config=LOOP, vision_config={**_VISION, "text_hidden_size": 32}
        ),
    ),
    "inkling_vl": ("InklingForConditionalGeneration", _inkling1_wrapper),
}


def write_tiny(path: Path, name: str, seed: int = 1) -> Path:
    cls_name, make_config = CASES[name]
    return write_hf_checkpoint(path, getattr(transformers, cls_name), make_config(), seed)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    return checkpoint_dirs(tmp_path_factory, write_tiny)


@pytest.mark.parametrize(
    ("name", "budget"),
    [("inkling2", None), ("inkling2_loop", 16)],  # whole prompts; prefill chunks of 16
)
def test_greedy_tokens_and_logprobs_match_hf(name, budget, dirs, monkeypatch):
    import hybrid_checks

    monkeypatch.setattr(hybrid_checks, "load_hf_model", load_hf_as_saved)
    llm = assert_greedy_matches_hf(name, dirs(name), "cpu", budget)
    runner = llm.llm_engine.model_runner
    # each layer's caches, then (Loop) passes 2 and 3 of layers 1 and 2; four conv windows a
    # layer and pass
    caches, windows = (8, 4 * (4 + 2 * 2)) if name == "inkling2_loop" else (3, 4 * 3)
    assert len(runner.cache.kv_caches) == caches and len(runner.states.layers) == windows
    if name == "inkling2_loop":
        assert [runner.model.model.cache_index(i, 2) for i in (1, 2)] == [6, 7]


def test_prefix_cache_snapshots_keep_outputs(dirs):
    assert_snapshots_keep_outputs(dirs("inkling2_loop"))


@pytest.mark.parametrize(
    ("name", "text_arch"),
    [
        ("inkling2_vl", "Inkling2ForCausalLM"),
        ("inkling2_loop_vl", "Inkling2LoopForCausalLM"),
        ("inkling_vl", "InklingForCausalLM"),
    ],
)
def test_wrappers_serve_their_text_model(name, text_arch, dirs):
    llm = assert_serves_like_hf(name, dirs(name), random_prompts(3, (9, 30)), max_tokens=6)
    assert type(llm.llm_engine.model_runner.model).__name__ == text_arch


def test_all_sliding_stack_is_refused(tmp_path):
    from paged_engine.models.inkling2 import Inkling2ForCausalLM

    config = transformers.Inkling2TextConfig(**{**TEXT, "layer_types": ["hybrid_sliding"] * 3})
    with pytest.raises(ValueError, match="layer_types"):
        Inkling2ForCausalLM(config)
