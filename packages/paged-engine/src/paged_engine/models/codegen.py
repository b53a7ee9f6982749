"""CodeGen (`CodeGenForCausalLM`: Salesforce codegen-350M / 2B / 6B / 16B, mono / multi / nl).

CodeGen's decoder is GPT-J's (models/gptj.py): one LayerNorm feeding attention and MLP in
parallel, bias-free attention with interleaved rotary on the first `rotary_dim` dims of each
head, fc_out(gelu_new(fc_in(x))) with biases, a final LayerNorm and an LM head with a bias. Only
the attention's input projection differs: one fused `qkv_proj` [3 * D, D] whose rows are the
model-parallel layout of the original TPU training, `mp_num = 4` groups, each holding that
group's q | v | k rows (note: v before k), D / 4 rows apiece. Group g's q rows are heads
[g * H / 4, (g + 1) * H / 4) of the query, likewise for v and k. `convert_weight` regathers them
into plain q, k and v tensors, which then load (and shard under tensor parallelism) through
`QKVParallelLinear` exactly as GPT-J's separate q_proj / k_proj / v_proj do.

`rotary_dim` None: HF rotates with a table as wide as the hidden size, which fits the heads only
when there is one head (then the whole head rotates); other head counts are refused by name.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from paged_engine.models.gptj import GPTJForCausalLM

MP_NUM = 4  # HF's hard-coded model-parallel group count of the fused qkv rows


class CodeGenForCausalLM(GPTJForCausalLM):
    # HF's causal-mask buffer in older checkpoints (`attn.causal_mask`), besides GPT-J's
    ignored_weights = (*GPTJForCausalLM.ignored_weights, ".self_attn.causal_mask")

    def __init__(self, config):
        d, heads = config.hidden_size, config.num_attention_heads
        if d % MP_NUM:
            raise ValueError(f"CodeGen: hidden_size={d} must split into {MP_NUM} qkv groups")
        if getattr(config, "rotary_dim", None) is None and heads != 1:
            raise ValueError(
                f"CodeGen: rotary_dim=None with num_attention_heads={heads} is not supported "
                "(transformers' rotary table is hidden_size wide and fits one head only)"
            )
        super().__init__(config)

    def convert_weight(self, name: str, w: torch.Tensor) -> Iterable[tuple[str, torch.Tensor]]:
        if not name.endswith(".self_attn.qkv_proj.weight"):
            yield name, w
            return
        # w: [MP_NUM * (q | v | k) * D / MP_NUM, K] -> q, v, k each [D, K] in head order (K: D
        # for the weight, the rank for a LoRA B)
        d, k = w.shape[0] // 3, w.shape[1]
        groups = w.reshape(MP_NUM, 3, d // MP_NUM, k)
        for i, shard in enumerate("qvk"):
            yield name.replace(".qkv_proj.", f".{shard}_proj."), groups[:, i].reshape(d, k)
