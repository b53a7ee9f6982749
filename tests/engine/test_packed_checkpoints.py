"""GPTQ, AWQ and llm-compressor's pack-quantized (W4A16 / W8A16) checkpoints
(packed_checkpoint.py, packed_codes.py). Each tiny checkpoint is quantized and packed the way
those tools lay out their tensors (tests/int_packers.py); its weights must load as exactly
their dequantized values, and the engine must give HF's greedy tokens (logprobs within 1e-3)
on a copy holding those values unquantized. Kept as 4-bit codes (CUDA's default,
quantization="int4" on the CPU) the engine must give the dense engine's tokens, through torch's
CPU kernels and the Triton kernels (interpreter), also under TP=2. What we cannot load fails
before any weight is read.
"""

from __future__ import annotations

import pytest
import torch
from checkpoint_copies import (
    assert_generates_like_hf,
    assert_loads_as_dense,
    assert_same_params,
    copy_with_quant_config,
    load_cpu,
)
from int_packers import SCHEMES, packed_copy

from paged_engine import LLM, SamplingParams
from paged_engine.testing import write_tiny_model

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("llama"), "llama", seed=2)


@pytest.mark.parametrize("scheme", list(SCHEMES))
def test_weights_load_as_their_dequantized_values(tiny, tmp_path, scheme):
    path, dense = packed_copy(tiny, scheme, tmp_path / scheme)
    # near the original (2-bit weights with one group a row are coarse)
    assert_loads_as_dense(path, dense, tiny, 1.5 if SCHEMES[scheme].get("bits") == 2 else 0.3)


@pytest.mark.parametrize("scheme", ["gptq-4bit-act-order", "awq", "w4a16-asym-act-order"])
def test_generation_matches_hf_on_the_dequantized_weights(tiny, tmp_path, scheme):
    path, dense = packed_copy(tiny, scheme, tmp_path / scheme)
    llm = LLM(model=str(path), dtype="float32", max_model_len=128)
    assert_generates_like_hf(llm, dense, scheme)


def test_per_expert_moe_weights_unpack(tmp_path):
    """Qwen3-30B-A3B-GPTQ-Int4's layout: every expert's matrices packed."""
    src = write_tiny_model(tmp_path / "moe", "qwen3_moe", seed=3)
    path, dense = packed_copy(src, "gptq-4bit", tmp_path / "q")
    assert_same_params(path, dense)


def test_vllm_quantization_names_are_checked_against_the_checkpoint(tiny, tmp_path):
    path, _ = packed_copy(tiny, "awq", tmp_path / "q")
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    prompt = [{"prompt_token_ids": [5, 6, 7]}]
    auto = LLM(model=str(path), dtype="float32", max_model_len=64)
    want = auto.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
    named = LLM(model=str(path), dtype="float32", max_model_len=64, quantization="awq_marlin")
    assert named.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids == want
    with pytest.raises(ValueError, match="quantization='gptq' but the checkpoint's quant_method"):
        LLM(model=str(path), dtype="float32", max_model_len=64, quantization="gptq")
    with pytest.raises(ValueError, match="quantization"):
        LLM(model=str(path), quantization="hqq")


def test_unsupported_schemes_fail_naming_them(tiny, tmp_path):
    pack = {"quant_method": "compressed-tensors", "format": "pack-quantized"}

    def group(**weights):
        return {**pack, "config_groups": {"g": {"weights": {"num_bits": 4, **weights}}}}

    cases = [
        ({"quant_method": "gptq", "bits": 5}, "5-bit"),
        ({"quant_method": "gptq", "bits": 4, "checkpoint_format": "marlin"}, "'marlin'"),
        ({"quant_method": "gptq", "bits": 4, "dynamic": {"+:.*down": {"bits": 5}}}, "dynamic"),
        ({"quant_method": "awq", "bits": 4, "version": "gemv"}, "'gemv'"),
        ({"quant_method": "awq", "bits": 3}, "3-bit"),
        ({"quant_method": "awq", "zero_point": False}, "zero_point"),
        (group(type="float"), "'float'"),
        (group(num_bits=5), "5-bit"),
        (pack, "no config group"),
        (
            {
                **pack,
                "config_groups": {
                    "a": {"weights": {"num_bits": 4}},
                    "b": {"weights": {"num_bits": 8}},
                },
            },
            "different bits",
        ),
        ({"quant_method": "hqq"}, "'hqq' is not supported"),
    ]
    for i, (quant, match) in enumerate(cases):
        with pytest.raises(ValueError, match=match):
            load_cpu(copy_with_quant_config(tiny, tmp_path / str(i), quant))


def test_an_incomplete_layer_is_named(tiny, tmp_path):
    from safetensors.torch import load_file, save_file

    path, _ = packed_copy(tiny, "gptq-4bit-act-order", tmp_path / "q")
    state = load_file(str(path / "model.safetensors"))
    del state["model.layers.1.self_attn.o_proj.g_idx"]
    save_file(state, str(path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"layers.1.self_attn.o_proj \(has qweight, qzeros"):
        load_cpu(path)


def test_a_nonzero_bias_the_model_lacks_is_still_unexpected(tiny, tmp_path):
    from safetensors.torch import load_file, save_file

    path, _ = packed_copy(tiny, "gptq-4bit", tmp_path / "q")
    state = load_file(str(path / "model.safetensors"))
    state["model.layers.0.mlp.up_proj.bias"][3] = 1.0
    save_file(state, str(path / "model.safetensors"))
    with pytest.raises(
        ValueError, match=r"unexpected weights model\.layers\.0\.mlp\.up_proj\.bias$"
    ):
        load_cpu(path)


def _int4_layers(llm) -> tuple[int, int]:
    """(linear layers running a checkpoint's codes or int4, and MoE layers running int4
    experts; linear and MoE layers)."""
    from paged_engine.layers.fused_moe import FusedMoE
    from paged_engine.layers.linear import LinearBase
    from paged_engine.layers.quantization import Int4Linear

    modules = list(llm.llm_engine.model_runner.model.modules())
    layers = [m for m in modules if isinstance(m, (LinearBase, FusedMoE))]
    int4 = [
        m
        for m in layers
        if (isinstance(m, FusedMoE) and m.int4 is not None)
        or (
            isinstance(m, LinearBase)
            and m.weight is None
            and isinstance(getattr(m.linear_method, "method", None), Int4Linear)
        )
    ]
    return len(int4), len(layers)


def _same_outputs(got, want, tol: float) -> None:
    for a, b in zip(got, want, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for la, lb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs, strict=True):
            for tok, lp in la.items():
                assert abs(lp.logprob - lb[tok].logprob) < tol


PROMPTS = [{"prompt_token_ids": [5, 6, 7, 9, 11, 40, 41]}, {"prompt_token_ids": [100, 3, 4]}]
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=2)
# Triton's interpreter runs every layer's kernel program by program: the prefill (10 rows)
# and two decode steps (2 rows), float32's 16-row tiles either way
SHORT = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, logprobs=2)


def _like_dense(llm: LLM, dense, tol: float) -> None:
    """`llm` gives the outputs of the engine on the dense copy `dense` (float32)."""
    want = LLM(model=str(dense), dtype="float32", max_model_len=64)
    _same_outputs(
        llm.generate(PROMPTS, GREEDY, use_tqdm=False),
        want.generate(PROMPTS, GREEDY, use_tqdm=False),
        tol,
    )


@pytest.mark.parametrize("scheme", ["gptq-4bit-g32", "awq-g64", "w4a16-channel"])
def test_int4_runs_the_checkpoints_own_codes(tiny, tmp_path, scheme):
    """quantization="int4" on a 4-bit checkpoint keeps its codes (not a second rounding): the
    dense engine's tokens, logprobs within 1e-4 (float32; w = code * scale + low instead of
    (code - zero) * scale)."""
    path, dense = packed_copy(tiny, scheme, tmp_path / scheme)
    llm = LLM(model=str(path), dtype="float32", max_model_len=64, quantization="int4")
    assert _int4_layers(llm) == (8, 8)
    _like_dense(llm, dense, 1e-4)


def test_layers_the_codes_cannot_serve_are_quantized_again(tiny, tmp_path):
    """Groups of 16 inputs are not Int4Linear's 32: with int4 those layers are rounded again
    from their dense values (as for any checkpoint), and the engine still runs."""
    path, _ = packed_copy(tiny, "gptq-4bit", tmp_path / "q")
    llm = LLM(model=str(path), dtype="float32", max_model_len=64, quantization="int4")
    assert _int4_layers(llm) == (8, 8)
    out = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 8 for o in out)


def test_codes_run_through_the_triton_kernel(tiny, tmp_path, monkeypatch):
    """The CUDA path (paged_kernels.int4_linear) on CPU tensors in Triton's interpreter: the
    dense engine's tokens."""
    import paged_kernels
    from paged_engine.layers import quantization

    if not paged_kernels.triton_available():
        pytest.skip("needs triton")
    path, dense = packed_copy(tiny, "gptq-4bit-g32", tmp_path / "q")
    want = LLM(model=str(dense), dtype="float32", max_model_len=64)
    calls = []
    kernel = paged_kernels.int4_linear

    def counted(*args):
        calls.append(1)
        return kernel(*args)

    monkeypatch.setattr(quantization, "TRITON_ON_CPU", True)
    monkeypatch.setattr(paged_kernels, "int4_linear", counted)
    llm = LLM(model=str(path), dtype="float32", max_model_len=64, quantization="int4")
    got = llm.generate(PROMPTS, SHORT, use_tqdm=False)
    assert calls
    _same_outputs(got, want.generate(PROMPTS, SHORT, use_tqdm=False), 1e-4)


def test_codes_under_tensor_parallelism_match_one_process(tiny, tmp_path):
    """TP=2 splits each layer's codes by output rows (q, k, v, gate, up) or by whole groups of
    inputs (o, down), in two processes: the single process's tokens."""
    path, _ = packed_copy(tiny, "gptq-4bit-g32", tmp_path / "q")
    one = LLM(model=str(path), dtype="float32", max_model_len=64, quantization="int4")
    want = one.generate(PROMPTS, GREEDY, use_tqdm=False)
    del one
    two = LLM(
        model=str(path),
        dtype="float32",
        max_model_len=64,
        quantization="int4",
        tensor_parallel_size=2,
    )
    try:
        _same_outputs(two.generate(PROMPTS, GREEDY, use_tqdm=False), want, 1e-4)
    finally:
        two.llm_engine.shutdown()


def test_kept_codes_come_back_after_a_level_2_sleep(tiny, tmp_path):
    """Sleep level 2 discards the weights; reload_weights rebuilds the codes from the
    checkpoint: the same tokens and logprobs as before."""
    path, _ = packed_copy(tiny, "gptq-4bit-g32", tmp_path / "q")
    llm = LLM(
        model=str(path),
        dtype="float32",
        max_model_len=64,
        quantization="int4",
        enable_sleep_mode=True,
    )
    want = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    llm.sleep(level=2)
    llm.wake_up(tags=["weights"])
    for module in llm.llm_engine.model_runner.model.modules():  # whatever came back: scrambled
        method = getattr(getattr(module, "linear_method", None), "method", None)
        if method is not None:
            method.packed.fill_(0x5A)
            if method.kernel_weight is not None:  # torch's CPU kernel's copy
                method.kernel_weight.fill_(0x5A)
    assert llm.collective_rpc("reload_weights")[0] > 0
    llm.wake_up(tags=["kv_cache"])
    assert _int4_layers(llm) == (8, 8)
    _same_outputs(llm.generate(PROMPTS, GREEDY, use_tqdm=False), want, 1e-6)


def _every_linear(name: str, t: torch.Tensor) -> bool:
    """Every 2-D weight but embeddings, heads and norms, where 32-input groups fit."""
    skip = ("embed", "lm_head", "wte", "wpe", "norm")
    return (
        t.dim() == 2
        and name.endswith(".weight")
        and not any(s in name for s in skip)
        and t.shape[1] % 32 == 0
        and t.shape[0] % 8 == 0
    )


@pytest.mark.parametrize(
    "arch, kept",
    [
        ("qwen2", (8, 8)),  # q / k / v biases
        ("phi3", (8, 8)),  # fused qkv and gate_up in the checkpoint, split by rows
        ("opt", (8, 8)),  # biases everywhere, fc1 / fc2
        ("falcon", (6, 8)),  # query_key_value interleaved by head: reshaped, so dense
        ("gpt2", (0, 8)),  # Conv1D weights stored transposed: dense
        ("mixtral", (6, 6)),  # the experts too (int4 pairs for the MoE kernel)
        ("deepseek_v2", (17, 17)),  # latent attention's projections, shared and routed experts
    ],
)
def test_codes_through_each_models_loaders(tmp_path, monkeypatch, arch, kept):
    """Every linear weight of the checkpoint packed: the layers a model's loader slices by rows
    or whole groups keep their codes (the count), the rest load dense, and the engine gives
    the dense checkpoint's tokens with logprobs within 1e-5 (float32)."""
    from paged_engine.packed_codes import KEEP_CODES
    from paged_engine.worker.worker import Worker

    # CUDA's default on this CPU: the codes, nothing else quantized
    monkeypatch.setattr(Worker, "_default_quantization", lambda *a: KEEP_CODES)
    src = write_tiny_model(tmp_path / arch, arch, seed=2)
    path, dense = packed_copy(src, "gptq-4bit-g32", tmp_path / "q", packs=_every_linear)
    llm = LLM(model=str(path), dtype="float32", max_model_len=64)
    assert _int4_layers(llm) == kept
    monkeypatch.undo()
    _like_dense(llm, dense, 1e-5)


def test_moe_codes_run_through_the_triton_kernels(tmp_path, monkeypatch):
    """CUDA's path for a 4-bit MoE checkpoint on CPU tensors in Triton's interpreter: the
    linear layers through int4_linear, the experts through fused_moe's int4 decode; the dense
    checkpoint's tokens."""
    import paged_kernels
    from paged_engine.layers import fused_moe, quantization
    from paged_engine.packed_codes import KEEP_CODES
    from paged_engine.worker.worker import Worker

    if not paged_kernels.triton_available():
        pytest.skip("needs triton")
    src = write_tiny_model(tmp_path / "moe", "qwen3_moe", seed=3)
    path, dense = packed_copy(src, "gptq-4bit-g32", tmp_path / "q", packs=_every_linear)
    want = LLM(model=str(dense), dtype="float32", max_model_len=64)
    want_out = want.generate(PROMPTS, SHORT, use_tqdm=False)
    monkeypatch.setattr(Worker, "_default_quantization", lambda *a: KEEP_CODES)
    monkeypatch.setattr(quantization, "TRITON_ON_CPU", True)
    monkeypatch.setattr(fused_moe, "TRITON_ON_CPU", True)
    llm = LLM(model=str(path), dtype="float32", max_model_len=64)
    assert _int4_layers(llm) == (6, 6)
    _same_outputs(llm.generate(PROMPTS, SHORT, use_tqdm=False), want_out, 1e-4)


@pytest.mark.parametrize(
    "scheme, deferred, second_pass", [("gptq-4bit-g32", 8, False), ("gptq-4bit", 8, True)]
)
def test_dense_weights_are_deferred_while_codes_load(
    tiny, tmp_path, monkeypatch, scheme, deferred, second_pass
):
    """The linear layers are built without dense weights (meta) and become their codes as
    they load; only when some layer's codes cannot serve it (groups of 16 here) does a second,
    dense pass over the checkpoint fill the leftovers."""
    from paged_engine.packed_codes import CodesLoad

    loads: list[CodesLoad] = []
    passes: list[int] = []
    init, materialize = CodesLoad.__init__, CodesLoad.materialize

    def watch(self, model):
        init(self, model)
        assert all(getattr(m, n).is_meta for m, n in self.targets.values())
        loads.append(self)

    def second(self, device):
        passes.append(len(self.leftovers()))
        materialize(self, device)

    monkeypatch.setattr(CodesLoad, "__init__", watch)
    monkeypatch.setattr(CodesLoad, "materialize", second)
    path, dense = packed_copy(tiny, scheme, tmp_path / "q")
    llm = LLM(model=str(path), dtype="float32", max_model_len=64, quantization="int4")
    assert len(loads) == 1 and len(loads[0].converted) + sum(passes) == deferred
    assert bool(passes) == second_pass
    assert _int4_layers(llm) == (8, 8)
    if not second_pass:
        _like_dense(llm, dense, 1e-4)


def test_cpu_default_keeps_the_codes_with_bf16_activations(tiny, tmp_path):
    """On a CPU with bf16 support and dtype="auto" a 4-bit checkpoint runs as int4 over its
    own codes in bfloat16 (torch's fused int4 kernel; the fast CPU path); dtype="float32"
    keeps it dense."""
    import torch

    if not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        pytest.skip("this CPU has no bf16 support in oneDNN")
    path, _ = packed_copy(tiny, "gptq-4bit-g32", tmp_path / "q")
    llm = LLM(model=str(path), max_model_len=64)
    assert _int4_layers(llm) == (8, 8)
    model = llm.llm_engine.model_runner.model
    assert model.model.embed_tokens.weight.dtype == torch.bfloat16
    out = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 8 for o in out)
    dense = LLM(model=str(path), dtype="float32", max_model_len=64)
    assert _int4_layers(dense) == (0, 8)
