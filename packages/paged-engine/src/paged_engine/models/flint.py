"""Recursive Flint (`FlintForCausalLM`: RecursiveSI/flint).

Qwen3-MoE's decoder (models/qwen3_moe.py: pre-norm layers, per-head q / k RMSNorms after the
projections, the `mlp_only_layers` and `decoder_sparse_step` rule for dense layers of
intermediate_size) with these differences, each as transformers runs it:

    norms      every RMSNorm, the q / k ones too, multiplies by its weight in float32 and rounds
               once (gpt-oss's RMSNorm, our Olmo2RMSNorm)
    attention  the `sliding_attention` layers of config.layer_types see the last
               sliding_window keys and rotate q and k; the `full_attention` ones (by default
               the first two, every fourth from layer 1, and the last) see the whole context
               without positional encoding (NoPE), their q / k still normed; one learned sink
               logit per query head joins every row's softmax (gpt-oss's SinkAttention)
    router     logits = x @ W_g^T in float32 (W_g kept in float32); a token's experts are the
               top num_experts_per_tok of sigmoid(logits), no balance bias, their scores
               renormalized when norm_topk_prob (True by default): DeepSeek-V3's router
               without its correction bias (layers/deepseek_moe.py)
    shared     an ungated shared expert of shared_expert_intermediate_size, added in full
               (Qwen2-MoE gates its shared expert)

q / k / v / o have biases when `attention_bias`. Checkpoints: transformers' names (the shared
expert `mlp.shared_expert.*` loads into DeepseekMoe's `shared_experts`), and the release's
`self_attn.softmax_offset` for the sinks (transformers' rename).
"""

from __future__ import annotations

from torch import nn

from paged_engine.layers.deepseek_moe import DeepseekMoe
from paged_engine.layers.rotary import RotaryEmbedding
from paged_engine.models.exaone4 import Exaone4Attention
from paged_engine.models.gemma2 import gemma_layer_types
from paged_engine.models.gpt_oss import SinkAttention
from paged_engine.models.llama import LlamaModel, PreNormDecoderLayer
from paged_engine.models.mixtral import check_silu, expert_rules, num_experts
from paged_engine.models.olmo2 import Olmo2RMSNorm
from paged_engine.models.qwen3_moe import Qwen3MoeForCausalLM
from paged_engine.models.utils import CausalLMBase, cfg_get


class FlintAttention(Exaone4Attention, SinkAttention):
    """SinkAttention (the window of the layer's type, the sinks) with EXAONE 4.0's forward:
    q / k norms in NoPE layers (`rope` None) too; the norms round once (Olmo2RMSNorm)."""

    def __init__(
        self, config, layer_idx: int, flags: dict[str, bool], rope: RotaryEmbedding | None
    ) -> None:
        super().__init__(config, layer_idx, flags, rope)
        eps = cfg_get(config, "rms_norm_eps", 1e-6)
        self.q_norm = Olmo2RMSNorm(self.head_dim, eps)
        self.k_norm = Olmo2RMSNorm(self.head_dim, eps)


class FlintDecoderLayer(PreNormDecoderLayer):
    def __init__(self, config, attention: nn.Module, mlp: nn.Module) -> None:
        super().__init__()
        eps = cfg_get(config, "rms_norm_eps", 1e-6)
        self.self_attn = attention
        self.mlp = mlp
        self.input_layernorm = Olmo2RMSNorm(config.hidden_size, eps)
        self.post_attention_layernorm = Olmo2RMSNorm(config.hidden_size, eps)


class FlintForCausalLM(Qwen3MoeForCausalLM):
    def __init__(self, config) -> None:
        check_silu(config, type(self).__name__)
        cls = type(self)
        flags = cls.layer_flags(config)
        types = gemma_layer_types(config, every=4)  # config.layer_types (always set)

        def build(i: int, rope: RotaryEmbedding) -> FlintDecoderLayer:
            rotates = types[i] == "sliding_attention"
            attention = FlintAttention(config, i, flags, rope if rotates else None)
            return FlintDecoderLayer(config, attention, cls.build_mlp(config, i))

        inner = LlamaModel(config, flags, build)
        inner.norm = Olmo2RMSNorm(config.hidden_size, cfg_get(config, "rms_norm_eps", 1e-6))
        CausalLMBase.__init__(self, config, inner)
        # Expert rules first: the dense / shared rules' ".gate_proj" would match an expert's.
        rules = expert_rules(num_experts(config), *self.expert_names)
        self.stacked_params = (*rules, *cls.stacked_params)

    @classmethod
    def sparse_block(cls, config) -> nn.Module:
        return DeepseekMoe(
            num_experts(config),
            int(config.num_experts_per_tok),
            config.hidden_size,
            int(config.moe_intermediate_size),
            int(config.shared_expert_intermediate_size),
            correction_bias=False,
            renormalize=bool(cfg_get(config, "norm_topk_prob", True)),
        )

    def rename_weight(self, name: str) -> str:
        name = name.replace("self_attn.softmax_offset", "self_attn.sinks")
        return super().rename_weight(name.replace(".mlp.shared_expert.", ".mlp.shared_experts."))
