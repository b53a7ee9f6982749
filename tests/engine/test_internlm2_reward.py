"""InternLM2ForRewardModel (models/reward_model.py) and the process reward model's empty STEP
pooling.

Reference for InternLM2's reward model: HF's Llama on a tiny random checkpoint, its tensors
converted into InternLM2's packed-wqkv layout (test_models_llama_variants' converter) with a
`v_head` Linear(D, 1) beside them; the reward is that Linear, in torch, on HF's final hidden
states of every prompt token, through vLLM's default activation (a sigmoid: one column), or raw
with `use_activation=False`.
"""

from __future__ import annotations

import json

import pytest
import torch
from hf_reference import load_hf_model
from safetensors.torch import load_file, save_file
from test_base_model_embeddings import KW, PROMPTS, write_reward_model
from test_models_llama_variants import internlm2_tensors

from paged_engine import LLM, PoolingParams, SamplingParams
from paged_engine.testing import write_tiny_model

REWARD_TOKEN = 9  # the config's reward_token_id (the releases name a special token)


def write_internlm2_reward(path) -> tuple[torch.nn.Module, torch.nn.Linear]:
    """A tiny internlm2-*-reward checkpoint: InternLM2's decoder tensors (no `output` head, as
    the releases) and `v_head.weight`; returns HF's Llama it came from and the head."""
    write_tiny_model(path, "llama", seed=6)
    hf = load_hf_model(path)
    cfg = hf.config
    state = internlm2_tensors(
        load_file(str(path / "model.safetensors")),
        cfg.hidden_size // cfg.num_attention_heads,
        cfg.num_attention_heads,
        cfg.num_key_value_heads,
    )
    del state["output.weight"]
    torch.manual_seed(7)
    head = torch.nn.Linear(cfg.hidden_size, 1, bias=False)
    state["v_head.weight"] = head.weight.detach().clone()
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    config.update(
        architectures=["InternLM2ForRewardModel"], bias=False, reward_token_id=REWARD_TOKEN
    )
    (path / "config.json").write_text(json.dumps(config))
    return hf, head


@torch.no_grad()
def test_internlm2_reward_model_matches_hf(tmp_path) -> None:
    hf, head = write_internlm2_reward(tmp_path / "rm")
    prompts = [p + [REWARD_TOKEN] for p in PROMPTS]  # as the remote code's get_score ends them
    llm = LLM(str(tmp_path / "rm"), **KW)
    assert type(llm.llm_engine.model_runner.model).__name__ == "InternLM2ForRewardModel"
    raw = [head(hf.model(torch.tensor([p])).last_hidden_state[0]) for p in prompts]  # [n, 1]
    inputs = [{"prompt_token_ids": p} for p in prompts]
    probs = llm.reward(inputs, use_tqdm=False)
    logits = llm.reward(inputs, use_tqdm=False, pooling_params=PoolingParams(use_activation=False))
    for want, out, out_raw in zip(raw, probs, logits, strict=True):
        assert out.outputs.data.shape == want.shape
        torch.testing.assert_close(out.outputs.data, want.sigmoid(), atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(out_raw.outputs.data, want, atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="does not generate"):
        llm.generate([{"prompt_token_ids": [5, 6]}], SamplingParams(max_tokens=2), use_tqdm=False)
    with pytest.raises(ValueError, match=r"runner='generate'.*InternLM2ForRewardModel"):
        LLM(str(tmp_path / "rm"), runner="generate", **KW)


@torch.no_grad()
def test_process_reward_model_without_step_tags_gives_zero_rows(tmp_path) -> None:
    """No step tag in the prompt: [0, 2] float32, as vLLM's STEP pooling's boolean row mask
    gives, beside a prompt with tags in the same batch."""
    tag = 7
    write_reward_model(tmp_path / "prm", 2, "Qwen2ForProcessRewardModel", step_tag_id=tag)
    llm = LLM(str(tmp_path / "prm"), **KW)
    prompts = [list(range(20, 41)), [5, tag, 6, tag], [5, 6]]
    outs = llm.reward([{"prompt_token_ids": p} for p in prompts], use_tqdm=False)
    shapes = [tuple(o.outputs.data.shape) for o in outs]
    assert shapes == [(0, 2), (2, 2), (0, 2)]
    assert all(o.outputs.data.dtype == torch.float32 for o in outs)
