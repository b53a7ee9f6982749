"""OLMo Hybrid (models/olmo_hybrid.py) against HF transformers: Gated DeltaNet layers with
separate q / k / v / g / b / a projections, beta doubled (linear_allow_neg_eigval) and a gated
norm of fixed eps 1e-5, among OLMo 3 attention layers (post norms, whole-projection q / k norms,
rope or NoPE).

Tiny random models (GDN, GDN, attention, GDN; 4 value heads of 32 on 2 key heads of 16; GQA
attention; rms_norm_eps 1e-6, apart from the gated norm's): `LLM.generate` gives HF `generate`'s
greedy tokens and top-5 logprobs (1e-3, float32) on prompts of 1 to 70 tokens (one state chunk
is 64), whole and in prefill chunks of 16, and on the Triton kernels (interpreted); also without
rope (the released checkpoints' rope_theta None), with beta undoubled and equal head counts, and
with tied embeddings. n = 3 greedy forks equal n = 1; prefix caching from state snapshots keeps
the outputs of an engine without it; TP=2 gives the one-process results; a LoRA adapter on the
mixers' separate projections (and the attention layers' q_proj) gives HF's merged model's
outputs; the checkpoint as transformers saves it, as it holds it in memory and as OLMo-core
writes it load to the same model; layer types other than linear / full attention are refused
by name.
"""

from __future__ import annotations

import pytest
from hf_reference import (
    assert_lora_matches_hf_merged,
    assert_tp_matches_one_process,
    load_hf_model,
)
from hybrid_checks import (
    assert_greedy_forks_equal_one,
    assert_greedy_matches_hf,
    assert_snapshots_keep_outputs,
    random_prompts,
    tiny_dirs,
    token_requests,
)

from paged_engine import LLM, SamplingParams
from paged_engine.testing import write_tiny_model

pytest.importorskip("transformers.models.olmo_hybrid")

# name -> (tiny arch, config overrides)
CASES: dict[str, tuple[str, dict]] = {
    "olmo_hybrid": ("olmo_hybrid", {}),
    # NoPE attention, beta in [0, 1], as many key as value heads, tied embeddings
    "olmo_hybrid-nope": (
        "olmo_hybrid",
        {
            "rope_parameters": {"rope_type": "default", "rope_theta": None},
            "linear_allow_neg_eigval": False,
            "linear_num_key_heads": 4,
            "tie_word_embeddings": True,
        },
    ),
}


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    return tiny_dirs(tmp_path_factory, CASES)


@pytest.mark.parametrize(
    ("name", "backend", "budget"),
    [
        ("olmo_hybrid", "cpu", None),
        ("olmo_hybrid", "cpu", 16),  # prefill chunks of 16: the state carries across them
        ("olmo_hybrid", "triton", 16),  # paged_kernels' Triton kernels (interpreted on the CPU)
        ("olmo_hybrid-nope", "cpu", None),
    ],
)
def test_greedy_tokens_and_logprobs_match_hf(name, backend, budget, dirs):
    assert_greedy_matches_hf(name, dirs(name), backend, budget)


def test_forks_equal_one(dirs):
    llm = LLM(model=str(dirs("olmo_hybrid")), dtype="float32", max_model_len=128)
    assert_greedy_forks_equal_one(llm)


def test_prefix_cache_resumes_from_state_snapshots(dirs):
    assert_snapshots_keep_outputs(dirs("olmo_hybrid"))


def test_tensor_parallel_matches_one_process(dirs):
    assert_tp_matches_one_process(dirs("olmo_hybrid"), random_prompts(5, (5, 23, 40)), 8, 128)


def test_lora_on_the_separate_projections_matches_hf_merged(dirs, tmp_path):
    targets = ("q_proj", "v_proj", "g_proj", "b_proj", "o_proj")
    prompt = random_prompts(3, (21,))[0]
    assert_lora_matches_hf_merged(dirs("olmo_hybrid"), tmp_path, prompt, 6, 5, targets=targets)


def _layouts(state: dict, config) -> dict[str, dict]:
    """transformers' in-memory state dict -> {layout: tensors}: that one, and OLMo-core's
    (q / k / v_conv1d of the segments' own sizes, attention_layer_norm / feedforward_layer_norm
    on the linear layers)."""
    key = config.linear_num_key_heads * config.linear_key_head_dim
    value = config.linear_num_value_heads * config.linear_value_head_dim
    core = {}
    for name, w in state.items():
        if ".linear_attn.conv1d." in name:
            for part, seg in zip("qkv", w.split([key, key, value]), strict=True):
                core[name.replace(".conv1d.", f".{part}_conv1d.")] = seg.contiguous()
            continue
        layer = name.split(".")[2] if name.startswith("model.layers.") else None
        if layer is not None and config.layer_types[int(layer)] == "linear_attention":
            name = name.replace(".input_layernorm.", ".attention_layer_norm.")
            name = name.replace(".post_attention_layernorm.", ".feedforward_layer_norm.")
        core[name] = w
    return {"in_memory": state, "olmo_core": core}


@pytest.mark.parametrize("name", ["olmo_hybrid", "olmo_hybrid-nope"])
def test_checkpoint_layouts_load(name, dirs, tmp_path):
    """What transformers saves (its fused conv1d cut into three equal chunks, not q / k / v
    here: 4 value heads of 32 vs 2 key heads of 16), its in-memory names and OLMo-core's all
    give the same outputs."""
    from safetensors.torch import save_file

    src = dirs(name)
    hf = load_hf_model(src)
    tied = hf.config.tie_word_embeddings  # the head shares the embedding's tensor: not saved
    state = {
        k: v.contiguous()
        for k, v in hf.state_dict().items()
        if not (tied and k == "lm_head.weight")
    }
    assert any(".linear_attn.conv1d." in k for k in state)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=2)
    reqs = token_requests(random_prompts(2, (9, 3)))

    def run(path) -> list:
        llm = LLM(model=str(path), dtype="float32", max_model_len=64)
        outs = llm.generate(reqs, params, use_tqdm=False)
        return [
            [{t: lp.logprob for t, lp in e.items()} for e in o.outputs[0].logprobs] for o in outs
        ]

    want = run(src)
    for layout, tensors in _layouts(state, hf.config).items():
        path = tmp_path / layout
        path.mkdir()
        save_file(tensors, str(path / "model.safetensors"))
        for f in ("config", "generation_config", "tokenizer", "tokenizer_config"):
            (path / f"{f}.json").write_text((src / f"{f}.json").read_text())
        assert run(path) == want, layout


def test_other_layer_types_are_refused(tmp_path):
    types = ["linear_attention", "sliding_attention", "full_attention", "linear_attention"]
    write_tiny_model(tmp_path, "olmo_hybrid", layer_types=types)
    with pytest.raises(ValueError, match="supports layer_types"):
        LLM(model=str(tmp_path), dtype="float32", max_model_len=128)
