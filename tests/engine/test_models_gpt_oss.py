"""gpt-oss (`GptOssForCausalLM`): attention sinks, alternating sliding / full layers, YaRN, a
biased router and biased experts with the clamped SwiGLU; checkpoints in transformers' layout
and in OpenAI's MXFP4 (`*_blocks` / `*_scales`).

`LLM.generate` against HF `generate` on the same weights (greedy tokens identical, logprobs
within 1e-3), also from an MXFP4 checkpoint (whose experts dequantize to exactly HF's values,
or stay MXFP4 as on CUDA: decoded by the torch path or by the Triton kernel in the
interpreter), at tensor_parallel_size=2, and on the CUDA path's Triton kernels.
"""

from __future__ import annotations

import json
import random
import shutil

import pytest
import torch
from hf_reference import assert_matches, assert_tp_matches_one_process, hf_greedy, load_hf_model

import paged_kernels
from paged_engine import LLM, SamplingParams
from paged_engine.layers import fused_moe as moe_layer
from paged_engine.layers.fused_moe import FusedMoE, grouped_experts, route
from paged_engine.loader import load_hf_config, load_model, resolve_model
from paged_engine.models import gpt_oss
from paged_engine.testing import tiny_config, write_tiny_model
from paged_kernels import MoeActivation, Mxfp4Weight, dequantize_mxfp4

transformers = pytest.importorskip("transformers")

E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
DENSE = ("experts.gate_up_proj", "experts.down_proj")
SWIGLU = MoeActivation("swigluoai", 1.702, 0.5)
# tokens a request on the interpreted Triton kernels (every step costs seconds): three decode
# steps, past the window (8) from the 8-token prompt
TRITON_MAX_TOKENS = 4


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("gpt_oss"), "gpt_oss", seed=1)


def _prompts(seed: int, count: int, longest: int = 40) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 512) for _ in range(rng.randint(1, longest))] for _ in range(count)]


def _generate(llm, prompts, max_tokens):
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=0)
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


def _load(path):
    resolved = resolve_model(str(path))
    return load_model(resolved, load_hf_config(resolved), dtype=torch.float32, device="cpu")


def test_greedy_tokens_and_logprobs_match_hf(tiny):
    """Prompts past the sliding window (8) and past YaRN's original context (64)."""
    llm = LLM(model=str(tiny), dtype="float32", max_model_len=256, block_size=16)
    hf = load_hf_model(tiny)
    prompts = _prompts(0, 4) + _prompts(1, 1, longest=80)
    for prompt, out in zip(prompts, _generate(llm, prompts, 12)):
        assert_matches("gpt_oss", out, hf_greedy(hf, prompt, 12))
    assert llm.get_stats().num_used_blocks == 0


def quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., N, K] float -> (blocks uint8 [..., N, K/32, 16], scales uint8 [..., N, K/32]): per
    32 values the smallest power of two putting them within E2M1's +-6, each value rounded to
    the nearest code (the low nibble holds the even position)."""
    groups = w.float().unflatten(-1, (-1, 32))  # [..., N, G, 32]
    peak = groups.abs().amax(-1).clamp(min=2.0**-100)
    exponent = torch.ceil(torch.log2(peak / 6.0))  # [..., N, G]
    scaled = groups / torch.exp2(exponent)[..., None]
    grid = torch.tensor(E2M1)
    magnitude = (scaled.abs()[..., None] - grid).abs().argmin(-1)
    codes = (magnitude + 8 * (scaled < 0)).to(torch.uint8)
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return blocks.contiguous(), (exponent + 127).to(torch.uint8)


def _mxfp4_copy(path, dst):
    """The tiny checkpoint with its experts in MXFP4, laid out as OpenAI's release: rows are
    output features (gate / up interleaved), blocks along the inputs."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(path, dst)
    state = load_file(str(path / "model.safetensors"))
    for name in [n for n in state if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        blocks, scales = quantize_mxfp4(state.pop(name).transpose(1, 2))  # [E, out, in]
        state[name + "_blocks"], state[name + "_scales"] = blocks, scales
    save_file(state, str(dst / "model.safetensors"))
    config = json.loads((dst / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "mxfp4",
        "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router"],
    }
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def test_mxfp4_checkpoint_dequantizes_as_hf_and_matches_its_outputs(tiny, tmp_path):
    """Our experts from the MXFP4 checkpoint equal HF's dequantized ones (put in our layout),
    and generation matches HF on that checkpoint."""
    path = _mxfp4_copy(tiny, tmp_path / "mxfp4")
    ours = _load(path)
    hf = _hf_mxfp4(path)
    for layer, hf_layer in zip(ours.model.layers, hf.model.layers):
        hf_experts = hf_layer.mlp.experts
        gate_up = hf_experts.gate_up_proj.detach().float()  # [E, H, 2I], interleaved columns
        want = torch.cat([gate_up[..., 0::2], gate_up[..., 1::2]], -1).transpose(1, 2)
        assert torch.equal(layer.mlp.experts.gate_up_proj, want)
        want_down = hf_experts.down_proj.detach().float().transpose(1, 2)
        assert torch.equal(layer.mlp.experts.down_proj, want_down)
    dense = _load(tiny).model.layers[0].mlp.experts.gate_up_proj
    assert not torch.equal(dense, ours.model.layers[0].mlp.experts.gate_up_proj)  # really FP4

    assert not ours.keeps_mxfp4  # the CPU dequantizes
    llm = LLM(model=str(path), dtype="float32", max_model_len=128)
    prompts = _prompts(2, 3)
    for prompt, out in zip(prompts, _generate(llm, prompts, 8)):
        assert_matches("gpt_oss mxfp4", out, hf_greedy(hf, prompt, 8))


def _hf_mxfp4(path):
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, quantization_config=transformers.Mxfp4Config(dequantize=True)
    )
    hf.generation_config.eos_token_id = None
    hf.generation_config.pad_token_id = 0
    return hf


@pytest.mark.parametrize("kernel", ["torch", "triton"])
def test_mxfp4_experts_kept_as_bytes_match_hf(tiny, tmp_path, monkeypatch, kernel):
    """The experts as CUDA keeps them (uint8 blocks and scales, 4.25 bits a weight), decoded
    per call by the CPU's grouped path or inside the Triton MoE kernel (interpreter): HF's
    tokens on the MXFP4 checkpoint."""
    if kernel == "triton" and (torch.cuda.is_available() or not paged_kernels.triton_available()):
        pytest.skip("Triton's interpreter, CPU only")
    path = _mxfp4_copy(tiny, tmp_path / "mxfp4")
    monkeypatch.setattr(gpt_oss, "KEEP_MXFP4_ON_CPU", True)
    monkeypatch.setattr(moe_layer, "TRITON_ON_CPU", kernel == "triton")
    model = _load(path)
    experts = model.model.layers[0].mlp.experts
    assert model.keeps_mxfp4 and experts.gate_up_proj_blocks.dtype == torch.uint8
    assert not any(n.endswith(DENSE) for n, _ in model.named_parameters())
    llm = LLM(model=str(path), dtype="float32", max_model_len=128)
    hf = _hf_mxfp4(path)
    prompts = _prompts(5, 2, longest=20)
    tokens = TRITON_MAX_TOKENS if kernel == "triton" else 6
    for prompt, out in zip(prompts, _generate(llm, prompts, tokens)):
        assert_matches(f"gpt_oss mxfp4 {kernel}", out, hf_greedy(hf, prompt, tokens))


def test_mxfp4_experts_tensor_parallel_shards_sum_to_the_whole_layer():
    """MXFP4 experts split over 2 ranks (gate / up rows, down's 32-value groups) from the
    checkpoint's [.., K/32, 16] blocks: the ranks' partial sums add up to the unsplit layer's,
    which is the dense layer on the dequantized weights; the down bias counts once."""
    e, hid, inter = 4, 64, 64
    gen = torch.Generator().manual_seed(0)

    def mx(n: int, k: int) -> Mxfp4Weight:
        blocks = torch.randint(0, 256, (e, n, k // 32, 16), generator=gen, dtype=torch.uint8)
        return Mxfp4Weight(blocks, torch.randint(118, 124, (e, n, k // 32), dtype=torch.uint8))

    gate_up, down = mx(2 * inter, hid), mx(hid, inter)
    gb, db = torch.randn(e, 2 * inter, generator=gen), torch.randn(e, hid, generator=gen)
    x = torch.randn(7, hid, generator=gen)
    weights, ids = route(torch.randn(7, e, generator=gen), 2, renormalize=True)
    outs = []
    for rank, size in ((0, 1), (0, 2), (1, 2)):
        layer = FusedMoE(e, hid, inter, rank, size, bias=True, mxfp4=True, activation=SWIGLU)
        tensors = {
            "gate_up_proj_blocks": gate_up.blocks,
            "gate_up_proj_scales": gate_up.scales,
            "down_proj_blocks": down.blocks,
            "down_proj_scales": down.scales,
            "gate_up_proj_bias": gb,
            "down_proj_bias": db,
        }
        for name, p in layer.named_parameters():
            loader = getattr(p, "weight_loader", None)
            loader(p, tensors[name]) if loader else p.data.copy_(tensors[name])
        outs.append(layer(x, weights, ids))
    torch.testing.assert_close(outs[1] + outs[2], outs[0], atol=1e-5, rtol=1e-5)
    flat = [Mxfp4Weight(w.blocks.flatten(-2), w.scales) for w in (gate_up, down)]
    dense = [dequantize_mxfp4(w) for w in flat]
    want = grouped_experts(x, *dense, weights, ids, gb, db, SWIGLU)
    torch.testing.assert_close(outs[0], want, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="multiples of 32"):
        FusedMoE(e, hid, 32, 0, 2, mxfp4=True)


def test_checkpoint_errors_name_the_problem(tiny, tmp_path):
    from safetensors.torch import load_file, save_file

    path = _mxfp4_copy(tiny, tmp_path / "half")
    state = load_file(str(path / "model.safetensors"))
    del state["model.layers.1.mlp.experts.down_proj_scales"]
    save_file(state, str(path / "model.safetensors"))
    with pytest.raises(ValueError, match="down_proj_blocks"):
        _load(path)
    config = tiny_config("gpt_oss", quantization_config={"quant_method": "gptq", "bits": 4})
    from paged_engine.models.gpt_oss import GptOssForCausalLM

    with pytest.raises(ValueError, match="'gptq' is not supported"):
        GptOssForCausalLM(config)


def test_tensor_parallel_matches_one_process(tiny):
    """tensor_parallel_size=2 (gloo on the CPU): each rank holds half of the heads (and their
    sinks) and half of every expert; the experts' down bias counts once."""
    assert_tp_matches_one_process(tiny, _prompts(3, 4), max_tokens=8, max_model_len=128)


@pytest.mark.skipif(not paged_kernels.triton_available(), reason="needs triton")
@pytest.mark.skipif(
    torch.cuda.is_available(), reason="Triton's interpreter runs only without a GPU (set there)"
)
def test_triton_kernels_give_hf_tokens(tiny, monkeypatch):
    """The CUDA path on CPU tensors in Triton's interpreter: paged attention with sinks and the
    MoE kernels with biases and the clamped SwiGLU."""
    monkeypatch.setattr(moe_layer, "TRITON_ON_CPU", True)
    calls = []
    real = paged_kernels.fused_moe
    monkeypatch.setattr(
        paged_kernels, "fused_moe", lambda *a, **k: calls.append(1) or real(*a, **k)
    )
    llm = LLM(model=str(tiny), dtype="float32", max_model_len=128, attention_backend="triton")
    hf = load_hf_model(tiny)
    prompts = _prompts(4, 2, longest=20)  # 8 and 1 tokens
    for prompt, out in zip(prompts, _generate(llm, prompts, TRITON_MAX_TOKENS)):
        assert_matches("gpt_oss triton", out, hf_greedy(hf, prompt, TRITON_MAX_TOKENS))
    assert calls
