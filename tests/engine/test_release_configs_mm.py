"""Release configs of multimodal, pooling and encoder-decoder models: the config.json their
authors published (release_configs_mm.py: nested vision / text configs with every odd field:
image_token_index beside image_token_id, Qwen2-VL's text fields at the top with rope_scaling
`type: mrope`, sizes a nested text config leaves to its class's defaults, torch_dtype / dtype
at two levels, tie_word_embeddings at the top and in text_config, Mllama's image id past its
vocab, PaliGemma's stale top-level hidden_size, BART's generation settings in the model
config), with only sizes and token ids made tiny (`assert_only_sizes_changed` checks it), on
random weights, served by `LLM` (float32) and compared with transformers: VLMs' greedy tokens
and top-5 logprobs with one and two images (also from chunks and the prefix cache, and
re-saved by transformers 5); embedders' pooled vectors and cross-encoders' scores; Whisper's
and BART's decoder tokens.

Regression: dtype="auto" read only the root config's dtype, so Qwen3-VL's releases (theirs in
text_config alone) were served in float32 where vLLM serves bfloat16 (loader.resolve_dtype now
falls back to the text, vision, then encoder config's, as vLLM does).
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from config_variant_check import CHUNKED_PREFIX_CACHE
from hf_parity import save_hf_checkpoint
from hf_reference import assert_matches
from image_checks import engine, greedy, hf_refs, noise_image, qwen2_vl_hf_inputs
from release_configs import shrink
from release_configs_mm import (
    CAUSAL_POOLERS,
    ENC_DEC,
    POOLERS,
    VLMS,
    assert_only_sizes_changed,
    enc_dec_release,
    shrink_enc_dec,
    shrink_encoder,
    shrink_vlm,
    vlm_release,
)
from test_aya_vision_images import _prompt as aya_prompt
from test_aya_vision_images import write_tiny as write_tiny_aya
from test_config_variants_vlm import _pixtral_inputs
from test_mllama_images import write_tiny_mllama
from test_paligemma_images import write_tiny_paligemma
from vlm_checkpoints import load_hf_vlm, tiled_context_inputs

from paged_engine import LLM
from paged_engine.testing import (
    TINY_VOCAB_SIZE,
    _randomize,
    build_tiny_tokenizer,
    write_tiny_gemma3,
    write_tiny_idefics3,
    write_tiny_internvl,
    write_tiny_llava,
    write_tiny_mistral3,
    write_tiny_qwen2_vl,
)
from paged_engine.testing.models import _quiet_progress

transformers = pytest.importorskip("transformers")
pytest.importorskip("PIL.Image")

_CHATML = "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"
_V = "<|vision_start|><|image_pad|><|vision_end|>"
_GEMMA = "<|bos|><start_of_turn>user\n{}<end_of_turn>\n<start_of_turn>model\n"
_BOI = "<start_of_image>"
_IDEFICS = "<|im_start|>User:{}<end_of_utterance>\nAssistant:"
PROMPTS = {
    "llava": ("USER: <image>\nWhat is in it?\nASSISTANT:", "USER: <image>\nand <image>\nWhich?"),
    "qwen": (_CHATML.format(f"{_V}What is in it?"), _CHATML.format(f"{_V} and {_V}Which?")),
    "mistral": ("[INST][IMG]What is in it?[/INST]", "[INST][IMG] and [IMG]Which?[/INST]"),
    "internvl": (
        _CHATML.format("<IMG_CONTEXT>\nWhat is in it?"),
        _CHATML.format("<IMG_CONTEXT>\nand <IMG_CONTEXT>\nWhich?"),
    ),
    "aya": (aya_prompt("aya", "{img}What is in it?"), aya_prompt("aya", "{img} and {img}Which?")),
    "mllama": ("<|bos|>describe the <|image|>picture", "<|image|><|bos|>what is it?"),
    "paligemma": ("caption en", "<image><image>answer en which is brighter?\n"),
    "idefics": (
        _IDEFICS.format("<image>What is in it?"),
        _IDEFICS.format("<image>and<image>Which?"),
    ),
    "gemma3": (_GEMMA.format(f"{_BOI}What is in it?"), _GEMMA.format(f"{_BOI}and{_BOI}Which?")),
}
# name -> (family, tiny checkpoint writer: the tokenizer, processor and sizes)
TINY: dict[str, tuple[str, Callable[[Path], Path]]] = {
    "llava-1.5-7b-hf": ("llava", lambda p: write_tiny_llava(p, seed=3)),
    "qwen2-vl-2b-instruct": ("qwen", lambda p: write_tiny_qwen2_vl(p, version="2", seed=2)),
    "qwen2.5-vl-3b-instruct": ("qwen", lambda p: write_tiny_qwen2_vl(p, version="2.5", seed=2)),
    "qwen2.5-vl-7b-instruct": ("qwen", lambda p: write_tiny_qwen2_vl(p, version="2.5", seed=2)),
    "gemma-3-4b-it": ("gemma3", lambda p: write_tiny_gemma3(p, seed=3)),
    "llava-v1.6-mistral-7b-hf": (
        "llava",
        lambda p: write_tiny_llava(
            p,
            text="mistral",
            seed=3,
            grid_pinpoints=[[30, 60], [60, 30], [60, 60], [90, 30], [30, 90]],
        ),
    ),
    "mistral-small-3.1-24b-instruct-2503": ("mistral", lambda p: write_tiny_mistral3(p, seed=2)),
    "pixtral-12b": ("mistral", lambda p: write_tiny_mistral3(p, arch="llava", seed=2)),
    "qwen3-vl-4b-instruct": ("qwen", lambda p: write_tiny_qwen2_vl(p, version="3", seed=2)),
    "aya-vision-8b": ("aya", lambda p: write_tiny_aya(p, "aya", seed=3)),
    "internvl3-1b-hf": ("internvl", lambda p: write_tiny_internvl(p, seed=2)),
    "llama-3.2-11b-vision-instruct": ("mllama", lambda p: write_tiny_mllama(p, seed=3)),
    "paligemma2-3b-pt-224": ("paligemma", lambda p: write_tiny_paligemma(p, "gemma2", seed=5)),
    "smolvlm-256m-instruct": (
        "idefics",
        lambda p: write_tiny_idefics3(p, seed=3, scale_factor=4, image_size=64),
    ),
}

# releases served from chunks and the prefix cache: M-RoPE with window attention, Gemma 3's
# bidirectional image rows beside an 8-token window, Mllama's cross-attention, Mistral 3's merge,
# Aya Vision's tiles past Cohere 2's 8-token windows
# (not PaliGemma: its whole prompt attends both ways, refused past one step's tokens)
CHUNKED = [
    "qwen2.5-vl-7b-instruct",
    "qwen3-vl-4b-instruct",
    "gemma-3-4b-it",
    "llama-3.2-11b-vision-instruct",
    "mistral-small-3.1-24b-instruct-2503",
    "aya-vision-8b",
]
# re-saved by transformers 5: Qwen2-VL's flat layout nested, ropes renamed, dtype
RESAVED = ["qwen2-vl-2b-instruct", "qwen2.5-vl-3b-instruct", "gemma-3-4b-it",
           "llama-3.2-11b-vision-instruct", "llava-1.5-7b-hf", "paligemma2-3b-pt-224"]  # fmt: skip


def write_release_vlm(path: Path, name: str) -> Path:
    """The tiny checkpoint of `name`'s family at `path` with the shrunk release as its
    config.json verbatim, and transformers' model of that file with random weights."""
    TINY[name][1](path)
    tiny = json.loads((path / "config.json").read_text())
    config = shrink_vlm(vlm_release(name), tiny)
    assert_only_sizes_changed(VLMS[name], config)
    _save_release(path, config)
    return path


def _inputs(path: Path, family: str) -> Callable:
    if family == "mistral":  # PixtralProcessor's rule: a line of [IMG] a merged patch
        config = json.loads((path / "config.json").read_text())
        merge = config.get("spatial_merge_size", 1)
        return _pixtral_inputs(path, merge * config["vision_config"]["patch_size"])
    if family == "internvl":
        return lambda text, imgs: tiled_context_inputs(path, text, imgs)
    if family == "qwen":
        images = transformers.AutoImageProcessor.from_pretrained(path)
        tok = transformers.AutoTokenizer.from_pretrained(path)
        pad = json.loads((path / "config.json").read_text())["image_token_id"]
        return lambda text, imgs: qwen2_vl_hf_inputs(
            tok.encode(text, add_special_tokens=False), imgs, images, pad
        )
    processor = transformers.AutoProcessor.from_pretrained(path)
    tokens = {"add_special_tokens": False} if family == "aya" else {}

    def inputs(text: str, imgs: list) -> tuple[list[int], dict]:
        out = processor(text=[text], images=[imgs], return_tensors="pt", **tokens)
        extra = {k: out[k] for k in out if k not in ("input_ids", "attention_mask")}
        return out["input_ids"][0].tolist(), extra

    return inputs


@pytest.mark.parametrize("name", list(VLMS))
def test_vlm_release_config_serves_like_hf(name, tmp_path):
    check_vlm(name, write_release_vlm(tmp_path / name, name))


@pytest.mark.parametrize("name", CHUNKED)
def test_vlm_release_config_chunked_prefill_and_prefix_cache(name, tmp_path):
    """16-token chunks through the images, the prefix cache on, each prompt served twice (the
    second time from the cache)."""
    path = write_release_vlm(tmp_path / name, name)
    check_vlm(name, path, passes=2, **CHUNKED_PREFIX_CACHE)


@pytest.mark.parametrize("name", RESAVED)
def test_vlm_release_config_as_transformers5_saves_it(name, tmp_path):
    """The release re-saved by transformers 5 (a fine-tune's checkpoint): Qwen2-VL's top-level
    text fields moved into text_config, rope_scaling -> rope_parameters, dtype."""
    path = write_release_vlm(tmp_path / name, name)
    transformers.AutoConfig.from_pretrained(path).save_pretrained(path)
    check_vlm(name, path)


def check_vlm(name: str, path: Path, passes: int = 1, **engine_kwargs: Any) -> None:
    """One image and two (Mllama: one) through the engine (`passes` times) give HF's prompt
    ids, greedy tokens and top-5 logprobs."""
    family = TINY[name][0]
    one, two = PROMPTS[family]
    mllama = family == "mllama"  # one image a prompt (vLLM's default limit for it)
    cases = [
        (one, [noise_image(1, (40, 52))]),
        (two, [noise_image(2, (64, 30)), noise_image(3, (30, 30))][: 1 if mllama else 2]),
    ]
    hf = load_hf_vlm(getattr(transformers, VLMS[name]["architectures"][0]), path)
    refs = hf_refs(hf, cases, _inputs(path, family))
    prompts = [{"prompt": t, "multi_modal_data": {"image": imgs}} for t, imgs in cases]
    llm = engine(path, **engine_kwargs)
    try:
        for _ in range(passes):
            outs = llm.generate(prompts, greedy(), use_tqdm=False)
            for (ids, ref), out in zip(refs, outs, strict=True):
                assert out.prompt_token_ids == ids, name
                assert_matches(name, out, ref)
    finally:
        llm.llm_engine.shutdown()


def write_release_encoder(path: Path, name: str) -> Path:
    """`name`'s shrunk pooling release at `path` (config.json verbatim), transformers' model of
    it with random weights and the tiny tokenizer."""
    config = shrink_encoder(copy.deepcopy(POOLERS[name]))
    assert_only_sizes_changed(POOLERS[name], config)
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps(config))
    cls = getattr(transformers, config["architectures"][0])
    model = cls(transformers.AutoConfig.from_pretrained(path)).float()
    _randomize(model, seed=1)
    save_hf_checkpoint(model, path, seed=1)
    # a BERT tokenizer's [SEP] (the EOS id here): pairs' token types start after the first
    tokenizer = build_tiny_tokenizer(TINY_VOCAB_SIZE, 1)
    tokenizer.sep_token = tokenizer.convert_ids_to_tokens(config.get("eos_token_id", 1))
    tokenizer.save_pretrained(path)
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return path


@pytest.mark.parametrize("name", list(POOLERS))
def test_pooling_release_config_matches_hf(name, tmp_path):
    """Embedders: the [CLS] (ModernBERT: mean, as gte's sentence-transformers files say)
    hidden state normalized; cross-encoders: the pair's score, by the config's activation
    (sigmoid, or the sentence-transformers Identity: the raw logit)."""
    path = write_release_encoder(tmp_path / name, name)
    config = json.loads((path / "config.json").read_text())
    arch = config["architectures"][0]
    bos, eos = config.get("bos_token_id", 0), config.get("eos_token_id", 1)
    prompts = [[bos, *range(5, 40), eos], [bos, 5, 6, 7, eos], [bos, *range(50, 71), eos]]
    model = getattr(transformers, arch).from_pretrained(path, dtype=torch.float32).eval()
    pooler = {"pooler_config": {"pooling_type": "MEAN"}} if "Modern" in arch else {}
    llm = LLM(model=str(path), dtype="float32", max_model_len=128, **pooler)
    try:
        if not arch.endswith("SequenceClassification"):
            outs = llm.embed([{"prompt_token_ids": p} for p in prompts], use_tqdm=False)
            for out, p in zip(outs, prompts, strict=True):
                with torch.no_grad():
                    h = model(torch.tensor([p])).last_hidden_state[0]
                want = torch.nn.functional.normalize(h.mean(0) if pooler else h[0], dim=-1)
                assert out.outputs.embedding == pytest.approx(want.tolist(), abs=1e-5), name
            return
        first, second = [bos, 10, 11, eos], [12, 13, 14, eos]
        types = [0] * 4 + [1] * 4 if config["type_vocab_size"] > 1 else [0] * 8
        with torch.no_grad():
            logit = model(
                torch.tensor([first + second]), token_type_ids=torch.tensor([types])
            ).logits[0, 0]
        identity = "Identity" in config.get("sbert_ce_default_activation_function", "")
        want = logit if identity else logit.sigmoid()
        got = llm.score([first], [second], use_tqdm=False)[0]
        assert got.prompt_token_ids == first + second, name
        assert got.outputs.score == pytest.approx(want.item(), abs=1e-5), name
    finally:
        llm.llm_engine.shutdown()


# Qwen3-Embedding's sentence-transformers files: last-token pooling, then normalized
_ST_MODULES = [
    {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
    {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
    {"idx": 2, "name": "2", "path": "2_Normalize",
     "type": "sentence_transformers.models.Normalize"},
]  # fmt: skip
_ST_POOLING = {
    "word_embedding_dimension": 1024,
    "pooling_mode_cls_token": False,
    "pooling_mode_mean_tokens": False,
    "pooling_mode_max_tokens": False,
    "pooling_mode_mean_sqrt_len_tokens": False,
    "pooling_mode_weightedmean_tokens": False,
    "pooling_mode_lasttoken": True,
    "include_prompt": True,
}


def test_qwen3_embedding_release_config_matches_hf(tmp_path):
    """Qwen3-Embedding-0.6B's config.json and sentence-transformers files: the last token's
    hidden state, normalized, over prompts chunked through prefill."""
    from test_embed import hf_embeddings
    from test_release_configs import write_release

    path = write_release(
        tmp_path / "emb", shrink(copy.deepcopy(CAUSAL_POOLERS["qwen3-embedding-0.6b"]))
    )
    (path / "modules.json").write_text(json.dumps(_ST_MODULES))
    (path / "1_Pooling").mkdir()
    (path / "1_Pooling" / "config.json").write_text(json.dumps(_ST_POOLING))
    prompts = [list(range(5, 42)), [7, 8, 9]]
    llm = LLM(
        model=str(path),
        runner="pooling",
        dtype="float32",
        max_model_len=128,
        max_num_batched_tokens=16,
    )
    try:
        outs = llm.embed([{"prompt_token_ids": p} for p in prompts], use_tqdm=False)
        for out, want in zip(outs, hf_embeddings(path, prompts, "LAST"), strict=True):
            assert out.outputs.embedding == pytest.approx(want.tolist(), abs=1e-5)
    finally:
        llm.llm_engine.shutdown()


def test_qwen3_reranker_release_config_as_vllm_serves_it(tmp_path):
    """Qwen3-Reranker-0.6B's config.json (tied embeddings) with vLLM's documented
    hf_overrides: sigmoid(l_yes - l_no) of the causal LM's last position."""
    from test_release_configs import write_release

    path = write_release(
        tmp_path / "rr", shrink(copy.deepcopy(CAUSAL_POOLERS["qwen3-reranker-0.6b"]))
    )
    lm = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    no_tok, yes_tok = 10, 11
    tokens = transformers.AutoTokenizer.from_pretrained(path).convert_ids_to_tokens(
        [no_tok, yes_tok]
    )
    overrides = {
        "architectures": ["Qwen3ForSequenceClassification"],
        "classifier_from_token": tokens,
        "is_original_qwen3_reranker": True,
    }
    llm = LLM(model=str(path), dtype="float32", max_model_len=128, hf_overrides=overrides)
    try:
        outs = llm.score([[5, 6, 7], [20, 21]], [[8, 9], [22, 23, 24]], use_tqdm=False)
        for out, ids in zip(outs, ([5, 6, 7, 8, 9], [20, 21, 22, 23, 24]), strict=True):
            with torch.no_grad():
                logits = lm(torch.tensor([ids])).logits[0, -1]
            want = logits[[no_tok, yes_tok]].softmax(-1)[1].item()
            assert out.outputs.score == pytest.approx(want, abs=1e-5)
    finally:
        llm.llm_engine.shutdown()


def test_whisper_large_v3_release_config_matches_hf(tmp_path):
    """whisper-large-v3's config.json (benchmarks/configs) on the tiny Whisper's tokenizer and
    2-second feature extractor: the decoder's greedy tokens and logprobs on two clips."""
    from test_whisper import PREFIX, clip, features, hf_loop, write_tiny_whisper

    path = write_tiny_whisper(tmp_path / "whisper")
    tiny = json.loads((path / "config.json").read_text())
    sizes = {k: tiny[k] for k in ("num_mel_bins", "max_source_positions")}
    config = shrink_enc_dec(enc_dec_release("whisper-large-v3"), tiny["vocab_size"], **sizes)
    config["decoder_start_token_id"] = tiny["decoder_start_token_id"]
    assert_only_sizes_changed(enc_dec_release("whisper-large-v3"), config)
    model = _save_release(path, config)
    llm = LLM(model=str(path), dtype="float32", block_size=16)
    try:
        prefix = llm.get_tokenizer().encode(PREFIX, add_special_tokens=False)
        waves = (clip(3, 1.7), clip(2, 1.3))
        refs = [hf_loop(model, features(path, w), prefix) for w in waves]
        prompts = [{"prompt": PREFIX, "multi_modal_data": {"audio": (w, 16000)}} for w in waves]
        for out, ref in zip(llm.generate(prompts, greedy(), use_tqdm=False), refs, strict=True):
            assert out.prompt_token_ids == prefix
            assert_matches("whisper-large-v3", out, ref)
    finally:
        llm.llm_engine.shutdown()


@pytest.mark.parametrize("name", list(ENC_DEC))
def test_bart_release_config_matches_hf(name, tmp_path):
    """bart-large-cnn's and mbart-large-50's config.json (summarization settings, forced BOS /
    EOS, n-gram blocking, beams in the model config; mBART's pre-norm and tokenizer_class):
    vLLM's default decoder prompt and an explicit one, against HF generate with what vLLM
    does not apply turned off."""
    from hf_reference import hf_generate_enc_dec

    config = shrink_enc_dec(enc_dec_release(name), TINY_VOCAB_SIZE)
    assert_only_sizes_changed(enc_dec_release(name), config)
    path = tmp_path / "bart"
    path.mkdir()
    build_tiny_tokenizer(TINY_VOCAB_SIZE, 0).save_pretrained(path)
    model = _save_release(path, config)
    start, bos = config["decoder_start_token_id"], config["bos_token_id"]
    gen = torch.Generator().manual_seed(0)
    encs = [torch.randint(3, TINY_VOCAB_SIZE, (n,), generator=gen).tolist() for n in (7, 30)]
    decs = [[start, bos], [start, bos, 9, 33]]
    refs = [
        hf_generate_enc_dec(
            model, 8, input_ids=torch.tensor([e]), decoder_input_ids=torch.tensor([d])
        )
        for e, d in zip(encs, decs, strict=True)
    ]
    prompts = [encs[0], {"encoder_prompt": encs[1], "decoder_prompt": decs[1]}]
    llm = LLM(model=str(path), dtype="float32", block_size=16)
    try:
        for out, ref in zip(llm.generate(prompts, greedy(), use_tqdm=False), refs, strict=True):
            assert_matches(name, out, ref)
    finally:
        llm.llm_engine.shutdown()


def _save_release(path: Path, config: dict):
    """transformers' model of `config` (written verbatim to `path`) with random weights, saved
    there; the model, in eval mode."""
    (path / "config.json").write_text(json.dumps(config))
    cls = getattr(transformers, config["architectures"][0])
    model = cls(transformers.AutoConfig.from_pretrained(path)).float()
    _randomize(model, seed=1)
    with _quiet_progress():
        model.save_pretrained(path)
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return model.eval()


# dtype="auto" as vLLM reads it: the root config's dtype, else the text config's, else the
# vision config's (Qwen3-VL's releases write theirs in text_config alone)
AUTO_DTYPES = {
    "llava-v1.6-mistral-7b-hf": torch.float16,  # the root's, not text_config's bfloat16
    "qwen3-vl-4b-instruct": torch.bfloat16,
    "gemma-3-4b-it": torch.bfloat16,
}


@pytest.mark.parametrize("name", AUTO_DTYPES)
def test_auto_dtype_of_nested_configs(name, tmp_path):
    """Regression: Qwen3-VL's release (dtype in text_config only) was served in float32 by
    default, where vLLM serves bfloat16."""
    from paged_engine.loader import resolve_dtype

    (tmp_path / "config.json").write_text(json.dumps(VLMS[name]))
    config = transformers.AutoConfig.from_pretrained(tmp_path)
    assert resolve_dtype("auto", config) == AUTO_DTYPES[name]
