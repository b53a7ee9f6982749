"""vLLM's token tasks (pooling.py, worker/pooler.py): `LLM.encode(pooling_task="token_embed")`
gives one embedding row per prompt token, `"token_classify"` one row of label probabilities per
token of a sequence classifier, and what a `*ForTokenClassification` checkpoint gives by
default. References: HF transformers' `last_hidden_state` on the same weights (normalized per
token), its classifier's `score` head applied to every position (softmax per token), and its
token classifier's logits; over chunked prefills, and again with the rows cached nowhere."""

from __future__ import annotations

import pytest
import torch

from paged_engine import LLM, PoolingParams
from paged_engine.testing import write_tiny_classifier, write_tiny_model

PROMPTS = [list(range(3, 40)), [5, 6, 7], [9]]
KW = dict(
    dtype="float32", max_model_len=128, num_gpu_blocks_override=64, max_num_batched_tokens=16
)  # the 37-token prompt runs in 3 chunks


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_token_embed_matches_hf_per_token(tmp_path, arch):
    from transformers import AutoModelForCausalLM

    path = write_tiny_model(tmp_path / arch, arch)
    llm = LLM(str(path), runner="pooling", **KW)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    for _ in range(2):  # the second time its prompts are not served from a cache
        outs = llm.encode(PROMPTS, pooling_task="token_embed", use_tqdm=False)
        for out, p in zip(outs, PROMPTS):
            with torch.no_grad():
                ref = hf.base_model(torch.tensor([p])).last_hidden_state[0]
            got = out.outputs.data
            assert got.shape == (len(p), ref.shape[1])
            torch.testing.assert_close(got, torch.nn.functional.normalize(ref, dim=-1))
    raw = llm.encode(PROMPTS[1], PoolingParams(task="token_embed", normalize=False))[0]
    with torch.no_grad():
        ref = hf.base_model(torch.tensor([PROMPTS[1]])).last_hidden_state[0]
    torch.testing.assert_close(raw.outputs.data, ref)


def test_token_classify_matches_the_head_on_every_token(tmp_path):
    from transformers import AutoModelForSequenceClassification

    path = write_tiny_classifier(tmp_path / "cls", "qwen3", num_labels=3)
    llm = LLM(str(path), **KW)
    hf = AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32).eval()
    outs = llm.encode(PROMPTS, pooling_task="token_classify", use_tqdm=False)
    for out, p in zip(outs, PROMPTS):
        with torch.no_grad():
            logits = hf.score(hf.model(torch.tensor([p])).last_hidden_state[0])  # [T, 3]
        torch.testing.assert_close(out.outputs.data, logits.softmax(-1))
    # the last token's row is what LLM.classify pools
    probs = llm.classify(PROMPTS[:1], use_tqdm=False)[0].outputs.probs
    torch.testing.assert_close(outs[0].outputs.data[-1], torch.tensor(probs))


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_token_classification_checkpoints_label_every_token(tmp_path, arch):
    from transformers import AutoModelForTokenClassification

    path = write_tiny_classifier(tmp_path / arch, arch, num_labels=4, kind="Token")
    llm = LLM(str(path), **KW)
    hf = AutoModelForTokenClassification.from_pretrained(path, dtype=torch.float32).eval()
    outs = llm.encode(PROMPTS, use_tqdm=False)  # its own task: token_classify
    for out, p in zip(outs, PROMPTS):
        with torch.no_grad():
            ref = hf(torch.tensor([p])).logits[0].softmax(-1)  # [T, 4]
        torch.testing.assert_close(out.outputs.data, ref)
    raw = llm.encode(PROMPTS[1], PoolingParams(use_activation=False), use_tqdm=False)[0]
    with torch.no_grad():
        torch.testing.assert_close(raw.outputs.data, hf(torch.tensor([PROMPTS[1]])).logits[0])
    with pytest.raises(ValueError, match="labels each token"):
        llm.classify(PROMPTS)
    with pytest.raises(ValueError, match="labels each token"):
        llm.score("a", "b")
    with pytest.raises(ValueError, match="token classifier"):
        llm.generate(PROMPTS)


def test_token_tasks_name_the_model_they_need(tmp_path):
    lm = LLM(str(write_tiny_model(tmp_path / "lm", "llama")), runner="pooling", **KW)
    with pytest.raises(ValueError, match="token_classify"):
        lm.encode(PROMPTS, pooling_task="token_classify")
    cls = LLM(str(write_tiny_classifier(tmp_path / "cls", "llama", num_labels=2)), **KW)
    with pytest.raises(ValueError, match="token_embed"):
        cls.encode(PROMPTS, pooling_task="token_embed")
    with pytest.raises(ValueError, match="task"):
        PoolingParams(task="tokens")
