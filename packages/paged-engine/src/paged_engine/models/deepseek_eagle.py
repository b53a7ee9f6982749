"""EAGLE-1 draft heads made of DeepSeek-V3 decoder layers (multi-head latent attention, a dense
or DeepSeek-MoE MLP), speculative_config={"method": "eagle", "model": HEAD, ...}:

- vLLM's `EagleDeepSeekMTPModel` (deepseek_eagle.py there, `EagleDeepseekV3ForCausalLM`): a
  head whose config.json is a DeepSeek-V3 one (model_type "deepseek_v3"; vLLM renames its
  architecture `DeepSeekMTPModel`, then prefixes "Eagle").
- vLLM's `EagleMistralLarge3ForCausalLM` (mistral_large_3_eagle.py): a head in Mistral's native
  format whose params.json is Mistral Large 3's (MLA: mistral_large3.py), read as the
  Mistral4Config the target's own params.json becomes (models/mistral4.py: Llama-4 query
  scaling, a softmax router).

At position p a head reads the embedding of token p + 1 (the target's) and a feature of
position p: the target's final normed hidden state, or at its later passes its own previous
output (spec_decode/eagle.py's `FinalHiddenRunner`):

    DeepSeek:  x = fc([enorm(embed(token)), hnorm(feature)])     # bias-free Linear 2D -> D
    Mistral:   x = fc([embed(token), feature])                    # `eagle_linear`, no norms
    x = layer_i(x) for each layer                                 # full pre-norm layers
    out = norm(x); logits = lm_head(out) (the target's); next feature = out

Layer i's MLP: vLLM names a DeepSeek head's layers after the target's (index L + i, L the
target's layer count) and its decoder layer picks the MLP by that index and the head's
first_k_dense_replace (dense below it, MoE from it on); the Mistral head adds L to
first_k_dense_replace first, so there its own index i decides.

Checkpoints: DeepSeek: `fc.weight`, `enorm.weight`, `hnorm.weight`, `layers.{i}.*` (V3's names),
`norm.weight`, a `model.` prefix accepted. Mistral: consolidated*.safetensors with
`eagle_linear.weight`, Large 3's layer names and `norm.weight`. Embedding and LM head copies
(`embed_tokens` / `lm_head`, `tok_embeddings` / `output`) are skipped: the target's serve, as
in vLLM.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from paged_engine.layers.attention import AttentionMetadata
from paged_engine.layers.linear import ColumnParallelLinear
from paged_engine.layers.norm import RMSNorm
from paged_engine.models.deepseek_v2 import (
    DeepseekDecoderLayer,
    DeepseekV2ForCausalLM,
    DeepseekV3ForCausalLM,
)
from paged_engine.models.llama import run_layers
from paged_engine.models.llama_eagle import EAGLE_CHECKPOINT
from paged_engine.models.mistral4 import Mistral4ForCausalLM
from paged_engine.models.mixtral import check_silu, expert_rules
from paged_engine.models.utils import FeatureHead, cfg_get, mla_rope

if TYPE_CHECKING:
    from paged_engine.loader import ResolvedModel
    from paged_engine.worker.model_runner import ModelRunner

DEEPSEEK, MISTRAL = "deepseek", "mistral"
_FC = "eagle_linear."  # the Mistral head's fc in its consolidated tensors
_SHARED = ("embed_tokens.", "lm_head.", "tok_embeddings.", "output.")  # the target's serve


def deepseek_eagle_kind(path: Path, hf_config) -> str | None:
    """DEEPSEEK or MISTRAL where the head at `path` (its config `hf_config`) is one of this
    file's, else None (a Llama-style head). ValueError naming what paged does not serve."""
    from paged_engine.mistral_format import PARAMS_FILE, config_format_of

    model_type = str(getattr(hf_config, "model_type", ""))
    if model_type == "deepseek_v32":
        raise ValueError(
            "a DeepSeek-V3.2 EAGLE head (model_type 'deepseek_v32': sparse attention) is not "
            "supported; DeepSeek-V3 heads are"
        )
    if model_type == "mistral4":
        if config_format_of(Path(path), "auto") != "mistral":
            raise ValueError(
                "a Mistral 4 EAGLE head in Hugging Face's format is not supported; Mistral "
                f"Large 3 heads are, in Mistral's native format ({PARAMS_FILE})"
            )
        kind = MISTRAL
    elif model_type == "deepseek_v3":
        kind = DEEPSEEK
    else:
        return None
    check_silu(hf_config, "the EAGLE head")
    freq = cfg_get(hf_config, "moe_layer_freq", 1)
    if freq != 1:
        raise ValueError(f"the EAGLE head's config field moe_layer_freq={freq!r} (only 1)")
    return kind


class EagleDeepseekHead(FeatureHead):
    """`forward` returns (out, out): the LM head's input and the next feature [T, D]."""

    def __init__(self, config, kind: str, target_layers: int) -> None:
        super().__init__()
        self.config, self.kind = config, kind
        family = Mistral4ForCausalLM if kind == MISTRAL else DeepseekV3ForCausalLM  # its layers'
        first = 0 if kind == MISTRAL else target_layers  # the index choosing layer 0's MLP
        d, eps = config.hidden_size, cfg_get(config, "rms_norm_eps", 1e-6)
        self.fc = ColumnParallelLinear(2 * d, d, bias=False, tp_rank=0, tp_size=1)
        self.para_norm = kind == DEEPSEEK
        if self.para_norm:
            self.enorm = RMSNorm(d, eps)
            self.hnorm = RMSNorm(d, eps)
        self.rotary_emb = mla_rope(config, family)
        self.layers = nn.ModuleList(
            DeepseekDecoderLayer(
                config,
                i,
                self.rotary_emb,
                family.build_mlp(config, first + i),
                family.attention_cls,
            )
            for i in range(int(config.num_hidden_layers))
        )
        self.norm = RMSNorm(d, eps)
        self.num_experts = int(getattr(config, "n_routed_experts", None) or 0)
        # the target's, set by the loader
        self.embed_tokens: nn.Module | None = None
        self.lm_head: nn.Module | None = None

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        md: AttentionMetadata,
        feature: torch.Tensor,  # [T, D]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        assert self.embed_tokens is not None
        self.rotary_emb.begin_forward(positions)
        embeds = self.embed_tokens(input_ids).to(feature.dtype)
        if self.para_norm:
            embeds, feature = self.enorm(embeds), self.hnorm(feature)
        x = self.fc(torch.cat([embeds, feature], dim=-1))
        out = run_layers(list(self.layers), True, positions, x, kv_caches, md, self.norm)
        return out, out

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # already normed
        assert self.lm_head is not None
        return self.lm_head(hidden)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """The head's tensors in our names (a `model.` prefix dropped; the embedding and LM
        head copies skipped); ValueError naming what is missing."""
        rules = expert_rules(self.num_experts, "gate_proj", "up_proj", "down_proj")
        return self.load_own_weights(
            ((n.removeprefix("model."), w) for n, w in weights),
            EAGLE_CHECKPOINT,
            stacked=(*rules, *DeepseekV2ForCausalLM.stacked_params),
            skip=lambda n: n.startswith(_SHARED) or n.endswith("inv_freq"),
        )


def mistral_head_weights(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """(our name, CPU tensor) of a native Mistral head's consolidated tensors: `eagle_linear`
    as `fc`, the layers by Large 3's names (mistral_format.hf_name); copies of the embedding
    and LM head skipped. ValueError for a quantized fc (its scales)."""
    from paged_engine.loader import mmap_safetensors
    from paged_engine.mistral_format import consolidated_files, hf_name

    for file in consolidated_files(path):
        for name, tensor in mmap_safetensors(file):
            if name == _FC + "weight":
                yield "fc.weight", tensor
            elif name.startswith(_FC):
                raise ValueError(
                    f"speculative_config.model: {name!r} (a quantized EAGLE fc) is not supported"
                )
            elif not name.startswith(_SHARED):
                yield hf_name(name).removeprefix("model."), tensor


def attach_deepseek_eagle_head(runner: ModelRunner, resolved: ResolvedModel, hf_config) -> None:
    """Build the head on the runner's device in the target's dtype, load it (dummy weights
    under load_format "dummy") and set `runner.draft`, over the target's embedding and LM
    head. `hf_config`: the head's, its rope already reaching max_model_len."""
    from paged_engine.loader import building_in, checkpoint_weights, init_dummy_weights
    from paged_engine.spec_decode.eagle import FinalHiddenRunner
    from paged_engine.spec_decode.head_loader import head_ropes

    config, target = runner.config, runner.model
    kind = deepseek_eagle_kind(resolved.path, hf_config)
    assert kind is not None
    dtype = next(target.parameters()).dtype
    target_layers = int(runner.hf_config.num_hidden_layers)
    with building_in(dtype, runner.device), head_ropes(runner):
        head = EagleDeepseekHead(hf_config, kind, target_layers)
    if config.load_format == "dummy":
        init_dummy_weights(head, config.seed)
    elif kind == MISTRAL:
        head.load_weights(mistral_head_weights(resolved.path))
    else:
        head.load_weights(
            checkpoint_weights(resolved, hf_config, dtype, runner.device, config.load_format, {})
        )
    head.embed_tokens = target.get_submodule(target.embed_path)
    head.lm_head = target.get_submodule(target.head_name)
    runner.draft = FinalHiddenRunner(head.eval().requires_grad_(False), hf_config, runner)
