"""GGUF files of the hybrid models (Qwen3-Next, Qwen3.5, Qwen3.5-MoE, LFM2, LFM2-MoE), written
from tiny HF models as llama.cpp's converter lays them out (gguf_writer.py): our loader must give
back HF's weights and config, and LLM(model=<file>.gguf) HF's greedy tokens."""

from __future__ import annotations

import pytest
import torch

from paged_engine.gguf import GGUFFile, gguf_to_hf_config, gguf_weights
from paged_engine.layers.rotary import rope_config
from paged_engine.loader import load_hf_config, resolve_model
from paged_engine.models.lfm2 import lfm2_intermediate_size

gguf = pytest.importorskip("gguf")

from gguf_writer import write_gguf, write_metadata_only  # noqa: E402  (needs gguf)
from hf_reference import assert_file_greedy_matches_hf  # noqa: E402
from test_models import load_hf  # noqa: E402

# llama.cpp's Qwen3-Next / Qwen3.5 files say which layers are full attention only through
# full_attention_interval (4 unless the HF config has one): every 4th layer
_EVERY_4TH = {"layer_types": ["linear_attention"] * 3 + ["full_attention"]}
# name -> config overrides making the tiny model one llama.cpp's converter can represent
CASES = {
    # no dense layers: QWEN3NEXT has no ffn_gate / ffn_up / ffn_down tensors
    "qwen3_next": {**_EVERY_4TH, "mlp_only_layers": []},
    # 2 key heads, 4 value heads: the value heads are stored tiled, not grouped
    "qwen3_5": _EVERY_4TH,
    "qwen3_5_moe": _EVERY_4TH,
    "lfm2": {},
    # LFM2MoeModel writes no routed scaling factor (llama.cpp then scales by 1)
    "lfm2_moe": {"routed_scaling_factor": 1.0},
}
COMMON_KEYS = (
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "vocab_size",
    "tie_word_embeddings",
    "max_position_embeddings",
    "layer_types",
)
QWEN_KEYS = (
    "head_dim",
    "intermediate_size",
    "linear_num_key_heads",
    "linear_num_value_heads",
    "linear_key_head_dim",
    "linear_value_head_dim",
    "linear_conv_kernel_dim",
)
QWEN_MOE_KEYS = (
    "num_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
    "shared_expert_intermediate_size",
)
CONFIG_KEYS = {
    "qwen3_next": (*QWEN_KEYS, *QWEN_MOE_KEYS, "norm_topk_prob"),
    "qwen3_5": QWEN_KEYS,
    "qwen3_5_moe": (*QWEN_KEYS, *QWEN_MOE_KEYS),
    "lfm2": ("conv_L_cache", "conv_bias"),
    "lfm2_moe": ("conv_L_cache", "conv_bias", "num_experts", "num_experts_per_tok",
                 "moe_intermediate_size", "num_dense_layers", "use_expert_bias", "norm_topk_prob",
                 "routed_scaling_factor"),
}  # fmt: skip


@pytest.fixture(scope="module", params=list(CASES))
def case(request, tiny_model_factory, tmp_path_factory):
    """(tiny arch, gguf path, HF model dir, expected HF-named weights)."""
    arch = request.param
    src = tiny_model_factory(arch, **CASES[arch])
    path = tmp_path_factory.mktemp(arch) / f"{arch}.gguf"
    expected = write_gguf(src, path, arch)
    return arch, path, src, expected


def test_weights_and_config_match_hf(case):
    arch, path, src, expected = case
    got = dict(gguf_weights(GGUFFile(path)))
    assert got.keys() == expected.keys()
    for key, want in expected.items():
        # A_log (stored -exp) and the +1 norms round in float32
        torch.testing.assert_close(got[key].float(), want, atol=1e-6, rtol=1e-6, msg=key)

    config = load_hf_config(resolve_model(str(path)))
    ref = load_hf(src).config
    assert config.architectures == ref.architectures
    for key in (*COMMON_KEYS, *CONFIG_KEYS[arch]):
        assert getattr(config, key) == getattr(ref, key), key
    eps = "norm_eps" if arch.startswith("lfm2") else "rms_norm_eps"
    assert getattr(config, eps) == pytest.approx(getattr(ref, eps), rel=1e-6)
    if arch.startswith("lfm2"):  # the file holds the adjusted MLP width
        assert lfm2_intermediate_size(config) == lfm2_intermediate_size(ref)
    theta, scaling, partial = rope_config(config, None)
    assert (theta, partial) == rope_config(ref, None)[::2]
    assert scaling is None or scaling.get("rope_type", "default") == "default"


def test_llm_generates_hf_greedy_tokens(case):
    """End to end: LLM(model=<file>.gguf) (config, tokenizer, weights from the file)."""
    _, path, src, _ = case
    assert_file_greedy_matches_hf(path, load_hf(src), 11, (7, 21, 34))


# -- metadata edge cases ------------------------------------------------------------------------
def _metadata_only(path, arch: str, kv, **keys) -> GGUFFile:
    return write_metadata_only(path, arch, len(kv) if isinstance(kv, list) else 4, kv=kv, **keys)


def test_hybrid_metadata_errors_name_the_key(tmp_path):
    # LFM2: conv layers are the 0 entries of the per-layer kv head counts
    f = _metadata_only(tmp_path / "a.gguf", "lfm2", [0, 2, 0], **{"shortconv.l_cache": 3})
    cfg = gguf_to_hf_config(f)
    assert cfg.layer_types == ["conv", "full_attention", "conv"]
    assert cfg.num_key_value_heads == 2 and cfg.conv_L_cache == 3
    f = _metadata_only(tmp_path / "b.gguf", "lfm2", 2, **{"shortconv.l_cache": 3})
    with pytest.raises(ValueError, match=r"lfm2\.attention\.head_count_kv"):
        gguf_to_hf_config(f)
    f = _metadata_only(tmp_path / "c.gguf", "lfm2", [0, 2, 1], **{"shortconv.l_cache": 3})
    with pytest.raises(ValueError, match=r"lfm2\.attention\.head_count_kv differs"):
        gguf_to_hf_config(f)
    # Qwen3.5: the gated delta net's sizes are required
    f = _metadata_only(tmp_path / "d.gguf", "qwen35", 2, **{"ssm.group_count": 2})
    with pytest.raises(ValueError, match=r"qwen35\.ssm\.time_step_rank"):
        gguf_to_hf_config(f)
