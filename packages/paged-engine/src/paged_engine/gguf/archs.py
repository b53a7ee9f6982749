"""The GGUF architectures we load: `general.architecture` -> our HF class and how llama.cpp's
converter (convert_hf_to_gguf.py) changed the checkpoint on the way in, which loading undoes.

- q/k rows: permuted for the Llama family only (llama.cpp's "normal" rope rotates interleaved
  pairs); Qwen2/3, Phi-3 and Gemma use NeoX rope there too and are stored as HF has them.
- Gemma's RMSNorm scales by (1 + w); llama.cpp's is plain, so every `*norm.weight` is stored
  as 1 + w and loads back as stored - 1 (Gemma 1, 2 and 3).
- Phi-3: fused `attn_qkv` and `ffn_up` = HF's fused qkv_proj / gate_up_proj (split by the model).
- MoE: the router is `ffn_gate_inp`; experts are merged into `ffn_{gate,up,down}_exps`
  ([E, I, H] / [E, H, I]), or in older Mixtral files one tensor each, `ffn_gate.M`.
- Mixtral is stored as arch "llama" with `llama.expert_count` > 0.

Hybrids (convert_hf_to_gguf.py: Qwen3NextModel, _LinearAttentionVReorderBase / Qwen3_5TextModel /
Qwen3_5MoeTextModel, LFM2Model, LFM2MoeModel; undone in convert.py):
- Qwen3-Next / Qwen3.5(-MoE) ("qwen3next", "qwen35", "qwen35moe"): their (1 + w) RMSNorm weights
  are stored as w + 1 except the gated-delta-net's own `linear_attn.norm` (ssm_norm); A_log is
  stored as A = -exp(A_log) (`ssm_a`, no suffix); dt_bias as `ssm_dt.bias`; conv1d weights
  squeezed to [C, K]. Qwen3-Next's fused in_proj_qkvz (per key head [q, k, v, z]) is split into
  `attn_qkv` ([all q, all k, all v]) and `attn_gate` (z); in_proj_ba stays as `ssm_ba`.
  Qwen3.5 with fewer key than value heads has its value heads reordered from grouped by key
  head to tiled (v-rows of attn_qkv, attn_gate, ssm_alpha / ssm_beta, ssm_a, ssm_dt, the conv's
  v channels, ssm_out's columns).
- LFM2 / LFM2-MoE ("lfm2", "lfm2moe"): short-conv weights squeezed to [C, K]; the expert bias
  stored as `exp_probs_b.bias`; the final norm (HF `embedding_norm`) as `token_embd_norm`.

Mamba2 hybrids (convert_hf_to_gguf.py: Mamba2Model, GraniteHybridModel, NemotronHModel):
- Granite 4.0-H ("granitehybrid") and Nemotron-H / Nemotron 3 ("nemotron_h", "nemotron_h_moe"):
  A_log stored as A = -exp(A_log) and D, both as [H, 1] (`ssm_a`, `ssm_d`, no suffix); dt_bias
  as `ssm_dt.bias`; conv1d weights squeezed to [C, K]; the gated norm (`ssm_norm`) reshaped to
  [groups, inner / groups]; attention q / k rows permuted as Llama's (GraniteModel and
  NemotronHModel derive from LlamaModel), though neither rotates them. Layer kinds: per-layer
  head_count_kv (0 off attention layers), and for Nemotron-H per-layer feed_forward_length (0 off
  MLP / MoE layers); we read them from the tensors each layer holds.
- Granite: the MoE's fused input_linear [E, 2I, H] split into `ffn_gate_exps` / `ffn_up_exps`,
  the shared MLP's input_linear into `ffn_gate_shexp` / `ffn_up_shexp` (dense models: `ffn_gate`
  / `ffn_up` / `ffn_down`); loading concatenates them back (GGUFArch.fold). The multipliers are
  metadata: attention.scale, embedding_scale, residual_scale, logit_scale.
- Nemotron-H keeps HF's `backbone.` names; Nemotron 3's experts are merged (`ffn_up_exps`,
  `ffn_down_exps`, no gate), the router's correction bias is `exp_probs_b.bias`, the latent
  projections are `ffn_latent_down` / `ffn_latent_up`.

Pure state-space models (convert_hf_to_gguf.py: MambaModel, Mamba2Model), HF's `backbone.` names:
- Mamba / Falcon Mamba ("mamba"; Falcon Mamba's files say `ssm.dt_b_c_rms` True): A_log stored
  as A = -exp(A_log), still [inner, state] (`ssm_a`, no suffix), D as is (`ssm_d`); conv1d weights
  squeezed to [C, K]; x_proj `ssm_x`, dt_proj `ssm_dt`; a head equal to the embedding left out.
- Mamba2 ("mamba2"): as the Mamba2 hybrids' mixers above.

Other hybrids (convert_hf_to_gguf.py: FalconH1Model, JambaModel), HF's `model.` names with
`final_layernorm` as `output_norm`:
- Falcon-H1 ("falcon-h1"): the mixer as Mamba2's above ([H, 1] A / D, [groups, n] gated norm,
  present only with mamba_rms_norm); the pre-MLP norm stored as `ffn_norm` with no `.weight`
  (gguf-py maps `pre_ff_layernorm.weight` whole). Every multiplier is folded into a weight and
  none is written: embedding_multiplier into token_embd, lm_head_multiplier into output,
  attention_in_multiplier into attn_q / attn_k / attn_v (key_multiplier too into attn_k),
  attention_out_multiplier into attn_output, ssm_in_multiplier and the ssm_multipliers (z, x, B,
  C, dt row blocks) into ssm_in, ssm_out_multiplier into ssm_out, mlp_multipliers into ffn_gate
  / ffn_down. They load as 1 with the folded weights (the same function; HF's split between
  weight and multiplier is lost). q / k not permuted (llama.cpp's NeoX rope).
- Jamba ("jamba"): Mamba (v1) mixers as Mamba's above (A = -exp(A_log), [inner, state]) with
  the dt / B / C norms' weights (`ssm_dt_norm`, `ssm_b_norm`, `ssm_c_norm`); layer kinds from the
  per-layer head_count_kv (0 on Mamba layers), MoE layers from their router (`ffn_gate_inp`) and
  merged experts (`ffn_{gate,up,down}_exps`).

More transformer archs (conversion/{exaone,apertus,arcee,olmo,minimax,hunyuan,dots1}.py):
- EXAONE 4.0 ("exaone4"): stored as HF has it (no permutation, NeoX rope); the post-norms are
  `post_attention_norm` / `post_ffw_norm`; sliding layers as a per-layer bool list
  (attention.sliding_window_pattern) beside attention.sliding_window; Llama 3 rope scaling baked
  into `rope_freqs`.
- Apertus ("apertus"): LlamaModel with undo_permute off (q/k as HF has them); the pre-norms
  `attn_norm` / `ffn_norm`; xIELU's four scalars per layer are metadata arrays
  (xielu.alpha_p / alpha_n / beta / eps, raw parameters: softplus applies at run time), loaded
  back as the HF `mlp.act_fn.*` tensors; Llama 3 scaling as `rope_freqs`.
- Arcee AFM ("arcee"): LlamaModel, q/k rows (and biases) permuted; YaRN as rope.scaling.*.
- Granite 3.x dense ("granite", conversion/granite.py's GraniteModel): LlamaModel, q/k rows
  permuted, head_dim dropped (hidden / heads), the multipliers as attention.scale,
  embedding_scale, residual_scale and logit_scale, each written only when set. Granite MoE
  ("granitemoe", GraniteMoeModel, GraniteMoe and GraniteMoeShared alike): the same, with the
  experts' fused [gate; up] rows split into ffn_gate_exps / ffn_up_exps (the shared MLP's into
  ffn_gate_shexp / ffn_up_shexp), its width as expert_shared_feed_forward_length.
- OLMo 2 ("olmo2", Olmo2Model), Seed-OSS ("seed_oss", SeedOssModel) and GLM-4 ("glm4",
  Glm4Model): TextModel's keys and HF's tensors, q/k unpermuted; OLMo 2's two post-norms as
  post_attention_norm / post_ffw_norm, Seed-OSS's pre-MLP norm as post_attention_norm, GLM-4's
  post-norms as post_attention_norm / post_ffw_norm and its fused gate_up_proj as ffn_up, its
  partial rotary dim as rope.dimension_count (llama.cpp rotates adjacent pairs, as HF's GLM-4).
- ERNIE 4.5 dense ("ernie4_5", Ernie4_5Model): TextModel's keys and HF's tensors (a fused
  qkv_proj / up_gate_proj of older checkpoints split by the converter, as HF has them now).
- gpt-oss ("gpt-oss", GptOssModel): HF's gate_up_proj [E, H, 2I] (gate and up columns
  interleaved) stored as ffn_gate_exps / ffn_up_exps [E, I, H] (the even and the odd rows of its
  transpose), down_proj transposed to [E, H, I], the biases split alike; MXFP4 checkpoints'
  experts repacked as ggml MXFP4 blocks (dequantized here). No key records the sliding-window
  pattern or the SwiGLU limit: llama.cpp's graph slides every even layer and clamps at 7, and
  computes YaRN's correction range truncated to whole dims.
- Llama 4 ("llama4", Llama4Model): q/k as HF has them (its rope already rotates interleaved
  pairs); feed_forward_length is the dense MLPs' width (intermediate_size_mlp),
  expert_feed_forward_length the experts' (intermediate_size); HF's gate_up_proj [E, H, 2I]
  stored as ffn_gate_exps / ffn_up_exps [E, I, H] (its transpose's halves), down_proj transposed
  to [E, H, I]; the router `ffn_gate_inp`, the shared expert `ffn_*_shexp`. No key records the
  chunked attention, the NoPE layers or the query temperature: llama.cpp's graph chunks by 8192
  with NoPE on every 4th layer and a temperature of floor 8192, scale 0.1, unless
  attention.sliding_window is 0 (MobileLLM: every layer full, and rope on all but the last);
  q/k norms on all models but the 128-expert one (Maverick).
- DeepSeek-V2 / V3 ("deepseek2", DeepseekV2Model; V3, R1, Kimi K2, Moonlight alike): MLA
  written as MQA (head_count_kv 1, key_length kv_lora_rank + rope dims, value_length
  kv_lora_rank) with the real head sizes in key_length_mla / value_length_mla; kv_b_proj split
  per head into attn_k_b (its key rows, transposed: [H, kv_lora, nope]) and attn_v_b
  ([H, v, kv_lora]), or whole as attn_kv_b in older files; merged experts, the shared ones as
  `ffn_*_shexp`, the router bias `exp_probs_b.bias`; expert_gating_func 2 (sigmoid) for V3,
  softmax when absent (V2); yarn's mscale_all_dim as rope.scaling.yarn_log_multiplier / 0.1.
  Multi-token-prediction layers a file appends (nextn_predict_layers, counted in block_count:
  GLM-4.7-Flash's converter exports one) are skipped (hf_config.main_layers), for any arch.
- StarCoder2 ("starcoder2", StarCoder2Model): TextModel's keys (its norm_epsilon as
  attention.layer_norm_epsilon) and HF's tensors; no key for its sliding window, which llama.cpp
  does not apply.
- SmolLM3 ("smollm3", SmolLM3Model): LlamaModel, q/k rows permuted. No key carries its NoPE
  layers: llama.cpp skips rope on every 4th layer ((il + 1) % 4 == 0, a constant in its graph),
  which is HF's default `no_rope_layer_interval` of 4.
- OLMoE ("olmoe"): no permutation; whole-projection q/k norms; merged experts; llama.cpp never
  renormalizes the top-k weights and does not clamp q/k/v (clip_qkv is not written).
- MiniMax-M2 ("minimax-m2"): merged experts (w1 / w3 / w2), the router bias
  `exp_probs_b.bias`, rope.dimension_count = rotary_dim, experts of
  expert_feed_forward_length; sigmoid gating.
- Hunyuan dense / MoE ("hunyuan-dense", "hunyuan-moe"): `query_layernorm` / `key_layernorm` as
  attn_q_norm / attn_k_norm; the NTK-alpha rope is baked into rope.freq_base (scaling none,
  context_length 256k); MoE: router `mlp.gate.wg` as ffn_gate_inp, merged experts, the shared
  MLP as `ffn_*_shexp` (expert_shared_feed_forward_length = intermediate_size).
- dots.llm1 ("dots1"): Qwen2MoeModel's layout: merged experts, `shared_experts` as
  `ffn_*_shexp`, the router bias `exp_probs_b.bias`; no expert groups and no sliding window in
  llama.cpp (they load as 1 group / no window).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace

from paged_engine.gguf.reader import GGUFFile

# llama.cpp per-layer tensor name -> HF module path (Llama layout)
LAYER_NAMES: dict[str, str] = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# norms after attention and after the MLP (Gemma 2 / 3, OLMo 2)
_POST_NORMS = {
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
# Gemma's four norms a layer: llama.cpp's ffn_norm is the pre-MLP norm there.
_GEMMA_NAMES = {**LAYER_NAMES, "ffn_norm": "pre_feedforward_layernorm", **_POST_NORMS}
_PHI3_NAMES = {**LAYER_NAMES, "attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"}
# Qwen2-MoE: every layer's experts beside a shared expert behind a sigmoid gate
_QWEN2MOE_NAMES = {
    **LAYER_NAMES,
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
}
# StarCoder2: LayerNorms with biases, an ungated c_fc / c_proj MLP
_STARCODER2_NAMES = {**LAYER_NAMES, "ffn_up": "mlp.c_fc", "ffn_down": "mlp.c_proj"}
# OLMo 2: no pre-norms, a norm after attention and after the MLP
_OLMO2_NAMES = {**LAYER_NAMES, **_POST_NORMS}
# GLM-4 (0414): four norms a layer (a post-norm after attention and after the MLP); the MLP's
# gate and up rows one fused tensor, as HF has it
_GLM4_NAMES = {
    **LAYER_NAMES,
    "post_attention_norm": "post_self_attn_layernorm",
    "post_ffw_norm": "post_mlp_layernorm",
    "ffn_up": "mlp.gate_up_proj",
}
# gpt-oss: the sinks, the router and the experts under HF's parameter names; the experts' up
# half loads interleaved into gate_up_proj with the gate half (convert.py)
_GPT_OSS_NAMES = {
    **LAYER_NAMES,
    "post_attention_norm": "post_attention_layernorm",
    "ffn_up_exps": None,
}
_GPT_OSS_PARAMS = {
    "attn_sinks.weight": "self_attn.sinks",
    "ffn_gate_inp.weight": "mlp.router.weight",
    "ffn_gate_inp.bias": "mlp.router.bias",
    "ffn_gate_exps.weight": "mlp.experts.gate_up_proj",
    "ffn_gate_exps.bias": "mlp.experts.gate_up_proj_bias",
    "ffn_down_exps.weight": "mlp.experts.down_proj",
    "ffn_down_exps.bias": "mlp.experts.down_proj_bias",
}
# Llama 4: HF's `feed_forward` names; the experts' up half loads into gate_up_proj with the
# gate half (convert.py)
_LLAMA4_NAMES = {
    **LAYER_NAMES,
    "ffn_gate": "feed_forward.gate_proj",
    "ffn_up": "feed_forward.up_proj",
    "ffn_down": "feed_forward.down_proj",
    "ffn_gate_shexp": "feed_forward.shared_expert.gate_proj",
    "ffn_up_shexp": "feed_forward.shared_expert.up_proj",
    "ffn_down_shexp": "feed_forward.shared_expert.down_proj",
    "ffn_up_exps": None,
}
_LLAMA4_PARAMS = {
    "ffn_gate_inp.weight": "feed_forward.router.weight",
    "ffn_gate_exps.weight": "feed_forward.experts.gate_up_proj",
    "ffn_down_exps.weight": "feed_forward.experts.down_proj",
}
# Seed-OSS: llama.cpp names HF's pre-MLP `post_attention_layernorm` an attention post-norm
_SEED_OSS_NAMES = {**LAYER_NAMES, "post_attention_norm": "post_attention_layernorm"}
# Qwen3.5: gated-delta-net (linear attention) layers among gated full-attention layers
_QWEN35_NAMES: dict[str, str | None] = {
    **LAYER_NAMES,
    "post_attention_norm": "post_attention_layernorm",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
    "attn_qkv": "linear_attn.in_proj_qkv",
    "attn_gate": "linear_attn.in_proj_z",
    "ssm_alpha": "linear_attn.in_proj_a",
    "ssm_beta": "linear_attn.in_proj_b",
    "ssm_conv1d": "linear_attn.conv1d",
    "ssm_norm": "linear_attn.norm",
    "ssm_out": "linear_attn.out_proj",
}
# Qwen3-Next: attn_qkv and attn_gate load back as one in_proj_qkvz (attn_gate: None, folded in)
_QWEN3NEXT_NAMES = {
    **_QWEN35_NAMES,
    "attn_qkv": "linear_attn.in_proj_qkvz",
    "attn_gate": None,
    "ssm_ba": "linear_attn.in_proj_ba",
}
# parameters whose GGUF name has no .weight (or whose HF name has no .weight / .bias)
_QWEN_HYBRID_PARAMS = {"ssm_a": "linear_attn.A_log", "ssm_dt.bias": "linear_attn.dt_bias"}
_LFM2_NAMES: dict[str, str | None] = {
    "attn_norm": "operator_norm",
    "ffn_norm": "ffn_norm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.out_proj",
    "attn_q_norm": "self_attn.q_layernorm",
    "attn_k_norm": "self_attn.k_layernorm",
    "ffn_gate": "feed_forward.w1",
    "ffn_up": "feed_forward.w3",
    "ffn_down": "feed_forward.w2",
    "shortconv.conv": "conv.conv",
    "shortconv.in_proj": "conv.in_proj",
    "shortconv.out_proj": "conv.out_proj",
}
# Mamba2 mixer parts, under the HF module holding them ("mamba" / "mixer")
_MAMBA2_PARTS = {
    "ssm_in": "in_proj",
    "ssm_conv1d": "conv1d",
    "ssm_norm": "norm",
    "ssm_out": "out_proj",
}
_MAMBA2_PARAMS = {"ssm_a": "A_log", "ssm_d": "D", "ssm_dt.bias": "dt_bias"}
# Granite MoE's experts and shared MLP (GraniteMoe, GraniteMoeShared, Granite 4.0-H); a `None`
# part loads folded into another one (_GRANITE_FOLD)
_GRANITE_MOE_NAMES: dict[str, str | None] = {
    **LAYER_NAMES,
    "ffn_gate_inp": "block_sparse_moe.router.layer",
    "ffn_gate_exps": "block_sparse_moe.input_linear",
    "ffn_up_exps": None,
    "ffn_down_exps": "block_sparse_moe.output_linear",
    "ffn_gate_shexp": "shared_mlp.input_linear",
    "ffn_up_shexp": None,
    "ffn_down_shexp": "shared_mlp.output_linear",
}
_GRANITE_HYBRID_NAMES: dict[str, str | None] = {
    **_GRANITE_MOE_NAMES,
    **{k: f"mamba.{v}" for k, v in _MAMBA2_PARTS.items()},
    "ffn_gate": "shared_mlp.input_linear",
    "ffn_up": None,
    "ffn_down": "shared_mlp.output_linear",
}
# GraniteMoeModel.modify_tensors split HF's fused [gate; up] rows: gate part -> (up part, dim)
_GRANITE_FOLD = {
    "ffn_gate_exps": ("ffn_up_exps", 1),
    "ffn_gate_shexp": ("ffn_up_shexp", 0),
    "ffn_gate": ("ffn_up", 0),
}
# Nemotron-H: one mixer per block (`backbone.layers.N.mixer`), its norm `norm`
_NEMOTRON_H_NAMES: dict[str, str | None] = {
    "attn_norm": "norm",
    "attn_q": "mixer.q_proj",
    "attn_k": "mixer.k_proj",
    "attn_v": "mixer.v_proj",
    "attn_output": "mixer.o_proj",
    "ffn_up": "mixer.up_proj",
    "ffn_down": "mixer.down_proj",
    "ffn_up_shexp": "mixer.shared_experts.up_proj",
    "ffn_down_shexp": "mixer.shared_experts.down_proj",
    "ffn_latent_down": "mixer.fc1_latent_proj",
    "ffn_latent_up": "mixer.fc2_latent_proj",
    **{k: f"mixer.{v}" for k, v in _MAMBA2_PARTS.items()},
}
# the global tensors under HF's `backbone.` (Nemotron-H, Mamba, Mamba2)
_BACKBONE_GLOBALS = {
    "token_embd.weight": "backbone.embeddings.weight",
    "output_norm.weight": "backbone.norm_f.weight",
}
# Mamba / Falcon Mamba and Mamba2: a norm and a mixer per block (`backbone.layers.N.mixer`)
_MAMBA_NAMES: dict[str, str | None] = {
    "attn_norm": "norm",
    "ssm_in": "mixer.in_proj",
    "ssm_conv1d": "mixer.conv1d",
    "ssm_x": "mixer.x_proj",
    "ssm_dt": "mixer.dt_proj",
    "ssm_out": "mixer.out_proj",
}
_MAMBA2_NAMES: dict[str, str | None] = {
    "attn_norm": "norm",
    **{k: f"mixer.{v}" for k, v in _MAMBA2_PARTS.items()},
}
# the global tensors of Falcon-H1 and Jamba (HF's final norm is `final_layernorm`)
_FINAL_LAYERNORM = {"output_norm.weight": "model.final_layernorm.weight"}
_FEED_FORWARD_NAMES = {
    "ffn_norm": "pre_ff_layernorm",
    "ffn_gate": "feed_forward.gate_proj",
    "ffn_up": "feed_forward.up_proj",
    "ffn_down": "feed_forward.down_proj",
}
# Falcon-H1: attention and a Mamba2 mixer (`mamba`) side by side in every layer
_FALCON_H1_NAMES: dict[str, str | None] = {
    **LAYER_NAMES,
    **_FEED_FORWARD_NAMES,
    **{k: f"mamba.{v}" for k, v in _MAMBA2_PARTS.items()},
}
# Jamba: a Mamba (v1) mixer or attention per layer, a MLP or MoE (`feed_forward`) after it
_JAMBA_NAMES: dict[str, str | None] = {
    **LAYER_NAMES,
    **_FEED_FORWARD_NAMES,
    "ssm_in": "mamba.in_proj",
    "ssm_conv1d": "mamba.conv1d",
    "ssm_x": "mamba.x_proj",
    "ssm_dt": "mamba.dt_proj",
    "ssm_dt_norm": "mamba.dt_layernorm",
    "ssm_b_norm": "mamba.b_layernorm",
    "ssm_c_norm": "mamba.c_layernorm",
    "ssm_out": "mamba.out_proj",
}
# EXAONE 4: post-norms only (OLMo 2's placement)
_EXAONE4_NAMES = {
    **LAYER_NAMES,
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
# Apertus: the pre-norms under their own names
_APERTUS_NAMES = {
    **LAYER_NAMES,
    "attn_norm": "attention_layernorm",
    "ffn_norm": "feedforward_layernorm",
}
_HUNYUAN_NAMES = {
    **LAYER_NAMES,
    "attn_q_norm": "self_attn.query_layernorm",
    "attn_k_norm": "self_attn.key_layernorm",
    "ffn_gate_shexp": "mlp.shared_mlp.gate_proj",
    "ffn_up_shexp": "mlp.shared_mlp.up_proj",
    "ffn_down_shexp": "mlp.shared_mlp.down_proj",
}
_DOTS1_NAMES = {
    **LAYER_NAMES,
    "ffn_gate_shexp": "mlp.shared_experts.gate_proj",
    "ffn_up_shexp": "mlp.shared_experts.up_proj",
    "ffn_down_shexp": "mlp.shared_experts.down_proj",
}
_HF_EXPERTS = ("mlp", "gate_proj", "up_proj", "down_proj")
# DeepSeek-V2 / V3 (multi-head latent attention): kv_b_proj stored whole (`attn_kv_b`, older
# files) or split into `attn_k_b` / `attn_v_b`, joined back by convert.py
_DEEPSEEK2_NAMES: dict[str, str | None] = {
    **_DOTS1_NAMES,
    "attn_q_a": "self_attn.q_a_proj",
    "attn_q_a_norm": "self_attn.q_a_layernorm",
    "attn_q_b": "self_attn.q_b_proj",
    "attn_kv_a_mqa": "self_attn.kv_a_proj_with_mqa",
    "attn_kv_a_norm": "self_attn.kv_a_layernorm",
    "attn_kv_b": "self_attn.kv_b_proj",
    "attn_v_b": None,
}
_DEEPSEEK2_PARAMS = {
    "attn_k_b.weight": "self_attn.kv_b_proj.weight",
    "exp_probs_b.bias": "mlp.gate.e_score_correction_bias",
}
# Falcon: `transformer.h.N`; 7B's one norm (`attn_norm`), 40B's two (FALCON_40B below)
_FALCON_NAMES: dict[str, str | None] = {
    "attn_norm": "input_layernorm",
    "attn_qkv": "self_attention.query_key_value",
    "attn_output": "self_attention.dense",
    "ffn_up": "mlp.dense_h_to_4h",
    "ffn_down": "mlp.dense_4h_to_h",
}
_FALCON_GLOBALS = {
    "token_embd.weight": "transformer.word_embeddings.weight",
    "output_norm.weight": "transformer.ln_f.weight",
    "output_norm.bias": "transformer.ln_f.bias",
}
_STARCODER_NAMES: dict[str, str | None] = {
    "attn_norm": "ln_1",
    "ffn_norm": "ln_2",
    "attn_qkv": "attn.c_attn",
    "attn_output": "attn.c_proj",
    "ffn_up": "mlp.c_fc",
    "ffn_down": "mlp.c_proj",
}
_STARCODER_GLOBALS = {
    "token_embd.weight": "transformer.wte.weight",
    "position_embd.weight": "transformer.wpe.weight",
    "output_norm.weight": "transformer.ln_f.weight",
    "output_norm.bias": "transformer.ln_f.bias",
}
_DBRX_NAMES: dict[str, str | None] = {
    "attn_norm": "norm_attn_norm.norm_1",
    "attn_output_norm": "norm_attn_norm.norm_2",
    "attn_qkv": "norm_attn_norm.attn.Wqkv",
    "attn_output": "norm_attn_norm.attn.out_proj",
}
# DBRX's stacked experts and router: HF parameters without `.weight` (convert.py reshapes them)
_DBRX_PARAMS = {
    "ffn_gate_inp.weight": "ffn.router.layer.weight",
    "ffn_gate_exps.weight": "ffn.experts.mlp.w1",
    "ffn_up_exps.weight": "ffn.experts.mlp.v1",
    "ffn_down_exps.weight": "ffn.experts.mlp.w2",
}
_DBRX_GLOBALS = {
    "token_embd.weight": "transformer.wte.weight",
    "output_norm.weight": "transformer.norm_f.weight",
}
# the GGUF families whose mixer is Mamba2 (convert.py reshapes A, D and the gated norm back)
MAMBA2_FAMILIES = ("granitehybrid", "nemotron_h", "mamba2", "falcon_h1")


@dataclass(frozen=True, slots=True)
class GGUFArch:
    hf_arch: str  # HF `architectures[0]`, our model class
    config_cls: str  # the transformers config class
    permute_qk: bool = False  # llama.cpp permuted q/k rows (Llama family)
    norm_offset: float = 0.0  # stored norm weight = HF weight + norm_offset (Gemma: 1)
    layer_names: Mapping[str, str | None] = field(default_factory=lambda: LAYER_NAMES)
    # MoE: (HF block name, per-expert gate, up, down matrix names); None for dense models
    experts: tuple[str, str, str, str] | None = None
    # GGUF parts whose `*norm.weight` carries no norm_offset
    plain_norms: tuple[str, ...] = ()
    # GGUF `<part>` / `<part>.<weight|bias>` -> HF parameter path within the layer, for names
    # that do not follow `<module>.<weight|bias>` on one side
    params: Mapping[str, str] = field(default_factory=dict)
    # extra global tensors: GGUF name -> HF name
    global_names: Mapping[str, str] = field(default_factory=dict)
    # family whose converter transforms convert.py undoes: "qwen3next", "qwen35", "lfm2",
    # "granitehybrid", "nemotron_h", "mamba", "mamba2", "falcon_h1", "jamba"; or whose config
    # hf_config.py rebuilds its own way: "exaone4", "apertus", "arcee", "olmo2", "granite",
    # "granitemoe", "smollm3", "seed_oss", "glm4", "ernie4_5", "starcoder2", "olmoe",
    # "minimax_m2", "hunyuan", "dots1", "nemotron"; or both: "falcon", "starcoder", "dbrx",
    # "gpt_oss", "llama4", "deepseek2"
    family: str = ""
    # HF path of the decoder layers (`<prefix>.<N>.<module>`)
    prefix: str = "model.layers"
    # GGUF part -> (part concatenated after it, dim): HF's one fused tensor stored as two
    fold: Mapping[str, tuple[str, int]] = field(default_factory=dict)


GGUF_ARCHS: dict[str, GGUFArch] = {
    "llama": GGUFArch("LlamaForCausalLM", "LlamaConfig", permute_qk=True),
    "qwen2": GGUFArch("Qwen2ForCausalLM", "Qwen2Config"),
    "qwen3": GGUFArch("Qwen3ForCausalLM", "Qwen3Config"),
    "qwen2moe": GGUFArch(
        "Qwen2MoeForCausalLM",
        "Qwen2MoeConfig",
        layer_names=_QWEN2MOE_NAMES,
        experts=("mlp", "gate_proj", "up_proj", "down_proj"),
    ),
    "qwen3moe": GGUFArch(
        "Qwen3MoeForCausalLM",
        "Qwen3MoeConfig",
        experts=("mlp", "gate_proj", "up_proj", "down_proj"),
    ),
    # Gemma 1 (gemma-2b / 7b, CodeGemma): Llama's two norms a layer
    "gemma": GGUFArch("GemmaForCausalLM", "GemmaConfig", norm_offset=1.0),
    "gemma2": GGUFArch(
        "Gemma2ForCausalLM", "Gemma2Config", norm_offset=1.0, layer_names=_GEMMA_NAMES
    ),
    "gemma3": GGUFArch(
        "Gemma3ForCausalLM", "Gemma3TextConfig", norm_offset=1.0, layer_names=_GEMMA_NAMES
    ),
    "phi3": GGUFArch("Phi3ForCausalLM", "Phi3Config", layer_names=_PHI3_NAMES),
    "qwen3next": GGUFArch(
        "Qwen3NextForCausalLM",
        "Qwen3NextConfig",
        norm_offset=1.0,
        layer_names=_QWEN3NEXT_NAMES,
        experts=("mlp", "gate_proj", "up_proj", "down_proj"),
        plain_norms=("ssm_norm",),
        params=_QWEN_HYBRID_PARAMS,
        family="qwen3next",
    ),
    "qwen35": GGUFArch(
        "Qwen3_5ForCausalLM",
        "Qwen3_5TextConfig",
        norm_offset=1.0,
        layer_names=_QWEN35_NAMES,
        plain_norms=("ssm_norm",),
        params=_QWEN_HYBRID_PARAMS,
        family="qwen35",
    ),
    "qwen35moe": GGUFArch(
        "Qwen3_5MoeForCausalLM",
        "Qwen3_5MoeTextConfig",
        norm_offset=1.0,
        layer_names=_QWEN35_NAMES,
        experts=("mlp", "gate_proj", "up_proj", "down_proj"),
        plain_norms=("ssm_norm",),
        params=_QWEN_HYBRID_PARAMS,
        family="qwen35",
    ),
    "lfm2": GGUFArch(
        "Lfm2ForCausalLM",
        "Lfm2Config",
        layer_names=_LFM2_NAMES,
        global_names={"token_embd_norm.weight": "model.embedding_norm.weight"},
        family="lfm2",
    ),
    "lfm2moe": GGUFArch(
        "Lfm2MoeForCausalLM",
        "Lfm2MoeConfig",
        layer_names=_LFM2_NAMES,
        experts=("feed_forward", "w1", "w3", "w2"),
        params={"exp_probs_b.bias": "feed_forward.expert_bias"},
        global_names={"token_embd_norm.weight": "model.embedding_norm.weight"},
        family="lfm2",
    ),
    "granitehybrid": GGUFArch(
        "GraniteMoeHybridForCausalLM",
        "GraniteMoeHybridConfig",
        permute_qk=True,
        layer_names=_GRANITE_HYBRID_NAMES,
        params={k: f"mamba.{v}" for k, v in _MAMBA2_PARAMS.items()},
        family="granitehybrid",
        fold=_GRANITE_FOLD,
    ),
    "nemotron_h": GGUFArch(
        "NemotronHForCausalLM",
        "NemotronHConfig",
        permute_qk=True,
        layer_names=_NEMOTRON_H_NAMES,
        params={k: f"mixer.{v}" for k, v in _MAMBA2_PARAMS.items()},
        global_names=_BACKBONE_GLOBALS,
        family="nemotron_h",
        prefix="backbone.layers",
    ),
    "nemotron_h_moe": GGUFArch(
        "NemotronHForCausalLM",
        "NemotronHConfig",
        permute_qk=True,
        layer_names=_NEMOTRON_H_NAMES,
        experts=("mixer", "gate_proj", "up_proj", "down_proj"),
        params={
            **{k: f"mixer.{v}" for k, v in _MAMBA2_PARAMS.items()},
            "exp_probs_b.bias": "mixer.gate.e_score_correction_bias",
        },
        global_names=_BACKBONE_GLOBALS,
        family="nemotron_h",
        prefix="backbone.layers",
    ),
    "mamba": GGUFArch(
        "MambaForCausalLM",
        "MambaConfig",
        layer_names=_MAMBA_NAMES,
        params={"ssm_a": "mixer.A_log", "ssm_d": "mixer.D"},
        global_names=_BACKBONE_GLOBALS,
        family="mamba",
        prefix="backbone.layers",
    ),
    "mamba2": GGUFArch(
        "Mamba2ForCausalLM",
        "Mamba2Config",
        layer_names=_MAMBA2_NAMES,
        params={k: f"mixer.{v}" for k, v in _MAMBA2_PARAMS.items()},
        global_names=_BACKBONE_GLOBALS,
        family="mamba2",
        prefix="backbone.layers",
    ),
    "falcon-h1": GGUFArch(
        "FalconH1ForCausalLM",
        "FalconH1Config",
        layer_names=_FALCON_H1_NAMES,
        # the pre-MLP norm without `.weight` (FFN_PRE_NORM's mapping takes HF's name whole)
        params={
            **{k: f"mamba.{v}" for k, v in _MAMBA2_PARAMS.items()},
            "ffn_norm": "pre_ff_layernorm.weight",
        },
        global_names=_FINAL_LAYERNORM,
        family="falcon_h1",
    ),
    "jamba": GGUFArch(
        "JambaForCausalLM",
        "JambaConfig",
        layer_names=_JAMBA_NAMES,
        experts=("feed_forward", "gate_proj", "up_proj", "down_proj"),
        params={
            "ssm_a": "mamba.A_log",
            "ssm_d": "mamba.D",
            "ffn_gate_inp.weight": "feed_forward.router.weight",
        },
        global_names=_FINAL_LAYERNORM,
        family="jamba",
    ),
    "exaone4": GGUFArch(
        "Exaone4ForCausalLM", "Exaone4Config", layer_names=_EXAONE4_NAMES, family="exaone4"
    ),
    "apertus": GGUFArch(
        "ApertusForCausalLM", "ApertusConfig", layer_names=_APERTUS_NAMES, family="apertus"
    ),
    "arcee": GGUFArch("ArceeForCausalLM", "ArceeConfig", permute_qk=True, family="arcee"),
    "granite": GGUFArch("GraniteForCausalLM", "GraniteConfig", permute_qk=True, family="granite"),
    "smollm3": GGUFArch("SmolLM3ForCausalLM", "SmolLM3Config", permute_qk=True, family="smollm3"),
    "olmo2": GGUFArch("Olmo2ForCausalLM", "Olmo2Config", layer_names=_OLMO2_NAMES, family="olmo2"),
    "glm4": GGUFArch("Glm4ForCausalLM", "Glm4Config", layer_names=_GLM4_NAMES, family="glm4"),
    "ernie4_5": GGUFArch("Ernie4_5ForCausalLM", "Ernie4_5Config", family="ernie4_5"),
    "gpt-oss": GGUFArch(
        "GptOssForCausalLM",
        "GptOssConfig",
        layer_names=_GPT_OSS_NAMES,
        params=_GPT_OSS_PARAMS,
        family="gpt_oss",
    ),
    "llama4": GGUFArch(
        "Llama4ForCausalLM",
        "Llama4TextConfig",
        layer_names=_LLAMA4_NAMES,
        params=_LLAMA4_PARAMS,
        family="llama4",
    ),
    "starcoder2": GGUFArch(
        "Starcoder2ForCausalLM",
        "Starcoder2Config",
        layer_names=_STARCODER2_NAMES,
        global_names={"output_norm.bias": "model.norm.bias"},
        family="starcoder2",
    ),
    "seed_oss": GGUFArch(
        "SeedOssForCausalLM", "SeedOssConfig", layer_names=_SEED_OSS_NAMES, family="seed_oss"
    ),
    # llama.cpp's one arch for GraniteMoe and GraniteMoeShared: loaded as the latter, whose
    # shared_intermediate_size 0 is the former
    "granitemoe": GGUFArch(
        "GraniteMoeSharedForCausalLM",
        "GraniteMoeSharedConfig",
        permute_qk=True,
        layer_names=_GRANITE_MOE_NAMES,
        family="granitemoe",
        fold=_GRANITE_FOLD,
    ),
    "olmoe": GGUFArch("OlmoeForCausalLM", "OlmoeConfig", experts=_HF_EXPERTS, family="olmoe"),
    "minimax-m2": GGUFArch(
        "MiniMaxM2ForCausalLM",
        "MiniMaxM2Config",
        experts=("block_sparse_moe", "w1", "w3", "w2"),
        params={"exp_probs_b.bias": "block_sparse_moe.e_score_correction_bias"},
        family="minimax_m2",
    ),
    "hunyuan-dense": GGUFArch(
        "HunYuanDenseV1ForCausalLM",
        "HunYuanDenseV1Config",
        layer_names=_HUNYUAN_NAMES,
        family="hunyuan",
    ),
    "hunyuan-moe": GGUFArch(
        "HunYuanMoEV1ForCausalLM",
        "HunYuanMoEV1Config",
        layer_names=_HUNYUAN_NAMES,
        experts=_HF_EXPERTS,
        params={"ffn_gate_inp.weight": "mlp.gate.wg.weight"},
        family="hunyuan",
    ),
    "dots1": GGUFArch(
        "Dots1ForCausalLM",
        "Dots1Config",
        layer_names=_DOTS1_NAMES,
        experts=_HF_EXPERTS,
        params={"exp_probs_b.bias": "mlp.gate.e_score_correction_bias"},
        family="dots1",
    ),
    # DeepSeek-V2 / V2-Lite (softmax routing); gguf_arch picks DEEPSEEK_V3 for sigmoid files
    "deepseek2": GGUFArch(
        "DeepseekV2ForCausalLM",
        "DeepseekV2Config",
        layer_names=_DEEPSEEK2_NAMES,
        experts=_HF_EXPERTS,
        params=_DEEPSEEK2_PARAMS,
        family="deepseek2",
    ),
    "falcon": GGUFArch(
        "FalconForCausalLM",
        "FalconConfig",
        layer_names=_FALCON_NAMES,
        global_names=_FALCON_GLOBALS,
        family="falcon",
        prefix="transformer.h",
    ),
    "starcoder": GGUFArch(
        "GPTBigCodeForCausalLM",
        "GPTBigCodeConfig",
        layer_names=_STARCODER_NAMES,
        global_names=_STARCODER_GLOBALS,
        family="starcoder",
        prefix="transformer.h",
    ),
    "nemotron": GGUFArch(
        "NemotronForCausalLM",
        "NemotronConfig",
        norm_offset=1.0,
        global_names={"output_norm.bias": "model.norm.bias"},
        family="nemotron",
    ),
    "dbrx": GGUFArch(
        "DbrxForCausalLM",
        "DbrxConfig",
        layer_names=_DBRX_NAMES,
        params=_DBRX_PARAMS,
        global_names=_DBRX_GLOBALS,
        family="dbrx",
        prefix="transformer.blocks",
    ),
}
# arch "llama" with experts
MIXTRAL = GGUFArch(
    "MixtralForCausalLM",
    "MixtralConfig",
    permute_qk=True,
    experts=("block_sparse_moe", "w1", "w3", "w2"),
)
# arch "deepseek2" with sigmoid expert gating (DeepSeek-V3 / R1, Kimi K2, Moonlight):
# llama.cpp's expert_gating_func 2
DEEPSEEK_V3 = replace(
    GGUF_ARCHS["deepseek2"], hf_arch="DeepseekV3ForCausalLM", config_cls="DeepseekV3Config"
)
# arch "mamba" whose mixer normalizes dt, B and C (MambaModel's dt_b_c_rms: model_type
# falcon_mamba)
FALCON_MAMBA = replace(
    GGUF_ARCHS["mamba"], hf_arch="FalconMambaForCausalLM", config_cls="FalconMambaConfig"
)

# arch "falcon" with two norms a layer (40B / 180B: gguf-py maps ln_mlp to attn_norm and
# ln_attn to attn_norm_2)
FALCON_40B = replace(
    GGUF_ARCHS["falcon"],
    layer_names={**_FALCON_NAMES, "attn_norm": "ln_mlp", "attn_norm_2": "ln_attn"},
)


def gguf_arch(f: GGUFFile) -> tuple[str, GGUFArch]:
    """(general.architecture, its spec); ValueError naming the supported ones."""
    arch = f.get("general.architecture")
    if not isinstance(arch, str) or arch not in GGUF_ARCHS:
        raise ValueError(
            f"unsupported GGUF general.architecture {arch!r}; supported: {sorted(GGUF_ARCHS)}"
        )
    if arch == "llama" and int(f.get("llama.expert_count") or 0) > 0:
        return arch, MIXTRAL
    if arch == "falcon" and "blk.0.attn_norm_2.weight" in f.tensors:
        return arch, FALCON_40B
    if arch == "mamba" and f.get("mamba.ssm.dt_b_c_rms"):
        return arch, FALCON_MAMBA
    if arch == "deepseek2" and int(f.get("deepseek2.expert_gating_func") or 0) == 2:
        return arch, DEEPSEEK_V3
    return arch, GGUF_ARCHS[arch]
