"""GGUF files of the pure state-space models: Mamba and Falcon Mamba (arch "mamba", Falcon Mamba's
with ssm.dt_b_c_rms) and Mamba2 / Mamba-Codestral ("mamba2"), written from tiny HF models as
llama.cpp's converter (MambaModel / Mamba2Model) lays them out (gguf_writer.py): our loader must
give back HF's weights (A_log through -exp and log: within float32 rounding; all else bit for
bit) and config, and LLM(model=<file>.gguf) HF's greedy tokens; a Q8_0 file (convert_hf_to_gguf.py
--outtype q8_0) its dequantized weights bit for bit and HF's tokens and logprobs on them.

What the format cannot carry is left at what the file implies, so the tiny Mamba2 models use it:
no dt clamp (time_step_limit (0, inf): llama.cpp clamps nothing)."""

from __future__ import annotations

import math

import pytest

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

_NO_CLAMP = {"time_step_limit": (0.0, math.inf)}
# name -> (tiny arch, config overrides)
CASES = {
    # tied embeddings (the converter writes no `output`), conv bias, dt rank 8
    "mamba": ("mamba", {}),
    # dt, B and C normalized (ssm.dt_b_c_rms); untied; a vocab of 516 the converter pads to 520
    "falcon_mamba": ("falcon_mamba", {"vocab_size": 516}),
    # 8 heads of 16 on 2 groups: the gated norm stored [2, 64]
    "mamba2": ("mamba2", _NO_CLAMP),
    # one group; a vocab of 520 the converter pads to 528
    "mamba2-1group": ("mamba2", {**_NO_CLAMP, "n_groups": 1, "vocab_size": 520}),
}
COMMON_KEYS = (
    "hidden_size",
    "num_hidden_layers",
    "vocab_size",
    "tie_word_embeddings",
    "state_size",
    "conv_kernel",
    "expand",
    "use_bias",
    "use_conv_bias",
    "residual_in_fp32",
    "hidden_act",
)
CONFIG_KEYS = {
    "mamba": ("time_step_rank", "intermediate_size"),
    "falcon_mamba": ("time_step_rank", "intermediate_size", "mixer_rms_eps"),
    "mamba2": ("num_heads", "head_dim", "n_groups", "time_step_limit"),
}
# the stored vocabulary: padded to a multiple of 8 (Mamba) / 16 (Mamba2)
TOKENS = {"mamba": 512, "falcon_mamba": 520, "mamba2": 512, "mamba2-1group": 528}


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
    arch = CASES[name][0]
    f = GGUFFile(path)
    ref = load_hf(src).config
    inner = ref.intermediate_size if arch != "mamba2" else ref.num_heads * ref.head_dim
    assert f.get("general.architecture") == ("mamba2" if arch == "mamba2" else "mamba")
    assert len(f.get("tokenizer.ggml.tokens")) == TOKENS[name]
    assert ("output.weight" in f.tensors) == (not ref.tie_word_embeddings)
    # the converter's shapes: conv squeezed to [C, K]; Mamba's A as HF's [inner, state], Mamba2's
    # A and D [H, 1], its gated norm [groups, inner / groups]
    channels = inner if arch != "mamba2" else inner + 2 * ref.n_groups * ref.state_size
    assert f.tensors["blk.0.ssm_conv1d.weight"].shape == (channels, ref.conv_kernel)
    if arch == "mamba2":
        assert f.tensors["blk.0.ssm_a"].shape == f.tensors["blk.0.ssm_d"].shape == (8, 1)
        assert f.tensors["blk.0.ssm_norm.weight"].shape == (ref.n_groups, inner // ref.n_groups)
        assert f.get("mamba2.ssm.time_step_rank") == ref.num_heads
    else:
        assert f.tensors["blk.0.ssm_a"].shape == (inner, ref.state_size)
        assert f.get("mamba.ssm.dt_b_c_rms") is (arch == "falcon_mamba")
    assert_weights_back(dict(gguf_weights(f)), expected)

    config = load_hf_config(resolve_model(str(path)))
    assert config.architectures == ref.architectures
    assert type(config) is type(ref)
    for key in (*COMMON_KEYS, *CONFIG_KEYS.get(name, CONFIG_KEYS.get(arch, ()))):
        want = getattr(ref, key)
        want = list(want) if isinstance(want, tuple) else want
        got = getattr(config, key)
        assert (list(got) if isinstance(got, tuple) else got) == want, key
    # float32 metadata
    assert config.layer_norm_epsilon == pytest.approx(ref.layer_norm_epsilon, rel=1e-6)


def test_llm_generates_hf_greedy_tokens(case):
    """End to end: LLM(model=<file>.gguf) (config, tokenizer, weights from the file)."""
    _, path, src, _ = case
    assert_file_greedy_matches_hf(path, load_hf(src), 13, (5, 21, 37))


@pytest.mark.parametrize("name", ["mamba", "mamba2"])
def test_q8_0_file(name, tiny_model_factory, tmp_path):
    """convert_hf_to_gguf.py --outtype q8_0: the matrices Q8_0 (dt_proj's 8 columns, not whole
    32-value blocks: F16), convs, norms, A, D and biases F32; loading gives the dequantized values
    bit for bit, and LLM(model=<file>.gguf) HF's greedy tokens and logprobs on them."""

    arch, overrides = CASES[name]
    src = tiny_model_factory(arch, **overrides)
    path = tmp_path / f"{name}-q8_0.gguf"
    exact: set[str] = set()
    expected = write_gguf(src, path, arch, quant="q8_0", exact=exact)
    f = GGUFFile(path)
    types = {t: type_name(info.ggml_type) for t, info in f.tensors.items()}
    quantized = {"token_embd.weight", "blk.0.ssm_in.weight", "blk.0.ssm_out.weight"}
    quantized |= {"blk.0.ssm_x.weight"} if arch == "mamba" else {"output.weight"}
    assert {types[t] for t in quantized} == {"Q8_0"}
    if arch == "mamba":
        assert types["blk.0.ssm_dt.weight"] == "F16"
    for t in ("blk.0.ssm_conv1d.weight", "blk.0.ssm_a", "blk.0.ssm_d", "blk.0.attn_norm.weight"):
        assert types[t] == "F32", t
    # the HF names whose expected values are the dequantized ones
    assert {
        f"backbone.layers.{i}.mixer.{m}.weight" for i in range(3) for m in ("in_proj", "out_proj")
    } <= exact
    assert_weights_back(dict(gguf_weights(f)), expected)

    ref_dir = dequantized_reference(src, tmp_path / "dequantized", expected)
    assert_file_logprobs_match_hf(name, path, load_hf(ref_dir), seed=5)


# -- metadata edge cases ------------------------------------------------------------------------
_SSM = {"ssm.conv_kernel": 4, "ssm.state_size": 16, "ssm.inner_size": 128,
        "ssm.time_step_rank": 8, "attention.layer_norm_rms_epsilon": 1e-5}  # fmt: skip


def test_ssm_metadata_defaults_and_errors(tmp_path):
    def config(name: str, arch: str, tensors=None, **keys):
        f = write_metadata_only(tmp_path / name, arch, 2, tensors=tensors, **keys)
        return gguf_to_hf_config(f)

    # dt_b_c_rms picks Falcon Mamba; absent or False: Mamba. No output tensor: tied.
    cfg = config("a.gguf", "mamba", **_SSM, **{"ssm.dt_b_c_rms": True})
    assert type(cfg).__name__ == "FalconMambaConfig"
    assert cfg.architectures == ["FalconMambaForCausalLM"] and cfg.tie_word_embeddings
    assert (cfg.expand, cfg.intermediate_size, cfg.time_step_rank) == (2, 128, 8)
    assert not cfg.use_conv_bias and not cfg.use_bias
    cfg = config("b.gguf", "mamba", {"blk.0.ssm_conv1d.bias": (128,)}, **_SSM)
    assert cfg.architectures == ["MambaForCausalLM"] and cfg.use_conv_bias
    # Mamba2: time_step_rank is the head count, group_count the groups
    cfg = config("c.gguf", "mamba2", **_SSM, **{"ssm.group_count": 4})
    assert cfg.architectures == ["Mamba2ForCausalLM"]
    assert (cfg.num_heads, cfg.head_dim, cfg.n_groups, cfg.expand) == (8, 16, 4, 2)
    assert list(cfg.time_step_limit) == [0.0, math.inf]
    with pytest.raises(ValueError, match=r"mamba2\.ssm\.\*"):  # 8 heads in 3 groups
        config("d.gguf", "mamba2", **_SSM, **{"ssm.group_count": 3})
    with pytest.raises(ValueError, match=r"mamba\.ssm\.inner_size=96 is no whole multiple"):
        config("e.gguf", "mamba", **{**_SSM, "ssm.inner_size": 96})
    keys = {k: v for k, v in _SSM.items() if k != "ssm.state_size"}
    with pytest.raises(ValueError, match=r"mamba\.ssm\.state_size"):
        config("f.gguf", "mamba", **keys)
