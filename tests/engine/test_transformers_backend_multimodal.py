"""The Transformers modeling backend on a vision-language checkpoint
(models/transformers_backend/multimodal.py): a tiny random LLaVA through `model_impl="transformers"`
(HF's tower, projector and `get_image_features`; HF's decoder with paged attention) gives HF
`generate`'s greedy tokens and top-5 logprobs (float32, 1e-3) with HF's processor's pixels, and
paged's native LLaVA's, in a batch mixing image and text prompts (likewise HF on Aya Vision and
Command A Vision tiles, and Mistral 3 / Pixtral-tower LLaVA images of their own size); chunked
prefill through an image and prefix caching keyed by the image keep the plain run's tokens;
vLLM's `TransformersMultiModalForCausalLM` name in hf_overrides selects it; what it cannot run
is refused by name."""

from __future__ import annotations

import pytest
import test_aya_vision_images as aya  # tests/engine is on sys.path
import test_mistral3_images as m3
import torch
from hf_reference import assert_matches, assert_same_greedy
from image_checks import (
    WIDE_TALL_SMALL,
    check_engine_matches_hf,
    greedy,
    hf_cases,
    hf_refs,
    noise_image,
    processor_inputs,
)
from vlm_checkpoints import load_hf_vlm

from paged_engine import LLM
from paged_engine.models.multimodal_text import MARKER
from paged_engine.models.transformers_backend import (
    TransformersImageEncoder,
    check_transformers_config,
)
from paged_engine.testing import tiny_config, write_tiny_llava

transformers = pytest.importorskip("transformers")

PROMPT = "USER: <image>\nWhat is in it?\nASSISTANT:"
TWO = "USER: <image>\nand <image>\nWhich one?\nASSISTANT:"
TEXT = "USER: Say something about the sea.\nASSISTANT:"
BACKEND = "TransformersMultiModalForCausalLM"


# (fixtures: the tiny Aya Vision / Command A Vision and Mistral 3 / Pixtral LLaVA checkpoints)
aya_dirs = aya.dirs
mistral3_dirs = m3.dirs


@pytest.fixture(scope="module")
def llava(tmp_path_factory):
    return write_tiny_llava(tmp_path_factory.mktemp("llava-tf"), vision="clip", seed=3)


def _llm(path, **kw) -> LLM:
    kw = {"max_model_len": 256, "model_impl": "transformers", **kw}
    return LLM(model=str(path), dtype="float32", block_size=16, **kw)


def _prompts(cases: list[tuple[str, list]]) -> list:
    return [
        {"prompt": text, "multi_modal_data": {"image": imgs}} if imgs else text
        for text, imgs in cases
    ]


def test_images_match_hf_and_the_native_class(llava) -> None:
    cases = hf_cases(PROMPT, TEXT, TWO)
    processor = transformers.AutoProcessor.from_pretrained(llava)
    hf = transformers.LlavaForConditionalGeneration.from_pretrained(llava, dtype=torch.float32)
    hf.eval().generation_config.eos_token_id = None
    refs = hf_refs(
        hf, cases, lambda text, imgs: processor_inputs(processor, text, imgs, ("pixel_values",))
    )
    llm = _llm(llava)
    model = llm.llm_engine.model_runner.model
    assert type(model).__name__ == BACKEND
    assert type(model.model).__module__.startswith("transformers.models.")  # HF's decoder
    encoder = llm.llm_engine.model_runner.images.encoder
    assert isinstance(encoder, TransformersImageEncoder)
    assert type(encoder.base).__name__ == "LlavaModel"  # HF's tower and projector
    outs = llm.generate(_prompts(cases), greedy(), use_tqdm=False)
    assert llm.llm_engine.model_runner.images.encoded == 3  # every image through HF's tower
    for (ids, ref), out in zip(refs, outs, strict=True):
        assert out.prompt_token_ids == ids
        assert_matches("llava-transformers", out, ref)
    native = LLM(model=str(llava), dtype="float32", block_size=16, max_model_len=256)
    assert type(native.llm_engine.model_runner.model).__name__ != BACKEND
    want = native.generate(_prompts(cases), greedy(), use_tqdm=False)
    assert_same_greedy([o.outputs[0] for o in want], [o.outputs[0] for o in outs], abs_tol=1e-3)


@pytest.mark.parametrize("arch", ["aya", "cohere2"])
def test_aya_vision_and_command_a_vision_tiles_match_hf(aya_dirs, arch: str) -> None:
    """One ImageInput a tile, HF's tower and projector on each (Cohere 2 decoder: a sliding
    and a NoPE layer; Aya Vision applies logit_scale, Command A Vision does not)."""
    path = aya_dirs(arch)
    cases = hf_cases(
        aya._prompt(arch, aya.PROMPT),
        aya._prompt(arch, aya.TEXT),
        aya._prompt(arch, aya.TWO),
        WIDE_TALL_SMALL,  # tiles and the whole image, and one tile alone
    )
    refs = hf_refs(aya._model(path, arch), cases, lambda *c: aya._hf_inputs(path, arch, *c))
    _check_backend_matches_hf(path, cases, refs, f"{arch}-transformers")


@pytest.mark.parametrize("arch", ["mistral3", "llava"])
def test_pixtral_towers_match_hf(mistral3_dirs, arch: str) -> None:
    """Images of their own size, one get_image_features call each with its image_sizes
    (Mistral 3: patches merged 2 x 2; Pixtral-12B-style LLaVA: none), rows of [IMG] ended by
    [IMG_BREAK] / [IMG_END]."""
    path = mistral3_dirs(arch)
    name = "Mistral3" if arch == "mistral3" else "Llava"
    hf = load_hf_vlm(getattr(transformers, f"{name}ForConditionalGeneration"), path)
    merge = 2 if arch == "mistral3" else 1
    cases = hf_cases(m3.PROMPT, m3.TEXT, m3.TWO, ((40, 56), (90, 30), (17, 33)))
    refs = hf_refs(hf, cases, lambda *c: m3._hf_inputs(path, merge, *c))
    _check_backend_matches_hf(path, cases, refs, f"{arch}-transformers")


def _check_backend_matches_hf(path, cases: list[tuple[str, list]], refs: list, name: str) -> None:
    """The backend's engine on `path` gives each case HF's prompt ids, greedy tokens and top-5
    logprobs, and takes HF's expanded ids as they are (image_checks.check_engine_matches_hf)."""
    llm = _llm(path, max_model_len=512)
    assert type(llm.llm_engine.model_runner.model).__name__ == BACKEND
    check_engine_matches_hf(llm, cases, refs, name)


def test_chunks_through_an_image_and_prefix_hits_keyed_by_it(llava) -> None:
    prompts = [
        {"prompt": PROMPT, "multi_modal_data": {"image": noise_image(1, (40, 56))}},
        {"prompt": PROMPT, "multi_modal_data": {"image": noise_image(9, (40, 56))}},
        {"prompt": TWO, "multi_modal_data": {"image": [noise_image(2, (30, 60))] * 2}},
    ]
    params = greedy(0, 12)

    def run(llm, batch=prompts):
        return [o.outputs[0] for o in llm.generate(batch, params, use_tqdm=False)]

    plain = run(_llm(llava))
    assert plain[0].token_ids != plain[1].token_ids  # the image changes the answer
    chunked = _llm(llava, max_num_batched_tokens=8, enable_chunked_prefill=True, max_num_seqs=3)
    assert_same_greedy(plain, run(chunked))
    cached = _llm(llava, enable_prefix_caching=True)
    run(cached, prompts[:1])
    again = cached.generate(prompts[:1], params, use_tqdm=False)[0]
    assert again.num_cached_tokens >= (len(again.prompt_token_ids) - 1) // 16 * 16
    assert_same_greedy(plain[:1], [again.outputs[0]])
    other = cached.generate(prompts[1:2], params, use_tqdm=False)[0]  # same text, other pixels
    image_id = transformers.AutoConfig.from_pretrained(llava).image_token_id
    assert other.num_cached_tokens <= other.prompt_token_ids.index(image_id) // 16 * 16
    assert_same_greedy(plain[1:2], [other.outputs[0]])


def test_vllm_name_in_hf_overrides_selects_it(llava) -> None:
    case = [(PROMPT, [noise_image(4, (36, 36))])]
    want = _llm(llava).generate(_prompts(case), greedy(), use_tqdm=False)
    llm = LLM(
        model=str(llava),
        dtype="float32",
        block_size=16,
        max_model_len=256,
        hf_overrides={"architectures": [BACKEND]},
    )
    assert type(llm.llm_engine.model_runner.model).__name__ == BACKEND
    got = llm.generate(_prompts(case), greedy(), use_tqdm=False)
    assert_same_greedy([want[0].outputs[0]], [got[0].outputs[0]])


def _wrapped(wrapper: str | None, arch: str = "LlamaForCausalLM"):
    config = tiny_config("llama")
    config.architectures = [arch]
    if wrapper is not None:
        setattr(config, MARKER, wrapper)
    return config


@pytest.mark.parametrize(
    ("config", "match"),
    [
        (_wrapped("Qwen2VLForConditionalGeneration"), "Qwen2VLForConditionalGeneration: M-RoPE"),
        (_wrapped("Gemma3ForConditionalGeneration"), "bidirectionally"),
        (
            _wrapped("Idefics2ForConditionalGeneration"),
            "Idefics2ForConditionalGeneration: only .*Llava",
        ),
        (_wrapped(None, BACKEND), "multimodal models need a VLM checkpoint"),
        (
            _wrapped(
                "LlavaForConditionalGeneration", "TransformersMultiModalForSequenceClassification"
            ),
            "multimodal models are not supported",
        ),
    ],
)
def test_what_it_cannot_run_is_refused_by_name(config, match: str) -> None:
    with pytest.raises(ValueError, match=f"model_impl='transformers': .*{match}"):
        check_transformers_config(config)


def test_a_wrapper_without_its_image_path_gets_no_encoder() -> None:
    config = transformers.VipLlavaConfig(architectures=["VipLlavaForConditionalGeneration"])
    with pytest.raises(ValueError, match=r"VipLlavaForConditionalGeneration.*no Transformers"):
        TransformersImageEncoder(config)
