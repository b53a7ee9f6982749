"""Headless `<Stem>Model` checkpoints served as embedding models (models/base_model.py) and the
Qwen2 reward models (models/reward_model.py).

References: transformers' own base model (`LlamaModel`, `Qwen2Model`, ...) on the same weights,
its `last_hidden_state` pooled as vLLM pools such decoders (last token, L2-normalized; the mean
when sentence-transformers' Pooling config says so); for the reward models, HF's `Qwen2Model`
with the reward head applied in torch to every token.
"""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from hf_parity import write_hf_checkpoint
from safetensors.torch import load_file, save_file

from paged_engine import LLM, PoolingParams, SamplingParams
from paged_engine.models import get_model_class
from paged_engine.testing import tiny_config

PROMPTS = [list(range(3, 40)), [5, 6, 7], list(range(50, 71))]
KW = {
    "device": "cpu",
    "dtype": "float32",
    "num_gpu_blocks_override": 64,
    "max_model_len": 128,
    "max_num_batched_tokens": 16,  # the 37-token prompt runs in 3 chunks
}


def write_base_model(path, arch: str, **overrides):
    """transformers' `<Stem>Model` (AutoModel) of the tiny `arch` config, saved headless."""
    config = tiny_config(arch, **overrides)
    cls = getattr(transformers, type(config).__name__.removesuffix("Config") + "Model")
    return write_hf_checkpoint(path, cls, config)


@torch.no_grad()
def hf_hidden(path, prompts: list[list[int]]) -> list[torch.Tensor]:
    model = transformers.AutoModel.from_pretrained(path, dtype=torch.float32).eval()
    return [model(torch.tensor([p])).last_hidden_state[0] for p in prompts]


# gemma3: Gemma3TextModel (its text-only causal class); gpt2: GPT2Model under `transformer.`
@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma2", "qwen3", "gemma3", "gpt2"])
def test_base_model_embeddings_match_hf_last_token(tmp_path, arch) -> None:
    path = write_base_model(tmp_path / arch, arch)
    names = load_file(path / "model.safetensors")
    assert not any(n.startswith(("model.", "lm_head.")) for n in names)  # headless, unprefixed
    llm = LLM(str(path), **KW)
    outs = llm.embed([{"prompt_token_ids": p} for p in PROMPTS], use_tqdm=False)
    for out, h in zip(outs, hf_hidden(path, PROMPTS)):
        want = torch.nn.functional.normalize(h[-1], dim=-1)
        assert out.outputs.embedding == pytest.approx(want.tolist(), abs=1e-4)
    if arch != "llama":
        return
    # it only pools: a generation request, or an engine started to generate, is refused by name
    with pytest.raises(ValueError, match=r"LlamaModel.*does not generate"):
        llm.generate([{"prompt_token_ids": [5, 6]}], SamplingParams(max_tokens=2), use_tqdm=False)
    with pytest.raises(ValueError, match=r"runner='generate'.*LlamaModel"):
        LLM(str(path), runner="generate", **KW)


def test_a_causal_checkpoint_named_as_its_base_model_skips_its_head(tmp_path) -> None:
    """`<Stem>Model` in config.json over a causal LM's tensors (`model.` prefix and `lm_head`,
    as a fine-tune relabelled for embeddings ships): served headless, the head's tensor unread,
    on the native class and through the Transformers backend alike."""
    path = write_base_model(tmp_path / "base", "llama")
    tensors = {f"model.{n}": w for n, w in load_file(path / "model.safetensors").items()}
    width, vocab = tiny_config("llama").hidden_size, tiny_config("llama").vocab_size
    tensors["lm_head.weight"] = torch.randn(vocab, width)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    want = [torch.nn.functional.normalize(h[-1], dim=-1) for h in hf_hidden(path, PROMPTS)]
    for impl in ("vllm", "transformers"):
        llm = LLM(str(path), model_impl=impl, **KW)
        outs = llm.embed([{"prompt_token_ids": p} for p in PROMPTS], use_tqdm=False)
        for out, w in zip(outs, want):
            assert out.outputs.embedding == pytest.approx(w.tolist(), abs=1e-4), impl


def _sentence_transformers(path, *modules: tuple[str, str], **pooling: bool) -> None:
    entries = [{"idx": i, "name": str(i), "path": p, "type": t} for i, (t, p) in enumerate(modules)]
    (path / "modules.json").write_text(json.dumps(entries))
    (path / "1_Pooling").mkdir(exist_ok=True)
    (path / "1_Pooling" / "config.json").write_text(json.dumps(pooling))


ST = "sentence_transformers.models."


def test_sentence_transformers_mean_pooling_and_refusals(tmp_path) -> None:
    path = write_base_model(tmp_path / "m", "mistral")
    mods = ((ST + "Transformer", ""), (ST + "Pooling", "1_Pooling"))
    _sentence_transformers(path, *mods, pooling_mode_mean_tokens=True)  # no Normalize module
    outs = LLM(str(path), **KW).embed([{"prompt_token_ids": p} for p in PROMPTS], use_tqdm=False)
    for out, h in zip(outs, hf_hidden(path, PROMPTS)):
        assert out.outputs.embedding == pytest.approx(h.mean(0).tolist(), abs=1e-4)
    # a module paged does not run would change the vector: refused (Dense modules run:
    # test_embedding_gemma.py)
    norm = (ST + "LayerNorm", "2_LayerNorm")
    _sentence_transformers(path, *mods, norm, pooling_mode_lasttoken=True)
    with pytest.raises(ValueError, match=r"MistralModel.*LayerNorm.*2_LayerNorm"):
        LLM(str(path), **KW)
    # bidirectional attention on a base model other than Gemma 3's: refused by its config field
    bidi = tiny_config("qwen2", use_bidirectional_attention=True)
    bidi.architectures = ["Qwen2Model"]
    with pytest.raises(ValueError, match="use_bidirectional_attention"):
        get_model_class(bidi)


def write_reward_model(path, num_labels: int, arch: str, **config_fields) -> torch.nn.Sequential:
    """A tiny Qwen2.5-Math-RM / PRM checkpoint: HF's Qwen2Model under `model.` plus the reward
    head `score.0` Linear(D, D) -> ReLU -> `score.2` Linear(D, num_labels); returns the head."""
    write_base_model(path, "qwen2")
    torch.manual_seed(3)
    width = tiny_config("qwen2").hidden_size
    head = torch.nn.Sequential(
        torch.nn.Linear(width, width), torch.nn.ReLU(), torch.nn.Linear(width, num_labels)
    )
    tensors = {f"model.{n}": w for n, w in load_file(path / "model.safetensors").items()}
    tensors |= {f"score.{n}": w.detach().clone() for n, w in head.state_dict().items()}
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    config.update(architectures=[arch], **config_fields)
    (path / "config.json").write_text(json.dumps(config))
    return head


@torch.no_grad()
def test_qwen2_reward_model_rewards_every_token(tmp_path) -> None:
    path = tmp_path / "rm"
    head = write_reward_model(path, 1, "Qwen2ForRewardModel")
    want = [head(h) for h in hf_hidden(path, PROMPTS)]  # [n, 1] raw, as vLLM returns them
    llm = LLM(str(path), **KW)
    outs = llm.reward([{"prompt_token_ids": p} for p in PROMPTS], use_tqdm=False)
    for out, w in zip(outs, want):
        assert out.outputs.data.shape == w.shape
        torch.testing.assert_close(out.outputs.data, w, atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="does not generate"):
        llm.generate([{"prompt_token_ids": [5, 6]}], SamplingParams(max_tokens=2), use_tqdm=False)
    with pytest.raises(ValueError, match="classifier"):
        llm.embed([{"prompt_token_ids": [5, 6]}], use_tqdm=False)


@torch.no_grad()
def test_qwen2_process_reward_model_scores_its_step_tags(tmp_path) -> None:
    path = tmp_path / "prm"
    tag = 7  # the config's step_tag_id (the real PRM's default: 151651, `<extra_0>`)
    head = write_reward_model(path, 2, "Qwen2ForProcessRewardModel", step_tag_id=tag)
    prompts = [[5, 9, 11, tag, 40, 41, tag] + list(range(60, 80)) + [tag], [5, 6, tag]]
    llm = LLM(str(path), **KW)
    probs = llm.encode([{"prompt_token_ids": p} for p in prompts], use_tqdm=False)
    raw = llm.reward(
        [{"prompt_token_ids": p} for p in prompts],
        use_tqdm=False,
        pooling_params=PoolingParams(use_activation=False),
    )
    for p, h, out, logits in zip(prompts, hf_hidden(path, prompts), probs, raw):
        steps = head(h)[torch.tensor(p) == tag]  # [num_steps, 2]
        assert out.outputs.data.shape == (p.count(tag), 2)
        torch.testing.assert_close(out.outputs.data, steps.softmax(-1), atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(logits.outputs.data, steps, atol=1e-4, rtol=1e-4)
