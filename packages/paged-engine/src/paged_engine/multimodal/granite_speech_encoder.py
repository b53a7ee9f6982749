"""Granite Speech's encoder (GraniteSpeechEncoder): its CTC conformer and Q-Former projector.

    features [L, 160] (multimodal/granite_speech.py's MelFeatures: stacked frame pairs)
    -> the CTC conformer (input_linear; per block: half FFN, block attention over `context_size`
        rows with Shaw's relative positions, conv module, half FFN, post-norm; after block
        num_layers // 2 the CTC head's softmax is mapped back and added)
    -> windows of `window_size` rows (the last zero-padded), a Q-Former of
        window_size // downsample_rate queries cross-attending to each -> linear into the text
    -> n = ceil(L / window_size) * (window_size // downsample_rate) rows

A prompt's clips run as one zero-padded batch, each clip's rows those of the clip alone (HF's
for it alone: the block attention and the depthwise convolution see only its rows, the
projector's last window is zero past it), which the encoder cache needs. Weight names are HF's
under `[model.]encoder.` and `[model.]projector.`. Refused by name: a context_size outside
[1, max_pos_emb], config.window_size not a multiple of config.downsample_rate (HF cannot run
it), a projector_config other than Blip-2's Q-Former.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from paged_engine.multimodal.inputs import ImageInput
from paged_engine.multimodal.qformer import QFormer
from paged_engine.multimodal.whisper_encoder import load_into


# ---- the conformer ---------------------------------------------------------------------------
class FeedForward(nn.Module):
    def __init__(self, d: int, mult: int) -> None:
        super().__init__()
        self.pre_norm = nn.LayerNorm(d)
        self.up_proj = nn.Linear(d, d * mult)
        self.down_proj = nn.Linear(d * mult, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.up_proj(self.pre_norm(x))))


class BlockAttention(nn.Module):
    """Attention inside blocks of `context` rows, biased by q . rel_pos_emb[i - j] (Shaw)."""

    def __init__(self, c: Any) -> None:
        super().__init__()
        if not 0 < c.context_size <= c.max_pos_emb:
            raise ValueError(
                f"config.encoder_config.context_size {c.context_size} must be in "
                f"[1, max_pos_emb {c.max_pos_emb}]"
            )
        self.heads, self.context = c.num_heads, c.context_size
        self.dim_head = c.dim_head or c.hidden_dim // c.num_heads
        inner = self.dim_head * self.heads
        self.pre_norm = nn.LayerNorm(c.hidden_dim)
        self.to_q = nn.Linear(c.hidden_dim, inner, bias=False)
        self.to_kv = nn.Linear(c.hidden_dim, 2 * inner, bias=False)
        self.to_out = nn.Linear(inner, c.hidden_dim)
        self.rel_pos_emb = nn.Embedding(2 * c.max_pos_emb + 1, self.dim_head)
        pos = torch.arange(self.context)
        dists = (pos[:, None] - pos[None, :]).clamp(-self.context, self.context) + c.max_pos_emb
        self.register_buffer("dists", dists, persistent=False)  # [C, C] table rows

    def forward(self, x: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        """x [B, T, D] with T a multiple of the block; keys [B, T] True at a clip's rows."""
        b, t, _ = x.shape
        n, c = t // self.context, self.context
        h = self.pre_norm(x)
        q = self.to_q(h).view(b * n, c, self.heads, -1).transpose(1, 2)  # [B n, H, C, dh]
        k, v = (
            s.reshape(b * n, c, self.heads, -1).transpose(1, 2)
            for s in self.to_kv(h).chunk(2, dim=-1)
        )
        scale = self.dim_head**-0.5
        bias = torch.einsum("bhcd,crd->bhcr", q, self.rel_pos_emb(self.dists)) * scale
        hidden = ~keys.view(b * n, 1, 1, c)  # a padding row is no key (HF: past the clip)
        bias = bias.masked_fill(hidden, -torch.finfo(bias.dtype).max)
        with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=scale)
        return self.to_out(o.transpose(1, 2).reshape(b, t, -1))


class EvalBatchNorm(nn.Module):
    """BatchNorm1d at inference: the running statistics as (frozen) parameters, so the
    checkpoint's `running_mean` / `running_var` load with the weights."""

    def __init__(self, n: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n))
        self.bias = nn.Parameter(torch.zeros(n))
        self.running_mean = nn.Parameter(torch.zeros(n), requires_grad=False)
        self.running_var = nn.Parameter(torch.ones(n), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B, C, T]
        return F.batch_norm(
            x, self.running_mean, self.running_var, self.weight, self.bias, False, 0.0, self.eps
        )


class ConvModule(nn.Module):
    def __init__(self, c: Any) -> None:
        super().__init__()
        inner = c.hidden_dim * c.conv_expansion_factor
        k = c.conv_kernel_size
        self.norm = nn.LayerNorm(c.hidden_dim)
        self.up_conv = nn.Conv1d(c.hidden_dim, 2 * inner, 1)
        self.depth_conv = nn.Module()
        self.depth_conv.conv = nn.Conv1d(inner, inner, k, groups=inner, bias=False)
        self.pad = (k // 2, k // 2 - (k + 1) % 2)  # even kernels: one less on the right
        self.batch_norm = EvalBatchNorm(inner)
        self.down_conv = nn.Conv1d(inner, c.hidden_dim, 1)

    def forward(self, x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """x [B, T, D]; rows [B, T] True at a clip's rows (the rest read as zero padding)."""
        h = F.glu(self.up_conv(self.norm(x).transpose(1, 2)), dim=1)
        h = h.masked_fill(~rows[:, None, :], 0.0)
        h = self.depth_conv.conv(F.pad(h, self.pad))
        return self.down_conv(F.silu(self.batch_norm(h))).transpose(1, 2)


class ConformerBlock(nn.Module):
    def __init__(self, c: Any) -> None:
        super().__init__()
        self.ff1 = FeedForward(c.hidden_dim, c.feedforward_mult)
        self.attn = BlockAttention(c)
        self.conv = ConvModule(c)
        self.ff2 = FeedForward(c.hidden_dim, c.feedforward_mult)
        self.post_norm = nn.LayerNorm(c.hidden_dim)

    def forward(self, x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        x = 0.5 * self.ff1(x) + x
        x = self.attn(x, rows) + x
        x = self.conv(x, rows) + x
        return self.post_norm(0.5 * self.ff2(x) + x)


class CTCEncoder(nn.Module):
    def __init__(self, c: Any) -> None:
        super().__init__()
        self.context = c.context_size
        self.input_linear = nn.Linear(c.input_dim, c.hidden_dim)
        self.layers = nn.ModuleList(ConformerBlock(c) for _ in range(c.num_layers))
        self.out = nn.Linear(c.hidden_dim, c.output_dim)
        self.out_mid = nn.Linear(c.output_dim, c.hidden_dim)

    def forward(self, features: torch.Tensor, lengths: list[int]) -> torch.Tensor:
        """features [B, T, input_dim] (clips zero-padded to T, a multiple of the block) ->
        [B, T, D]; a clip's rows are those of the clip alone."""
        t = features.shape[1]
        rows = (
            torch.arange(t, device=features.device)[None, :]
            < torch.tensor(lengths, device=features.device)[:, None]
        )
        x = self.input_linear(features)
        mid = len(self.layers) // 2
        for i, layer in enumerate(self.layers, start=1):
            x = layer(x, rows)
            if i == mid:  # self-conditioned CTC: the head's distribution mapped back in
                x = x + self.out_mid(torch.softmax(self.out(x), dim=-1))
        return x


# ---- the Q-Former projector (multimodal/qformer.py's Q-Former) ------------------------------
class Projector(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        p = config.projector_config
        if getattr(p, "model_type", None) != "blip_2_qformer":
            raise ValueError(
                f"config.projector_config.model_type {getattr(p, 'model_type', None)!r}: only "
                "Blip-2's Q-Former ('blip_2_qformer') is served"
            )
        if config.window_size % config.downsample_rate:
            raise ValueError(
                f"config.window_size {config.window_size} is not a multiple of "
                f"config.downsample_rate {config.downsample_rate}"
            )
        self.window = config.window_size
        queries = config.window_size // config.downsample_rate
        self.query = nn.Parameter(torch.zeros(1, queries, p.hidden_size))
        self.qformer = QFormer(p)
        self.linear = nn.Linear(p.hidden_size, config.text_config.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [B, T, D] (T a multiple of the window, rows past each clip zero) ->
        [B, T / window * queries, text hidden]."""
        b, t, d = x.shape
        windows = x.reshape(b * t // self.window, self.window, d)
        out = self.qformer(self.query.expand(windows.shape[0], -1, -1), windows)
        return self.linear(out.reshape(b, -1, out.shape[-1]))


class GraniteSpeechEncoder(nn.Module):
    """The conformer and the projector: `encode(clips)` -> each clip's [n, text hidden]."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.encoder = CTCEncoder(config.encoder_config)
        self.projector = Projector(config)

    def encode(self, clips: Sequence[ImageInput]) -> list[torch.Tensor]:
        feats = [m.pixel_values for m in clips if m.pixel_values is not None]
        assert len(feats) == len(clips)  # [rows, 2 * n_mels] each
        w = self.encoder.input_linear.weight
        lengths = [f.shape[0] for f in feats]
        # one padded batch: T a multiple of both the attention block and the projector window
        step = math.lcm(self.encoder.context, self.projector.window)
        t = -(-max(lengths) // step) * step
        padded = [F.pad(f, (0, 0, 0, t - n)) for f, n in zip(feats, lengths)]
        x = self.encoder(torch.stack(padded).to(device=w.device, dtype=w.dtype), lengths)
        rows = (
            torch.arange(t, device=w.device)[None, :]
            < torch.tensor(lengths, device=w.device)[:, None]
        )
        out = self.projector(x * rows[..., None])  # the last window zero past the clip, as HF's
        return [r[: m.length] for r, m in zip(out, clips, strict=True)]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        def mine() -> Iterator[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                name = name.removeprefix("model.")
                if name.startswith(("encoder.", "projector.")):
                    yield name, tensor

        return load_into(self, mine(), "Granite Speech's encoder")
