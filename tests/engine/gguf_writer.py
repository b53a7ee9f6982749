"""Test helper: a GGUF file written from a tiny HF model directory the way llama.cpp's
convert_hf_to_gguf.py lays one out, with the `gguf` package's writer and its own HF -> GGUF
tensor-name map (so our loader is checked against llama.cpp's naming, not its own mirror).

What the converter does and we redo here: Llama-family q/k rows permuted (arch "llama", Mixtral
included), Gemma norm weights stored as 1 + w, per-expert matrices merged into one [E, ...]
tensor per layer (or, `merged_experts=False`, old Mixtral files' one tensor per expert), a tied
head left out, Phi-3's longrope factors as `rope_factors_{long,short}` tensors.

Hybrids, as convert_hf_to_gguf.py's Qwen3NextModel / _LinearAttentionVReorderBase (Qwen3.5,
Qwen3.5-MoE) and LFM2Model / LFM2MoeModel do: (1 + w) norms stored as w + 1 except
linear_attn.norm, A_log stored as -exp(A_log), dt_bias renamed dt_proj.bias, conv weights
squeezed to [C, K], Qwen3-Next's in_proj_qkvz split into attn_qkv + attn_gate, Qwen3.5's value
heads reordered grouped -> tiled, LFM2's expert bias renamed expert_bias.bias, the ssm.* /
full_attention_interval / shortconv.l_cache keys and LFM2's per-layer head_count_kv.

Mamba2 hybrids, as Mamba2Model / GraniteHybridModel / NemotronHModel do: A_log stored as
-exp(A_log) and D, both [H, 1]; dt_bias renamed dt_proj.bias (Nemotron 3: dt.bias); conv1d weights
squeezed; the gated norm reshaped to [groups, inner / groups]; q / k rows permuted as Llama's;
Granite's fused input_linear split into gate / up (experts, shared MLP, or a dense model's
ffn_gate / ffn_up / ffn_down), its multipliers as attention.scale / embedding_scale /
residual_scale / logit_scale; Nemotron 3's experts merged (model.layers.N.mlp.experts.*), its
router bias renamed e_score_correction.bias; per-layer head_count_kv (and Nemotron-H's
feed_forward_length), ssm.* keys, context_length 2**20 and rope.scaling.finetuned False (no rope).
Layer kinds are taken from the config by meaning (the converter matches the Hub configs' names:
"mamba" / "attention" lists or "M" / "*" / "-" / "E" patterns, not transformers 5's
"linear_attention" / "full_attention"), and Nemotron-H is MoE when it has MoE blocks.

Pure state-space models, as MambaModel / Mamba2Model do: A_log stored as -exp(A_log) (Mamba:
[inner, state] as HF has it; Mamba2: [H, 1], with D), Mamba2's dt_bias renamed dt_proj.bias and
its gated norm reshaped [groups, inner / groups], conv1d weights squeezed; head_count and
feed_forward_length 0, context_length 2**20, ssm.* keys (Mamba: dt_b_c_rms, True for Falcon
Mamba; Mamba2: group_count, time_step_rank = inner / head_dim); the token list padded with
`[PAD<i>]` to a multiple of 8 (Mamba) / 16 (Mamba2).

Falcon-H1, as FalconH1Model does (Mamba2Model's mixer transforms and keys first): every
multiplier folded into a weight, none written (token_embd x embedding_multiplier, output x
lm_head_multiplier, attn_q / attn_v x attention_in_multiplier, attn_k x key_multiplier x
attention_in_multiplier, attn_output x attention_out_multiplier, ssm_in x ssm_in_multiplier and
its z / x / B / C / dt row blocks x ssm_multipliers, ssm_out x ssm_out_multiplier, ffn_gate /
ffn_down x mlp_multipliers); the pre-MLP norm as `blk.N.ffn_norm` (no `.weight`); ssm.* keys
(inner_size mamba_d_ssm, time_step_rank = inner / mamba_d_head), then its attention keys over
Mamba2Model's zeros. The expected weights are the folded ones (the converter's own float32
products), in HF's names and shapes.

Jamba, as JambaModel does: A_log stored as -exp(A_log) ([inner, state]), conv1d weights
squeezed, experts merged (under Qwen2-MoE's `mlp.experts` name), the router `ffn_gate_inp`;
per-layer head_count_kv (0 on Mamba layers), ssm.* keys, expert_count / expert_used_count.
Its converter writes a SentencePiece vocabulary (tokenizer.model, else the HF tokenizer as
"llama"); we write the tiny model's byte-level BPE one as for the other archs.

More transformer archs (MORE_ARCHS; conversion/{exaone,apertus,arcee,granite,olmo,minimax,
hunyuan,dots1,smollm3}.py): TextModel's keys, then each class's own (_write_more_metadata;
Granite's: its head_dim dropped, its multipliers as *_scale keys when set, GraniteMoe's shared
MLP width). Tensors as HF has them except: Arcee's, Granite's and SmolLM3's q/k rows permuted
(LlamaModel; Apertus turns that off), GraniteMoe's fused [gate; up] experts and shared MLP split
in two, Apertus's xIELU scalars moved into xielu.* metadata arrays, MiniMax-M2's / dots1's
e_score_correction_bias renamed e_score_correction.bias, experts merged; Llama 3 rope scaling
(EXAONE 4, Apertus) as `rope_freqs`; Hunyuan's NTK-alpha rope baked into rope.freq_base.

Older archs (OLD_ARCHS; FalconModel, StarCoderModel, NemotronModel, DbrxModel; _write_old_metadata):
Falcon's query_key_value reordered per KV group [q.., k, v] -> [all q; all k; all v],
context_length 2048 and feed_forward_length 4 x hidden whatever the config says; StarCoder as HF
has it with head_count_kv 1; Nemotron's norm weights stored as w + 1, rope.dimension_count
partial_rotary_factor x hidden / heads; DBRX's stacked experts viewed [E, ff, d] (w2 transposed
per expert to [E, d, ff]) and named `.weight`, clip_qkv as attention.clamp_kqv, layer norm eps
1e-5. InternLM3 is written as "llama" (q/k permuted, as InternLM3Model does).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import numpy as np
import torch

# our tiny arch -> (llama.cpp general.architecture, gguf MODEL_ARCH member)
GGUF_ARCH = {
    "llama": ("llama", "LLAMA"),
    "mixtral": ("llama", "LLAMA"),
    "qwen2": ("qwen2", "QWEN2"),
    "qwen3": ("qwen3", "QWEN3"),
    "qwen2_moe": ("qwen2moe", "QWEN2MOE"),
    "qwen3_moe": ("qwen3moe", "QWEN3MOE"),
    "gemma": ("gemma", "GEMMA"),
    "gemma2": ("gemma2", "GEMMA2"),
    "gemma3": ("gemma3", "GEMMA3"),
    "phi3": ("phi3", "PHI3"),
    "qwen3_next": ("qwen3next", "QWEN3NEXT"),
    "qwen3_5": ("qwen35", "QWEN35"),
    "qwen3_5_moe": ("qwen35moe", "QWEN35MOE"),
    "lfm2": ("lfm2", "LFM2"),
    "lfm2_moe": ("lfm2moe", "LFM2MOE"),
    "granitemoehybrid": ("granitehybrid", "GRANITE_HYBRID"),
    "nemotron_h": ("nemotron_h", "NEMOTRON_H"),  # nemotron_h_moe with MoE blocks (_gguf_arch)
    "mamba": ("mamba", "MAMBA"),
    "falcon_mamba": ("mamba", "MAMBA"),
    "mamba2": ("mamba2", "MAMBA2"),
    "falcon_h1": ("falcon-h1", "FALCON_H1"),
    "jamba": ("jamba", "JAMBA"),
    "exaone4": ("exaone4", "EXAONE4"),
    "apertus": ("apertus", "APERTUS"),
    "arcee": ("arcee", "ARCEE"),
    "granite": ("granite", "GRANITE"),
    "granitemoe": ("granitemoe", "GRANITE_MOE"),
    "granitemoeshared": ("granitemoe", "GRANITE_MOE"),
    "smollm3": ("smollm3", "SMOLLM3"),
    "olmo2": ("olmo2", "OLMO2"),  # Olmo2Model: TextModel's keys and tensors
    "seed_oss": ("seed_oss", "SEED_OSS"),  # SeedOssModel: likewise
    "glm4": ("glm4", "GLM4"),  # Glm4Model: likewise, plus its partial rotary dim
    "starcoder2": ("starcoder2", "STARCODER2"),  # StarCoder2Model: TextModel's keys and tensors
    "ernie4_5": ("ernie4_5", "ERNIE4_5"),  # Ernie4_5Model: likewise (HF's split projections)
    "gpt_oss": ("gpt-oss", "GPT_OSS"),
    "llama4": ("llama4", "LLAMA4"),
    "deepseek_v2": ("deepseek2", "DEEPSEEK2"),
    "deepseek_v3": ("deepseek2", "DEEPSEEK2"),
    "olmoe": ("olmoe", "OLMOE"),
    "minimax_m2": ("minimax-m2", "MINIMAXM2"),
    "hunyuan_v1_dense": ("hunyuan-dense", "HUNYUAN_DENSE"),
    "hunyuan_v1_moe": ("hunyuan-moe", "HUNYUAN_MOE"),
    "dots1": ("dots1", "DOTS1"),
    "falcon": ("falcon", "FALCON"),
    "gpt_bigcode": ("starcoder", "STARCODER"),
    "nemotron": ("nemotron", "NEMOTRON"),
    "dbrx": ("dbrx", "DBRX"),
    "internlm3": ("llama", "LLAMA"),  # InternLM3Model: model_arch LLAMA, q/k permuted
}
OLD_ARCHS = ("falcon", "gpt_bigcode", "nemotron", "dbrx")
LLAMAS = ("llama", "mixtral", "internlm3")  # q/k permuted
GRANITES = ("granite", "granitemoe", "granitemoeshared")
MORE_ARCHS = ("exaone4", "apertus", "arcee", *GRANITES, "smollm3", "olmoe", "minimax_m2",
              "hunyuan_v1_dense", "hunyuan_v1_moe", "dots1", "gpt_oss", "llama4",
              "deepseek_v2", "deepseek_v3")  # fmt: skip
DEEPSEEKS = ("deepseek_v2", "deepseek_v3")
QWEN_HYBRIDS = ("qwen3_next", "qwen3_5", "qwen3_5_moe")
LFM2S = ("lfm2", "lfm2_moe")
MAMBA_HYBRIDS = ("granitemoehybrid", "nemotron_h")
SSMS = ("mamba", "falcon_mamba", "mamba2")  # pure state-space models
OTHER_HYBRIDS = ("falcon_h1", "jamba")
HYBRIDS = QWEN_HYBRIDS + LFM2S + MAMBA_HYBRIDS + SSMS + OTHER_HYBRIDS
# MambaModel / Mamba2Model.set_vocab: the vocabulary padded to a multiple of this
_SSM_PAD_VOCAB = {"mamba": 8, "falcon_mamba": 8, "mamba2": 16}
_EXPERT = re.compile(
    r"^((?:model|backbone)\.layers\.\d+\.(?:mlp|block_sparse_moe|feed_forward|mixer)\.experts)"
    r"\.(\d+)\.(\w+)\.weight$"
)


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """What llama.cpp's converter does to Llama q/k rows (from its documented layout)."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def _rope_params(cfg: dict) -> dict:
    rope = cfg.get("rope_parameters") or {}
    return rope.get("full_attention", rope)


def _lfm2_ff(cfg: dict) -> int:
    """LFM2Model._add_feed_forward_length: the MLP width LFM2 auto-adjusts to."""
    ff = cfg["intermediate_size"]
    if cfg["block_auto_adjust_ff_dim"]:
        ff = int(2 * ff / 3)
        if cfg.get("block_ffn_dim_multiplier") is not None:
            ff = int(cfg["block_ffn_dim_multiplier"] * ff)
        multiple = cfg["block_multiple_of"]
        ff = multiple * ((ff + multiple - 1) // multiple)
    return ff


def _gguf_arch(tiny_arch: str, cfg: dict) -> tuple[str, str]:
    """(general.architecture, MODEL_ARCH member): NemotronHModel picks NEMOTRON_H_MOE for MoE."""
    if tiny_arch == "nemotron_h" and "moe" in _kinds(tiny_arch, cfg):
        return "nemotron_h_moe", "NEMOTRON_H_MOE"
    return GGUF_ARCH[tiny_arch]


def _kinds(tiny_arch: str, cfg: dict) -> list[str]:
    """Each layer's kind, "mamba" / "attention" / "mlp" / "moe", whatever the config calls it."""
    names = {"linear_attention": "mamba", "full_attention": "attention", "M": "mamba",
             "*": "attention", "-": "mlp", "E": "moe"}  # fmt: skip
    if tiny_arch == "granitemoehybrid":
        listed = cfg["layer_types"]
    else:
        listed = cfg.get("layers_block_type") or list(cfg["hybrid_override_pattern"])
    return [names.get(k, k) for k in listed]


def _write_granite_keys(w, cfg: dict) -> None:
    """GraniteModel's multipliers, then GraniteMoeModel's shared MLP width: each only when set."""
    for key, add in (
        ("attention_multiplier", w.add_attention_scale),
        ("embedding_multiplier", w.add_embedding_scale),
        ("residual_multiplier", w.add_residual_scale),
        ("logits_scaling", w.add_logit_scale),
        ("shared_intermediate_size", w.add_expert_shared_feed_forward_length),
    ):
        if cfg.get(key):
            add(cfg[key])


def _write_mamba_metadata(w, arch: str, tiny_arch: str, cfg: dict) -> None:
    """GraniteHybridModel.set_gguf_parameters (GraniteMoeModel's, then the hybrid's keys), and
    NemotronHModel's on top; the last value of a key written twice."""
    kinds = _kinds(tiny_arch, cfg)
    granite = tiny_arch == "granitemoehybrid"
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(2**20)  # no rope: GraniteHybridModel's use_rope is False
    w.add_embedding_length(cfg["hidden_size"])
    if granite:
        w.add_feed_forward_length(cfg["intermediate_size"])
    else:  # per layer: MLP (dense) or MoE (Nemotron 3) blocks, 0 elsewhere
        ff = cfg["moe_intermediate_size"] if arch == "nemotron_h_moe" else cfg["intermediate_size"]
        w.add_feed_forward_length([ff if k in ("mlp", "moe") else 0 for k in kinds])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv([cfg["num_key_value_heads"] if k == "attention" else 0 for k in kinds])
    rope_theta = _rope_params(cfg).get("rope_theta")
    if rope_theta is not None:
        w.add_rope_freq_base(rope_theta)
    if "rms_norm_eps" in cfg:
        w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    if "layer_norm_epsilon" in cfg:
        w.add_layer_norm_eps(cfg["layer_norm_epsilon"])
    if granite:  # TextModel's expert keys (0 experts for a dense model)
        w.add_expert_count(cfg["num_local_experts"])
        w.add_expert_used_count(cfg["num_experts_per_tok"])
    w.add_vocab_size(cfg["vocab_size"])
    w.add_rope_dimension_count(cfg["hidden_size"] // cfg["num_attention_heads"])
    if granite:
        _write_granite_keys(w, cfg)
        heads, inner = cfg["mamba_n_heads"], cfg["mamba_expand"] * cfg["hidden_size"]
        w.add_ssm_conv_kernel(cfg["mamba_d_conv"])
        w.add_ssm_state_size(cfg["mamba_d_state"])
        w.add_ssm_group_count(cfg["mamba_n_groups"])
    else:
        heads, inner = cfg["mamba_num_heads"], cfg["mamba_num_heads"] * cfg["mamba_head_dim"]
        w.add_ssm_conv_kernel(cfg["conv_kernel"])
        w.add_ssm_state_size(cfg["ssm_state_size"])
        w.add_ssm_group_count(cfg["n_groups"])
    w.add_ssm_inner_size(inner)
    w.add_ssm_time_step_rank(heads)
    w.add_rope_scaling_finetuned(False)
    if granite:
        return
    w.add_key_length(cfg["head_dim"])
    w.add_value_length(cfg["head_dim"])
    w.add_add_bos_token(arch == "nemotron_h")  # NemotronHModel.set_vocab, dense models only
    if arch != "nemotron_h_moe":
        return
    w.add_expert_used_count(cfg["num_experts_per_tok"])
    w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    w.add_expert_shared_feed_forward_length(cfg["moe_shared_expert_intermediate_size"])
    w.add_expert_count(cfg["n_routed_experts"])
    w.add_expert_shared_count(cfg["n_shared_experts"])
    w.add_expert_weights_norm(cfg["norm_topk_prob"])
    w.add_expert_weights_scale(cfg["routed_scaling_factor"])
    w.add_expert_group_count(cfg["n_group"])
    w.add_expert_group_used_count(cfg["topk_group"])  # TextModel's
    if cfg.get("moe_latent_size") is not None:
        w.add_moe_latent_size(cfg["moe_latent_size"])


def _write_ssm_metadata(w, tiny_arch: str, cfg: dict) -> None:
    """MambaModel / Mamba2Model.set_gguf_parameters (neither calls TextModel's)."""
    hidden = cfg["hidden_size"]
    inner = cfg.get("intermediate_size") or 2 * hidden  # Mamba2Config saves none
    w.add_context_length(2**20)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(0)
    w.add_head_count(0)
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_ssm_conv_kernel(cfg["conv_kernel"])
    w.add_ssm_inner_size(inner)
    w.add_ssm_state_size(cfg["state_size"])
    if tiny_arch == "mamba2":
        w.add_ssm_time_step_rank(inner // cfg["head_dim"])
        w.add_ssm_group_count(cfg["n_groups"])
    else:
        rank = cfg["time_step_rank"]
        w.add_ssm_time_step_rank(-(hidden // -16) if rank == "auto" else rank)
    w.add_layer_norm_rms_eps(cfg["layer_norm_epsilon"])
    if tiny_arch != "mamba2":
        w.add_ssm_dt_b_c_rms(cfg["model_type"] == "falcon_mamba")


def _write_falcon_h1_metadata(w, cfg: dict) -> None:
    """Mamba2Model.set_gguf_parameters, then FalconH1Model's: the values each key ends with."""
    inner = cfg["mamba_d_ssm"]
    w.add_vocab_size(cfg["vocab_size"])
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg.get("max_position_embeddings", 0))
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_key_length(cfg["head_dim"])
    w.add_value_length(cfg["head_dim"])
    w.add_ssm_conv_kernel(cfg["mamba_d_conv"])
    w.add_ssm_inner_size(inner)
    w.add_ssm_state_size(cfg["mamba_d_state"])
    w.add_ssm_time_step_rank(inner // cfg["mamba_d_head"])
    w.add_ssm_group_count(cfg["mamba_n_groups"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_rope_freq_base(_rope_params(cfg)["rope_theta"])


def _write_jamba_metadata(w, cfg: dict) -> None:
    """JambaModel.set_gguf_parameters (no TextModel keys)."""
    layers, hidden = cfg["num_hidden_layers"], cfg["hidden_size"]
    offset, period = cfg["attn_layer_offset"], cfg["attn_layer_period"]
    kv = [cfg["num_key_value_heads"] if i >= offset and (i - offset) % period == 0 else 0
          for i in range(layers)]  # fmt: skip
    w.add_block_count(layers)
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(kv)
    w.add_ssm_conv_kernel(cfg.get("mamba_d_conv") or 4)
    w.add_ssm_inner_size(cfg["mamba_expand"] * hidden)
    w.add_ssm_state_size(cfg.get("mamba_d_state") or 16)
    w.add_ssm_time_step_rank(cfg.get("mamba_dt_rank") or -(hidden // -16))
    w.add_layer_norm_rms_eps(cfg.get("rms_norm_eps") or 1e-6)
    w.add_expert_count(cfg.get("num_local_experts") or cfg["num_experts"])
    w.add_expert_used_count(cfg["num_experts_per_tok"])


def llama3_rope_factors(cfg: dict) -> np.ndarray | None:
    """LlamaModel / Exaone4Model.generate_extra_tensors: Llama 3's scaling as one divisor per
    rotary frequency (`rope_freqs`); None for other ropes. (Our own arithmetic: smooth
    interpolation between the low- and high-frequency wavelength bounds.)"""
    rope = _rope_params(cfg)
    if (rope.get("rope_type") or "").lower() != "llama3":
        return None
    dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    base = rope.get("rope_theta", 10000.0)
    freqs = 1.0 / (base ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    factor = rope["factor"]
    low, high = rope.get("low_freq_factor", 1.0), rope.get("high_freq_factor", 4.0)
    old = rope.get("original_max_position_embeddings", 8192)
    out = []
    for freq in freqs:
        wavelen = 2 * np.pi / freq
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def _write_more_metadata(w, tiny_arch: str, cfg: dict) -> None:
    """TextModel.set_gguf_parameters, then the arch class's own keys (the last value of a key
    written twice only)."""
    import gguf

    rope = _rope_params(cfg)
    hidden, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    head_dim = None if tiny_arch in GRANITES else cfg.get("head_dim")  # GraniteModel pops it
    context, theta = cfg["max_position_embeddings"], rope.get("rope_theta", 10000.0)
    if tiny_arch.startswith("hunyuan") and rope.get("rope_type") == "dynamic":
        # NTK by alpha baked into the base (the MoE converter takes hidden / heads per head)
        dim = head_dim if tiny_arch == "hunyuan_v1_dense" else hidden // heads
        theta = theta * rope["alpha"] ** (dim / (dim - 2))
        context = 256 * 1024
        w.add_rope_scaling_type(gguf.RopeScalingType.NONE)
        w.add_rope_scaling_factor(1)
        w.add_rope_scaling_orig_ctx_len(256 * 1024)
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(context)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_rope_freq_base(theta)
    w.add_layer_norm_rms_eps(1e-5 if tiny_arch == "olmoe" else cfg["rms_norm_eps"])
    experts = cfg.get("num_local_experts") or cfg.get("num_experts") or cfg.get("n_routed_experts")
    if experts and tiny_arch != "hunyuan_v1_dense":
        w.add_expert_count(experts)
    if cfg.get("num_experts_per_tok"):
        w.add_expert_used_count(cfg["num_experts_per_tok"])
    if head_dim:
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    if tiny_arch in ("exaone4", "apertus", "arcee", *GRANITES, "smollm3", "llama4"):
        w.add_vocab_size(cfg["vocab_size"])
    if tiny_arch in ("apertus", "arcee", *GRANITES, "smollm3", "llama4"):  # LlamaModel
        w.add_rope_dimension_count(head_dim or hidden // heads)
    if tiny_arch in GRANITES:
        _write_granite_keys(w, cfg)
    if tiny_arch == "arcee" and rope.get("rope_type") == "yarn":
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(rope["factor"])
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    if tiny_arch == "exaone4" and cfg.get("sliding_window") is not None:
        w.add_sliding_window(cfg["sliding_window"])
        w.add_sliding_window_pattern([t == "sliding_attention" for t in cfg["layer_types"]])
    if tiny_arch == "gpt_oss":  # GptOssModel: the window, the experts' width, YaRN
        w.add_sliding_window(cfg["sliding_window"])
        w.add_expert_feed_forward_length(cfg["intermediate_size"])
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(rope["factor"])
        w.add_rope_scaling_orig_ctx_len(rope.get("original_max_position_embeddings", 4096))
    if tiny_arch == "llama4":  # Llama4Model: the dense width as feed_forward_length
        w.add_feed_forward_length(cfg["intermediate_size_mlp"])
        w.add_interleave_moe_layer_step(cfg["interleave_moe_layer_step"])
        w.add_expert_feed_forward_length(cfg["intermediate_size"])
    if tiny_arch in DEEPSEEKS:  # DeepseekV2Model: MLA as MQA, its real sizes as *_mla
        _write_deepseek2_keys(w, tiny_arch, cfg)
    if tiny_arch == "minimax_m2":
        w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)  # scoring_func sigmoid
        w.add_expert_feed_forward_length(cfg["intermediate_size"])
        w.add_rope_dimension_count(cfg["rotary_dim"])
    if tiny_arch == "hunyuan_v1_moe":
        first = {k: v[0] if isinstance(v, list) else v for k, v in cfg.items()}
        w.add_expert_shared_feed_forward_length(cfg["intermediate_size"])
        w.add_expert_feed_forward_length(first["moe_intermediate_size"])
        w.add_expert_used_count(first["moe_topk"])
        w.add_expert_shared_count(first["num_shared_expert"])
    if tiny_arch == "dots1":  # Qwen2MoeModel's, then Dots1Model's
        w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
        w.add_leading_dense_block_count(cfg["first_k_dense_replace"])
        w.add_expert_shared_count(cfg["n_shared_experts"])
        w.add_expert_weights_scale(cfg["routed_scaling_factor"])
        w.add_expert_weights_norm(cfg["norm_topk_prob"])
        w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)  # scoring_func noaux_tc


def _write_deepseek2_keys(w, tiny_arch: str, cfg: dict) -> None:
    import gguf

    kv, rope_dims = cfg["kv_lora_rank"], cfg["qk_rope_head_dim"]
    w.add_head_count_kv(1)
    w.add_leading_dense_block_count(cfg["first_k_dense_replace"])
    w.add_vocab_size(cfg["vocab_size"])
    if cfg.get("q_lora_rank"):
        w.add_q_lora_rank(cfg["q_lora_rank"])
    w.add_kv_lora_rank(kv)
    w.add_key_length(kv + rope_dims)
    w.add_value_length(kv)
    w.add_key_length_mla(cfg["qk_nope_head_dim"] + rope_dims)
    w.add_value_length_mla(cfg["v_head_dim"])
    w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    w.add_expert_shared_count(cfg["n_shared_experts"])
    w.add_expert_weights_scale(cfg["routed_scaling_factor"])
    if cfg.get("norm_topk_prob"):
        w.add_expert_weights_norm(True)
    w.add_rope_dimension_count(rope_dims)
    if tiny_arch == "deepseek_v3":  # TextModel: scoring_func sigmoid; V2 files leave it out
        w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    if cfg.get("n_group"):
        w.add_expert_group_count(cfg["n_group"])
        w.add_expert_group_used_count(cfg["topk_group"])
    rope = _rope_params(cfg)
    if rope.get("rope_type") == "yarn":
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(rope["factor"])
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        w.add_rope_scaling_yarn_log_mul(0.1 * rope["mscale_all_dim"])


def _write_mtp_layer(w, cfg: dict) -> None:
    """One multi-token-prediction layer after the decoder's: block_count + 1,
    nextn_predict_layers 1, its nextn.* tensors and a layer norm of its own (the loader skips
    them all)."""
    layer, hidden = cfg["num_hidden_layers"], cfg["hidden_size"]
    w.add_block_count(layer + 1)
    w.add_nextn_predict_layers(1)
    rng = np.random.default_rng(0)
    for part, shape in (("nextn.eh_proj", (hidden, 2 * hidden)), ("nextn.enorm", (hidden,)),
                        ("nextn.hnorm", (hidden,)), ("attn_norm", (hidden,))):  # fmt: skip
        w.add_tensor(f"blk.{layer}.{part}.weight", rng.standard_normal(shape).astype(np.float32))


def _more(tiny_arch: str, cfg: dict, name: str, arr: np.ndarray):
    """The arch class's modify_tensors before the name map: [(HF-side name, array)]."""
    if tiny_arch == "apertus" and ".act_fn." in name:
        return []  # xielu.* metadata (write_gguf)
    if tiny_arch == "gpt_oss":  # GptOssModel.modify_tensors, for experts not in MXFP4
        if name.endswith(".sinks"):
            return [(name + ".weight", arr)]
        bid = int(name.split(".")[2]) if ".layers." in name else None
        stem = f"blk.{bid}.ffn"
        pair = None
        if name.endswith("experts.gate_up_proj"):  # [E, H, 2I] -> even / odd rows of [E, 2I, H]
            t, kind = arr.transpose(0, 2, 1), "weight"
            pair = t[:, ::2], t[:, 1::2]
        elif name.endswith("experts.gate_up_proj_bias"):  # [E, 2I] -> even / odd columns
            pair, kind = (arr[..., ::2], arr[..., 1::2]), "bias"
        if pair is not None:
            gate, up = (np.ascontiguousarray(p) for p in pair)
            return [(("gguf", f"{stem}_gate_exps.{kind}"), gate),
                    (("gguf", f"{stem}_up_exps.{kind}"), up)]  # fmt: skip
        if name.endswith("experts.down_proj"):
            return [
                (("gguf", f"{stem}_down_exps.weight"), np.ascontiguousarray(arr.transpose(0, 2, 1)))
            ]
        if name.endswith("experts.down_proj_bias"):
            return [(("gguf", f"{stem}_down_exps.bias"), arr)]
    if tiny_arch == "llama4" and ".experts." in name:  # Llama4Model.modify_tensors
        stem = f"blk.{name.split('.')[2]}.ffn"
        if name.endswith("gate_up_proj"):  # [E, H, 2I] -> the halves of its transpose
            gate, up = np.split(arr.transpose(0, 2, 1), 2, axis=1)
            return [(("gguf", f"{stem}_gate_exps.weight"), np.ascontiguousarray(gate)),
                    (("gguf", f"{stem}_up_exps.weight"), np.ascontiguousarray(up))]  # fmt: skip
        return [
            (("gguf", f"{stem}_down_exps.weight"), np.ascontiguousarray(arr.transpose(0, 2, 1)))
        ]
    if tiny_arch in DEEPSEEKS and name.endswith("kv_b_proj.weight"):
        # per head: key rows (transposed, [H, kv_lora, nope]) and value rows ([H, v, kv_lora])
        nope, heads = cfg["qk_nope_head_dim"], cfg["num_attention_heads"]
        kv_b = arr.reshape(heads, nope + cfg["v_head_dim"], arr.shape[-1])
        stem = f"blk.{name.split('.')[2]}"
        k_b = np.ascontiguousarray(kv_b[:, :nope].transpose(0, 2, 1))
        v_b = np.ascontiguousarray(kv_b[:, nope:])
        return [
            (("gguf", f"{stem}.attn_k_b.weight"), k_b),
            (("gguf", f"{stem}.attn_v_b.weight"), v_b),
        ]
    if tiny_arch in ("granitemoe", "granitemoeshared") and "input_linear" in name:
        # GraniteMoeModel.modify_tensors: HF's fused [gate; up] rows in two
        bid = int(name.split(".")[2])
        gate, up = np.split(arr, 2, axis=-2)
        stem = "exps" if "block_sparse_moe" in name else "shexp"
        return [(("gguf", f"blk.{bid}.ffn_gate_{stem}.weight"), gate),
                (("gguf", f"blk.{bid}.ffn_up_{stem}.weight"), up)]  # fmt: skip
    if tiny_arch in ("arcee", *GRANITES, "smollm3"):  # LlamaModel.modify_tensors, undo_permute
        if name.endswith(("q_proj.weight", "q_proj.bias")):
            arr = llama_cpp_permute(arr, cfg["num_attention_heads"])
        elif name.endswith(("k_proj.weight", "k_proj.bias")):
            arr = llama_cpp_permute(arr, cfg["num_key_value_heads"])
    if name.endswith("e_score_correction_bias"):  # MiniMax-M2, dots1
        name = name.replace("e_score_correction_bias", "e_score_correction.bias")
    return [(name, arr)]


def _falcon_kv(cfg: dict) -> int:
    """FalconModel's n_head_kv: num_kv_heads, else n_head_kv, else 1. The released 7B config has
    neither key; transformers saves num_kv_heads = heads for it, which the converter would take,
    so the old layout's tiny config is read as the released one."""
    if not cfg.get("new_decoder_architecture"):
        return cfg.get("n_head_kv", 1)
    return cfg.get("num_kv_heads") or cfg.get("n_head_kv", 1)


def _write_old_metadata(w, tiny_arch: str, cfg: dict) -> None:
    """FalconModel / StarCoderModel / DbrxModel.set_gguf_parameters (their own keys only);
    NemotronModel's: TextModel's, then its own (the last value of a key written twice)."""
    import gguf

    if tiny_arch == "falcon":
        w.add_context_length(2048)  # "not in config.json"
        w.add_tensor_data_layout("jploski")
        w.add_embedding_length(cfg["hidden_size"])
        w.add_feed_forward_length(4 * cfg["hidden_size"])
        w.add_block_count(cfg["num_hidden_layers"])
        w.add_head_count(cfg["num_attention_heads"])
        w.add_head_count_kv(_falcon_kv(cfg))
        w.add_layer_norm_eps(cfg["layer_norm_epsilon"])
    elif tiny_arch == "gpt_bigcode":
        w.add_context_length(cfg["n_positions"])
        w.add_embedding_length(cfg["n_embd"])
        w.add_feed_forward_length(4 * cfg["n_embd"])
        w.add_block_count(cfg["n_layer"])
        w.add_head_count(cfg["n_head"])
        w.add_head_count_kv(1)
        w.add_layer_norm_eps(cfg["layer_norm_epsilon"])
    elif tiny_arch == "dbrx":
        ffn, attn = cfg["ffn_config"], cfg["attn_config"]
        w.add_block_count(cfg["n_layers"])
        w.add_context_length(cfg["max_seq_len"])
        w.add_embedding_length(cfg["d_model"])
        w.add_feed_forward_length(ffn["ffn_hidden_size"])
        w.add_head_count(cfg["n_heads"])
        w.add_head_count_kv(attn["kv_n_heads"])
        w.add_rope_freq_base(attn["rope_theta"])
        w.add_clamp_kqv(attn["clip_qkv"])
        w.add_expert_count(ffn["moe_num_experts"])
        w.add_expert_used_count(ffn["moe_top_k"])
        w.add_layer_norm_eps(1e-5)
    else:  # nemotron
        rope = _rope_params(cfg)
        hidden, heads = cfg["hidden_size"], cfg["num_attention_heads"]
        w.add_block_count(cfg["num_hidden_layers"])
        w.add_context_length(cfg["max_position_embeddings"])
        w.add_embedding_length(hidden)
        w.add_feed_forward_length(cfg["intermediate_size"])
        w.add_head_count(heads)
        w.add_head_count_kv(cfg["num_key_value_heads"])
        w.add_rope_freq_base(rope.get("rope_theta", 10000.0))
        if cfg.get("head_dim"):
            w.add_key_length(cfg["head_dim"])
            w.add_value_length(cfg["head_dim"])
        w.add_vocab_size(cfg["vocab_size"])
        w.add_layer_norm_eps(cfg["norm_eps"])
        w.add_rope_dimension_count(int(rope.get("partial_rotary_factor", 1.0) * hidden) // heads)
        w.add_rope_scaling_type(gguf.RopeScalingType.NONE)


def _old(tiny_arch: str, cfg: dict, name: str, arr: np.ndarray) -> tuple[str, np.ndarray]:
    """The arch class's modify_tensors before the name map: (HF-side name, array)."""
    if tiny_arch == "falcon" and "query_key_value" in name:
        heads = cfg["num_attention_heads"]
        kv = _falcon_kv(cfg)
        head_dim = cfg["hidden_size"] // heads
        qkv = arr.reshape(kv, heads // kv + 2, head_dim, *arr.shape[1:])
        rest = arr.shape[1:]
        q = qkv[:, :-2].reshape(heads * head_dim, *rest)
        k = qkv[:, -2].reshape(kv * head_dim, *rest)
        v = qkv[:, -1].reshape(kv * head_dim, *rest)
        arr = np.concatenate([q, k, v])
    elif tiny_arch == "nemotron" and name.endswith("norm.weight"):
        arr = arr + np.float32(1)
    elif tiny_arch == "dbrx" and ".experts.mlp." in name:
        ffn = cfg["ffn_config"]
        arr = arr.reshape(ffn["moe_num_experts"], ffn["ffn_hidden_size"], cfg["d_model"])
        if name.endswith(".w2"):
            arr = np.ascontiguousarray(arr.transpose(0, 2, 1))
        name += ".weight"
    return name, arr


def _write_metadata(w, arch: str, cfg: dict) -> None:
    """The converter's set_gguf_parameters: TextModel's keys, then each arch's own."""
    import gguf

    rope = _rope_params(cfg)
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(_lfm2_ff(cfg) if arch == "lfm2" else cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    if arch in ("lfm2", "lfm2moe"):  # LFM2Model: kv heads on attention layers only, 0 on conv
        w.add_head_count_kv(
            [cfg["num_key_value_heads"] if t == "full_attention" else 0 for t in cfg["layer_types"]]
        )
    else:
        w.add_head_count_kv(cfg["num_key_value_heads"])
    if "norm_epsilon" in cfg:  # TextModel: a LayerNorm's epsilon (StarCoder2)
        w.add_layer_norm_eps(cfg["norm_epsilon"])
    else:
        w.add_layer_norm_rms_eps(cfg["rms_norm_eps"] if "rms_norm_eps" in cfg else cfg["norm_eps"])
    if arch != "gemma2":  # Gemma2Model writes its own keys, no rope base
        w.add_rope_freq_base(rope.get("rope_theta", 10000.0))
    if cfg.get("head_dim"):
        w.add_key_length(cfg["head_dim"])
        w.add_value_length(cfg["head_dim"])
    experts = cfg.get("num_local_experts") or cfg.get("num_experts")
    if experts:
        w.add_expert_count(experts)
        w.add_expert_used_count(cfg["num_experts_per_tok"])
    if cfg.get("moe_intermediate_size"):
        w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    if arch in ("gemma2", "gemma3"):
        if cfg.get("attn_logit_softcapping"):
            w.add_attn_logit_softcapping(cfg["attn_logit_softcapping"])
        if cfg.get("final_logit_softcapping"):
            w.add_final_logit_softcapping(cfg["final_logit_softcapping"])
        w.add_sliding_window(cfg["sliding_window"])
    if rope.get("rope_type") == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(rope["factor"])
    if arch == "phi3":
        head_dim = cfg["hidden_size"] // cfg["num_attention_heads"]
        w.add_rope_dimension_count(int(rope.get("partial_rotary_factor", 1.0) * head_dim))
        w.add_rope_scaling_orig_ctx_len(
            rope.get("original_max_position_embeddings") or cfg["original_max_position_embeddings"]
        )
        w.add_sliding_window(cfg.get("sliding_window") or 0)
    shared = cfg.get("shared_expert_intermediate_size")
    if arch in ("qwen2moe", "qwen3next", "qwen35", "qwen35moe") and shared:  # Qwen2MoeModel's
        w.add_expert_shared_feed_forward_length(shared)
    if arch in ("qwen3next", "qwen35", "qwen35moe"):  # then Qwen3NextModel's
        w.add_ssm_conv_kernel(cfg["linear_conv_kernel_dim"])
        w.add_ssm_state_size(cfg["linear_key_head_dim"])
        w.add_ssm_group_count(cfg["linear_num_key_heads"])
        w.add_ssm_time_step_rank(cfg["linear_num_value_heads"])
        w.add_ssm_inner_size(cfg["linear_value_head_dim"] * cfg["linear_num_value_heads"])
        w.add_full_attention_interval(cfg.get("full_attention_interval", 4))
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
        partial = cfg.get("partial_rotary_factor", rope.get("partial_rotary_factor", 0.25))
        w.add_rope_dimension_count(int(head_dim * partial))
    if arch == "glm4":  # Glm4Model: head_dim x partial_rotary_factor (0.5 when unset)
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
        partial = cfg.get("partial_rotary_factor", rope.get("partial_rotary_factor", 0.5))
        w.add_rope_dimension_count(int(head_dim * partial))
    if arch in ("lfm2", "lfm2moe"):
        w.add_vocab_size(cfg["vocab_size"])
        w.add_shortconv_l_cache(cfg["conv_L_cache"])
    if arch == "lfm2moe":
        w.add_leading_dense_block_count(cfg["num_dense_layers"])
        w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)


def _tile_heads(a: np.ndarray, axis: int, groups: int, per_group: int, size: int) -> np.ndarray:
    """_LinearAttentionVReorderBase's value-head reorder along `axis`: grouped by key head
    ([g0 v0..v{r-1}, g1 ..]) -> tiled ([g0 v0, g1 v0, .., g0 v1, ..])."""
    shape = a.shape
    split = a.reshape(*shape[:axis], groups, per_group, size, *shape[axis + 1 :])
    return np.ascontiguousarray(np.swapaxes(split, axis, axis + 1)).reshape(shape)


def _qwen_hybrid(tiny_arch: str, cfg: dict, name: str, arr: np.ndarray):
    """Qwen3NextModel.modify_tensors (after _LinearAttentionVReorderBase's reorder for Qwen3.5):
    [(HF-side name to map, or a GGUF name given as ("gguf", name)), array]."""
    nk, nv = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
    dk, dv = cfg["linear_key_head_dim"], cfg["linear_value_head_dim"]
    if name.startswith("mtp"):
        return []
    if tiny_arch != "qwen3_next" and nk != nv and "linear_attn." in name:
        per, qk = nv // nk, 2 * dk * nk
        if ".in_proj_qkv." in name or ".conv1d" in name:
            arr = arr.squeeze() if ".conv1d" in name else arr
            arr = np.concatenate([arr[:qk], _tile_heads(arr[qk:], 0, nk, per, dv)])
        elif ".in_proj_z." in name:
            arr = _tile_heads(arr, 0, nk, per, dv)
        elif any(p in name for p in (".in_proj_a.", ".in_proj_b.", ".A_log", ".dt_bias")):
            arr = _tile_heads(arr, 0, nk, per, 1)
        elif ".out_proj." in name:
            arr = _tile_heads(arr, 1, nk, per, dv)
    if name.endswith(".A_log"):
        arr = -np.exp(arr)
    elif name.endswith(".dt_bias"):
        name = name.removesuffix(".dt_bias") + ".dt_proj.bias"
    elif "conv1d" in name:
        arr = arr.squeeze()
    elif name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
        arr = arr + np.float32(1)
    if "in_proj_qkvz.weight" in name:
        # per key head [q, k, v, z] -> [all q; all k; all v] and z
        bid = int(name.split(".")[2])
        per_head = arr.reshape(nk, -1, arr.shape[1])
        sizes = np.cumsum([dk, dk, nv // nk * dv])
        q, k, v, z = np.split(per_head, sizes, axis=1)
        qkv = np.concatenate([p.reshape(-1, arr.shape[1]) for p in (q, k, v)])
        return [(("gguf", f"blk.{bid}.attn_qkv.weight"), qkv),
                (("gguf", f"blk.{bid}.attn_gate.weight"), z.reshape(-1, arr.shape[1]))]  # fmt: skip
    return [(name, arr)]


def _mamba_hybrid(tiny_arch: str, cfg: dict, name: str, arr: np.ndarray):
    """GraniteHybridModel / NemotronHModel.modify_tensors (Nemotron 3's expert merging: in
    _converted): [(HF-side name to map, or ("gguf", name)), array]."""
    if name.startswith("mtp."):
        return []
    bid = int(name.split(".")[2]) if ".layers." in name else None
    kind = None if bid is None else _kinds(tiny_arch, cfg)[bid]
    moe = tiny_arch == "nemotron_h" and "moe" in _kinds(tiny_arch, cfg)
    if tiny_arch == "granitemoehybrid":  # GraniteMoeModel's splits of fused [gate; up] rows
        experts = bool(cfg.get("num_local_experts"))
        if name.endswith("block_sparse_moe.input_linear.weight"):
            gate, up = np.split(arr, 2, axis=-2)
            return [(("gguf", f"blk.{bid}.ffn_gate_exps.weight"), gate),
                    (("gguf", f"blk.{bid}.ffn_up_exps.weight"), up)]  # fmt: skip
        if name.endswith("shared_mlp.input_linear.weight"):
            gate, up = np.split(arr, 2, axis=-2)
            stem = "_shexp" if experts else ""
            return [(("gguf", f"blk.{bid}.ffn_gate{stem}.weight"), gate),
                    (("gguf", f"blk.{bid}.ffn_up{stem}.weight"), up)]  # fmt: skip
        if name.endswith("shared_mlp.output_linear.weight") and not experts:
            return [(("gguf", f"blk.{bid}.ffn_down.weight"), arr)]
    if kind == "attention":  # LlamaModel.modify_tensors (undo_permute is True)
        if name.endswith("q_proj.weight"):
            arr = llama_cpp_permute(arr, cfg["num_attention_heads"])
        elif name.endswith("k_proj.weight"):
            arr = llama_cpp_permute(arr, cfg["num_key_value_heads"])
    elif kind == "mamba":  # Mamba2Model.modify_tensors (NemotronHModel's own when MoE)
        groups = cfg["mamba_n_groups"] if tiny_arch == "granitemoehybrid" else cfg["n_groups"]
        if name.endswith(".dt_bias"):
            name = name.removesuffix("_bias") + (".bias" if moe else "_proj.bias")
        elif name.endswith("conv1d.weight"):
            arr = arr.squeeze()
        elif name.endswith((".A_log", ".D")):
            arr = arr.reshape(-1, 1)
        elif name.endswith(("mamba.norm.weight", "mixer.norm.weight")):
            arr = arr.reshape(groups, -1)
        if name.endswith(".A_log"):
            arr = -np.exp(arr)
    elif name.endswith("gate.e_score_correction_bias"):
        name = name.replace("e_score_correction_bias", "e_score_correction.bias")
    return [(name, arr)]


def _ssm(tiny_arch: str, cfg: dict, name: str, arr: np.ndarray):
    """MambaModel / Mamba2Model.modify_tensors (Mamba2's dt_bias rename: its filter_tensors)."""
    if name.endswith(".dt_bias"):
        name = name.removesuffix(".dt_bias") + ".dt_proj.bias"
    if name.endswith("conv1d.weight"):
        arr = arr.squeeze()
    elif tiny_arch == "mamba2" and name.endswith((".A_log", ".D")):
        arr = arr.reshape(*arr.shape, 1)
    elif tiny_arch == "mamba2" and name.endswith("mixer.norm.weight"):
        arr = arr.reshape(cfg["n_groups"], -1)
    if name.endswith(".A_log"):
        arr = -np.exp(arr)
    return [(name, arr)]


def _falcon_h1_fold(cfg: dict, name: str, arr: np.ndarray) -> np.ndarray:
    """FalconH1Model.modify_tensors' multipliers, by HF-name substring in its order (float32
    products, as torch makes them); HF's shape."""
    mlp, f32 = cfg["mlp_multipliers"], np.float32
    if "down_proj" in name:
        return arr * f32(mlp[1])
    if "gate_proj" in name:
        return arr * f32(mlp[0])
    if "k_proj" in name:
        return arr * f32(cfg["key_multiplier"]) * f32(cfg["attention_in_multiplier"])
    if "q_proj" in name or "v_proj" in name:
        return arr * f32(cfg["attention_in_multiplier"])
    if "o_proj" in name:
        return arr * f32(cfg["attention_out_multiplier"])
    if "out_proj" in name:
        return arr * f32(cfg["ssm_out_multiplier"])
    if "in_proj" in name:
        arr = arr * f32(cfg["ssm_in_multiplier"])
        inner, bc = cfg["mamba_d_ssm"], cfg["mamba_n_groups"] * cfg["mamba_d_state"]
        ends = np.cumsum([0, inner, inner, bc, bc])  # z, x, B, C, then dt to the end
        for start, end, m in zip(ends, [*ends[1:], len(arr)], cfg["ssm_multipliers"]):
            arr[start:end] *= f32(m)
        return arr
    if "lm_head" in name:
        return arr * f32(cfg["lm_head_multiplier"])
    if "embed_tokens" in name:
        return arr * f32(cfg["embedding_multiplier"])
    return arr


def _falcon_h1(cfg: dict, name: str, arr: np.ndarray):
    """Mamba2Model's filter_tensors / modify_tensors under FalconH1Model (the shapes: dt_bias
    renamed dt_proj.bias, conv squeezed, A and D [H, 1], the gated norm [groups, inner / groups],
    A_log stored as -exp(A_log)); the multipliers come first (_falcon_h1_fold)."""
    if name.endswith(".dt_bias"):
        name = name.removesuffix(".dt_bias") + ".dt_proj.bias"
    elif name.endswith("conv1d.weight"):
        arr = arr.squeeze()
    elif name.endswith((".A_log", ".D")):
        arr = arr.reshape(*arr.shape, 1)
    elif name.endswith("mamba.norm.weight"):
        arr = arr.reshape(cfg["mamba_n_groups"], -1)
    if name.endswith(".A_log"):
        arr = -np.exp(arr)
    return [(name, arr)]


def _lfm2(name: str, arr: np.ndarray):
    """LFM2Model / LFM2MoeModel.modify_tensors (expert merging: in _converted)."""
    if "conv.conv" in name:
        arr = arr.squeeze(1)
    if name.endswith(".expert_bias"):
        name = name.replace(".expert_bias", ".expert_bias.bias")
    return [(name, arr)]


def _write_tokenizer(w, src: Path, pad_to: int = 1) -> None:
    """The byte-level BPE vocabulary; `pad_to` > 1: padded with `[PAD<i>]` (type unused) to a
    multiple of it, as the converter pads a vocabulary to the config's (padded) vocab_size."""
    tok = json.loads((src / "tokenizer.json").read_text())
    vocab = sorted(tok["model"]["vocab"].items(), key=lambda kv: kv[1])
    added = {t["id"]: t for t in tok["added_tokens"]}
    tokens = [t for t, _ in vocab] + [added[i]["content"] for i in sorted(added) if i >= len(vocab)]
    types = [3 if i in added and added[i]["special"] else 1 for i in range(len(tokens))]
    while len(tokens) % pad_to:
        tokens.append(f"[PAD{len(tokens)}]")
        types.append(5)
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    w.add_token_merges([" ".join(m) if isinstance(m, list) else m for m in tok["model"]["merges"]])
    w.add_token_types(types)
    w.add_bos_token_id(0)
    w.add_eos_token_id(1)
    w.add_pad_token_id(2)
    w.add_chat_template("{{ messages[0]['content'] }}")


@dataclass
class SpmVocab:
    """A SentencePiece vocabulary as llama.cpp's converter writes one (`tokenizer.ggml.model`
    "llama"); None leaves a key out (the reader's default applies)."""

    tokens: list[str]
    scores: list[float]
    types: list[int]  # 1 normal, 2 unknown, 3 control, 4 user defined, 5 unused, 6 byte
    bos: int | None = 1
    eos: int | None = 2
    unk: int | None = 0
    pad: int | None = None
    add_bos: bool | None = None
    add_eos: bool | None = None
    add_space_prefix: bool | None = None
    name: str | None = None  # general.name (llama.cpp keys Phi-3's token attributes on it)
    chat_template: str | None = None


def write_spm_tokenizer(w, vocab: SpmVocab) -> None:
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(vocab.tokens)
    w.add_token_scores(vocab.scores)
    w.add_token_types(vocab.types)
    for value, add in (
        (vocab.bos, w.add_bos_token_id),
        (vocab.eos, w.add_eos_token_id),
        (vocab.unk, w.add_unk_token_id),
        (vocab.pad, w.add_pad_token_id),
        (vocab.add_bos, w.add_add_bos_token),
        (vocab.add_eos, w.add_add_eos_token),
        (vocab.add_space_prefix, w.add_add_space_prefix),
        (vocab.name, w.add_name),
        (vocab.chat_template, w.add_chat_template),
    ):
        if value is not None:
            add(value)


def _converted(src: Path, tiny_arch: str, cfg: dict, merged_experts: bool):
    """(GGUF name, float32 array as the converter emits it, HF names, HF's own array, sources):
    one HF name per expert of a merged tensor, whose HF array is the stack of theirs; sources
    (hybrids' own transforms only, else None): the flat index into HF's array of each stored
    value, as float64 in the stored shape."""
    import gguf
    from safetensors.torch import load_file

    _, member = _gguf_arch(tiny_arch, cfg)
    names = gguf.get_tensor_name_map(getattr(gguf.MODEL_ARCH, member), cfg["num_hidden_layers"])
    heads, kv_heads = cfg.get("num_attention_heads"), cfg.get("num_key_value_heads")
    out: list[tuple[str, np.ndarray, list[str], np.ndarray, np.ndarray | None]] = []
    groups: dict[str, dict[int, tuple[str, np.ndarray]]] = {}

    def to_gguf(name) -> str:
        if isinstance(name, tuple):  # already a GGUF name
            return name[1]
        found = names.get_name(name, try_suffixes=(".weight", ".bias")) or names.get_name(name)
        if found is None:
            raise ValueError(f"llama.cpp has no {member} tensor for {name!r}")
        return found

    for name, t in sorted(load_file(src / "model.safetensors").items()):
        hf = arr = t.float().numpy()
        if tiny_arch == "falcon_h1":  # what we expect back: the folded weights
            hf = arr = _falcon_h1_fold(cfg, name, arr)
        if tiny_arch in HYBRIDS and _EXPERT.match(name) is None:
            if tiny_arch in QWEN_HYBRIDS:
                transform = partial(_qwen_hybrid, tiny_arch, cfg, name)
            elif tiny_arch in SSMS or tiny_arch == "jamba":  # Jamba's mixer: Mamba's transforms
                transform = partial(_ssm, tiny_arch, cfg, name)
            elif tiny_arch == "falcon_h1":
                transform = partial(_falcon_h1, cfg, name)
            elif tiny_arch in MAMBA_HYBRIDS:
                transform = partial(_mamba_hybrid, tiny_arch, cfg, name)
            else:
                transform = partial(_lfm2, name)
            # the same transform on HF's flat element indices: where each stored value came from
            with np.errstate(all="ignore"):  # -exp of an index (A_log's, never quantized)
                sources = transform(np.arange(hf.size, dtype=np.float64).reshape(hf.shape))
            for i, ((mapped, piece), (_, src)) in enumerate(zip(transform(arr), sources)):
                # a split tensor: HF's names under the first piece
                out.append((to_gguf(mapped), piece, [name] if i == 0 else [], hf, src))
            continue
        if tiny_arch in MORE_ARCHS and _EXPERT.match(name) is None:
            # the same transform on HF's flat element indices: where each stored value came from
            sources = _more(
                tiny_arch, cfg, name, np.arange(hf.size, dtype=np.float64).reshape(hf.shape)
            )
            pieces = zip(_more(tiny_arch, cfg, name, arr), sources)
            for i, ((mapped, piece), (_, src)) in enumerate(pieces):
                # a split tensor: HF's name under the first piece
                out.append((to_gguf(mapped), piece, [name] if i == 0 else [], hf, src))
            continue
        if tiny_arch in OLD_ARCHS:
            mapped, arr = _old(tiny_arch, cfg, name, arr)
            if tiny_arch == "nemotron" and name.endswith("norm.weight"):
                hf = arr - np.float32(1)  # the stored float32(1 + w), less the 1 we add back
            out.append((to_gguf(mapped), arr, [name], hf, None))
            continue
        if tiny_arch in LLAMAS and name.endswith("q_proj.weight"):
            arr = llama_cpp_permute(arr, heads)
        elif tiny_arch in LLAMAS and name.endswith("k_proj.weight"):
            arr = llama_cpp_permute(arr, kv_heads)
        elif tiny_arch in ("gemma", "gemma2", "gemma3") and name.endswith("norm.weight"):
            arr = arr + np.float32(1)
        m = _EXPERT.match(name)
        if m is not None:
            base, expert, part = m.groups()
            groups.setdefault(f"{base}.{part}.weight", {})[int(expert)] = (name, arr)
            continue
        out.append((names.get_name(name, try_suffixes=(".weight", ".bias")), arr, [name], hf, None))
    for merged, per_expert in sorted(groups.items()):
        if tiny_arch == "lfm2_moe":  # LFM2MoeModel's merged name has no "model." prefix
            merged = merged.removeprefix("model.")
        if tiny_arch == "nemotron_h":  # NemotronHModel merges into Qwen2-MoE's name
            merged = re.sub(r"^backbone\.(layers\.\d+)\.mixer\.", r"model.\1.mlp.", merged)
        if tiny_arch == "jamba":  # so does JambaModel
            merged = merged.replace(".feed_forward.experts.", ".mlp.experts.")
        gguf_name = names.get_name(merged, try_suffixes=(".weight",))
        hf_names = [per_expert[e][0] for e in sorted(per_expert)]
        arrays = [per_expert[e][1] for e in sorted(per_expert)]
        if merged_experts:
            stacked = np.stack(arrays)
            out.append((gguf_name, stacked, hf_names, stacked, None))
        else:  # blk.N.ffn_gate.M.weight
            stem = gguf_name.removesuffix("_exps.weight")
            for e, (hf_name, arr) in enumerate(zip(hf_names, arrays, strict=True)):
                out.append((f"{stem}.{e}.weight", arr, [hf_name], arr, None))
    return out


# -- quantized hybrid files ---------------------------------------------------------------------
HYBRID_QUANTS = ("f32", "q8_0", "q4_k_m", "q6_k")
# convert_hf_to_gguf.py's prepare_tensors keeps these F32 whatever --outtype says (with 1-D
# tensors, "_norm.weight" ones and names not ending ".weight": ssm_a, ssm_d, biases)
_CONVERTER_F32 = ("ffn_gate_inp", "ffn_gate_inp_shexp", "ssm_conv1d", "shortconv.conv")
# llama-quant.cpp's tensor_allows_quantization: substrings of names it never quantizes
_QUANTIZE_SKIPS = ("_norm.weight", "ffn_gate_inp.weight", "ssm_conv1d", "shortconv.conv.weight")


def _f16_round(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16).astype(np.float32)


def quantize_q6_k(arr: np.ndarray) -> np.ndarray:
    """A plain Q6_K encoder (rows of 256-value super-blocks; our own rounding, not ggml's search):
    16 sub-blocks of 16 with an int8 scale each on a float16 d, values (q - 32) in -32..31."""
    x = arr.astype(np.float32).reshape(-1, 16, 16)
    sub = np.abs(x).max(axis=2) / 31  # [nb, 16] wanted step per sub-block
    d = _f16_round(sub.max(axis=1, keepdims=True) / 127)
    sc = np.round(_safe_div(sub, d)).clip(-128, 127)
    step = (d * sc)[:, :, None]
    q = np.round(_safe_div(x, step)).clip(-32, 31)
    q = (q + 32).astype(np.uint8).reshape(-1, 2, 4, 32)  # [nb, half, quarter, 32]
    low = q & 15
    ql = np.concatenate(
        [low[:, :, 0] | (low[:, :, 2] << 4), low[:, :, 1] | (low[:, :, 3] << 4)], axis=2
    )  # [nb, 2, 64]
    qh = (q[:, :, 0] >> 4) | ((q[:, :, 1] >> 4) << 2) | ((q[:, :, 2] >> 4) << 4)
    qh = qh | ((q[:, :, 3] >> 4) << 6)  # [nb, 2, 32]
    nb = x.shape[0]
    blocks = np.concatenate(
        [
            ql.reshape(nb, 128),
            qh.reshape(nb, 64),
            sc.astype(np.int8).view(np.uint8),
            d.astype(np.float16).view(np.uint8),
        ],
        axis=1,
    )
    return blocks.reshape(*arr.shape[:-1], arr.shape[-1] // 256 * 210)


def quantize_q4_k(arr: np.ndarray) -> np.ndarray:
    """A plain Q4_K encoder: 8 sub-blocks of 32 per super-block of 256, each value
    d * scale * q - dmin * min with q in 0..15 and 6-bit scales / mins on float16 d / dmin."""
    x = arr.astype(np.float32).reshape(-1, 8, 32)
    low = np.maximum(-x.min(axis=2), 0)  # [nb, 8] subtracted minimum
    step = (x.max(axis=2) + low) / 15
    d = _f16_round(step.max(axis=1, keepdims=True) / 63)
    dmin = _f16_round(low.max(axis=1, keepdims=True) / 63)
    sc = np.round(_safe_div(step, d)).clip(0, 63)
    mn = np.round(_safe_div(low, dmin)).clip(0, 63)
    eff = (d * sc)[:, :, None]
    shifted = x + (dmin * mn)[:, :, None]
    q = np.round(_safe_div(shifted, eff)).clip(0, 15)
    q = q.astype(np.uint8).reshape(-1, 4, 2, 32)  # chunk c: sub-blocks 2c (low), 2c + 1 (high)
    qs = (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(-1, 128)
    sc, mn = sc.astype(np.uint8), mn.astype(np.uint8)
    scales = np.concatenate(
        [
            sc[:, :4] | ((sc[:, 4:] >> 4) << 6),
            mn[:, :4] | ((mn[:, 4:] >> 4) << 6),
            (sc[:, 4:] & 15) | ((mn[:, 4:] & 15) << 4),
        ],
        axis=1,
    )
    blocks = np.concatenate(
        [d.astype(np.float16).view(np.uint8), dmin.astype(np.float16).view(np.uint8), scales, qs],
        axis=1,
    )
    return blocks.reshape(*arr.shape[:-1], arr.shape[-1] // 256 * 144)


def _safe_div(x: np.ndarray, step: np.ndarray) -> np.ndarray:
    """x / step where the step is positive, 0 where it is 0 (an all-zero block)."""
    return np.where(step > 0, x / np.where(step > 0, step, 1), 0)


def _pack_two_bits(q: np.ndarray) -> np.ndarray:
    """[nb, 256] values 0..3 -> [nb, 64]: value v in byte 32 * (v // 128) + v % 32, at bits
    2 * (v % 128 // 32) (the Q2_K / Q3_K layout)."""
    q = q.astype(np.uint8).reshape(-1, 2, 4, 32)
    return (q[:, :, 0] | q[:, :, 1] << 2 | q[:, :, 2] << 4 | q[:, :, 3] << 6).reshape(-1, 64)


def quantize_q2_k(arr: np.ndarray) -> np.ndarray:
    """A plain Q2_K encoder: 16 sub-blocks of 16, each value d * scale * q - dmin * min with q in
    0..3 and 4-bit scales / mins on float16 d / dmin."""
    x = arr.astype(np.float32).reshape(-1, 16, 16)
    low = np.maximum(-x.min(axis=2), 0)
    step = (x.max(axis=2) + low) / 3
    d = _f16_round(step.max(axis=1, keepdims=True) / 15)
    dmin = _f16_round(low.max(axis=1, keepdims=True) / 15)
    sc = np.round(_safe_div(step, d)).clip(0, 15)
    mn = np.round(_safe_div(low, dmin)).clip(0, 15)
    q = np.round(_safe_div(x + (dmin * mn)[:, :, None], (d * sc)[:, :, None])).clip(0, 3)
    scales = sc.astype(np.uint8) | (mn.astype(np.uint8) << 4)
    blocks = np.concatenate(
        [
            scales,
            _pack_two_bits(q.reshape(-1, 256)),
            d.astype(np.float16).view(np.uint8),
            dmin.astype(np.float16).view(np.uint8),
        ],
        axis=1,
    )
    return blocks.reshape(*arr.shape[:-1], arr.shape[-1] // 256 * 84)


def quantize_q3_k(arr: np.ndarray) -> np.ndarray:
    """A plain Q3_K encoder: 16 sub-blocks of 16, values d * (scale - 32) * q with q in -4..3
    (two low bits, and a high bit that is clear for q < 0) and 6-bit scales on a float16 d."""
    x = arr.astype(np.float32).reshape(-1, 16, 16)
    sub = np.abs(x).max(axis=2) / 4
    d = _f16_round(sub.max(axis=1, keepdims=True) / 31)
    sc = np.round(_safe_div(sub, d)).clip(0, 31)
    q = np.round(_safe_div(x, (d * sc)[:, :, None])).clip(-4, 3).astype(np.int64) + 4  # 0..7
    q = q.reshape(-1, 256)
    high = (q >> 2).astype(np.uint8).reshape(-1, 8, 32)  # bit 4 * half + quarter of byte v % 32
    hmask = np.bitwise_or.reduce(high << np.arange(8, dtype=np.uint8)[None, :, None], axis=1)
    six = (sc + 32).astype(np.uint8)  # [nb, 16]
    top = (six >> 4) & 3  # scale k's top bits: byte 8 + k % 4, bits 2 * (k // 4)
    scales = np.concatenate(
        [
            (six[:, 0:8] & 15) | ((six[:, 8:16] & 15) << 4),
            top[:, 0:4] | top[:, 4:8] << 2 | top[:, 8:12] << 4 | top[:, 12:16] << 6,
        ],
        axis=1,
    )
    blocks = np.concatenate(
        [hmask, _pack_two_bits(q & 3), scales, d.astype(np.float16).view(np.uint8)], axis=1
    )
    return blocks.reshape(*arr.shape[:-1], arr.shape[-1] // 256 * 110)


def _iq4_nibbles(x: np.ndarray, step: np.ndarray) -> np.ndarray:
    """[..., 32] values over their step -> [..., 16] bytes of the nearest IQ4 grid levels, value
    j in the low nibble of byte j and value j + 16 in its high nibble."""
    from paged_engine.gguf.dequant import IQ4_GRID

    n = np.abs(_safe_div(x, step)[..., None] - IQ4_GRID).argmin(axis=-1).astype(np.uint8)
    return n[..., :16] | (n[..., 16:] << 4)


def quantize_iq4_nl(arr: np.ndarray) -> np.ndarray:
    """A plain IQ4_NL encoder: blocks of 32, each value d * IQ4_GRID[nibble], d on float16."""
    x = arr.astype(np.float32).reshape(-1, 32)
    d = _f16_round(np.abs(x).max(axis=1, keepdims=True) / 127)
    blocks = np.concatenate([d.astype(np.float16).view(np.uint8), _iq4_nibbles(x, d)], axis=1)
    return blocks.reshape(*arr.shape[:-1], arr.shape[-1] // 32 * 18)


def quantize_iq4_xs(arr: np.ndarray) -> np.ndarray:
    """A plain IQ4_XS encoder: 8 sub-blocks of 32 per 256, each value
    d * (scale - 32) * IQ4_GRID[nibble] with a 6-bit scale on a float16 d."""
    x = arr.astype(np.float32).reshape(-1, 8, 32)
    sub = np.abs(x).max(axis=2) / 127
    d = _f16_round(sub.max(axis=1, keepdims=True) / 31)
    sc = np.round(_safe_div(sub, d)).clip(0, 31)
    qs = _iq4_nibbles(x, (d * sc)[:, :, None]).reshape(-1, 128)
    six = (sc + 32).astype(np.uint16)
    high = np.bitwise_or.reduce((six >> 4) << (2 * np.arange(8, dtype=np.uint16)), axis=1)
    low = (six & 15).astype(np.uint8)
    blocks = np.concatenate(
        [
            d.astype(np.float16).view(np.uint8),
            high.astype("<u2")[:, None].view(np.uint8),
            low[:, 0::2] | (low[:, 1::2] << 4),
            qs,
        ],
        axis=1,
    )
    return blocks.reshape(*arr.shape[:-1], arr.shape[-1] // 256 * 136)


def _ggml_n_dims(shape: tuple[int, ...]) -> int:
    """ggml_n_dims: dimensions up to the last one > 1 in ggml's order (numpy's reversed)."""
    lead = 0
    while lead < len(shape) - 1 and shape[lead] == 1:
        lead += 1
    return len(shape) - lead


def _use_more_bits(i: int, n: int) -> bool:  # llama-quant.cpp's helper of that name
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def _layer(name: str) -> int:
    return int(name.split(".")[1]) if name.startswith("blk.") else -1


def hybrid_tensor_types(
    tensors: list[tuple[str, tuple[int, ...]]],
    quant: str,
    cfg: dict,
    overrides: dict[str, str] | None = None,
) -> dict[str, str]:
    """GGUF name -> ggml type name of each tensor, as llama.cpp would store it.

    "q8_0": convert_hf_to_gguf.py's prepare_tensors: F32 for 1-D tensors, "_norm.weight" ones,
    names not ending ".weight" and the _CONVERTER_F32 kinds; Q8_0 otherwise, F16 when a row is
    not whole 32-value blocks (gguf.quants.quantize's QuantError). "q4_k_m" / "q6_k":
    llama-quant.cpp on the F32 file, tensors in its loader's order (by layer, then name):
    tensor_allows_quantization (>= 2 ggml dims, ".weight", none of _QUANTIZE_SKIPS), then
    llama_tensor_get_type_impl's Q4_K_M / Q6_K choices (output, and a tied token_embd: Q6_K, Q8_0
    when rows are not whole 256 blocks; attn_v / attn_qkv and ffn_down: Q6_K on use_more_bits
    layers) and tensor_type_fallback (rows not whole 256 blocks: Q4_K -> Q5_0, Q6_K -> Q8_0, F16
    when not whole 32 blocks either). `overrides` (llama-quantize's --tensor-type: regex ->
    type) replace the choice for the tensors it quantizes, before the fallback."""
    types: dict[str, str] = {}
    if quant == "f32":
        return {name: "F32" for name, _ in tensors}
    if quant == "q8_0":
        for name, shape in tensors:
            part = name.removesuffix(".weight").split(".", 2)[-1]
            keep = (
                len(shape) <= 1
                or name.endswith("_norm.weight")
                or not name.endswith(".weight")
                or part in _CONVERTER_F32
            )
            types[name] = "F32" if keep else "Q8_0" if shape[-1] % 32 == 0 else "F16"
        return types
    n_layers = cfg["num_hidden_layers"]
    n_expert = cfg.get("num_local_experts") or cfg.get("num_experts") or 0
    n_expert = n_expert or cfg.get("n_routed_experts") or 0
    names = [name for name, _ in tensors]
    tied = "output.weight" not in names
    n_attn_v = sum(("attn_v.weight" in n or "attn_qkv.weight" in n) for n in names)
    i_attn_v = i_ffn_down = 0
    default = "Q4_K" if quant == "q4_k_m" else "Q6_K"
    for name, shape in sorted(tensors, key=lambda t: (_layer(t[0]), t[0])):
        allowed = (
            _ggml_n_dims(shape) >= 2
            and name.endswith("weight")
            and not any(skip in name for skip in _QUANTIZE_SKIPS)
        )
        if not allowed:
            types[name] = "F32"
            continue
        new = default
        manual = next((t for p, t in (overrides or {}).items() if re.search(p, name)), None)
        if manual is not None:
            new = manual
        elif name == "output.weight" or (tied and name == "token_embd.weight"):
            new = "Q8_0" if shape[-1] % 256 else "Q6_K"
        elif "attn_v.weight" in name or "attn_qkv.weight" in name:
            if quant == "q4_k_m" and _use_more_bits(i_attn_v, n_attn_v):
                new = "Q6_K"
            i_attn_v += 1
        elif "ffn_down" in name:
            layer = _layer(name) if n_expert > 1 else i_ffn_down
            if quant == "q4_k_m" and _use_more_bits(layer, n_layers):
                new = "Q6_K"
            i_ffn_down += 1
        if new in ("Q4_K", "Q6_K") and shape[-1] % 256:
            new = {"Q4_K": "Q5_0", "Q6_K": "Q8_0"}[new]
            if shape[-1] % 32:
                new = "F16"
        types[name] = new
    return types


def _store(arr: np.ndarray, ggml: str) -> tuple[np.ndarray, np.ndarray | None]:
    """(array for GGUFWriter.add_tensor, its dequantized float32 values or None for F32)."""
    import gguf

    if ggml == "F32":
        return arr, None
    if ggml == "F16":
        half = arr.astype(np.float16)
        return half, half.astype(np.float32)
    qtype = gguf.GGMLQuantizationType[ggml]
    encode = {
        "Q2_K": quantize_q2_k,
        "Q3_K": quantize_q3_k,
        "Q4_K": quantize_q4_k,
        "Q6_K": quantize_q6_k,
        "IQ4_NL": quantize_iq4_nl,
        "IQ4_XS": quantize_iq4_xs,
    }.get(ggml)
    raw = encode(arr) if encode else gguf.quants.quantize(arr, qtype)
    return raw, gguf.quants.dequantize(raw, qtype)  # the gguf package's own dequantizer


def _put_back(want: np.ndarray, sources: np.ndarray | None, values: np.ndarray) -> None:
    """A stored tensor's (dequantized) values written into HF's array `want` where the
    converter took them from: `sources` holds each stored value's flat index in HF's array
    (None: stored as HF has it, merged experts as their stack)."""
    if sources is None:
        want[...] = values.reshape(want.shape)
    else:
        want.reshape(-1)[sources.reshape(-1).astype(np.int64)] = values.reshape(-1)


def _write_hybrid_tensors(w, entries, quant: str, cfg: dict, exact: set[str] | None, overrides):
    """Add a hybrid's tensors to `w` as `quant` stores them; the HF-named expected weights: HF's
    own where the stored value is F32, else the dequantized values put back where the
    converter took them from (its transforms only move, split or reshape quantized tensors)."""
    import gguf

    types = hybrid_tensor_types([(e[0], e[1].shape) for e in entries], quant, cfg, overrides)
    built: dict[int, tuple[list[str], np.ndarray, list[bool]]] = {}
    for gguf_name, arr, hf_names, hf, sources in entries:
        data, values = _store(arr, types[gguf_name])
        if data.dtype == np.uint8:
            qtype = gguf.GGMLQuantizationType[types[gguf_name]]
            w.add_tensor(gguf_name, data, raw_shape=data.shape, raw_dtype=qtype)
        else:
            w.add_tensor(gguf_name, data)
        names, want, quantized = built.setdefault(id(hf), ([], hf.astype(np.float32), []))
        names.extend(hf_names)
        quantized.append(values is not None)
        if values is None:
            continue
        _put_back(want, sources, values)
    expected: dict[str, torch.Tensor] = {}
    for names, want, quantized in built.values():
        tensor = torch.from_numpy(np.ascontiguousarray(want))
        parts = tensor.unbind(0) if len(names) > 1 else [tensor]
        expected.update(zip(names, parts, strict=True))
        if exact is not None and all(quantized):
            exact.update(names)
    return expected


def dequantized_reference(src: Path, dst: Path, expected: dict[str, torch.Tensor]) -> Path:
    """`dst`: a copy of the HF model dir `src` whose weights are the file's dequantized ones
    (`expected`; what the file leaves out, such as a tied head, kept): HF on what a quantized
    file holds."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    weights = load_file(src / "model.safetensors")
    assert expected.keys() <= weights.keys()
    weights.update({k: v.contiguous() for k, v in expected.items()})
    save_file(weights, dst / "model.safetensors")
    return dst


def write_case(param: str, cases: dict, quantized: dict, model_factory, tmp_path_factory):
    """A parametrized GGUF case: `param` names a case of `cases` ((tiny arch, overrides)) or a
    Q8_0 file of one (`quantized`: param -> case name). Returns (case name, tiny arch, gguf path,
    HF reference model dir, expected weights); the reference of a quantized file runs on its
    dequantized weights."""
    name = quantized.get(param, param)
    arch, overrides = cases[name]
    src = model_factory(arch, **overrides)
    tmp = tmp_path_factory.mktemp(param)
    path = tmp / f"{param}.gguf"
    quant = "q8_0" if param in quantized else "f32"
    expected = write_gguf(src, path, arch, quant=quant)
    if quant != "f32":
        src = dequantized_reference(src, tmp / "hf", expected)
    return name, arch, path, src, expected


def assert_weights_back(got: dict, expected: dict) -> None:
    """The loaded weights are HF's, bit for bit (a quantized file's: its dequantized values),
    but A_log, stored as -exp(A_log), whose log rounds in float32."""
    assert got.keys() == expected.keys()
    for key, want in expected.items():
        if key.endswith(".A_log"):
            torch.testing.assert_close(got[key].float(), want, atol=1e-6, rtol=1e-6, msg=key)
        else:
            assert torch.equal(got[key].float(), want), key


def write_gguf(
    src: Path,
    path: Path,
    tiny_arch: str,
    *,
    quant: str = "f32",
    merged_experts: bool = True,
    rope_freqs: np.ndarray | None = None,
    spm_vocab: SpmVocab | None = None,
    exact: set[str] | None = None,
    tensor_types: dict[str, str] | None = None,
) -> dict[str, torch.Tensor]:
    """Write `src` (a tiny HF model dir) as GGUF to `path`; returns the HF-named float32 weights
    our reader must produce (HF's own, after the file's rounding and dequantization).

    quant: "f32" (every tensor F32), "q8_0" (every matrix Q8_0, vectors F32), or "mixed"
    (embedding and gate projections Q8_0, down projections F16, the rest F32). Hybrids: "f32",
    or a quantized file as llama.cpp makes one (which tensors stay F32, fallback types: see
    hybrid_tensor_types): "q8_0" (convert_hf_to_gguf.py --outtype q8_0), "q4_k_m" / "q6_k"
    (llama-quantize of the F32 file; `tensor_types`: its --tensor-type overrides). `exact`,
    when given, receives the HF names whose expected values are dequantized ones (our loader
    must give them bit for bit). `spm_vocab`: write that SentencePiece vocabulary instead of
    the model dir's byte-level BPE one."""
    import gguf

    Q = gguf.GGMLQuantizationType
    cfg = json.loads((src / "config.json").read_text())
    hybrid = tiny_arch in HYBRIDS
    quants = ("f32", "q8_0", "mixed") + (("mxfp4",) if tiny_arch == "gpt_oss" else ())
    if quant not in (HYBRID_QUANTS if hybrid else quants):
        raise NotImplementedError(f"{tiny_arch} GGUF files are not written as {quant!r}")
    if tiny_arch == "nemotron_h":  # transformers 5's NemotronHConfig saves no layer count
        cfg.setdefault("num_hidden_layers", len(_kinds(tiny_arch, cfg)))
    if tiny_arch in ("gpt_bigcode", "dbrx"):  # their own name for the layer count
        cfg.setdefault("num_hidden_layers", cfg.get("n_layer") or cfg.get("n_layers"))
    arch, _ = _gguf_arch(tiny_arch, cfg)
    w = gguf.GGUFWriter(str(path), arch)
    if tiny_arch in MAMBA_HYBRIDS:
        _write_mamba_metadata(w, arch, tiny_arch, cfg)
    elif tiny_arch in SSMS:
        _write_ssm_metadata(w, tiny_arch, cfg)
    elif tiny_arch == "falcon_h1":
        _write_falcon_h1_metadata(w, cfg)
    elif tiny_arch == "jamba":
        _write_jamba_metadata(w, cfg)
    elif tiny_arch in MORE_ARCHS:
        _write_more_metadata(w, tiny_arch, cfg)
    elif tiny_arch in OLD_ARCHS:
        _write_old_metadata(w, tiny_arch, cfg)
    else:
        _write_metadata(w, arch, cfg)
    if spm_vocab is None:
        _write_tokenizer(w, src, _SSM_PAD_VOCAB.get(tiny_arch, 1))
    else:
        write_spm_tokenizer(w, spm_vocab)
    expected: dict[str, torch.Tensor] = {}
    entries = _converted(src, tiny_arch, cfg, merged_experts)
    if hybrid:
        expected = _write_hybrid_tensors(w, entries, quant, cfg, exact, tensor_types)
        entries = []
    mxfp4: dict[int, tuple[list[str], np.ndarray]] = {}  # HF tensor -> (name, dequantized)
    for gguf_name, arr, hf_names, hf, sources in entries:
        if quant == "mxfp4" and gguf_name.endswith("_exps.weight"):
            # gpt-oss's release: the experts in MXFP4 (32-value blocks along the stored rows,
            # which the split and the transpose moved), everything else as is
            q = gguf.quants.quantize(arr, Q.MXFP4)
            w.add_tensor(gguf_name, q, raw_shape=q.shape, raw_dtype=Q.MXFP4)
            names, want = mxfp4.setdefault(id(hf), ([], hf.astype(np.float32)))
            names.extend(hf_names)
            _put_back(want, sources, gguf.quants.dequantize(q, Q.MXFP4))
            continue
        is_gate = "ffn_gate" in gguf_name and "ffn_gate_inp" not in gguf_name
        if arr.ndim >= 2 and (
            quant == "q8_0" or (quant == "mixed" and (gguf_name == "token_embd.weight" or is_gate))
        ):
            q = gguf.quants.quantize(arr, Q.Q8_0)
            w.add_tensor(gguf_name, q, raw_shape=q.shape, raw_dtype=Q.Q8_0)
            # Q8_0 blocks run along rows, so a row permutation commutes with its rounding
            want = gguf.quants.dequantize(gguf.quants.quantize(hf, Q.Q8_0), Q.Q8_0)
        elif quant == "mixed" and "ffn_down" in gguf_name:
            w.add_tensor(gguf_name, arr.astype(np.float16))
            want = hf.astype(np.float16).astype(np.float32)
        else:
            w.add_tensor(gguf_name, arr)
            want = hf
        if tiny_arch in ("gemma", "gemma2", "gemma3") and gguf_name.endswith("norm.weight"):
            want = arr - np.float32(1)  # the stored float32(1 + w), less the 1 we add back
        if not hf_names:  # the second half of a split tensor (Qwen3-Next's attn_gate)
            continue
        want = torch.from_numpy(np.ascontiguousarray(want, dtype=np.float32))
        parts = want.unbind(0) if len(hf_names) > 1 else [want]
        expected.update(zip(hf_names, parts, strict=True))
    expected.update({names[0]: torch.from_numpy(want) for names, want in mxfp4.values()})
    if tiny_arch in ("exaone4", "apertus") and rope_freqs is None:
        rope_freqs = llama3_rope_factors(cfg)
    if tiny_arch == "apertus":  # ApertusModel: xIELU's scalars as per-layer float32 arrays
        from safetensors.torch import load_file

        weights = load_file(src / "model.safetensors")
        for key, add in (("alpha_n", w.add_xielu_alpha_n), ("alpha_p", w.add_xielu_alpha_p),
                         ("beta", w.add_xielu_beta), ("eps", w.add_xielu_eps)):  # fmt: skip
            names = [f"model.layers.{i}.mlp.act_fn.{key}" for i in range(cfg["num_hidden_layers"])]
            add([weights[n].float().item() for n in names])
            expected.update({n: weights[n].float() for n in names})
    if tiny_arch == "deepseek_v3":  # as Glm4MoeLiteModel exports one: an MTP layer appended
        _write_mtp_layer(w, cfg)
    if rope_freqs is not None:
        w.add_tensor("rope_freqs.weight", rope_freqs.astype(np.float32))
    rope = _rope_params(cfg)
    if tiny_arch == "phi3" and rope.get("rope_type") == "longrope":
        w.add_tensor("rope_factors_long.weight", np.array(rope["long_factor"], np.float32))
        w.add_tensor("rope_factors_short.weight", np.array(rope["short_factor"], np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return expected


def write_metadata_only(
    path,
    arch: str,
    layers: int,
    *,
    ffn: int = 128,
    kv: int | list[int] | None = None,
    head_len: int | None = None,
    tensors: dict[str, tuple[int, ...]] | None = None,
    **keys,
):
    """A GGUF file of metadata (hidden 64, 4 heads, `layers` blocks, `ffn` wide; `kv` KV heads,
    per layer when a list; `head_len` as key and value length) and zero tensors: a 32-row
    embedding plus `tensors` (name -> shape). `keys` go under `arch.`, typed by their values.
    For the loader's config and error paths."""
    import gguf

    from paged_engine.gguf import GGUFFile

    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(layers)
    w.add_embedding_length(64)
    w.add_feed_forward_length(ffn)
    w.add_head_count(4)
    if kv is not None:
        w.add_head_count_kv(kv)
    if head_len is not None:
        w.add_key_length(head_len)
        w.add_value_length(head_len)
    for key, value in keys.items():
        name = f"{arch}.{key}"
        if isinstance(value, list):
            w.add_array(name, value)
        elif isinstance(value, bool):
            w.add_bool(name, value)
        elif isinstance(value, int):
            w.add_uint32(name, value)
        elif isinstance(value, float):
            w.add_float32(name, value)
        else:
            w.add_string(name, value)
    w.add_tensor("token_embd.weight", np.zeros((32, 64), np.float32))
    for name, shape in (tensors or {}).items():
        w.add_tensor(name, np.zeros(shape, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return GGUFFile(path)
