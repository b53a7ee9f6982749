"""Multi-LoRA on the hybrid models (Qwen3.5, Qwen3-Next, Granite 4.0-H, Nemotron-H, LFM2,
Falcon-H1) and the pure state-space ones (Mamba, Mamba2): adapters on the attention and MLP
projections and on the linear mixers' own projections (Gated DeltaNet's in_proj_qkv / z / b / a,
Qwen3-Next's interleaved in_proj_qkvz / ba, Mamba2's and the short conv's in_proj / out_proj,
Mamba's in_proj / x_proj / dt_proj / out_proj) give HF's greedy tokens and logprobs on the
model with the adapter merged, two adapters and the base model in one batch; under tensor
parallelism the one process's; prefix-cache state snapshots never cross adapters; modules that
cannot be adapted are refused with a ValueError naming them."""

from __future__ import annotations

import json
import random

import pytest
import torch
from hf_reference import assert_same_greedy, hf_greedy, load_hf_model
from torch import nn

from paged_engine import LLM, LoRARequest, SamplingParams
from paged_engine.layers.linear import ColumnParallelLinear
from paged_engine.lora.adapter import LoRAModule, PeftAdapter
from paged_engine.lora.model import LoRAModel
from paged_engine.testing import merge_lora_adapter, write_lora_adapter

pytest.importorskip("transformers")

ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")
# HF module names (their last part) each model's adapters target.
TARGETS = {
    "qwen3_5": (*ATTN, *MLP, "in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj"),
    # the shared experts' projections; the routed experts are refused
    "qwen3_next": (*ATTN, *MLP, "in_proj_qkvz", "in_proj_ba", "out_proj"),
    "granitemoehybrid": (*ATTN, "input_linear", "output_linear", "in_proj", "out_proj"),
    "nemotron_h": (*ATTN, "up_proj", "down_proj", "in_proj", "out_proj"),
    # conv.in_proj / conv.out_proj, and the attention's out_proj (our o_proj)
    "lfm2": ("q_proj", "k_proj", "v_proj", "out_proj", "in_proj", "w1", "w2", "w3"),
    "falcon_h1": (*ATTN, *MLP, "in_proj", "out_proj"),
    # pure state-space models: Mamba's every projection (dt_proj's bias added in float32 after
    # its adapter), Mamba2's two
    "mamba": ("in_proj", "x_proj", "dt_proj", "out_proj"),
    "mamba2": ("in_proj", "out_proj"),
}
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=2)


def _prompts(n: int, seed: int, lo: int = 3, hi: int = 24) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 500) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def _llm(model, **options) -> LLM:
    kw = {"dtype": "float32", "max_model_len": 128, "enable_lora": True, "max_lora_rank": 8}
    return LLM(str(model), **{**kw, **options})


def _adapters(model, root, targets):
    a = write_lora_adapter(root / "a", model, rank=4, seed=1, target_modules=targets)
    b = write_lora_adapter(
        root / "b", model, rank=8, alpha=8, seed=2, use_rslora=True, target_modules=targets
    )
    loras = {1: LoRARequest("a", 1, str(a)), 2: LoRARequest("b", 2, str(b))}
    refs = {
        None: load_hf_model(model),
        1: merge_lora_adapter(load_hf_model(model), a),
        2: merge_lora_adapter(load_hf_model(model), b),
    }
    return loras, refs


def _check(outs, ids, refs, abs_tol=1e-3):
    """Each output is HF's greedy continuation (tokens, top-2 logprobs) on its adapter's
    merged model."""
    for out, lora_id in zip(outs, ids, strict=True):
        ref = hf_greedy(refs[lora_id], out.prompt_token_ids, GREEDY.max_tokens, top=2)
        got = out.outputs[0]
        assert got.token_ids == ref.tokens, f"adapter {lora_id}: greedy tokens differ from HF"
        lps = [entry[t].logprob for entry, t in zip(got.logprobs, got.token_ids)]
        assert lps == pytest.approx(ref.logprobs, abs=abs_tol), f"adapter {lora_id}: logprobs"
        for entry, want in zip(got.logprobs, ref.tops, strict=True):
            top = {t: lp.logprob for t, lp in entry.items() if t in want}
            assert top == pytest.approx(want, abs=abs_tol), f"adapter {lora_id}: top logprobs"


@pytest.mark.parametrize("arch", list(TARGETS))
def test_adapters_match_hf_merged(arch, tiny_model_factory, tmp_path):
    model = tiny_model_factory(arch)
    loras, refs = _adapters(model, tmp_path, TARGETS[arch])
    # prefill chunks of 16 tokens: the adapted mixers' state carries across them
    llm = _llm(model, max_loras=2, max_num_batched_tokens=16)
    try:
        prompts = _prompts(4, seed=3)
        ids = [1, 2, None, 1]
        outs = llm.generate(
            prompts, GREEDY, lora_request=[loras.get(i) for i in ids], use_tqdm=False
        )
    finally:
        llm.llm_engine.shutdown()
    _check(outs, ids, refs)
    # the adapters change the outputs (the test would pass trivially otherwise)
    base = [hf_greedy(refs[None], p, GREEDY.max_tokens).tokens for p in prompts]
    assert sum(o.outputs[0].token_ids != t for o, t in zip(outs, base)) >= 2


def test_state_snapshots_never_cross_adapters(tiny_model_factory, tmp_path):
    """The same 40-token prompt (two full blocks) with adapter a, then b, then none, then a
    again: each matches its own reference; only the repeat resumes from a state snapshot."""
    model = tiny_model_factory("qwen3_5")
    loras, refs = _adapters(model, tmp_path, TARGETS["qwen3_5"])
    llm = _llm(model, max_loras=2, block_size=16, prefix_state_snapshots=8)
    engine = llm.llm_engine
    assert engine.config.enable_prefix_caching
    slots = engine.scheduler.state_slots
    prompt = _prompts(1, seed=5, lo=40, hi=40)[0]
    try:
        for lora_id, cached in ((1, False), (2, False), (None, False), (1, True)):
            hits = slots.snapshot_hits
            outs = llm.generate([prompt], GREEDY, lora_request=loras.get(lora_id), use_tqdm=False)
            _check(outs, [lora_id], refs)
            assert (slots.snapshot_hits > hits) == cached, lora_id
            assert (outs[0].num_cached_tokens > 0) == cached, lora_id
    finally:
        engine.shutdown()


@pytest.mark.parametrize(
    ("arch", "overrides"),
    [("qwen3_5", {}), ("granitemoehybrid", {"mamba_n_groups": 1}), ("mamba", {})],
)
def test_tensor_parallel_matches_one_process(arch, overrides, tiny_model_factory, tmp_path):
    """tensor_parallel_size=2 (gloo on the CPU): each rank cuts its heads' rows of every
    segment of the mixers' input projections' B (Gated DeltaNet's q | k | v, z, b, a; Mamba2's
    z | x | B | C | dt, its one group's B and C whole on every rank) and its input shard of
    out_proj's A; tokens and logprobs are the one process's."""
    model = tiny_model_factory(arch, **overrides)
    loras, _ = _adapters(model, tmp_path, TARGETS[arch])
    prompts = _prompts(4, seed=9)
    reqs = [loras[1], loras[2], None, loras[2]]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=0)
    runs = []
    for tp in (1, 2):
        llm = _llm(model, max_loras=2, tensor_parallel_size=tp)
        try:
            outs = llm.generate(prompts, params, lora_request=reqs, use_tqdm=False)
        finally:
            llm.llm_engine.shutdown()
        runs.append([o.outputs[0] for o in outs])
    assert_same_greedy(*runs)
    assert len({tuple(c.token_ids) for c in runs[0][:3]}) == 3  # a, b and base all differ


def _wrapper_adapter(path, hf, targets, seed: int):
    """A PEFT adapter on every linear layer of the HF wrapper `hf` whose last name part is a
    target, named as PEFT names them on the wrapper (`model.language_model.layers.N...`,
    `model.visual.blocks.N...`)."""
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, layer in hf.named_modules():
        if isinstance(layer, nn.Linear) and name.rsplit(".", 1)[-1] in targets:
            key = f"base_model.model.{name}"
            n_in, n_out = layer.in_features, layer.out_features
            tensors[f"{key}.lora_A.weight"] = torch.randn(4, n_in, generator=gen) * n_in**-0.5
            tensors[f"{key}.lora_B.weight"] = torch.randn(n_out, 4, generator=gen) * 0.5
    save_file(tensors, str(path / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": sorted(targets)}
    (path / "adapter_config.json").write_text(json.dumps(config))
    return path


def test_vlm_wrapper_adapter_matches_hf_merged(tmp_path):
    """Qwen3.5 as released (Qwen3_5ForConditionalGeneration, served text-only): an adapter
    trained on the wrapper names the language model's modules `model.language_model.*`, mapped
    as the weights are; its vision-tower modules are not loaded (the tower never runs)."""
    from test_models_vlm_text import load_hf_wrapper, write_tiny_vlm

    model = write_tiny_vlm(tmp_path / "vlm", "qwen3_5", seed=1)
    targets = (*TARGETS["qwen3_5"], "qkv", "proj", "linear_fc1", "linear_fc2")
    adapter = _wrapper_adapter(tmp_path / "a", load_hf_wrapper(model), targets, seed=4)
    refs = {None: load_hf_wrapper(model), 1: merge_lora_adapter(load_hf_wrapper(model), adapter)}
    llm = _llm(model, max_model_len=64)
    try:
        lora = LoRARequest("a", 1, str(adapter))
        outs = llm.generate(_prompts(2, seed=6), GREEDY, lora_request=[lora, None], use_tqdm=False)
    finally:
        llm.llm_engine.shutdown()
    _check(outs, [1, None], refs)
    assert outs[0].outputs[0].token_ids != hf_greedy(refs[None], outs[0].prompt_token_ids, 8).tokens


def test_modules_that_cannot_be_adapted_are_refused(tiny_model_factory, tmp_path):
    """Routed experts and the shared expert's gate (not linear layers LoRA slots hold) are
    refused naming the module; the engine keeps serving."""
    model = tiny_model_factory("qwen3_next")
    llm = _llm(model, max_model_len=64)
    engine = llm.llm_engine
    try:
        for k, (target, fragment) in enumerate(
            (("shared_expert_gate", "shared_expert_gate"), ("gate_proj", "experts"))
        ):
            path = write_lora_adapter(tmp_path / target, model, rank=2, target_modules=(target,))
            if target == "gate_proj":  # a routed expert's, as a PEFT adapter on it names it
                from safetensors.torch import load_file, save_file

                st = path / "adapter_model.safetensors"
                tensors = {
                    k.replace("mlp.shared_expert.", "mlp.experts.0."): v
                    for k, v in load_file(st).items()
                    if ".shared_expert." in k
                }
                save_file(tensors, str(st))
            lora = LoRARequest(target, 10 + k, str(path))
            with pytest.raises(ValueError, match="lora_request") as info:
                llm.generate([[5, 6]], GREEDY, lora_request=lora, use_tqdm=False)
            assert fragment in str(info.value), str(info.value)
        outs = llm.generate([[9, 8, 7]], GREEDY, use_tqdm=False)
        assert len(outs[0].outputs[0].token_ids) == GREEDY.max_tokens
    finally:
        engine.shutdown()


class _OwnLoader(nn.Module):
    """A column-parallel layer whose weight loads through a loader of its own that declares
    nothing for LoRA (as a future mixer's might)."""

    stacked_params = ()

    def __init__(self) -> None:
        super().__init__()
        self.proj = ColumnParallelLinear(8, 8, bias=False, tp_rank=0, tp_size=1)
        self.proj.weight.weight_loader = lambda param, w, shard_id=None: param.data.copy_(w.flip(0))
        self.plain = ColumnParallelLinear(8, 8, bias=False, tp_rank=0, tp_size=1)

    def rename_weight(self, name: str) -> str:
        return name

    def convert_lora_b(self, name: str, b: torch.Tensor):
        return ((name, b),)


def test_a_layer_with_its_own_loader_is_refused_not_misapplied():
    model = _OwnLoader()
    cpu = torch.device("cpu")
    lm = LoRAModel(model, max_loras=1, max_rank=2, max_tokens=4, dtype=torch.float32, device=cpu)
    module = LoRAModule(torch.ones(2, 8), torch.ones(8, 2), 1.0)
    assert set(lm.pack(PeftAdapter("/x", 2, {"plain": module}))) == {"plain"}
    with pytest.raises(ValueError, match=r"module 'proj'.*cannot be adapted"):
        lm.pack(PeftAdapter("/x", 2, {"proj": module}))
