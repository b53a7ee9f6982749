"""PLaMo 2 (`Plamo2ForCausalLM`, remote code; models/plamo2.py) against a reference composed here.

transformers has no PLaMo class, and no Mamba2 piece computes PLaMo's mixer (its conv runs over
x alone and B, C, dt come from a projection of the conv's output, RMS-normed), so the reference
is plain torch, as the remote modeling code and vLLM's plamo2.py compute it: the selective scan
a token at a time (S = exp(dt A) S + dt x B^T, y = S C + D x; the remote code's naive form, not
paged's chunked scan), the whole sequence recomputed every step (no cache), the attention's
window as a mask over the keys (a query sees its attention_window_size previous positions),
the sandwich norms with their offsets. Its weights are written under the release's names
(model.layers.layers.{i}.*, in_proj's z / x rows interleaved per head, fused qkv_proj and
gate_up_proj) with a release-shaped config.json, served by paged and compared: greedy tokens
identical, top-5 logprobs within 1e-3 (float32).

Tiny model: 4 layers (mixer, sliding attention with a window of 6, mixer, full attention by
`full_attention_idx`), 4 mixer heads of 16, state 8, conv 4; attention 4 heads on 2 KV heads.
Prompts of 5 to 40 tokens, whole and in prefill chunks of 16 (the conv window, scan state and
KV carried across chunks), and under tensor parallelism (2 ranks: the mixer's heads and the
query heads split, a single KV head replicated). Also: the config fields models/plamo2.py does
not serve are refused by name.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from hf_parity import assert_llm_matches
from hf_reference import Greedy, greedy_over_logits, random_token_prompts
from torch import nn

from paged_engine import LLM
from paged_engine.testing import _COMMON, TINY_VOCAB_SIZE, _randomize, build_tiny_tokenizer

transformers = pytest.importorskip("transformers")
from safetensors.torch import save_file  # noqa: E402

TOKENS = 6
EPS = 1e-6
CONFIG = {
    "architectures": ["Plamo2ForCausalLM"],
    "auto_map": {
        "AutoConfig": "modeling_plamo.Plamo2Config",
        "AutoModelForCausalLM": "modeling_plamo.Plamo2ForCausalLM",
    },
    "model_type": "plamo2",
    "hidden_size": 64,
    "num_hidden_layers": 4,
    "rms_norm_eps": EPS,
    "tie_word_embeddings": True,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "hidden_size_per_head": 16,
    "max_position_embeddings": 2048,
    "attention_window_size": 6,
    "full_attention_idx": [3],
    "mamba_d_state": 8,
    "mamba_d_conv": 4,
    "mamba_num_heads": 4,
    "mamba_step": 2,
    "mamba_chunk_size": 256,
    "mamba_enabled": True,
    "intermediate_size": 96,
    "vocab_size": TINY_VOCAB_SIZE,
    "torch_dtype": "float32",
    **_COMMON,
}
OFFSETS = {"pre_mixer": 1.0, "post_mixer": 0.2, "pre_mlp": 1.0, "post_mlp": 5**-1.5}


def _rms(x: torch.Tensor, weight: torch.Tensor | None, offset: float = 0.0) -> torch.Tensor:
    y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS)
    return y if weight is None else y * (offset + weight)


class _Mixer(nn.Module):
    def __init__(self, c: dict):
        super().__init__()
        names = ("hidden_size", "mamba_num_heads", "hidden_size_per_head", "mamba_d_state")
        d, h, p, n = (c[f] for f in names)
        k = c["mamba_d_conv"]
        self.h, self.p, self.n, self.dt_dim = h, p, n, max(64, d // 16)
        self.in_proj = nn.Linear(d, 2 * h * p, bias=False)
        self.conv1d = nn.Conv1d(h * p, h * p, k, groups=h * p, bias=False)
        self.bcdt_proj = nn.Linear(h * p, 2 * n + self.dt_dim, bias=False)
        self.dt_proj = nn.Linear(self.dt_dim, h, bias=False)
        self.dt_bias = nn.Parameter(torch.zeros(h))
        self.A_log = nn.Parameter(torch.zeros(h))
        self.D = nn.Parameter(torch.ones(h))
        self.dt_norm_weight = nn.Parameter(torch.ones(self.dt_dim))
        self.B_norm_weight = nn.Parameter(torch.ones(n))
        self.C_norm_weight = nn.Parameter(torch.ones(n))
        self.out_proj = nn.Linear(h * p, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [S, D]
        s = x.shape[0]
        zx = self.in_proj(x).view(s, self.h, 2, self.p)  # per head: z_h | x_h
        z, xs = zx[:, :, 0].reshape(s, -1), zx[:, :, 1].reshape(s, -1)
        k = self.conv1d.kernel_size[0]
        xs = F.silu(self.conv1d(F.pad(xs.T[None], (k - 1, 0)))[0].T)  # causal
        b, c, dt = self.bcdt_proj(xs).split([self.n, self.n, self.dt_dim], -1)
        b, c = _rms(b, self.B_norm_weight), _rms(c, self.C_norm_weight)
        dt = F.softplus(self.dt_proj(_rms(dt, self.dt_norm_weight)) + self.dt_bias)  # [S, H]
        a = -torch.exp(self.A_log)
        xs = xs.view(s, self.h, self.p)
        state = torch.zeros(self.h, self.p, self.n)
        ys = []
        for t in range(s):  # one token at a time
            decay = torch.exp(dt[t] * a)[:, None, None]
            state = decay * state + dt[t][:, None, None] * xs[t][:, :, None] * b[t]
            ys.append(state @ c[t] + self.D[:, None] * xs[t])
        y = torch.stack(ys).reshape(s, -1) * F.silu(z)
        return self.out_proj(y)


class _Attention(nn.Module):
    def __init__(self, c: dict, window: int | None):
        super().__init__()
        self.hq, self.hk = c["num_attention_heads"], c["num_key_value_heads"]
        self.d, self.window = c["hidden_size_per_head"], window
        self.qkv_proj = nn.Linear(c["hidden_size"], (self.hq + 2 * self.hk) * self.d, bias=False)
        self.o_proj = nn.Linear(self.hq * self.d, c["hidden_size"], bias=False)
        self.q_weight = nn.Parameter(torch.ones(self.hq, self.d))
        self.k_weight = nn.Parameter(torch.ones(self.hk, self.d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [S, D]
        s, d = x.shape[0], self.d
        q, k, v = self.qkv_proj(x).split([self.hq * d, self.hk * d, self.hk * d], -1)
        q = _rms(q.view(s, self.hq, d), None) * self.q_weight
        k = _rms(k.view(s, self.hk, d), None) * self.k_weight
        inv = 1.0 / 10000.0 ** (torch.arange(0, d, 2).float() / d)
        ang = torch.outer(torch.arange(s).float(), inv)
        cos, sin = torch.cat([ang.cos()] * 2, -1)[:, None], torch.cat([ang.sin()] * 2, -1)[:, None]

        def rot(t: torch.Tensor) -> torch.Tensor:
            t1, t2 = t.chunk(2, -1)
            return t * cos + torch.cat([-t2, t1], -1) * sin

        q, k = rot(q), rot(k)
        rep = self.hq // self.hk
        k, v = k.repeat_interleave(rep, 1), v.view(s, self.hk, d).repeat_interleave(rep, 1)
        i, j = torch.arange(s)[:, None], torch.arange(s)[None]
        allowed = j <= i
        if self.window is not None:  # the remote swa_mask: j >= i - window
            allowed &= j >= i - self.window
        scores = torch.einsum("ihd,jhd->hij", q, k) * d**-0.5
        probs = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
        return self.o_proj(torch.einsum("hij,jhd->ihd", probs, v).reshape(s, -1))


class _MLP(nn.Module):
    def __init__(self, c: dict):
        super().__init__()
        self.gate_up_proj = nn.Linear(c["hidden_size"], 2 * c["intermediate_size"], bias=False)
        self.down_proj = nn.Linear(c["intermediate_size"], c["hidden_size"], bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, -1)
        return self.down_proj(F.silu(gate) * up)


class _Layer(nn.Module):
    def __init__(self, c: dict, i: int):
        super().__init__()
        step = c["mamba_step"]
        self.is_mamba = i % step != step // 2
        window = None if i in c["full_attention_idx"] else c["attention_window_size"]
        self.mixer = _Mixer(c) if self.is_mamba else _Attention(c, window)
        self.mlp = _MLP(c)
        for name in OFFSETS:
            setattr(self, f"{name}_norm", nn.Module())
            getattr(self, f"{name}_norm").weight = nn.Parameter(torch.zeros(c["hidden_size"]))

    def norm(self, name: str, x: torch.Tensor) -> torch.Tensor:
        return _rms(x, getattr(self, f"{name}_norm").weight, OFFSETS[name])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.norm("post_mixer", self.mixer(self.norm("pre_mixer", x)))
        return x + self.norm("post_mlp", self.mlp(self.norm("pre_mlp", x)))


class Plamo2Reference(nn.Module):
    """The release's module tree (model.embed_tokens, model.layers.layers.{i}, model.norm)."""

    def __init__(self, c: dict):
        super().__init__()
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(c["vocab_size"], c["hidden_size"])
        self.model.layers = nn.Module()
        self.model.layers.layers = nn.ModuleList(
            _Layer(c, i) for i in range(c["num_hidden_layers"])
        )
        self.model.norm = nn.Module()
        self.model.norm.weight = nn.Parameter(torch.zeros(c["hidden_size"]))

    def logits(self, ids: torch.Tensor) -> torch.Tensor:  # [S] -> [S, V]
        x = self.model.embed_tokens(ids)
        for layer in self.model.layers.layers:
            x = layer(x)
        return _rms(x, self.model.norm.weight, 1.0) @ self.model.embed_tokens.weight.T

    def greedy(self, prompt: list[int], steps: int, top: int = 5) -> Greedy:
        return greedy_over_logits(self.logits, prompt, steps, top)


def _write(path: Path, config: dict, seed: int) -> Plamo2Reference:
    """The reference of `config` with random weights, saved to `path` as a release would be."""
    ref = Plamo2Reference(config).eval()
    with torch.no_grad():
        _randomize(ref, seed)
        gen = torch.Generator().manual_seed(seed)
        for name, p in ref.named_parameters():
            if name.endswith(("q_weight", "k_weight")):  # per-head norm weights near 1
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
            elif name.endswith("_norm.weight") or name == "model.norm.weight":
                p.sub_(1.0)  # the sandwich / final norms store offsets: around 0
    state = {k: v.contiguous() for k, v in ref.state_dict().items()}
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(config))
    build_tiny_tokenizer(TINY_VOCAB_SIZE, seed).save_pretrained(path)
    transformers.GenerationConfig(**_COMMON).save_pretrained(path)
    return ref


@pytest.fixture(scope="module")
def plamo2(tmp_path_factory) -> tuple[Path, Plamo2Reference]:
    path = tmp_path_factory.mktemp("plamo2")
    return path, _write(path, CONFIG, 5)


@pytest.mark.parametrize("budget", [None, 16])
def test_plamo2_matches_reference(budget, plamo2):
    path, ref = plamo2
    prompts = [*random_token_prompts(3, 2), random_token_prompts(4, 1)[0][:5]]
    prompts[0] = (prompts[0] * 3)[:40]  # past the window and over 2 prefill chunks of 16
    refs = [ref.greedy(p, TOKENS) for p in prompts]
    kw = {} if budget is None else {"max_num_batched_tokens": budget}
    llm = LLM(model=str(path), dtype="float32", max_model_len=96, block_size=16, **kw)
    model = llm.llm_engine.model_runner.model.model
    assert model.kv_index == [-1, 0, -1, 1]  # mixers hold state, attention layers KV
    windows = [layer.mixer.attn.sliding_window for layer in model.layers if not layer.is_mamba]
    assert windows == [7, None]  # 6 previous positions and the query's own; full attention
    assert_llm_matches(f"plamo2-{budget}", llm, prompts, refs)


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("mamba_enabled", False),
        ("linear_type", "fp8"),
        ("rope_theta", 1e6),
        ("image_token_id", 5),
        ("mamba_step", 1),
    ],
)
def test_plamo2_refuses_unserved_fields(name, value, tmp_path):
    from paged_engine.models.remote_aliases import remote_config

    (tmp_path / "config.json").write_text(json.dumps({**CONFIG, name: value}))
    with pytest.raises(ValueError, match=name):
        remote_config(tmp_path)


def test_plamo2_tensor_parallel_matches_reference(tmp_path):
    """TP=2 (gloo on the CPU) on plamo-2-1b's attention shape, one KV head (replicated on both
    ranks, its k_weight too): the mixer's heads, in_proj's z / x rows, the conv channels and
    bcdt_proj's input split over the ranks, the query heads and q_weight too."""
    ref = _write(tmp_path, {**CONFIG, "num_key_value_heads": 1}, 6)
    prompts = random_token_prompts(6, 2)
    refs = [ref.greedy(p, TOKENS) for p in prompts]
    llm = LLM(model=str(tmp_path), dtype="float32", max_model_len=96, tensor_parallel_size=2)
    try:
        assert_llm_matches("plamo2-tp2", llm, prompts, refs)
    finally:
        llm.llm_engine.shutdown()
