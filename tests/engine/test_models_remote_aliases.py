"""Remote-code releases under vLLM's names (models/remote_aliases.py, qwen_v1.py, baichuan.py,
telechat2.py) against HF transformers: each test writes a tiny HF model of a mathematically equal
transformers class, converts its tensors and config.json into the release's own layout (the
Hub's names and config fields), serves that through paged and compares with the HF model:
greedy tokens identical, top-5 logprobs within 1e-3 (float32). Also: Falcon's RW and
StableLM-Epoch configs, MPT / Phi-3.5-MoE / Qwen2.5-Omni under their Hub class names, and bad
config fields refused by name."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from hf_parity import assert_llm_matches, fuse_qkv
from hf_reference import hf_greedy, load_hf_model, random_token_prompts

from paged_engine import LLM
from paged_engine.testing import write_tiny_model

transformers = pytest.importorskip("transformers")
from safetensors.torch import load_file, save_file  # noqa: E402

TOKENS = 6


def _matches(path: Path, hf, seed: int, case: str, prompts: int = 2) -> LLM:
    """paged on `path` gives `hf`'s greedy tokens and top-5 logprobs on random prompts."""
    cases = random_token_prompts(seed, prompts)
    refs = [hf_greedy(hf, p, TOKENS, 5) for p in cases]
    llm = LLM(model=str(path), dtype="float32", max_model_len=96, block_size=16)
    assert_llm_matches(case, llm, cases, refs)
    return llm


def _rewrite(path: Path, state: dict[str, torch.Tensor], config: dict) -> None:
    """The release's tensors and its config.json (replacing transformers')."""
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(config))


def _renamed(state: dict[str, torch.Tensor], names: tuple[tuple[str, str], ...]) -> dict:
    out = {}
    for name, w in state.items():
        for ours, theirs in names:
            name = name.replace(ours, theirs)
        out[name] = w
    return out


def _config(path: Path) -> dict:
    return json.loads((path / "config.json").read_text())


# HF Qwen2's names -> Qwen v1's (q / k / v fused into attn.c_attn apart; w2 is the gate)
QWEN_V1_NAMES = (
    ("model.embed_tokens.", "transformer.wte."),
    ("model.layers.", "transformer.h."),
    ("model.norm.", "transformer.ln_f."),
    (".self_attn.o_proj.", ".attn.c_proj."),
    (".input_layernorm.", ".ln_1."),
    (".post_attention_layernorm.", ".ln_2."),
    (".mlp.gate_proj.", ".mlp.w2."),
    (".mlp.up_proj.", ".mlp.w1."),
    (".mlp.down_proj.", ".mlp.c_proj."),
)


def test_qwen_v1(tmp_path):
    """QWenLMHeadModel: HF Qwen2 (q / k / v biases, one KV head per head) with q, k, v merged
    into c_attn, w2 the gate and w1 the up projection, intermediate_size counting both; the
    context stops at seq_length where dynamic NTK / logn attention would act."""
    path = write_tiny_model(
        tmp_path, "qwen2", seed=1, num_key_value_heads=4, tie_word_embeddings=False
    )
    hf = load_hf_model(path)
    src, state = _config(path), load_file(str(path / "model.safetensors"))
    out = _renamed(fuse_qkv(state, ".attn.c_attn."), QWEN_V1_NAMES)
    assert "transformer.h.0.attn.c_attn.bias" in out
    config = {
        "architectures": ["QWenLMHeadModel"],
        "auto_map": {"AutoConfig": "configuration_qwen.QWenConfig"},
        "model_type": "qwen",
        "hidden_size": src["hidden_size"],
        "num_attention_heads": src["num_attention_heads"],
        "num_hidden_layers": src["num_hidden_layers"],
        "intermediate_size": 2 * src["intermediate_size"],
        "kv_channels": src["hidden_size"] // src["num_attention_heads"],
        "layer_norm_epsilon": src["rms_norm_eps"],
        "rotary_emb_base": 10000,
        "rotary_pct": 1.0,
        "max_position_embeddings": 1024,
        "seq_length": 96,
        "use_dynamic_ntk": True,
        "use_logn_attn": True,
        "no_bias": True,
        "vocab_size": src["vocab_size"],
        "tie_word_embeddings": False,
    }
    _rewrite(path, out, config)
    llm = _matches(path, hf, 1, "qwen-v1")
    assert type(llm.llm_engine.model_runner.model).__name__ == "QWenLMHeadModel"
    assert llm.llm_engine.config.max_model_len == 96  # seq_length: no NTK / logn below it
    with pytest.raises(ValueError, match="max_model_len=128 exceeds"):
        LLM(model=str(path), dtype="float32", max_model_len=128)


def test_baichuan2_rope_and_norm_head(tmp_path):
    """Baichuan-7B's layout (W_pack, rope) with Baichuan2's vocabulary, whose NormHead divides
    each LM-head row by its norm: the release's rows are scaled, the reference's normalized.
    (The tiny model's tokenizer keeps its 512 ids; the tables grow to Baichuan2's size.)"""
    vocab = 125696  # Baichuan2's: vLLM's (and our) NormHead switch
    path = write_tiny_model(tmp_path, "llama", seed=2, num_key_value_heads=4, hidden_size=32)
    state = load_file(str(path / "model.safetensors"))
    rows = torch.Generator().manual_seed(0)
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        extra = torch.randn(vocab - state[name].shape[0], 32, generator=rows)
        state[name] = torch.cat((state[name], extra * state[name].std()))
    state["lm_head.weight"] = torch.nn.functional.normalize(state["lm_head.weight"], dim=-1)
    config = {**_config(path), "vocab_size": vocab}
    _rewrite(path, state, config)
    hf = load_hf_model(path)
    scale = torch.rand(vocab, 1, generator=rows) * 3 + 0.2
    out = _baichuan_tensors({**state, "lm_head.weight": state["lm_head.weight"] * scale})
    _rewrite(path, out, _baichuan_config(config, "BaiChuanForCausalLM"))
    llm = _matches(path, hf, 2, "baichuan2-normhead")
    assert type(llm.llm_engine.model_runner.model).__name__ == "BaichuanForCausalLM"


def _baichuan_tensors(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return fuse_qkv(state, ".self_attn.W_pack.")


def _baichuan_config(src: dict, arch: str) -> dict:
    return {
        "architectures": [arch],
        "auto_map": {"AutoConfig": "configuration_baichuan.BaichuanConfig"},
        "model_type": "baichuan",
        "hidden_size": src["hidden_size"],
        "num_attention_heads": src["num_attention_heads"],
        "num_hidden_layers": src["num_hidden_layers"],
        "intermediate_size": src["intermediate_size"],
        "rms_norm_eps": src["rms_norm_eps"],
        "hidden_act": "silu",
        "model_max_length": 4096,
        "vocab_size": src["vocab_size"],
        "tie_word_embeddings": False,
        "z_loss_weight": 0,
    }


def _alibi_attention(module, query, key, value, attention_mask, scaling, dropout=0.0, **kw):
    """HF eager attention with BLOOM's ALiBi bias (slope x key position) added to the scaled
    scores under a causal mask: Baichuan-13B's attention. query [B, H, q, D], key [B, H, k, D]."""
    from transformers.models.bloom.modeling_bloom import build_alibi_tensor

    b, heads, q_len, _ = query.shape
    k_len = key.shape[2]
    alibi = build_alibi_tensor(torch.ones(b, k_len, dtype=torch.long), heads, torch.float32)
    scores = query @ key.transpose(2, 3) * scaling + alibi.view(b, heads, 1, k_len)
    q_pos = torch.arange(k_len - q_len, k_len)[:, None]
    scores = scores.masked_fill(torch.arange(k_len)[None, :] > q_pos, float("-inf"))
    probs = torch.softmax(scores.float(), dim=-1).to(query.dtype)
    return (probs @ value).transpose(1, 2).contiguous(), probs


def test_baichuan_13b_alibi(tmp_path):
    """BaichuanForCausalLM at a hidden_size other than 4096 (the 13B models): no rope, ALiBi.
    The reference is HF Llama with its rope made the identity and BLOOM's ALiBi in its
    attention (the same slopes for 6 heads, not a power of two)."""
    path = write_tiny_model(
        tmp_path,
        "llama",
        seed=3,
        num_attention_heads=6,
        num_key_value_heads=6,
        head_dim=8,
        hidden_size=48,
    )
    hf = load_hf_model(path)
    transformers.AttentionInterface.register("baichuan_alibi_reference", _alibi_attention)
    hf.set_attn_implementation("baichuan_alibi_reference")
    rope = hf.model.rotary_emb

    def no_rotation(x, position_ids):  # cos 1, sin 0: apply_rotary_pos_emb leaves q, k
        cos, _ = rope.__class__.forward(rope, x, position_ids)
        return torch.ones_like(cos), torch.zeros_like(cos)

    hf.model.rotary_emb.forward = no_rotation
    state = load_file(str(path / "model.safetensors"))
    _rewrite(path, _baichuan_tensors(state), _baichuan_config(_config(path), "BaichuanForCausalLM"))
    llm = _matches(path, hf, 3, "baichuan-13b-alibi")
    layer = llm.llm_engine.model_runner.model.model.layers[0]
    assert layer.self_attn.attn.alibi_slopes is not None and layer.self_attn.rotary_emb is None


def test_baichuan_position_encoding_as_vllm_decides():
    from paged_engine.models.baichuan import baichuan_config

    src = {"hidden_size": 4096, "num_attention_heads": 32, "num_hidden_layers": 1}
    src.update(intermediate_size=8, vocab_size=64000, rms_norm_eps=1e-6)
    assert (
        baichuan_config(_baichuan_config(src, "BaichuanForCausalLM")).position_embedding == "ROPE"
    )
    src.update(hidden_size=5120, num_attention_heads=40)
    assert (
        baichuan_config(_baichuan_config(src, "BaichuanForCausalLM")).position_embedding == "ALIBI"
    )
    assert (
        baichuan_config(_baichuan_config(src, "BaiChuanForCausalLM")).position_embedding == "ROPE"
    )
    assert not baichuan_config(_baichuan_config(src, "BaiChuanForCausalLM")).normalized_head


def test_telechat2(tmp_path):
    """TeleChat2: HF Llama with biases on o_proj and down_proj alone (the others zeroed), k and
    v interleaved per head in key_value, BLOOM-style names and n_head / n_layer fields."""
    path = write_tiny_model(
        tmp_path, "llama", seed=4, num_key_value_heads=4, attention_bias=True, mlp_bias=True
    )
    state = load_file(str(path / "model.safetensors"))
    for name in list(state):
        if name.endswith(".bias") and any(p in name for p in ("q_", "k_", "v_", "gate_", "up_")):
            state[name] = torch.zeros_like(state[name])
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    hf = load_hf_model(path)
    src, heads, d = _config(path), 4, 16
    out = {}
    for name, w in state.items():
        if name.endswith(".bias") and not (".o_proj." in name or ".down_proj." in name):
            continue  # the zeroed ones: TeleChat2 has none
        if ".self_attn.k_proj." in name or ".self_attn.v_proj." in name:
            continue
        if ".self_attn.q_proj." in name:
            k = state[name.replace("q_proj", "k_proj")].reshape(heads, 1, d, -1)
            v = state[name.replace("q_proj", "v_proj")].reshape(heads, 1, d, -1)
            out[name.replace(".q_proj.", ".key_value.")] = torch.cat((k, v), 1).reshape(
                -1, w.shape[1]
            )
            out[name.replace(".q_proj.", ".query.")] = w
            continue
        out[name] = w
    out = _renamed(
        out,
        (
            ("model.embed_tokens.", "transformer.word_embeddings."),
            ("model.layers.", "transformer.h."),
            ("model.norm.", "transformer.ln_f."),
            (".self_attn.o_proj.", ".self_attention.dense."),
            (".self_attn.", ".self_attention."),
        ),
    )
    config = {
        "architectures": ["TeleChat2ForCausalLM"],
        "auto_map": {"AutoConfig": "configuration_telechat2.Telechat2Config"},
        "model_type": "telechat",
        "hidden_size": src["hidden_size"],
        "n_head": heads,
        "n_layer": src["num_hidden_layers"],
        "ffn_hidden_size": src["intermediate_size"],
        "layer_norm_epsilon": src["rms_norm_eps"],
        "vocab_size": src["vocab_size"],
        "seq_length": 1024,
        "training_seqlen": 1024,
        "tie_word_embeddings": False,
        "apply_residual_connection_post_layernorm": False,
    }
    _rewrite(path, out, config)
    _matches(path, hf, 4, "telechat2")


@pytest.mark.parametrize("kind", ["RefinedWeb", "RefinedWebModel"])
def test_rw_falcon_configs(kind, tmp_path):
    """Falcon's first release (RWForCausalLM): "RefinedWeb" is 40B's new decoder architecture
    (n_head_kv grouped KV heads), "RefinedWebModel" 7B's (multi-query, parallel attention); the
    tensors are HF Falcon's already."""
    new = kind == "RefinedWeb"
    overrides = {"new_decoder_architecture": new, "multi_query": True, "parallel_attn": True}
    overrides["ffn_hidden_size"] = 4 * 64  # RW's MLP is always 4 x hidden_size
    path = write_tiny_model(tmp_path, "falcon", seed=5, **overrides)
    hf = load_hf_model(path)
    src = _config(path)
    config = {
        "architectures": ["RWForCausalLM"],
        "model_type": kind,
        "hidden_size": src["hidden_size"],
        "n_head": src["num_attention_heads"],
        "n_layer": src["num_hidden_layers"],
        "layer_norm_epsilon": src["layer_norm_epsilon"],
        "vocab_size": src["vocab_size"],
        "bias": False,
        "alibi": False,
        "parallel_attn": True,
        "bos_token_id": 1,
        "eos_token_id": 2,
    }
    config.update({"n_head_kv": src["num_kv_heads"]} if new else {"multi_query": True})
    _rewrite(path, load_file(str(path / "model.safetensors")), config)
    llm = _matches(path, hf, 5, kind)
    assert type(llm.llm_engine.model_runner.model).__name__ == "FalconForCausalLM"


def test_stablelm_epoch_config(tmp_path):
    """StableLM-3B-4E1T's remote config (StableLMEpochForCausalLM): rope_pct / norm_eps."""
    path = write_tiny_model(tmp_path, "stablelm", seed=6)
    hf = load_hf_model(path)
    src = _config(path)
    config = {k: src[k] for k in ("hidden_size", "intermediate_size", "vocab_size")}
    config.update(
        architectures=["StableLMEpochForCausalLM"],
        model_type="stablelm_epoch",
        num_hidden_layers=src["num_hidden_layers"],
        num_attention_heads=src["num_attention_heads"],
        num_key_value_heads=src["num_key_value_heads"],
        rope_pct=src["rope_parameters"]["partial_rotary_factor"],
        rope_theta=src["rope_parameters"]["rope_theta"],
        norm_eps=src["layer_norm_eps"],
        use_qkv_bias=src["use_qkv_bias"],
        max_position_embeddings=src["max_position_embeddings"],
        tie_word_embeddings=False,
        hidden_act="silu",
    )
    _rewrite(path, load_file(str(path / "model.safetensors")), config)
    _matches(path, hf, 6, "stablelm-epoch")


@pytest.mark.parametrize(
    ("arch", "name"), [("mpt", "MPTForCausalLM"), ("phimoe", "PhiMoEForCausalLM")]
)
def test_names_alone(arch, name, tmp_path):
    """MosaicML's MPT and Phi-3.5-MoE name their class otherwise; transformers reads the rest."""
    path = write_tiny_model(tmp_path, arch, seed=7)
    hf = load_hf_model(path)
    config = _config(path)
    (path / "config.json").write_text(json.dumps({**config, "architectures": [name]}))
    _matches(path, hf, 7, name, prompts=1)


@pytest.mark.parametrize(
    ("arch", "bad", "field"),
    [
        ("QWenLMHeadModel", {"intermediate_size": 33}, "intermediate_size"),
        ("QWenLMHeadModel", {"kv_channels": "16"}, "kv_channels"),
        ("TeleChat2ForCausalLM", {"n_layer": None}, "n_layer"),
        ("RWForCausalLM", {"n_head": 0}, "n_head"),
        ("StableLMEpochForCausalLM", {"norm_eps": "x"}, "norm_eps"),
        ("BaichuanForCausalLM", {"hidden_act": "gelu"}, "hidden_act"),
    ],
)
def test_bad_config_fields_are_named(arch, bad, field, tmp_path):
    from paged_engine.models.remote_aliases import remote_config

    model_type = {"RWForCausalLM": "RefinedWebModel", "StableLMEpochForCausalLM": "x"}
    raw = {
        "architectures": [arch],
        "model_type": model_type.get(arch, "remote"),
        "hidden_size": 32,
        "num_attention_heads": 4,
        "n_head": 4,
        "num_hidden_layers": 1,
        "n_layer": 1,
        "intermediate_size": 64,
        "ffn_hidden_size": 64,
        "vocab_size": 64,
        **bad,
    }
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ValueError, match=field):
        remote_config(tmp_path)


def test_qwen2_5_omni_preview_class_name(tmp_path):
    """Qwen2.5-Omni-7B's config.json names the preview's Qwen2_5OmniModel: read as
    Qwen2_5OmniForConditionalGeneration, its thinker serves text as HF's, and the image path
    (which reads the config on its own) knows the checkpoint."""
    from hf_parity import assert_serves_like_hf, load_hf_as_saved
    from test_models_vlm_text_more import write_tiny_wrapper

    from paged_engine.multimodal.processor import wrapper_config

    path = write_tiny_wrapper(tmp_path, "qwen2_5_omni", seed=8)
    hf = load_hf_as_saved(path).thinker
    config = _config(path)
    (path / "config.json").write_text(json.dumps({**config, "architectures": ["Qwen2_5OmniModel"]}))
    assert_serves_like_hf("qwen2.5-omni", path, random_token_prompts(8, 2), TOKENS, hf=hf)
    seen = wrapper_config(path)
    assert seen is not None and seen.architectures == ["Qwen2_5OmniThinkerForConditionalGeneration"]
