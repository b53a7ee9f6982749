"""The fused kernels the Triton backend swaps into a model's layers (layers/triton_layers.py),
against the torch layers they replace, inside real models (Triton's interpreter runs them here;
natively on a GPU).

- use_triton_rope: the q and k heads of each Llama-family attention layer (with Qwen3's
  per-head q/k norms) normalised and rotated in place by paged_kernels.rope_qk_;
- use_triton_activations: SiluAndMul as paged_kernels.silu_and_mul;
- use_triton_norms: RMSNorms as paged_kernels.rms_norm, and in Llama's own layers each
  residual add with the norm after it as paged_kernels.add_rms_norm (the stream kept apart).
"""

from __future__ import annotations

import pytest
import torch
from test_models import CASES, PagedRunner, load_ours, prompt

from paged_engine.layers.activation import SiluAndMul
from paged_engine.layers.norm import GemmaRMSNorm, RMSNorm
from paged_engine.layers.rotary import RotaryEmbedding
from paged_engine.layers.triton_layers import (
    use_triton_activations,
    use_triton_norms,
    use_triton_rope,
)

# The models run on CPU (test_models' PagedRunner), so the kernels run in Triton's interpreter;
# on a CUDA machine the fused layers run natively inside the engine instead (test_llm_vs_hf
# and the engine tests take CUDA's Triton path).
pytestmark = pytest.mark.skipif(
    torch.cuda.is_available(), reason="CPU models: the kernels run natively in the engine tests"
)

# (arch, config overrides, kernel calls a layer and step: rope, gated SiLU, fused add + norm).
# Llama-family attention: plain NeoX rope, llama3 scaling, qk norms (Qwen3), GPT-J pairs over a
# partial rotary (GLM-4), partial NeoX (Phi), GQA with a sliding window (Mistral). Phi's q/k
# LayerNorms are no RMSNorms: the torch rope runs there. Plain pre-norm layers (Llama's,
# Mistral's, Qwen3's, the MoE layers of Qwen3-MoE / gpt-oss, DeepSeek's around MLA) fuse both
# adds; layers that compute otherwise (GLM-4's four norms, Granite's multipliers, Phi's
# parallel block) keep them. DeepSeek-V3's MLA ropes itself; its dense first layer and each
# MoE layer's shared experts run one gated SiLU.
CASES_FUSED = [
    (*CASES[0], 1, 1, 2),  # Llama
    (*CASES[1], 1, 1, 2),  # and with llama3 scaling, tied embeddings
    ("qwen3", {}, 1, 1, 2),
    ("mistral", {"sliding_window": 8}, 1, 1, 2),
    ("glm4", {}, 1, 1, 0),
    ("phi", {"qk_layernorm": False}, 1, 0, 0),
    ("phi", {"qk_layernorm": True}, 0, 0, 0),
    ("qwen3_moe", {}, 1, 0, 2),
    ("gpt_oss", {}, 1, 0, 2),
    ("granitemoe", {}, 1, 0, 0),
    ("deepseek_v3", {}, 0, 1, 2),
    # their own layers: Gemma's rope (with Gemma 3's q/k norms, 1 + w, rounded once) and
    # norms run the kernels with their roundings; OLMo 2's norms too
    ("gemma2", {}, 1, 0, 0),
    ("gemma3", {}, 1, 0, 0),
    ("olmo2", {}, 0, 1, 0),
]


def _run(model) -> torch.Tensor:
    """Logits of a 2-sequence prefill, a chunk and three decode steps."""
    runner = PagedRunner(model)
    a, b = prompt(23, seed=5), prompt(11, seed=6)
    out = [runner.step([(0, a[:17], 0), (1, b, 0)])]
    out.append(runner.step([(0, a[17:], 17), (1, [7], 11)]))
    out += [runner.step([(0, [3 + i], 23 + i), (1, [9 + i], 12 + i)]) for i in range(3)]
    return torch.cat(out)


class _Counting:
    def __init__(self, fn):
        self.fn, self.calls = fn, 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self.fn(*args, **kwargs)


def _count(model, cls, attr: str) -> list[_Counting]:
    """Wrap `attr` of every `cls` module (shared instances once) in a call counter."""
    counters = []
    for module in {id(m): m for m in model.modules() if type(m) is cls}.values():
        if getattr(module, attr) is not None:
            counter = _Counting(getattr(module, attr))
            setattr(module, attr, counter)
            counters.append(counter)
    return counters


def _calls(counters: list[_Counting]) -> int:
    return sum(c.calls for c in counters)


@pytest.mark.parametrize(
    ("arch", "overrides", "ropes", "silus", "add_norms"),
    CASES_FUSED,
    ids=[f"{c[0]}-{'-'.join(c[1]) or 'default'}" for c in CASES_FUSED],
)
def test_triton_layers_match_torch_layers(
    tiny_model_factory, arch, overrides, ropes, silus, add_norms
):
    model = load_ours(tiny_model_factory(arch, **overrides))
    want = _run(model)
    use_triton_rope(model)
    use_triton_activations(model)
    use_triton_norms(model)
    counters = {
        "ropes": _count(model, RotaryEmbedding, "kernel"),
        "silus": _count(model, SiluAndMul, "kernel"),
        "add_norms": _count(model, RMSNorm, "add_kernel"),
    }
    got = _run(model)
    runs = 5 * model.config.num_hidden_layers  # layer forwards over the run
    calls = {name: _calls(c) for name, c in counters.items()}
    assert calls["ropes"] == ropes * runs
    assert calls["add_norms"] == add_norms * runs
    assert calls["silus"] == silus * runs
    assert all(m.kernel is not None for m in model.modules() if isinstance(m, RMSNorm))
    # float32; the kernels sum a row's squares in another order than torch (Gemma: six norms
    # a layer, soft-capped scores: up to ~2e-5 apart; test_models holds models to HF at 1e-4)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_rotate_qkv_declines_what_it_cannot_fuse():
    """Without its kernel, with rows that are not dense or with norms that are not a pair of
    RMSNorms of one kind over a head, rotate_qkv_ leaves qkv alone and says so."""
    rope = RotaryEmbedding(16, 16, 64, 10000.0)
    qkv = torch.randn(3, 4 * 16)  # 2 q heads, 1 kv head
    pos = torch.arange(3)
    assert not rope.rotate_qkv_(pos, qkv, 2, 1)
    assert use_triton_rope(torch.nn.ModuleList([rope])) == 1
    before = qkv.clone()
    for norms in [
        (GemmaRMSNorm(16), RMSNorm(16, 1e-6)),  # two kinds of rounding
        (RMSNorm(16, 1e-6), RMSNorm(16, 1e-5)),
        (RMSNorm(32, 1e-6), RMSNorm(32, 1e-6)),  # not a head's width
        (RMSNorm(16, 1e-6, weight_offset=1.0), RMSNorm(16, 1e-6)),
        (RMSNorm(16, 1e-6), None),
    ]:
        assert not rope.rotate_qkv_(pos, qkv, 2, 1, *norms)
    assert not rope.rotate_qkv_(pos, torch.randn(4 * 16, 3).t(), 2, 1)
    assert torch.equal(qkv, before)
    assert rope.rotate_qkv_(pos, qkv.clone(), 2, 1, GemmaRMSNorm(16), GemmaRMSNorm(16))
    assert rope.rotate_qkv_(pos, qkv, 2, 1, RMSNorm(16, 1e-6), RMSNorm(16, 1e-6))
    assert not torch.equal(qkv[:, :48], before[:, :48])
    assert torch.equal(qkv[:, 48:], before[:, 48:])  # v untouched
