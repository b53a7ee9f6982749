"""LLM.classify and cross-encoder LLM.score on `*ForSequenceClassification` models
(classification.py, models/sequence_classifier.py).

Reference: HF transformers' own `*ForSequenceClassification` on the same weights (its logits at
the last token, then the activation vLLM picks for the config).
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from paged_engine import LLM, ClassificationRequestOutput, PoolingParams, SamplingParams
from paged_engine.classification import classifier_info
from paged_engine.testing import SUPPORTED_TINY_ARCHS, write_tiny_classifier

PROMPTS = [list(range(3, 40)), [5, 6, 7], list(range(50, 71)), [9]]
# Beyond the seven core tiny archs: checkpoints with other decoder prefixes and head layouts
# (Bloom / Falcon / GPT-J / StarCoder's transformer.*, Gemma 3's and Qwen 3.5's text-only
# classifiers, MoE and hybrid stacks).
MORE = ["gemma3", "qwen3_5", "bloom", "falcon", "gptj", "gpt_bigcode", "mixtral", "jamba"]


def make_llm(path, **kw) -> LLM:
    kw = {
        "device": "cpu",
        "dtype": "float32",
        "num_gpu_blocks_override": 64,
        "max_model_len": 128,
        "max_num_batched_tokens": 16,  # the 37-token prompt runs in 3 chunks
        **kw,
    }
    return LLM(model=str(path), **kw)


def hf_classifier(path):
    from transformers import AutoModelForSequenceClassification

    return AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32).eval()


@torch.no_grad()
def hf_logits(model, prompts: list[list[int]]) -> list[torch.Tensor]:
    return [model(torch.tensor([p])).logits[0] for p in prompts]


@pytest.mark.parametrize("arch", SUPPORTED_TINY_ARCHS + MORE)
def test_classify_matches_hf(tmp_path, arch) -> None:
    path = write_tiny_classifier(tmp_path / arch, arch, num_labels=3)
    llm = make_llm(path)
    outs = llm.classify([{"prompt_token_ids": p} for p in PROMPTS], use_tqdm=False)
    ref = hf_logits(hf_classifier(path), PROMPTS)
    for out, logits, prompt in zip(outs, ref, PROMPTS):
        assert isinstance(out, ClassificationRequestOutput) and out.finished
        assert out.prompt_token_ids == prompt
        assert out.outputs.num_classes == 3
        assert out.outputs.probs == pytest.approx(logits.softmax(-1).tolist(), abs=1e-5)
    # prefix-cached the second time (LAST pooling keeps the cache): the same answers
    again = llm.classify([{"prompt_token_ids": p} for p in PROMPTS], use_tqdm=False)
    for a, b in zip(again, outs):
        assert a.outputs.probs == pytest.approx(b.outputs.probs, abs=1e-6)


def test_raw_logits_mean_pooling_and_truncation(tmp_path) -> None:
    path = write_tiny_classifier(tmp_path / "m", "qwen3", num_labels=4)
    model = hf_classifier(path)
    llm = make_llm(path)
    raw = llm.classify(PROMPTS, use_tqdm=False, pooling_params=PoolingParams(use_activation=False))
    for out, logits in zip(raw, hf_logits(model, PROMPTS)):
        assert out.outputs.probs == pytest.approx(logits.tolist(), abs=1e-5)
    cut = llm.classify(PROMPTS[0], use_tqdm=False, truncate_prompt_tokens=10)[0]
    assert cut.prompt_token_ids == PROMPTS[0][:10]  # a pooling runner keeps the start (vLLM)
    want = hf_logits(model, [PROMPTS[0][:10]])[0].softmax(-1)
    assert cut.outputs.probs == pytest.approx(want.tolist(), abs=1e-5)

    mean = make_llm(path, pooler_config={"pooling_type": "MEAN"})
    with torch.no_grad():
        for out, p in zip(mean.classify(PROMPTS, use_tqdm=False), PROMPTS):
            h = model.model(torch.tensor([p])).last_hidden_state[0].mean(0)
            assert out.outputs.probs == pytest.approx(model.score(h).softmax(-1).tolist(), abs=1e-5)


@pytest.mark.parametrize(
    ("problem_type", "num_labels", "activation"),
    [
        (None, 3, torch.softmax),
        (None, 1, torch.sigmoid),
        ("single_label_classification", 2, torch.softmax),
        ("multi_label_classification", 3, torch.sigmoid),
        ("regression", 2, None),
    ],
)
def test_activation_follows_the_config(tmp_path, problem_type, num_labels, activation) -> None:
    path = write_tiny_classifier(
        tmp_path / "m", "llama", num_labels=num_labels, problem_type=problem_type
    )
    out = make_llm(path).classify(PROMPTS[1], use_tqdm=False)[0]
    logits = hf_logits(hf_classifier(path), PROMPTS[1:2])[0]
    if activation is torch.softmax:
        want = logits.softmax(-1)
    else:
        want = logits if activation is None else logits.sigmoid()
    assert out.outputs.probs == pytest.approx(want.tolist(), abs=1e-5)


def test_labels_and_activations_read_from_the_config(tmp_path) -> None:
    path = write_tiny_classifier(
        tmp_path / "m", "llama", num_labels=2, id2label={0: "negative", 1: "positive"}
    )
    from transformers import AutoConfig

    info = classifier_info(AutoConfig.from_pretrained(path))
    assert info is not None
    assert info.labels == ("negative", "positive") and info.num_labels == 2
    assert (info.activation, info.scores) == ("softmax", False)


def test_cross_encoder_score_matches_hf(tmp_path) -> None:
    path = write_tiny_classifier(tmp_path / "ce", "llama", num_labels=1)
    llm = make_llm(path)
    tok = llm.get_tokenizer()
    model = hf_classifier(path)
    query, docs = "the capital of France", ["Paris is a city", "one two three", "bananas"]
    outs = llm.score(query, docs, use_tqdm=False)
    for out, doc in zip(outs, docs):
        ids = tok(query, text_pair=doc)["input_ids"]
        assert out.prompt_token_ids == ids
        want = hf_logits(model, [ids])[0].sigmoid().item()
        assert out.outputs.score == pytest.approx(want, abs=1e-5)
    raw = llm.score(
        query, docs[0], use_tqdm=False, pooling_params=PoolingParams(use_activation=False)
    )
    ids = tok(query, text_pair=docs[0])["input_ids"]
    assert raw[0].outputs.score == pytest.approx(hf_logits(model, [ids])[0].item(), abs=1e-5)
    # token-id sides are joined; a pair given one of each is refused naming data_2
    joined = llm.score([[5, 6, 7]], [[8, 9]], use_tqdm=False)[0]
    assert joined.prompt_token_ids == [5, 6, 7, 8, 9]
    assert joined.outputs.score == pytest.approx(
        hf_logits(model, [[5, 6, 7, 8, 9]])[0].sigmoid().item(), abs=1e-5
    )
    with pytest.raises(ValueError, match="data_2"):
        llm.score("text", [[8, 9]], use_tqdm=False)
    # one pair, N:N
    nn_ = llm.score(["a b", "c d"], ["e f", "g h"], use_tqdm=False)
    assert [o.prompt_token_ids for o in nn_] == [
        tok("a b", text_pair="e f")["input_ids"],
        tok("c d", text_pair="g h")["input_ids"],
    ]


def test_sentence_transformers_identity_activation_scores_raw_logits(tmp_path) -> None:
    path = write_tiny_classifier(tmp_path / "ce", "qwen2", num_labels=1)
    cfg = json.loads((path / "config.json").read_text())
    cfg["sentence_transformers"] = {"activation_fn": "torch.nn.modules.linear.Identity"}
    (path / "config.json").write_text(json.dumps(cfg))
    llm = make_llm(path)
    out = llm.score([[5, 6, 7]], [[8, 9]], use_tqdm=False)[0]
    want = hf_logits(hf_classifier(path), [[5, 6, 7, 8, 9]])[0].item()
    assert out.outputs.score == pytest.approx(want, abs=1e-5)
    # classify keeps the config's classification activation (sigmoid for one label)
    probs = llm.classify([[5, 6, 7, 8, 9]], use_tqdm=False)[0].outputs.probs
    assert probs == pytest.approx([torch.tensor(want).sigmoid().item()], abs=1e-6)


def test_score_bias_from_the_checkpoint_is_loaded(tmp_path) -> None:
    path = write_tiny_classifier(tmp_path / "b", "llama", num_labels=3)
    weights = load_file(path / "model.safetensors")
    bias = torch.tensor([0.5, -1.0, 2.0])
    weights["score.bias"] = bias
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    out = make_llm(path).classify(PROMPTS[0], use_tqdm=False)[0]
    model = hf_classifier(path)  # HF's class has no bias: added by hand
    want = (hf_logits(model, PROMPTS[:1])[0] + bias).softmax(-1)
    assert out.outputs.probs == pytest.approx(want.tolist(), abs=1e-5)


def test_a_classifier_refuses_what_it_cannot_do(tmp_path) -> None:
    path = write_tiny_classifier(tmp_path / "c", "llama", num_labels=3)
    llm = make_llm(path)
    with pytest.raises(ValueError, match=r"params: .*sequence classifier"):
        llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2), use_tqdm=False)
    with pytest.raises(ValueError, match="task='embed'"):
        llm.embed([[5, 6, 7]], use_tqdm=False)
    with pytest.raises(ValueError, match="single-label"):
        llm.score("a", "b", use_tqdm=False)
    with pytest.raises(ValueError, match="normalize"):
        llm.classify("a", use_tqdm=False, pooling_params=PoolingParams(normalize=True))
    with pytest.raises(ValueError, match="pooling_params"):
        llm.classify(["a"], use_tqdm=False, pooling_params=["not params"])
    # the engine goes on serving after each refusal
    assert len(llm.classify(["a", "b"], use_tqdm=False)) == 2
    with pytest.raises(ValueError, match="speculative_config"):
        make_llm(path, speculative_config={"method": "ngram", "num_speculative_tokens": 2})


def test_an_embedding_model_does_not_classify(tmp_path) -> None:
    from paged_engine.testing import write_tiny_model

    llm = make_llm(write_tiny_model(tmp_path / "e", "llama"))
    with pytest.raises(ValueError, match="ForSequenceClassification"):
        llm.classify("hello", use_tqdm=False)
    assert llm.llm_engine.classifier is None


def test_tensor_parallel_classify_matches_one_process(tmp_path) -> None:
    path = write_tiny_classifier(tmp_path / "tp", "qwen3", num_labels=3)
    kw = {"max_num_batched_tokens": 64}
    one = make_llm(path, **kw).classify(PROMPTS, use_tqdm=False)
    two_llm = make_llm(path, tensor_parallel_size=2, **kw)
    try:
        two = two_llm.classify(PROMPTS, use_tqdm=False)
    finally:
        two_llm.llm_engine.shutdown()
    for a, b in zip(one, two):
        assert b.outputs.probs == pytest.approx(a.outputs.probs, abs=1e-5)


@pytest.mark.parametrize(("arch", "tied"), [("qwen3", False), ("llama", True)])
def test_a_causal_lm_served_as_a_reranker_from_token_rows(tmp_path, arch, tied) -> None:
    """vLLM's hf_overrides for Qwen3-Reranker: the classifier built from the LM head's rows of
    the "no" / "yes" tokens scores sigmoid(l_yes - l_no), the probability of "yes" between the
    two in the causal model's next-token distribution."""
    from transformers import AutoModelForCausalLM

    from paged_engine.testing import write_tiny_model

    path = write_tiny_model(tmp_path / "lm", arch, tie_word_embeddings=tied)
    no_tok, yes_tok = 10, 11
    llm0 = make_llm(path)
    tokens = llm0.get_tokenizer().convert_ids_to_tokens([no_tok, yes_tok])
    del llm0
    stem = {"qwen3": "Qwen3", "llama": "Llama"}[arch]
    overrides = {
        "architectures": [f"{stem}ForSequenceClassification"],
        "classifier_from_token": tokens,
        "is_original_qwen3_reranker": True,
    }
    llm = make_llm(path, hf_overrides=overrides)
    assert llm.llm_engine.classifier.num_labels == 1
    lm = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    outs = llm.score([[5, 6, 7], [20, 21]], [[8, 9], [22, 23, 24]], use_tqdm=False)
    for out, ids in zip(outs, ([5, 6, 7, 8, 9], [20, 21, 22, 23, 24])):
        with torch.no_grad():
            logits = lm(torch.tensor([ids])).logits[0, -1]
        want = logits[[no_tok, yes_tok]].softmax(-1)[1].item()
        assert out.outputs.score == pytest.approx(want, abs=1e-5)

    # no_post_processing (bge-reranker-v2-gemma's): one label per token, the head's own logit
    one = make_llm(
        path,
        hf_overrides={
            "architectures": [f"{stem}ForSequenceClassification"],
            "classifier_from_token": tokens[1:],
            "method": "no_post_processing",
        },
    )
    got = one.classify(
        [[5, 6, 7]], use_tqdm=False, pooling_params=PoolingParams(use_activation=False)
    )
    with torch.no_grad():
        want = lm(torch.tensor([[5, 6, 7]])).logits[0, -1, yes_tok].item()
    assert got[0].outputs.probs == pytest.approx([want], abs=1e-5)


def test_from_token_overrides_are_checked(tmp_path) -> None:
    from paged_engine.testing import write_tiny_model

    path = write_tiny_model(tmp_path / "lm", "qwen3")
    arch = ["Qwen3ForSequenceClassification"]
    bad = [
        ({"architectures": arch, "classifier_from_token": ["a", "b"]}, "needs a method"),
        ({"architectures": arch, "method": "nope", "classifier_from_token": ["a"]}, "method="),
        (
            {"architectures": arch, "method": "from_2_way_softmax", "classifier_from_token": ["a"]},
            "false, true",
        ),
        (
            {
                "architectures": arch,
                "is_original_qwen3_reranker": True,
                "classifier_from_token": ["no-such-token", "x"],
            },
            "not a token",
        ),
    ]
    for overrides, message in bad:
        with pytest.raises(ValueError, match=message):
            make_llm(path, hf_overrides=overrides)
    with pytest.raises(ValueError, match="hf_overrides"):
        make_llm(path, hf_overrides=["architectures"])
