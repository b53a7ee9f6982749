"""GGUF files of the Mamba2 hybrids (Granite 4.0-H: "granitehybrid"; Nemotron-H / Nemotron Nano 2:
"nemotron_h"; Nemotron 3: "nemotron_h_moe"), written from tiny HF models as llama.cpp's converter
lays them out (gguf_writer.py): our loader must give back HF's weights and config, and
LLM(model=<file>.gguf) HF's greedy tokens.

What the format cannot carry is left at what the file implies (llama.cpp's reading), so the tiny
models here use it: rope on Granite's attention layers (the converter writes use_rope False for
every GraniteMoeHybrid), Granite's and Nemotron-H's time_step_limit and Nemotron-H's
time_step_min (the config class defaults, (0, inf) and 0.001, load back)."""

from __future__ import annotations

import pytest
import torch

from paged_engine.gguf import GGUFFile, gguf_to_hf_config, gguf_weights
from paged_engine.loader import load_hf_config, resolve_model

gguf = pytest.importorskip("gguf")

from gguf_writer import write_gguf, write_metadata_only  # noqa: E402  (needs gguf)
from hf_reference import assert_file_greedy_matches_hf  # noqa: E402
from hybrid_checks import NEMOTRON_MOE  # noqa: E402
from test_models import load_hf  # noqa: E402

# the converter stores no dt clamp: the file loads the config class defaults (no clamp; older
# transformers clamp at time_step_min, 0.001 never bites in these models)
NEMOTRON_GGUF = {"time_step_min": 0.001, "time_step_limit": (0.0, float("inf"))}
NEMOTRON_MOE_GGUF = {**NEMOTRON_MOE, **NEMOTRON_GGUF}

# name -> (tiny arch, config overrides)
CASES = {
    # Mamba2 (2 groups of 4 heads), attention without rope, a MoE and a shared MLP, multipliers
    "granitemoehybrid": ("granitemoehybrid", {}),
    # dense: the shared MLP alone (stored as ffn_gate / ffn_up / ffn_down), one group
    "granitemoehybrid-dense": ("granitemoehybrid", {"num_local_experts": 0, "mamba_n_groups": 1}),
    # Mamba2, relu^2 MLP and attention blocks
    "nemotron_h": ("nemotron_h", NEMOTRON_GGUF),
    # Nemotron 3 (Nano): MoE blocks (DeepSeek-V3's router over 2 groups, relu^2 experts, shared
    # ones); (Super) the experts in a latent space
    "nemotron_h-moe": ("nemotron_h", NEMOTRON_MOE_GGUF),
    "nemotron_h-moe-latent": ("nemotron_h", {**NEMOTRON_MOE_GGUF, "moe_latent_size": 24}),
}
COMMON_KEYS = (
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "vocab_size",
    "tie_word_embeddings",
    "layer_types",
)
GRANITE_KEYS = (
    "shared_intermediate_size",
    "num_local_experts",
    "mamba_n_heads",
    "mamba_d_head",
    "mamba_n_groups",
    "mamba_d_state",
    "mamba_d_conv",
    "mamba_expand",
    "mamba_conv_bias",
    "mamba_proj_bias",
    "embedding_multiplier",
    "residual_multiplier",
    "attention_multiplier",
    "logits_scaling",
    "position_embedding_type",
    "time_step_limit",
)
NEMOTRON_KEYS = (
    "head_dim",
    "mamba_num_heads",
    "mamba_head_dim",
    "n_groups",
    "ssm_state_size",
    "conv_kernel",
    "use_conv_bias",
    "use_bias",
    "time_step_min",
    "time_step_limit",
)
_MOE_KEYS = (*NEMOTRON_KEYS, "n_routed_experts", "num_experts_per_tok", "moe_intermediate_size",
             "moe_shared_expert_intermediate_size", "n_shared_experts", "norm_topk_prob",
             "routed_scaling_factor", "n_group", "topk_group", "moe_latent_size")  # fmt: skip
CONFIG_KEYS = {
    "granitemoehybrid": (*GRANITE_KEYS, "intermediate_size", "num_experts_per_tok"),
    "granitemoehybrid-dense": GRANITE_KEYS,
    "nemotron_h": (*NEMOTRON_KEYS, "intermediate_size"),
    "nemotron_h-moe": _MOE_KEYS,
    "nemotron_h-moe-latent": _MOE_KEYS,
}
GGUF_NAMES = {  # general.architecture and a few tensors the converter writes
    "granitemoehybrid": ("granitehybrid", ["blk.0.ffn_gate_exps.weight",
                                           "blk.0.ffn_up_shexp.weight"]),
    "granitemoehybrid-dense": ("granitehybrid", ["blk.0.ffn_gate.weight",
                                                 "blk.0.ffn_down.weight"]),
    "nemotron_h": ("nemotron_h", ["blk.1.ffn_up.weight", "blk.0.ssm_d"]),
    "nemotron_h-moe": ("nemotron_h_moe", ["blk.1.ffn_up_exps.weight", "blk.1.exp_probs_b.bias",
                                          "blk.1.ffn_gate_inp.weight"]),
    "nemotron_h-moe-latent": ("nemotron_h_moe", ["blk.1.ffn_latent_down.weight",
                                                 "blk.4.ffn_latent_up.weight"]),
}  # fmt: skip


@pytest.fixture(scope="module", params=list(CASES))
def case(request, tiny_model_factory, tmp_path_factory):
    """(case name, gguf path, HF model dir, expected HF-named weights)."""
    name = request.param
    arch, overrides = CASES[name]
    src = tiny_model_factory(arch, **overrides)
    path = tmp_path_factory.mktemp(name) / f"{name}.gguf"
    expected = write_gguf(src, path, arch)
    return name, path, src, expected


def test_weights_and_config_match_hf(case):
    name, path, src, expected = case
    f = GGUFFile(path)
    arch, tensors = GGUF_NAMES[name]
    assert f.get("general.architecture") == arch
    assert all(t in f.tensors for t in tensors)
    # Mamba2Model's shapes: A and D [H, 1], the gated norm [groups, inner / groups], conv [C, K]
    heads, groups = f.get(f"{arch}.ssm.time_step_rank"), f.get(f"{arch}.ssm.group_count")
    assert f.tensors["blk.0.ssm_a"].shape == f.tensors["blk.0.ssm_d"].shape == (heads, 1)
    assert f.tensors["blk.0.ssm_norm.weight"].shape == (groups, 128 // groups)
    channels = 128 + 2 * groups * f.get(f"{arch}.ssm.state_size")  # x, B, C
    assert f.tensors["blk.0.ssm_conv1d.weight"].shape == (channels, 4)
    got = dict(gguf_weights(f))
    assert got.keys() == expected.keys()
    for key, want in expected.items():
        # A_log goes through -exp and log in float32
        torch.testing.assert_close(got[key].float(), want, atol=1e-6, rtol=1e-6, msg=key)

    config = load_hf_config(resolve_model(str(path)))
    ref = load_hf(src).config
    assert config.architectures == ref.architectures
    for key in (*COMMON_KEYS, *CONFIG_KEYS[name]):
        want, got = getattr(ref, key), getattr(config, key)
        if isinstance(want, tuple | list):  # a pair written as a JSON list or a default tuple
            want, got = list(want), list(got)
        want = pytest.approx(want, rel=1e-6) if isinstance(want, float) else want  # float32 meta
        assert got == want, key
    eps = "rms_norm_eps" if name.startswith("granite") else "layer_norm_epsilon"
    assert getattr(config, eps) == pytest.approx(getattr(ref, eps), rel=1e-6)
    assert config.max_position_embeddings == 2**20  # what the converter writes without rope


def test_llm_generates_hf_greedy_tokens(case):
    """End to end: LLM(model=<file>.gguf) (config, tokenizer, weights from the file)."""
    _, path, src, _ = case
    assert_file_greedy_matches_hf(path, load_hf(src), 5, (6, 19, 40))


# -- metadata edge cases ------------------------------------------------------------------------
def _metadata_only(path, arch: str, kv, tensors: dict[str, tuple[int, ...]], **keys) -> GGUFFile:
    layers = len(kv) if isinstance(kv, list) else 2
    return write_metadata_only(path, arch, layers, ffn=32, kv=kv, tensors=tensors, **keys)


_SSM = {"ssm.conv_kernel": 4, "ssm.state_size": 16, "ssm.group_count": 2, "ssm.inner_size": 128,
        "ssm.time_step_rank": 8, "expert_shared_feed_forward_length": 48}  # fmt: skip


def test_granite_metadata_defaults_and_errors(tmp_path):
    # no multipliers written: llama.cpp scales by 1, attention by 1 / sqrt(head_dim)
    tensors = {"blk.0.ssm_in.weight": (328, 64), "blk.1.attn_q.weight": (64, 64)}
    f = _metadata_only(tmp_path / "a.gguf", "granitehybrid", [0, 2], tensors, **_SSM)
    cfg = gguf_to_hf_config(f)
    assert cfg.layer_types == ["linear_attention", "full_attention"]
    assert cfg.num_key_value_heads == 2 and cfg.num_local_experts == 0
    assert cfg.attention_multiplier == pytest.approx(16**-0.5)
    assert (cfg.embedding_multiplier, cfg.residual_multiplier, cfg.logits_scaling) == (1, 1, 1)
    assert (cfg.mamba_n_heads, cfg.mamba_d_head, cfg.mamba_expand) == (8, 16, 2)
    assert cfg.position_embedding_type is None
    # a Mamba layer must hold the Mamba tensors its 0 kv heads announce
    f = _metadata_only(tmp_path / "b.gguf", "granitehybrid", [2, 2], tensors, **_SSM)
    with pytest.raises(ValueError, match=r"layer 0 does not match"):
        gguf_to_hf_config(f)
    f = _metadata_only(tmp_path / "c.gguf", "granitehybrid", 2, tensors, **_SSM)
    with pytest.raises(ValueError, match=r"granitehybrid\.attention\.head_count_kv"):
        gguf_to_hf_config(f)
    keys = {k: v for k, v in _SSM.items() if k != "ssm.time_step_rank"}
    f = _metadata_only(tmp_path / "d.gguf", "granitehybrid", [0, 2], tensors, **keys)
    with pytest.raises(ValueError, match=r"granitehybrid\.ssm\.time_step_rank"):
        gguf_to_hf_config(f)


def test_nemotron_layer_kinds_come_from_the_tensors(tmp_path):
    tensors = {
        "blk.0.ssm_in.weight": (328, 64),
        "blk.1.ffn_up.weight": (96, 64),
        "blk.2.attn_q.weight": (64, 64),
    }
    f = _metadata_only(tmp_path / "a.gguf", "nemotron_h", [0, 0, 2], tensors, **_SSM)
    cfg = gguf_to_hf_config(f)
    assert cfg.layers_block_type == ["linear_attention", "mlp", "full_attention"]
    assert cfg.intermediate_size == 96 and cfg.num_key_value_heads == 2
    f = _metadata_only(tmp_path / "b.gguf", "nemotron_h", [0, 2, 2], tensors, **_SSM)
    with pytest.raises(ValueError, match=r"layer 1 \(mlp\) does not match"):
        gguf_to_hf_config(f)
