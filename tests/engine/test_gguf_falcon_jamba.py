"""GGUF files of Falcon-H1 ("falcon-h1") and Jamba ("jamba"), written from tiny HF models as
llama.cpp's converter (FalconH1Model / JambaModel) lays them out (gguf_writer.py): our loader must
give back the weights (A_log through -exp and log: within float32 rounding; all else bit for bit)
and the config, and LLM(model=<file>.gguf) HF's greedy tokens; a Q8_0 file per arch
(convert_hf_to_gguf.py --outtype q8_0) its dequantized weights bit for bit and HF's tokens and
logprobs on them.

What the format cannot carry:
- Falcon-H1: the converter folds every multiplier into a weight and writes none of them
  (embedding_multiplier into token_embd, lm_head_multiplier into output, attention_in_multiplier
  into q / k / v, key_multiplier into k, attention_out_multiplier into o, ssm_in_multiplier and
  the ssm_multipliers (mup vector: z, x, B, C, dt row blocks) into the mixer's in_proj,
  ssm_out_multiplier into its out_proj, mlp_multipliers into gate / down). The file loads with
  every multiplier 1 and the folded weights: the same model up to float32 rounding, but HF's own
  weights and multipliers cannot be told apart again. The weights expected here are the folded
  ones (checked against HF's weight times HF's multiplier, within float32 rounding). The mixer's
  gated norm, when present, runs after the gate as in llama.cpp (mamba_norm_before_gate False),
  so the tiny model with the norm uses that. A tied head cannot be represented (the embedding
  carries embedding_multiplier, which llama.cpp's head would reuse in place of
  lm_head_multiplier), nor rope scaling: the tiny models are untied with plain rope.
- Jamba: which layers are attention (per-layer head_count_kv) and MoE (a router) is in the file,
  not JambaConfig's periods and offsets: they load as the smallest ones giving those layers
  (attention on layer 1 of 4: period 3, not the tiny's 4), so layer_types is compared. Its
  converter writes a SentencePiece vocabulary; the writer keeps the tiny byte-level BPE one."""

from __future__ import annotations

import json

import pytest
import torch

from paged_engine.gguf import GGUFFile, gguf_to_hf_config, gguf_weights
from paged_engine.gguf.dequant import type_name
from paged_engine.loader import load_hf_config, resolve_model

gguf = pytest.importorskip("gguf")

from gguf_writer import assert_weights_back, dequantized_reference, write_gguf, write_metadata_only  # noqa: E402  (needs gguf)
from hf_reference import (  # noqa: E402
    assert_file_greedy_matches_hf,
    assert_file_logprobs_match_hf,
)
from test_models import load_hf  # noqa: E402

# name -> (tiny arch, config overrides)
CASES = {
    # attention (heads of 24) beside a Mamba2 mixer (6 heads of 16, 2 groups) in every layer, no
    # gated norm, every multiplier != 1 (folded into the weights)
    "falcon_h1": ("falcon_h1", {}),
    # with the mixer's gated norm (stored [2, 48]), after the gate as llama.cpp runs it
    "falcon_h1-norm": ("falcon_h1", {"mamba_rms_norm": True, "mamba_norm_before_gate": False}),
    # Mamba layers around attention on layer 1; 4 experts (top 2) on layers 1 and 3
    "jamba": ("jamba", {}),
    # dense (one expert: no router), attention on layers 1 and 3, dt rank "auto" (4)
    "jamba-dense": ("jamba", {"num_experts": 1, "num_experts_per_tok": 1,
                              "attn_layer_period": 2, "mamba_dt_rank": "auto"}),
}  # fmt: skip
FALCON_KEYS = (
    "head_dim",
    "intermediate_size",
    "max_position_embeddings",
    "mamba_d_ssm",
    "mamba_n_heads",
    "mamba_d_head",
    "mamba_n_groups",
    "mamba_d_state",
    "mamba_d_conv",
    "mamba_conv_bias",
    "mamba_proj_bias",
    "mamba_rms_norm",
    "projectors_bias",
    "attention_bias",
    "mlp_bias",
    "time_step_limit",
)
JAMBA_KEYS = (
    "intermediate_size",
    "max_position_embeddings",
    "layer_types",
    "layers_num_experts",
    "num_experts",
    "num_experts_per_tok",
    "mamba_d_state",
    "mamba_d_conv",
    "mamba_expand",
    "mamba_dt_rank",
    "mamba_conv_bias",
    "mamba_proj_bias",
)
COMMON_KEYS = (
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "vocab_size",
    "tie_word_embeddings",
)
# Falcon-H1's multipliers, all folded into weights: 1 in the loaded config
UNIT_MULTIPLIERS = {
    "embedding_multiplier": 1.0,
    "lm_head_multiplier": 1.0,
    "key_multiplier": 1.0,
    "attention_in_multiplier": 1.0,
    "attention_out_multiplier": 1.0,
    "ssm_in_multiplier": 1.0,
    "ssm_out_multiplier": 1.0,
    "ssm_multipliers": [1.0] * 5,
    "mlp_multipliers": [1.0, 1.0],
}


@pytest.fixture(scope="module", params=list(CASES))
def case(request, tiny_model_factory, tmp_path_factory):
    """(case name, gguf path, HF model dir, expected HF-named weights)."""
    name = request.param
    arch, overrides = CASES[name]
    src = tiny_model_factory(arch, **overrides)
    path = tmp_path_factory.mktemp(name) / f"{name}.gguf"
    expected = write_gguf(src, path, arch)
    return name, path, src, expected


def _falcon_factor(hf, name: str) -> torch.Tensor | float:
    """What the converter multiplied HF's `name` by (the mixer's in_proj: by HF's mup vector)."""
    from transformers.models.falcon_h1.modeling_falcon_h1 import compute_mup_vector

    c = hf.config
    if name.endswith("mamba.in_proj.weight"):
        return c.ssm_in_multiplier * compute_mup_vector(c).reshape(-1, 1)
    for part, factor in (
        ("down_proj", c.mlp_multipliers[1]),
        ("gate_proj", c.mlp_multipliers[0]),
        ("k_proj", c.key_multiplier * c.attention_in_multiplier),
        ("q_proj", c.attention_in_multiplier),
        ("v_proj", c.attention_in_multiplier),
        ("o_proj", c.attention_out_multiplier),
        ("mamba.out_proj", c.ssm_out_multiplier),
        ("lm_head", c.lm_head_multiplier),
        ("embed_tokens", c.embedding_multiplier),
    ):
        if part in name:
            return factor
    return 1.0


def test_weights_and_config_match_hf(case):
    name, path, src, expected = case
    arch = CASES[name][0]
    f = GGUFFile(path)
    hf = load_hf(src)
    ref = hf.config
    got = dict(gguf_weights(f))
    assert_weights_back(got, expected)
    config = load_hf_config(resolve_model(str(path)))
    assert config.architectures == ref.architectures
    assert type(config) is type(ref)
    keys = (*COMMON_KEYS, *(FALCON_KEYS if arch == "falcon_h1" else JAMBA_KEYS))
    for key in keys:
        want = getattr(ref, key)
        want = list(want) if isinstance(want, tuple) else want
        value = getattr(config, key)
        assert (list(value) if isinstance(value, tuple) else value) == want, key
    assert config.rms_norm_eps == pytest.approx(ref.rms_norm_eps, rel=1e-6)  # float32 metadata

    if arch == "falcon_h1":
        assert f.get("general.architecture") == "falcon-h1"
        # the converter's layout: no multiplier keys, the pre-MLP norm without `.weight`, A and
        # D [H, 1], conv [x + B + C channels, K], the gated norm (if any) [groups, n]
        assert not [k for k in f.metadata if "multiplier" in k]
        assert "blk.0.ffn_norm" in f.tensors and "blk.0.ffn_norm.weight" not in f.tensors
        assert f.tensors["blk.0.ssm_a"].shape == f.tensors["blk.0.ssm_d"].shape == (6, 1)
        assert f.tensors["blk.0.ssm_conv1d.weight"].shape == (96 + 2 * 2 * 16, 4)
        assert ("blk.0.ssm_norm.weight" in f.tensors) == ref.mamba_rms_norm
        if ref.mamba_rms_norm:
            assert f.tensors["blk.0.ssm_norm.weight"].shape == (2, 48)
            assert config.mamba_norm_before_gate is False
        for key, want in UNIT_MULTIPLIERS.items():
            assert getattr(config, key) == want, key
        assert config.rope_parameters["rope_theta"] == ref.rope_parameters["rope_theta"]
        # the folded weights are HF's times HF's multiplier (float32 products)
        for key, param in hf.state_dict().items():
            if key in got and not key.endswith(".A_log"):
                want = param.float() * _falcon_factor(hf, key)
                torch.testing.assert_close(got[key].float(), want, rtol=1e-6, atol=0, msg=key)
    else:
        assert f.get("general.architecture") == "jamba"
        kv = [ref.num_key_value_heads if t == "full_attention" else 0 for t in ref.layer_types]
        assert f.get("jamba.attention.head_count_kv") == kv
        assert f.tensors["blk.0.ssm_a"].shape == (128, 16)  # HF's [inner, state]
        assert f.tensors["blk.0.ssm_conv1d.weight"].shape == (128, 4)
        assert f.tensors["blk.0.ssm_dt_norm.weight"].shape == (ref.mamba_dt_rank,)
        assert {"blk.0.ssm_b_norm.weight", "blk.0.ssm_c_norm.weight"} <= f.tensors.keys()
        moe = ref.num_experts > 1
        assert ("blk.1.ffn_gate_inp.weight" in f.tensors) == moe
        assert ("blk.1.ffn_gate_exps.weight" in f.tensors) == moe
        if moe:
            assert f.tensors["blk.1.ffn_gate_exps.weight"].shape == (4, 128, 64)
            assert "blk.0.ffn_gate.weight" in f.tensors  # the dense layers' MLP


def test_llm_generates_hf_greedy_tokens(case):
    """End to end: LLM(model=<file>.gguf) (config, tokenizer, weights from the file)."""
    _, path, src, _ = case
    assert_file_greedy_matches_hf(path, load_hf(src), 17, (7, 22, 41))


@pytest.mark.parametrize("name", ["falcon_h1-norm", "jamba"])
def test_q8_0_file(name, tiny_model_factory, tmp_path):
    """convert_hf_to_gguf.py --outtype q8_0: the matrices Q8_0 (Jamba's dt_proj, 8 columns, not
    whole 32-value blocks: F16), norms, convs, A, D, biases and the router F32; loading gives the
    dequantized values bit for bit, and LLM(model=<file>.gguf) HF's greedy tokens and logprobs
    on them (Falcon-H1's HF reference: the folded weights with every multiplier 1)."""

    arch, overrides = CASES[name]
    src = tiny_model_factory(arch, **overrides)
    path = tmp_path / f"{name}-q8_0.gguf"
    exact: set[str] = set()
    expected = write_gguf(src, path, arch, quant="q8_0", exact=exact)
    f = GGUFFile(path)
    types = {t: type_name(info.ggml_type) for t, info in f.tensors.items()}
    quantized = {"token_embd.weight", "output.weight", "blk.0.ssm_in.weight"}
    quantized |= {"blk.0.ssm_out.weight", "blk.1.attn_q.weight", "blk.1.attn_output.weight"}
    keep = {"blk.0.ssm_conv1d.weight", "blk.0.ssm_a", "blk.0.ssm_d", "blk.0.attn_norm.weight"}
    if arch == "jamba":
        quantized |= {"blk.0.ssm_x.weight", "blk.1.ffn_gate_exps.weight", "blk.0.ffn_down.weight"}
        keep |= {"blk.1.ffn_gate_inp.weight", "blk.0.ssm_dt_norm.weight", "blk.0.ssm_dt.bias"}
        assert types["blk.0.ssm_dt.weight"] == "F16"
    else:
        quantized |= {"blk.0.ffn_gate.weight", "blk.0.attn_k.weight"}
        keep |= {"blk.0.ffn_norm", "blk.0.ssm_norm.weight", "blk.0.ssm_dt.bias"}
    assert {types[t] for t in quantized} == {"Q8_0"}
    assert {types[t] for t in keep} == {"F32"}
    prefix = "model.layers.0.mamba"
    assert {f"{prefix}.in_proj.weight", f"{prefix}.out_proj.weight", "lm_head.weight"} <= exact
    assert_weights_back(dict(gguf_weights(f)), expected)

    ref_dir = dequantized_reference(src, tmp_path / "dequantized", expected)
    if arch == "falcon_h1":  # the folded weights need multipliers of 1
        config = json.loads((ref_dir / "config.json").read_text())
        (ref_dir / "config.json").write_text(json.dumps({**config, **UNIT_MULTIPLIERS}))
    assert_file_logprobs_match_hf(name, path, load_hf(ref_dir), seed=5)


# -- metadata edge cases ------------------------------------------------------------------------
_SSM = {"ssm.conv_kernel": 4, "ssm.state_size": 16, "ssm.inner_size": 128,
        "ssm.time_step_rank": 4, "attention.layer_norm_rms_epsilon": 1e-5}  # fmt: skip


def test_jamba_layer_layout_comes_from_the_file(tmp_path):
    def config(name: str, kv: list[int], moe: tuple[int, ...], **keys):
        tensors = {f"blk.{i}.ssm_in.weight": (256, 64) for i, n in enumerate(kv) if n == 0}
        for i in moe:
            tensors[f"blk.{i}.ffn_gate_inp.weight"] = (4, 64)
            tensors[f"blk.{i}.ffn_gate_exps.weight"] = (4, 128, 64)
        f = write_metadata_only(tmp_path / name, "jamba", len(kv), kv=kv, tensors=tensors, **keys)
        return gguf_to_hf_config(f)

    experts = {"expert_count": 4, "expert_used_count": 2}
    # attention every 3rd layer from 1, experts every 2nd from 0: JambaConfig's periods
    cfg = config("a.gguf", [0, 2, 0, 0, 2, 0], (0, 2, 4), **_SSM, **experts)
    assert cfg.layer_types == ["linear_attention", "full_attention", "linear_attention"] * 2
    assert (cfg.attn_layer_period, cfg.attn_layer_offset) == (3, 1)
    assert cfg.layers_num_experts == [4, 1, 4, 1, 4, 1]
    assert (cfg.mamba_expand, cfg.mamba_dt_rank, cfg.num_key_value_heads) == (2, 4, 2)
    assert not cfg.mamba_conv_bias and not cfg.mamba_proj_bias
    # no attention and no router at all; no expert keys: one expert
    cfg = config("b.gguf", [0, 0, 0], (), **_SSM)
    assert cfg.layer_types == ["linear_attention"] * 3 and cfg.layers_num_experts == [1, 1, 1]
    # attention on layers 1, 2 and 5: no period and offset give those
    with pytest.raises(ValueError, match=r"attention layers \[1, 2, 5\]"):
        config("c.gguf", [0, 2, 2, 0, 0, 2], (), **_SSM)
    # experts every 2nd layer from 3: the offset must be below the period
    with pytest.raises(ValueError, match=r"MoE layers \[3, 5\]"):
        config("d.gguf", [0, 2, 0, 0, 0, 0], (3, 5), **_SSM, **experts)
    # experts narrower than the MLPs (feed_forward_length 128)
    tensors = {"blk.0.ssm_in.weight": (256, 64), "blk.0.ffn_gate_inp.weight": (4, 64),
               "blk.0.ffn_gate_exps.weight": (4, 96, 64)}  # fmt: skip
    f = write_metadata_only(tmp_path / "e.gguf", "jamba", 1, kv=[0], tensors=tensors, **_SSM,
                            **experts)  # fmt: skip
    with pytest.raises(ValueError, match=r"layer 0's experts are 96 wide"):
        gguf_to_hf_config(f)
    # head_count_kv must be per layer
    with pytest.raises(ValueError, match=r"jamba\.attention\.head_count_kv"):
        gguf_to_hf_config(write_metadata_only(tmp_path / "f.gguf", "jamba", 2, kv=2, **_SSM))


def test_falcon_h1_needs_a_mixer_in_every_layer(tmp_path):
    keys = {**_SSM, "ssm.group_count": 1, "ssm.inner_size": 96, "ssm.time_step_rank": 6}
    tensors = {"blk.0.ssm_in.weight": (262, 64)}
    f = write_metadata_only(tmp_path / "a.gguf", "falcon-h1", 2, kv=2, tensors=tensors, **keys)
    with pytest.raises(ValueError, match=r"layer 1 lacks ssm_in"):
        gguf_to_hf_config(f)
    tensors["blk.1.ssm_in.weight"] = (262, 64)
    f = write_metadata_only(tmp_path / "b.gguf", "falcon-h1", 2, kv=2, tensors=tensors, **keys)
    cfg = gguf_to_hf_config(f)
    assert (cfg.mamba_d_ssm, cfg.mamba_n_heads, cfg.mamba_d_head) == (96, 6, 16)
    assert not cfg.mamba_rms_norm and cfg.embedding_multiplier == 1.0
