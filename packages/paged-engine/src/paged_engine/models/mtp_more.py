"""More models' own multi-token-prediction (MTP) layers as draft heads
(speculative_config={"method": "mtp", "num_speculative_tokens": k}): ERNIE 4.5 MoE's
(`ErnieMtpHead`; vLLM's ErnieMTPModel, ernie_mtp.py) and LongCat-Flash's (`LongcatMtpHead`;
vLLM's LongCatFlashMTPModel, longcat_flash_mtp.py). models/mtp.py holds DeepSeek-V3's, GLM-4.5's
and Qwen3-Next's, whose runner (`FinalHiddenRunner`) and loader (head_loader.load_mtp_layer)
these share: at position p the layer reads the embedding of token p + 1 and a feature of
position p, the target's final normed hidden state or, on later passes, its own output.

ERNIE 4.5 MoE (ERNIE-4.5-21B-A3B / 300B-A47B, `num_nextn_predict_layers` 1), as transformers
5's `MtpModel` runs it (`generate(use_mtp=True)`):

    x   = mtp_linear_proj(cat([mtp_emb_norm(embedding), mtp_hidden_norm(feature)]))
    out = norm(ernie_decoder_layer(x))    # a dense layer; `norm` is the TARGET's final norm
    logits = lm_head(out);   the next pass's feature = out

Checkpoint names `model.mtp_emb_norm.0.*`, `model.mtp_hidden_norm.0.*`, `model.mtp_linear_proj.0.*`,
`model.mtp_block.0.*` (an ERNIE decoder layer with a dense SiLU MLP of `intermediate_size`:
interleaved rope, the target's attention), and `model.norm.weight` (transformers'
`_keys_shared_with_mtp`: the target's final norm is the layer's post-norm). Embedding and LM head
are the target's. Where vLLM and SGLang differ from transformers, we follow transformers: they
run no norm after the block and zero the embedding at position 0 (transformers has no such
entry: its positions are ours plus one, the same rope offsets); vLLM's block is a Llama layer
(NeoX rope), SGLang's and transformers' ERNIE's own. `use_bias` is refused (no release has it;
the three disagree on the projection's bias).

LongCat-Flash (`num_nextn_predict_layers`, 1 when absent as vLLM reads it), as vLLM runs it:

    x   = eh_proj(cat([enorm(embedding), hnorm(feature)]))      # nothing zeroed at position 0
    out = final_layernorm(block(x))   # one pre-norm layer: LongCat's MLA, a dense SiLU MLP
    logits = lm_head(out);   the next pass's feature = out

Checkpoint names under `model.mtp.`: `layers.0.{eh_proj, enorm.m, hnorm.m}`,
`layers.0.{input_layernorm, post_attention_layernorm, self_attn}.*`,
`layers.0.transformer_layer.mlp.*` (of `ffn_hidden_size`), `norm` (the final norm) and, where
present, `embed_tokens` (the layer's own embedding; else the target's). The LM head is the
target's. The MLA is the target's (models/longcat_flash.py: LoRA scalings, interleaved rope,
YaRN), with a latent cache of its own.

Both load only their own tensors from the target's checkpoint (`more_mtp_weight_name`); the
targets' loads skip them. openPangu's MTP (vLLM's OpenPanguMTPModel) is models/openpangu_mtp.py's.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from paged_engine.layers.attention import AttentionMetadata
from paged_engine.layers.embedding import VocabParallelEmbedding
from paged_engine.layers.linear import ColumnParallelLinear
from paged_engine.layers.norm import RMSNorm
from paged_engine.layers.rotary import get_rope
from paged_engine.models.llama import LlamaForCausalLM, LlamaMLP, llama_head_dim
from paged_engine.models.mixtral import MoeDecoderLayer
from paged_engine.models.mtp import MTP_LAYER
from paged_engine.models.utils import FeatureHead, cfg_get

# Each family's checkpoint names (prefixes) -> ours, the first that matches; others: not the layer's
_ERNIE_RENAMES = (
    ("model.mtp_emb_norm.0.", "enorm."),
    ("model.mtp_hidden_norm.0.", "hnorm."),
    ("model.mtp_linear_proj.0.", "eh_proj."),
    ("model.mtp_block.0.", "block."),
    ("model.norm.weight", "final_layernorm.weight"),  # the target's final norm: the post-norm
)
_LONGCAT_RENAMES = (
    ("model.mtp.layers.0.enorm.m.", "enorm."),
    ("model.mtp.layers.0.hnorm.m.", "hnorm."),
    ("model.mtp.layers.0.eh_proj.", "eh_proj."),
    ("model.mtp.layers.0.transformer_layer.mlp.", "block.mlp."),
    ("model.mtp.layers.0.", "block."),  # the rest of layers.0.* is the block's
    ("model.mtp.norm.", "final_layernorm."),
    ("model.mtp.embed_tokens.", "embed_tokens."),
)


def more_mtp_family(hf_config) -> str | None:
    """The family ("ernie", "longcat") of a target whose MTP layer this file runs, else None."""
    from paged_engine.models import get_model_class
    from paged_engine.models.ernie4_5_moe import Ernie4_5_MoeForCausalLM
    from paged_engine.models.longcat_flash import LongcatFlashForCausalLM

    try:
        cls = get_model_class(hf_config)
    except ValueError:
        return None
    if issubclass(cls, Ernie4_5_MoeForCausalLM):
        return "ernie"
    return "longcat" if issubclass(cls, LongcatFlashForCausalLM) else None


def more_mtp_weight_name(hf_config, name: str) -> str | None:
    """Our name for a checkpoint tensor of the target's first MTP layer, None for any other."""
    renames = _ERNIE_RENAMES if more_mtp_family(hf_config) == "ernie" else _LONGCAT_RENAMES
    for theirs, ours in renames:
        if name.startswith(theirs):
            return ours + name[len(theirs) :]
    return None


def check_more_mtp(hf_config) -> None:
    """ValueError naming what this file's MTP layers refuse: ERNIE's `use_bias`."""
    if more_mtp_family(hf_config) == "ernie" and getattr(hf_config, "use_bias", False):
        raise ValueError(
            "speculative_config method 'mtp': ERNIE 4.5's MTP layer with use_bias true is not "
            "supported (no release has one)"
        )


class ProjectedMtpLayer(FeatureHead):
    """The layer both families run (module docstring): out = final_layernorm(block(eh_proj(
    cat([enorm(embedding), hnorm(feature)])))), nothing zeroed at position 0. A subclass
    builds `enorm`, `hnorm`, `eh_proj`, `rope`, `block` (a MoeDecoderLayer), `final_layernorm`
    and, where it has its own, `embed_tokens`; the loader sets the rest to the target's.
    `forward` returns (out, out): the logits' input and the next pass's feature."""

    embed_tokens: nn.Module | None
    lm_head: nn.Module | None

    def forward(
        self,
        input_ids: torch.Tensor,  # [T] token p + 1 of each entry p
        positions: torch.Tensor,  # [T]
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        md: AttentionMetadata,
        feature: torch.Tensor,  # [T, D] the target's final hidden state, or the last pass's out
    ) -> tuple[torch.Tensor, torch.Tensor]:
        assert self.embed_tokens is not None
        self.rope.begin_forward(positions)
        embeds = self.embed_tokens(input_ids).to(feature.dtype)
        x = self.eh_proj(torch.cat([self.enorm(embeds), self.hnorm(feature)], dim=-1))
        out = self.final_layernorm(self.block(positions, x, kv_caches[0], md))
        return out, out

    def compute_logits(self, normed: torch.Tensor) -> torch.Tensor:  # [N, D] -> [N, V] fp32
        assert self.lm_head is not None
        return self.lm_head(normed)


class ErnieMtpHead(ProjectedMtpLayer):
    """ERNIE 4.5 MoE's MTP layer (module docstring): a dense ERNIE decoder layer, post-normed by
    the target's final norm. Embedding and LM head: the target's (set by the loader)."""

    def __init__(self, config) -> None:
        super().__init__()
        from paged_engine.models.ernie4_5 import ernie_layer_flags

        check_more_mtp(config)
        self.config = config
        d, eps = config.hidden_size, cfg_get(config, "rms_norm_eps", 1e-6)
        self.enorm = RMSNorm(d, eps)  # mtp_emb_norm.0
        self.hnorm = RMSNorm(d, eps)  # mtp_hidden_norm.0
        self.eh_proj = ColumnParallelLinear(2 * d, d, bias=False, tp_rank=0, tp_size=1)
        self.rope = get_rope(config, llama_head_dim(config), is_neox_style=False)
        layer = int(config.num_hidden_layers)
        mlp = LlamaMLP(config, bias=False)  # dense, as vLLM, SGLang and transformers build it
        self.block = MoeDecoderLayer(config, layer, ernie_layer_flags(config), self.rope, mlp)
        self.final_layernorm = RMSNorm(d, eps)  # the target's model.norm
        # the target's, shared by the loader
        self.embed_tokens = None
        self.lm_head = None

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """`model.mtp_*.0.*` and `model.norm.weight`, named as `more_mtp_weight_name` gives
        them; ValueError naming what is missing."""
        return self.load_own_weights(
            weights, f"{MTP_LAYER} model.mtp_*.0", stacked=LlamaForCausalLM.stacked_params
        )


class LongcatMtpHead(ProjectedMtpLayer):
    """LongCat-Flash's MTP layer (module docstring): LongCat's MLA and a dense MLP. The LM head
    is the target's, the embedding the layer's own where the checkpoint has one (set by the
    loader otherwise)."""

    def __init__(self, config) -> None:
        super().__init__()
        from paged_engine.models.longcat_flash import LongcatMla

        self.config = config
        d, eps = config.hidden_size, cfg_get(config, "rms_norm_eps", 1e-6)
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, d)
        self.enorm = RMSNorm(d, eps)
        self.hnorm = RMSNorm(d, eps)
        self.eh_proj = ColumnParallelLinear(2 * d, d, bias=False, tp_rank=0, tp_size=1)
        self.rope = get_rope(config, config.qk_rope_head_dim, is_neox_style=False)
        flags = {"qkv_bias": False, "o_bias": False, "qk_norm": False, "mlp_bias": False}
        self.block = MoeDecoderLayer(
            config,
            0,
            {**flags, "sliding": False},
            self.rope,
            LlamaMLP(config, bias=False),  # intermediate_size: ffn_hidden_size (HF's alias)
            attention=LongcatMla(config, self.rope),
        )
        self.final_layernorm = RMSNorm(d, eps)
        self.shares_target_embedding = False  # set by load_weights
        self.lm_head = None  # the target's, set by the loader

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """`model.mtp.*`, named as `more_mtp_weight_name` gives them; ValueError naming what
        is missing (the embedding may be absent: the target's is shared)."""
        from paged_engine.models.longcat_flash import LongcatFlashForCausalLM

        loaded = self.load_own_weights(
            weights,
            f"{MTP_LAYER} model.mtp.*",
            stacked=LongcatFlashForCausalLM.stacked_params,
            skip=lambda name: name.endswith("rotary_emb.inv_freq"),
            optional=frozenset({"embed_tokens.weight"}),
        )
        self.shares_target_embedding = "embed_tokens.weight" not in loaded
        return loaded


def attach_more_mtp_head(runner, resolved, quantization: str | None) -> None:
    """Build the target's first MTP layer (ERNIE 4.5 MoE's or LongCat-Flash's) on the runner's
    device and dtype, load it from the target's own checkpoint (its tensors only), share the
    target's embedding (where the layer has none) and LM head, and set `runner.draft`."""
    from paged_engine.models.mtp import mtp_cache_config
    from paged_engine.spec_decode.eagle import FinalHiddenRunner
    from paged_engine.spec_decode.head_loader import load_mtp_layer

    hf_config, target = runner.hf_config, runner.model
    ernie = more_mtp_family(hf_config) == "ernie"
    head = load_mtp_layer(
        runner,
        resolved,
        quantization,
        lambda: ErnieMtpHead(hf_config) if ernie else LongcatMtpHead(hf_config),
        lambda name: more_mtp_weight_name(hf_config, name),
    )
    embed = target.get_submodule(target.embed_path)
    if ernie or runner.config.load_format == "dummy" or head.shares_target_embedding:
        head.embed_tokens = embed
    head.lm_head = target.get_submodule(target.head_name)
    cache_config = mtp_cache_config(hf_config)
    if not ernie:  # LongCat's num_hidden_layers is 2 * num_layers: a plain config of one layer
        from transformers import PretrainedConfig

        cache_config = PretrainedConfig(**{**hf_config.to_dict(), "num_hidden_layers": 1})
    runner.draft = FinalHiddenRunner(head.eval().requires_grad_(False), cache_config, runner)
