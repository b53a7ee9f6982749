"""gpt-oss (OpenAI's gpt-oss-20b / gpt-oss-120b, `GptOssForCausalLM`).

Llama's pre-norm decoder with:

    attention  q / k / v / o biases, YaRN rope (NeoX halves), sliding-window (128) and full layers
               alternating (`layer_types`), and one learned sink logit per query head: the
               softmax of each row also runs over exp(sink_h), whose mass then multiplies no
               value (the attention backends take `sinks`)
    MLP        a MoE in every layer: the router has a bias; top-k over its logits, softmax over
               the k chosen (= softmax over all, renormalized); experts with biases and the
               clamped SwiGLU `(clamp(up, -L, L) + 1) * g * sigmoid(alpha * g)`, g = min(gate, L)

Checkpoints: transformers' layout holds the experts as x @ W (gate_up_proj [E, H, 2I] with the
gate and up columns interleaved, down_proj [E, I, H]); OpenAI's release holds them in MXFP4
(`*_blocks` / `*_scales`, mxfp4.py, rows interleaved alike). Either becomes FusedMoE's
[E, 2I, H] (gate rows, then up rows) and [E, H, I]. An MXFP4 checkpoint on CUDA keeps its
experts in MXFP4 (4.25 bits a weight: gpt-oss-120b's fit one 80 GB GPU), decoded inside the MoE
kernel (`keep_mxfp4`); elsewhere they dequantize to the model dtype as they load.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

import torch
from torch import nn

import paged_kernels
from paged_engine.distributed.parallel_state import get_tp_rank, get_tp_size
from paged_engine.layers.attention import Attention
from paged_engine.layers.fused_moe import SparseMoeBlock
from paged_engine.layers.norm import RMSNorm
from paged_engine.layers.rotary import RotaryEmbedding
from paged_engine.models.llama import (
    LlamaAttention,
    LlamaForCausalLM,
    LlamaModel,
    PreNormDecoderLayer,
)
from paged_engine.models.mixtral import num_experts
from paged_engine.models.utils import CausalLMBase, cfg_get, layer_sliding_window
from paged_engine.mxfp4 import Mxfp4Pairs
from paged_engine.quantized_checkpoint import quant_method
from paged_kernels import MoeActivation, dequantize_mxfp4

logger = logging.getLogger(__name__)

# Tests set this to keep MXFP4 experts on the CPU too (decoded per call by the torch path, or by
# the Triton kernels in the interpreter with fused_moe.TRITON_ON_CPU).
KEEP_MXFP4_ON_CPU = False


def layer_flags(config) -> dict[str, bool]:
    """Llama attention's switches: q/k/v/o biases as `attention_bias` says (True in gpt-oss's
    configs), windows by layer_types; no q/k norms. The experts have no dense MLP."""
    bias = bool(cfg_get(config, "attention_bias", True))
    return {"qkv_bias": bias, "o_bias": bias, "qk_norm": False, "mlp_bias": False, "sliding": True}


class SinkAttention(LlamaAttention):
    """Llama's attention (the window of the layer's type when `flags["sliding"]`) plus this
    rank's heads' sinks, kept in float32 whatever the model dtype: gpt-oss's, GraniteSWA's."""

    def __init__(
        self, config, layer_idx: int, flags: dict[str, bool], rope: RotaryEmbedding | None
    ) -> None:
        super().__init__(config, layer_idx, flags, rope)
        heads = self.qkv_proj.num_heads
        self.sinks = nn.Parameter(torch.empty(heads, dtype=torch.float32))
        self.sinks.weight_loader = self._load_sinks
        attn = self.attn
        self.attn = Attention(
            attn.num_heads,
            attn.head_dim,
            attn.num_kv_heads,
            attn.scale,
            sliding_window=layer_sliding_window(config, layer_idx) if flags["sliding"] else None,
            sinks=self.sinks,
        )

    def _load_sinks(self, param: nn.Parameter, w: torch.Tensor) -> None:
        heads = param.shape[0]
        begin = get_tp_rank() * heads
        if w.shape[0] < begin + heads:
            raise ValueError(f"sinks: {tuple(w.shape)} holds fewer than {begin + heads} heads")
        param.data.copy_(w[begin : begin + heads])


class GptOssDecoderLayer(PreNormDecoderLayer):
    def __init__(self, config, layer_idx: int, rope: RotaryEmbedding, mxfp4: bool) -> None:
        super().__init__()
        eps = cfg_get(config, "rms_norm_eps", 1e-5)
        self.self_attn = SinkAttention(config, layer_idx, layer_flags(config), rope)
        self.mlp = SparseMoeBlock(
            num_experts(config),
            config.num_experts_per_tok,
            config.hidden_size,
            config.intermediate_size,
            renormalize=True,
            router_bias=True,
            expert_bias=True,
            activation=MoeActivation(
                "swigluoai",
                float(cfg_get(config, "swiglu_alpha", 1.702)),
                float(cfg_get(config, "swiglu_limit", 7.0)),
            ),
            mxfp4=mxfp4,
        )
        self.input_layernorm = RMSNorm(config.hidden_size, eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps)


def _split_interleaved(w: torch.Tensor, dim: int) -> torch.Tensor:
    """gate / up interleaved along `dim` (g0 u0 g1 u1 ...) -> all gates, then all ups."""
    index = torch.cat([torch.arange(0, w.shape[dim], 2), torch.arange(1, w.shape[dim], 2)])
    return w.index_select(dim, index.to(w.device))


def keep_mxfp4(config) -> bool:
    """Whether an MXFP4 checkpoint's experts stay MXFP4: on CUDA with triton (the model is built
    under its device), when every rank's share of the experts splits into 32-value groups."""
    if quant_method(config) != "mxfp4":
        return False
    on_cuda = torch.get_default_device().type == "cuda"
    if not (on_cuda or KEEP_MXFP4_ON_CPU) or not paged_kernels.triton_available():
        return False
    share = config.intermediate_size // get_tp_size()
    if config.hidden_size % 32 or share % 32:
        logger.warning(
            "MXFP4 experts dequantize to the model dtype: each rank's share of the "
            "intermediate size (%d) is not a multiple of 32 at tensor_parallel_size=%d",
            share,
            get_tp_size(),
        )
        return False
    return True


class GptOssForCausalLM(CausalLMBase):
    stacked_params = LlamaForCausalLM.stacked_params
    ignored_weights = ("rotary_emb.inv_freq",)
    checkpoint_quantizations = ("mxfp4",)  # its experts are not `.weight`s: no generic FP8

    def __init__(self, config) -> None:
        # (hidden_act is unused: the experts' SwiGLU is fixed, as in HF)
        self.keeps_mxfp4 = keep_mxfp4(config)
        mxfp4 = self.keeps_mxfp4
        inner = LlamaModel(
            config, layer_flags(config), lambda i, rope: GptOssDecoderLayer(config, i, rope, mxfp4)
        )
        super().__init__(config, inner)
        self._mxfp4 = Mxfp4Pairs()
        if mxfp4:
            logger.info("gpt-oss: the experts stay in MXFP4 (4.25 bits a weight)")

    def rename_weight(self, name: str) -> str:
        return name.replace(".mlp.router.", ".mlp.gate.")

    def convert_weight(self, name: str, w: torch.Tensor) -> Iterable[tuple[str, torch.Tensor]]:
        if ".mlp.experts." not in name:
            return ((name, w),)
        if self._mxfp4.takes(name):  # [E, out, ...] (rows = outputs, gate / up interleaved)
            if self.keeps_mxfp4:  # FusedMoE's own blocks / scales
                return ((name, _split_interleaved(w, 1) if ".gate_up_proj_" in name else w),)
            pair = self._mxfp4.add(name, w)
            if pair is None:
                return ()
            name, mx = pair
            like = self.model.embed_tokens.weight  # the model's device and dtype
            w = dequantize_mxfp4(type(mx)(*(t.to(like.device) for t in mx)), like.dtype)
            if name.endswith(".gate_up_proj"):
                w = _split_interleaved(w, 1)
            return ((name, w),)
        if name.endswith(".gate_up_proj"):  # [E, H, 2I] interleaved columns
            return ((name, _split_interleaved(w, 2).transpose(1, 2)),)
        if name.endswith(".gate_up_proj_bias"):  # [E, 2I] interleaved
            return ((name, _split_interleaved(w, 1)),)
        if name.endswith(".down_proj"):  # [E, I, H]
            return ((name, w.transpose(1, 2)),)
        return ((name, w),)

    def load_weights(
        self, weights: Iterable[tuple[str, torch.Tensor]], strict: bool = True
    ) -> set[str]:
        try:
            loaded = super().load_weights(weights, strict)
        except ValueError:
            self._mxfp4.check_done()  # an MXFP4 half without its mate: the root cause
            raise
        self._mxfp4.check_done()
        return loaded
