"""Models under vLLM's names that reach paged's families through a translation:
`LlamaBidirectionalForSequenceClassification` (llama-nemotron-rerank: models/llama_bidirectional.py)
`Tarsier2ForConditionalGeneration` (Tarsier2-Recap-7b: models/tarsier2_config.py) and
`MantisForConditionalGeneration` (Mantis-8B: multimodal/mantis.py).

References, on the same tiny random weights in float32: transformers'
`LlamaForSequenceClassification`, its `model` run with a full 4-D mask (non-causal, as the remote
code runs it), the final hidden state pooled as config.json's `pooling` says and passed through
its `score` head here in torch (1e-4); transformers' `Qwen2VLForConditionalGeneration` for
Tarsier2, whose checkpoint the test converts into the release's LLaVA layout (config.json
`model_type="llava"` around a flat 4.4x-style Qwen2-VL text_config, the tower under
`vision_tower.`, the decoder under `language_model.`, the preprocessor's size as min / max
pixels): greedy tokens identical, top-5 logprobs within 1e-3; transformers'
`LlavaForConditionalGeneration` for Mantis, on the prompt vLLM's Mantis processor builds (each
image token replaced by "(image i: <Image>" + its run + "</Image>)", tokenized on its own),
with the same tolerances.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import transformers
from hf_parity import write_hf_checkpoint
from hf_reference import assert_matches, hf_greedy
from image_checks import greedy, noise_image
from safetensors.torch import load_file, save_file

from paged_engine import LLM, PoolingParams, SamplingParams
from paged_engine.multimodal.mantis import as_mantis
from paged_engine.testing import BOS_ID, tiny_config, write_tiny_llava, write_tiny_qwen2_vl

KW = {"device": "cpu", "dtype": "float32", "num_gpu_blocks_override": 64, "max_model_len": 64}
PROMPTS = [[BOS_ID, *range(5, 30)], [BOS_ID, 5, 6, 7], list(range(50, 63))]
RERANK = "LlamaBidirectionalForSequenceClassification"


def write_nemotron_rerank(path, num_labels: int, pooling: str, **extra) -> tuple:
    """HF's tiny LlamaForSequenceClassification (`model.*`, `score.weight`), its config.json
    rewritten as the rerank releases have it; returns the path and the HF model."""
    config = tiny_config("llama", tie_word_embeddings=False, num_labels=num_labels)
    path = write_hf_checkpoint(path, transformers.LlamaForSequenceClassification, config)
    model = transformers.LlamaForSequenceClassification.from_pretrained(path, dtype=torch.float32)
    raw = json.loads((path / "config.json").read_text())
    raw |= {
        "architectures": [RERANK],
        "model_type": "llama_bidirec",
        "auto_map": {
            "AutoConfig": "llama_bidirectional_model.LlamaBidirectionalConfig",
            "AutoModelForSequenceClassification": (
                "llama_bidirectional_model.LlamaBidirectionalForSequenceClassification"
            ),
        },
        "pooling": pooling,
        "temperature": 1.0,
        **extra,
    }
    (path / "config.json").write_text(json.dumps(raw))
    return path, model.eval()


@torch.no_grad()
def rerank_logits(model, prompt: list[int], pooling: str) -> torch.Tensor:
    """The remote class's logits: score(pool(h)) with every key visible."""
    n = len(prompt)
    h = model.model(torch.tensor([prompt]), attention_mask=torch.zeros(1, 1, n, n))
    h = h.last_hidden_state[0]
    pooled = {"avg": h.mean(0), "cls": h[0], "last": h[-1]}[pooling]
    return model.score(pooled)


@pytest.mark.parametrize(("num_labels", "pooling"), [(1, "avg"), (3, "last"), (1, "cls")])
def test_nemotron_rerank_matches_hf_bidirectional(tmp_path, num_labels, pooling) -> None:
    path, model = write_nemotron_rerank(tmp_path / "r", num_labels, pooling)
    llm = LLM(model=str(path), max_num_batched_tokens=64, **KW)
    reads = {"avg": "MEAN", "cls": "CLS", "last": "LAST"}[pooling]
    assert llm.llm_engine.config.pooler_config["pooling_type"] == reads
    off = PoolingParams(use_activation=False)
    outs = llm.classify(
        [{"prompt_token_ids": p} for p in PROMPTS], pooling_params=off, use_tqdm=False
    )
    for out, p in zip(outs, PROMPTS, strict=True):
        want = rerank_logits(model, p, pooling)
        assert out.outputs.probs == pytest.approx(want.tolist(), abs=1e-4)
    if num_labels == 1:  # a reranker: LLM.score is the sigmoid of its logit (vLLM's default)
        first, second = [BOS_ID, 10, 11, 12], [13, 14, 15]
        got = llm.score([first], [second], use_tqdm=False)[0]
        want = rerank_logits(model, got.prompt_token_ids, pooling).sigmoid()
        assert got.prompt_token_ids[:4] == first
        assert got.outputs.score == pytest.approx(want.item(), abs=1e-4)
    else:  # several labels: softmax over them
        got = llm.classify([PROMPTS[0]], use_tqdm=False)[0].outputs.probs
        want = rerank_logits(model, PROMPTS[0], pooling).softmax(-1)
        assert got == pytest.approx(want.tolist(), abs=1e-4)
    if pooling == "avg":  # the causal model's pooled logits differ: the test tells them apart
        with torch.no_grad():
            causal = model.model(torch.tensor([PROMPTS[0]])).last_hidden_state[0].mean(0)
        assert not torch.allclose(model.score(causal), rerank_logits(model, PROMPTS[0], "avg"))
        with pytest.raises(ValueError, match="does not generate"):
            llm.generate([[5, 6]], SamplingParams(max_tokens=2), use_tqdm=False)


def test_nemotron_rerank_refuses_what_it_cannot_serve(tmp_path) -> None:
    path, _ = write_nemotron_rerank(tmp_path / "t", 1, "avg", temperature=2.0)
    with pytest.raises(ValueError, match=r"field 'temperature'=2\.0"):
        LLM(model=str(path), **KW)
    raw = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(raw | {"temperature": 1.0}))
    with pytest.raises(ValueError, match="pooling_type 'CLS' is not supported"):
        LLM(model=str(path), pooler_config={"pooling_type": "CLS"}, **KW)
    llm = LLM(model=str(path), **KW)
    with pytest.raises(ValueError, match="task='embed' is not supported"):
        llm.embed([PROMPTS[1]], use_tqdm=False)


TARSIER2 = {"architectures": ["Tarsier2ForConditionalGeneration"]}  # vLLM's spelling
VISION = "<|vision_start|><|image_pad|><|vision_end|>"


def tarsier2_layout(src, dst) -> None:
    """`src` (transformers' tiny Qwen2-VL, tied head) rewritten as the Tarsier2 release lays it
    out, its head saved untied (a copy of the embedding: the same model)."""
    dst.mkdir()
    for f in src.iterdir():
        if f.name not in ("config.json", "model.safetensors", "video_preprocessor_config.json"):
            shutil.copy(f, dst / f.name)
    cfg = json.loads((src / "config.json").read_text())
    text, vision = cfg.pop("text_config"), cfg.pop("vision_config")
    rope = text.pop("rope_parameters")
    for key in ("layer_types", "dtype", "architectures", "model_type"):
        text.pop(key, None)
    ids = {k: cfg[k] for k in cfg if k.endswith("_token_id")}
    text |= ids | {"model_type": "qwen2_vl", "architectures": ["Qwen2VLForConditionalGeneration"]}
    text |= {"rope_theta": rope["rope_theta"], "tie_word_embeddings": False}
    text["rope_scaling"] = {"type": "mrope", "mrope_section": rope["mrope_section"]}
    llava = {
        "architectures": ["TarsierForConditionalGeneration"],
        "model_type": "llava",
        "text_config": text,
        "vision_config": vision | {"model_type": "qwen2_vl"},
        "image_token_index": ids["image_token_id"],
        "projector_hidden_act": "gelu",
        "vision_feature_layer": -2,
        "vision_feature_select_strategy": "default",
        "torch_dtype": "float32",
    }
    (dst / "config.json").write_text(json.dumps(llava))
    # transformers 5 saves Qwen2-VL as `visual.*` and `model.*`
    renames = (("visual.", "vision_tower."), ("model.", "language_model.model."))
    out = {}
    for name, w in load_file(str(src / "model.safetensors")).items():
        old, new = next(((o, n) for o, n in renames if name.startswith(o)), (None, None))
        assert old is not None, name
        out[new + name.removeprefix(old)] = w
    out["language_model.lm_head.weight"] = out["language_model.model.embed_tokens.weight"].clone()
    save_file(out, str(dst / "model.safetensors"))
    pre = json.loads((dst / "preprocessor_config.json").read_text())
    size = pre["size"]
    pre["size"] = {"min_pixels": size["shortest_edge"], "max_pixels": size["longest_edge"]}
    (dst / "preprocessor_config.json").write_text(json.dumps(pre))


@pytest.fixture(scope="module")
def tarsier2(tmp_path_factory):
    root = tmp_path_factory.mktemp("tarsier2")
    src = write_tiny_qwen2_vl(root / "qwen2-vl", version="2", seed=4)
    tarsier2_layout(src, root / "tarsier2")
    return src, root / "tarsier2"


def qwen2_vl_inputs(src, model, text: str, images: list) -> tuple[list[int], dict]:
    """HF's ids (<|image_pad|> once per merged patch) and the model's image inputs."""
    tok = transformers.AutoTokenizer.from_pretrained(src)
    ids = tok.encode(text, add_special_tokens=False)
    if not images:
        return ids, {}
    out = transformers.AutoImageProcessor.from_pretrained(src)(images=images, return_tensors="pt")
    runs = iter(int(g.prod()) // 4 for g in out["image_grid_thw"])
    pad = model.config.image_token_id
    expanded: list[int] = []
    for t in ids:
        expanded += [t] * next(runs) if t == pad else [t]
    kinds = torch.tensor([[int(t == pad) for t in expanded]])
    extra = {k: out[k] for k in ("pixel_values", "image_grid_thw")}
    return expanded, extra | {"mm_token_type_ids": kinds}


def test_tarsier2_matches_hf_qwen2_vl(tarsier2) -> None:
    src, path = tarsier2
    model = transformers.Qwen2VLForConditionalGeneration.from_pretrained(src, dtype=torch.float32)
    model.eval().generation_config.eos_token_id = None
    one = f"<|im_start|>user\n{VISION}What is in it?<|im_end|>\n<|im_start|>assistant\n"
    two = f"<|im_start|>user\n{VISION} and {VISION}Which?<|im_end|>\n<|im_start|>assistant\n"
    cases = [
        (one, [noise_image(1, (40, 56))]),
        (two, [noise_image(2, (72, 24)), noise_image(3, (33, 47))]),
        ("<|im_start|>user\nThe sea.<|im_end|>\n", []),
    ]
    llm = LLM(model=str(path), hf_overrides=TARSIER2, dtype="float32", max_model_len=512)
    assert llm.llm_engine.hf_config.architectures == ["Qwen2ForCausalLM"]
    prompts = [
        {"prompt": text, "multi_modal_data": {"image": imgs}} if imgs else text
        for text, imgs in cases
    ]
    for (text, imgs), out in zip(cases, llm.generate(prompts, greedy(), use_tqdm=False)):
        ids, extra = qwen2_vl_inputs(src, model, text, imgs)
        assert out.prompt_token_ids == ids
        assert_matches("tarsier2", out, hf_greedy(model, ids, 8, 5, **extra))


def test_tarsier2_loads_without_the_override_and_refuses_no_tower(tarsier2, tmp_path) -> None:
    _, path = tarsier2
    llm = LLM(model=str(path), dtype="float32", max_model_len=512)
    out = llm.generate(
        {"prompt": VISION + "Hi", "multi_modal_data": {"image": [noise_image(5, (32, 32))]}},
        greedy(n=2),
        use_tqdm=False,
    )
    assert len(out[0].outputs[0].token_ids) == 2
    bare = tmp_path / "bare"
    shutil.copytree(path, bare)
    raw = json.loads((bare / "config.json").read_text())
    del raw["vision_config"]
    (bare / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ValueError, match="no 'vision_config'"):
        LLM(model=str(bare), hf_overrides=TARSIER2, dtype="float32", max_model_len=512)


MANTIS = {"architectures": ["MantisForConditionalGeneration"]}


@pytest.fixture(scope="module")
def mantis(tmp_path_factory):
    """A tiny LLaVA (SigLIP tower: Mantis-8B-siglip-llama3's kind) and HF's model of it."""
    path = write_tiny_llava(tmp_path_factory.mktemp("mantis"), vision="siglip", seed=5)
    model = transformers.LlavaForConditionalGeneration.from_pretrained(path, dtype=torch.float32)
    model.eval().generation_config.eos_token_id = None
    return path, model


def mantis_ids(path, text: str, run: int) -> list[int]:
    """vLLM's Mantis prompt: each <image> token -> its numbered text around a run of `run`."""
    tok = transformers.AutoTokenizer.from_pretrained(path)
    image = tok.convert_tokens_to_ids("<image>")
    out: list[int] = []
    for t in tok(text)["input_ids"]:
        i = sum(1 for x in out if x == image) // run
        wrap = f"(image {i + 1}: <Image>" + "<image>" * run + "</Image>)"
        out += tok.encode(wrap, add_special_tokens=False) if t == image else [t]
    return out


def test_mantis_is_llava_with_numbered_image_text(mantis) -> None:
    path, model = mantis
    processor = transformers.AutoProcessor.from_pretrained(path)
    one = "USER: <image>\nWhat is in it?\nASSISTANT:"
    two = "USER: <image>\nand <image>\nWhich one?\nASSISTANT:"
    cases = [
        (one, [noise_image(1, (40, 52))]),
        (two, [noise_image(2, (64, 30)), noise_image(3, (40, 52))]),
    ]
    llm = LLM(model=str(path), hf_overrides=MANTIS, dtype="float32", max_model_len=256)
    assert llm.llm_engine.hf_config.architectures == ["LlamaForCausalLM"]
    prompts = [{"prompt": t, "multi_modal_data": {"image": imgs}} for t, imgs in cases]
    llava = list(processor(text=one, images=cases[0][1])["input_ids"][0])  # LLaVA's prompt
    run = llava.count(model.config.image_token_id)  # LLaVA's run, as HF's processor makes it
    for (text, imgs), out in zip(cases, llm.generate(prompts, greedy(), use_tqdm=False)):
        pixels = processor.image_processor(imgs, return_tensors="pt")["pixel_values"]
        ids = mantis_ids(path, text, run)
        assert out.prompt_token_ids == ids
        assert ids.count(model.config.image_token_id) == len(imgs) * run
        assert_matches("mantis", out, hf_greedy(model, ids, 8, 5, pixel_values=pixels))
    # without the override: LLaVA's own prompt, which the wrapper text changes
    plain = LLM(model=str(path), dtype="float32", max_model_len=256)
    assert plain.generate(prompts[:1], greedy(), use_tqdm=False)[0].prompt_token_ids == llava
    assert len(llava) < len(mantis_ids(path, one, run))
    with pytest.raises(ValueError, match="image embeddings are not supported"):
        llm.generate(
            {"prompt": one, "multi_modal_data": {"image": torch.zeros(1, 4, 64)}},
            greedy(),
            use_tqdm=False,
        )
    qwen = transformers.Qwen2VLConfig(architectures=["Qwen2VLForConditionalGeneration"])
    with pytest.raises(ValueError, match=r"hf_overrides architectures.*'qwen2_vl' path"):
        as_mantis(qwen)
