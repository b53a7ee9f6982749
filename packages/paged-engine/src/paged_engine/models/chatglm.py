"""ChatGLM2 / ChatGLM3 / GLM-4 as their remote-code releases ship them (`ChatGLMModel`,
`ChatGLMForConditionalGeneration`, model_type "chatglm": chatglm2-6b, chatglm3-6b and their
-32k / -128k variants, glm-4-9b-chat and glm-4-9b-chat-1m), as vLLM's chatglm.py serves them.

The model is transformers' GlmForCausalLM (glm-4-9b-chat-hf is glm-4-9b-chat converted), which
models/glm4.py serves: Llama's pre-RMSNorm layers with q / k / v biases, an o_proj without one,
GPT-J-style rope (interleaved (even, odd) pairs) on the first half of each head's dims and the
rest passed through. Only the names differ:

    config       num_layers -> num_hidden_layers, padded_vocab_size -> vocab_size,
                 kv_channels -> head_dim, ffn_hidden_size -> intermediate_size,
                 multi_query_group_num -> num_key_value_heads (all heads without
                 multi_query_attention), layernorm_epsilon -> rms_norm_eps,
                 add_qkv_bias -> attention_bias, seq_length -> max_position_embeddings,
                 rope base 10000 x rope_ratio over head_dim / 2 rotary dims
    tensors      transformer.embedding.word_embeddings -> model.embed_tokens,
                 transformer.encoder.layers.N -> model.layers.N,
                 transformer.encoder.final_layernorm -> model.norm,
                 transformer.output_layer -> lm_head;
                 self_attention.query_key_value ([q | k | v] rows) -> q_proj / k_proj / v_proj,
                 self_attention.dense -> o_proj, mlp.dense_h_to_4h ([gate | up] rows, the
                 halves of its swiglu) -> gate_proj / up_proj, mlp.dense_4h_to_h -> down_proj

`with_llama_names` writes the Llama names onto the config (the loader calls it on a loaded
"chatglm" config, so the KV cache and the parallelism checks read them too); the model reads
a copy with them. Tensor parallelism splits the rows as Llama's do.

Refused by name (no exact reference to test them against): rmsnorm=False (LayerNorms),
apply_residual_connection_post_layernorm=True, post_layer_norm=False, add_bias_linear=True,
original_rope=False (NeoX-style rope: CogAgent), pre_seq_len (a p-tuning prefix encoder),
quantization_bit (the releases' own int4 / int8 weights). GLM-4V's config.json (a
vision_config beside these fields) is GLM4VForCausalLM's: models/glm4v_remote_config.py and
multimodal/glm4v_remote.py, whose text model is this one.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable

import torch

from paged_engine.models.glm4 import GlmForCausalLM
from paged_engine.models.utils import cfg_get

# (field, value ChatGLM's code needs for it to be Glm's model): a config that differs is refused
_REQUIRED = (
    ("rmsnorm", True),
    ("apply_residual_connection_post_layernorm", False),
    ("post_layer_norm", True),
    ("add_bias_linear", False),
    ("original_rope", True),
)


def check_chatglm_config(config) -> None:
    """ValueError naming the first field whose variant of the model we do not serve."""
    if getattr(config, "vision_config", None) is not None:
        raise ValueError(
            "ChatGLM's text model takes no vision_config: GLM-4V is served as GLM4VForCausalLM "
            "(multimodal/glm4v_remote.py), which strips it from this model's config"
        )
    for field, want in _REQUIRED:
        got = getattr(config, field, None)
        if got is not None and bool(got) != want:
            raise ValueError(f"ChatGLM with {field}={got} is not supported (only {want})")
    if getattr(config, "pre_seq_len", None):
        raise ValueError("ChatGLM with pre_seq_len (a p-tuning prefix encoder) is not supported")
    if getattr(config, "quantization_bit", 0):
        raise ValueError(
            f"ChatGLM with quantization_bit={config.quantization_bit} (the release's own "
            "quantized weights) is not supported"
        )


def with_llama_names(config):
    """`config` with Llama's names for ChatGLM's fields set on it (in place; returns it)."""
    heads = int(config.num_attention_heads)
    head_dim = int(cfg_get(config, "kv_channels", config.hidden_size // heads))
    mqa = bool(getattr(config, "multi_query_attention", False))
    config.num_hidden_layers = int(config.num_layers)
    config.num_key_value_heads = int(cfg_get(config, "multi_query_group_num", 1)) if mqa else heads
    config.head_dim = head_dim
    config.vocab_size = int(cfg_get(config, "padded_vocab_size", getattr(config, "vocab_size", 0)))
    config.intermediate_size = int(config.ffn_hidden_size)
    config.max_position_embeddings = int(cfg_get(config, "seq_length", 8192))
    config.rms_norm_eps = float(cfg_get(config, "layernorm_epsilon", 1e-5))
    config.attention_bias = bool(getattr(config, "add_qkv_bias", False))
    config.hidden_act = "silu"
    # rotary dims head_dim / 2 whatever the head size; base 10000 x rope_ratio
    config.rope_parameters = {
        "rope_type": "default",
        "rope_theta": 10000.0 * float(cfg_get(config, "rope_ratio", 1.0)),
        "partial_rotary_factor": 0.5,
    }
    return config


class ChatGLMForCausalLM(GlmForCausalLM):
    renames = (
        ("transformer.embedding.word_embeddings.", "model.embed_tokens."),
        ("transformer.encoder.final_layernorm.", "model.norm."),
        ("transformer.encoder.layers.", "model.layers."),
        ("transformer.output_layer.", "lm_head."),
        (".self_attention.query_key_value.", ".self_attn.query_key_value."),
        (".self_attention.dense.", ".self_attn.o_proj."),
        (".mlp.dense_h_to_4h.", ".mlp.gate_up_proj."),
        (".mlp.dense_4h_to_h.", ".mlp.down_proj."),
    )
    ignored_weights = ("rotary_pos_emb.inv_freq",)

    def __init__(self, config):
        check_chatglm_config(config)
        super().__init__(with_llama_names(copy.copy(config)))

    def convert_weight(self, name: str, w: torch.Tensor) -> Iterable[tuple[str, torch.Tensor]]:
        if ".query_key_value." not in name:
            yield from super().convert_weight(name, w)
            return
        cfg = self.config
        q_rows = cfg.num_attention_heads * cfg.head_dim
        kv_rows = cfg.num_key_value_heads * cfg.head_dim
        if w.shape[0] != q_rows + 2 * kv_rows:
            raise ValueError(f"{name}: {w.shape[0]} rows, expected {q_rows} + 2 x {kv_rows}")
        q, k, v = w.split([q_rows, kv_rows, kv_rows], dim=0)  # [q | k | v] rows
        for part, rows in (("q_proj", q), ("k_proj", k), ("v_proj", v)):
            yield name.replace(".query_key_value.", f".{part}."), rows
