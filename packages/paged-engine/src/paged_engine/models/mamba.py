"""Pure state-space models: Mamba (`MambaForCausalLM`: state-spaces/mamba-130m-hf ... 2.8b),
Falcon Mamba (`FalconMambaForCausalLM`: tiiuae/falcon-mamba-7b) and Mamba2
(`Mamba2ForCausalLM`: Mamba-Codestral-7B, mamba2-*m), every layer a mixer:

    x += mixer(norm(x))  per layer;  norm_f;  lm_head (tied by default for Mamba)

The mixer is Mamba's (layers/mamba.py; Falcon Mamba normalizes dt, B and C without weights) or
Mamba2's (layers/mamba2.py). `residual_in_fp32` (the configs' default) carries the residual
stream in float32 between layers, each norm reading it rounded to the model dtype, as HF does.

No layer holds KV: the engine runs these with blocks that only count tokens (their bytes are 0),
no context limit but `max_model_len`, and the whole cache budget for recurrent-state rows
(worker/recurrent_state.py `fit_state_snapshots`). Checkpoints load under HF's names
(`backbone.embeddings`, `backbone.layers.N.{norm,mixer}`, `backbone.norm_f`; early Mamba
checkpoints' `backbone.embedding`).
"""

from __future__ import annotations

import torch
from torch import nn

from paged_engine.layers.embedding import VocabParallelEmbedding
from paged_engine.layers.linear_mixer import check_mixer
from paged_engine.layers.mamba import MambaMixer, MambaSpec
from paged_engine.layers.mamba2 import Mamba2Mixer, Mamba2Spec
from paged_engine.layers.norm import RMSNorm
from paged_engine.models.utils import CausalLMBase, cfg_get, make_layers


def mamba_spec(config, inner_norms: str = "none") -> MambaSpec:
    """Mamba's / Falcon Mamba's mixer from a MambaConfig (time_step_rank "auto": hidden / 16)."""
    rank = config.time_step_rank
    rank = -(-config.hidden_size // 16) if rank == "auto" else int(rank)
    inner = int(getattr(config, "intermediate_size", None) or config.expand * config.hidden_size)
    return MambaSpec(
        hidden_size=config.hidden_size,
        intermediate_size=inner,
        state_size=int(config.state_size),
        time_step_rank=rank,
        conv_kernel=int(config.conv_kernel),
        conv_bias=bool(cfg_get(config, "use_conv_bias", True)),
        proj_bias=bool(cfg_get(config, "use_bias", False)),
        inner_norms=inner_norms,
        inner_norm_eps=float(cfg_get(config, "mixer_rms_eps", 1e-6)),
        activation=cfg_get(config, "hidden_act", "silu"),
    )


def mamba2_spec(config) -> Mamba2Spec:
    """Mamba2's mixer from a Mamba2Config (its gated norm's eps is layer_norm_epsilon)."""
    heads, head_dim = int(config.num_heads), int(config.head_dim)
    inner = int(config.expand * config.hidden_size)
    if heads * head_dim != inner:
        raise ValueError(
            f"num_heads={heads} x head_dim={head_dim} must equal expand x hidden_size = {inner}"
        )
    check_mixer("Mamba2", cfg_get(config, "hidden_act", "silu"), 1)
    return Mamba2Spec(
        hidden_size=config.hidden_size,
        num_heads=heads,
        head_dim=head_dim,
        num_groups=int(config.n_groups),
        state_size=int(config.state_size),
        conv_kernel=int(config.conv_kernel),
        conv_bias=bool(cfg_get(config, "use_conv_bias", True)),
        proj_bias=bool(cfg_get(config, "use_bias", False)),
        eps=float(cfg_get(config, "layer_norm_epsilon", 1e-5)),
        dt_limit=tuple(getattr(config, "time_step_limit", None) or (0.0, float("inf"))),
    )


class MambaBlock(nn.Module):
    """x + mixer(norm(x)); with `residual_fp32` x stays float32 and the norm reads it in the
    model dtype."""

    def __init__(self, mixer: nn.Module, hidden_size: int, eps: float, residual_fp32: bool):
        super().__init__()
        self.norm = RMSNorm(hidden_size, eps)
        self.mixer = mixer
        self.residual_fp32 = residual_fp32

    def forward(self, positions, x: torch.Tensor, kv_cache, md) -> torch.Tensor:
        h = self.mixer(self.norm(x.to(self.norm.weight.dtype)), md)
        return (x.float() if self.residual_fp32 else x) + h


class StateSpaceModel(nn.Module):
    """Embedding, the mixer blocks (`build_mixer(i)`), the final norm: HF's `backbone`."""

    def __init__(self, config, build_mixer) -> None:
        super().__init__()
        eps = float(cfg_get(config, "layer_norm_epsilon", 1e-5))
        self.residual_fp32 = bool(cfg_get(config, "residual_in_fp32", True))
        self.embeddings = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.layers, self.stage = make_layers(
            config.num_hidden_layers,
            lambda i: MambaBlock(build_mixer(i), config.hidden_size, eps, self.residual_fp32),
        )
        self.norm_f = RMSNorm(config.hidden_size, eps)

    def forward(self, input_ids, positions, kv_caches, md, hidden=None) -> torch.Tensor:
        x = self.embeddings(input_ids) if hidden is None else hidden
        dtype = x.dtype
        for layer in self.layers:
            x = layer(positions, x, None, md)
        if x.dtype == dtype:
            return self.norm_f(x)
        # the float32 residual: normalized in float32, the weight applied there (HF's order),
        # then back in the model dtype for the head
        norm = self.norm_f
        y = torch.rms_norm(x, (x.shape[-1],), None, norm.eps)
        return (norm.weight.float() * y).to(dtype)


class MambaForCausalLM(CausalLMBase):
    inner_name = "backbone"
    embed_path = "backbone.embeddings"
    tie_default = True
    inner_norms = "none"

    def __init__(self, config) -> None:
        spec = mamba_spec(config, type(self).inner_norms)
        super().__init__(config, StateSpaceModel(config, lambda i: MambaMixer(spec)))

    def rename_weight(self, name: str) -> str:
        # early checkpoints (mamba-*-hf before the rename) call the embedding `embedding`
        return name.replace("backbone.embedding.", "backbone.embeddings.")


class FalconMambaForCausalLM(MambaForCausalLM):
    inner_norms = "weightless"


class Mamba2ForCausalLM(CausalLMBase):
    inner_name = "backbone"
    embed_path = "backbone.embeddings"
    tie_default = False

    def __init__(self, config) -> None:
        spec = mamba2_spec(config)
        super().__init__(config, StateSpaceModel(config, lambda i: Mamba2Mixer(spec)))
