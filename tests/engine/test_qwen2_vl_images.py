"""Images through Qwen2-VL / 2.5-VL / 3-VL checkpoints (multimodal/qwen2_vl.py) against HF.

Tiny random checkpoints (4-pixel patches merged 2 x 2; Qwen2.5-VL with window attention;
Qwen3-VL and Qwen3-VL-MoE with interleaved M-RoPE and deepstack rows after 2 layers):
`LLM.generate` with `multi_modal_data` must give HF's placeholder runs (one per merged patch,
so by image size) and HF `generate`'s greedy tokens and top-5 logprobs (1e-3, float32), with
HF's M-RoPE positions (3-D over images, shifted after them). The M-RoPE table equals HF's
`get_rope_index`. Then the engine's own paths against the plain run: chunks through images,
prefix-cache hits, preemption, forks, n-gram speculation (drafts at shifted positions), images
processed ahead, tensor and pipeline parallelism (every rank rotates by the table).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hf_reference import assert_matches, assert_same_greedy, hf_greedy
from image_checks import qwen2_vl_hf_inputs

from paged_engine import LLM, SamplingParams
from paged_engine.testing import write_tiny_qwen2_vl

transformers = pytest.importorskip("transformers")
Image = pytest.importorskip("PIL.Image")

MAX_TOKENS = 8
VISION = "<|vision_start|><|image_pad|><|vision_end|>"
PROMPT = f"<|im_start|>user\n{VISION}What is in it? Tell me.<|im_end|>\n<|im_start|>assistant\n"
TWO = (
    f"<|im_start|>user\n{VISION} and {VISION}Which is brighter?<|im_end|>\n<|im_start|>assistant\n"
)
TEXT = "<|im_start|>user\nSay something about the sea.<|im_end|>\n<|im_start|>assistant\n"


def _image(seed: int, size: tuple[int, int]):
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (*size, 3), dtype=np.uint8))


@pytest.fixture(scope="module")
def qwen_dirs(tmp_path_factory):
    cache = {}

    def make(version: str = "2"):
        if version not in cache:
            cache[version] = write_tiny_qwen2_vl(
                tmp_path_factory.mktemp(f"qwen{version}-vl"), version=version, seed=2
            )
        return cache[version]

    return make


def _greedy(top: int = 5, n: int = MAX_TOKENS) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=top)


def _llm(path, **kw) -> LLM:
    kw = {"max_model_len": 512, **kw}
    return LLM(model=str(path), dtype="float32", block_size=16, **kw)


class _HF:
    """HF's model with the prompt built as its processor builds it (Qwen2VLProcessor itself
    needs torchvision for its video processor): each <|image_pad|> repeated once per merged
    patch of its image, pixel values and grids from the checkpoint's image processor."""

    def __init__(self, path, version: str) -> None:
        names = {"2": "Qwen2VL", "2.5": "Qwen2_5_VL", "3": "Qwen3VL", "3-moe": "Qwen3VLMoe"}
        name = {**names, "3.5": "Qwen3_5", "3.5-moe": "Qwen3_5Moe"}[version]
        cls = getattr(transformers, f"{name}ForConditionalGeneration")
        self.model = cls.from_pretrained(path, dtype=torch.float32).eval()
        self.model.generation_config.eos_token_id = None
        self.images = transformers.AutoImageProcessor.from_pretrained(path)
        self.tok = transformers.AutoTokenizer.from_pretrained(path)
        self.pad = self.model.config.image_token_id

    def inputs(self, text: str, images: list) -> tuple[list[int], dict]:
        ids = self.tok.encode(text, add_special_tokens=False)
        return qwen2_vl_hf_inputs(ids, images, self.images, self.pad)

    def greedy(self, text: str, images: list):
        ids, extra = self.inputs(text, images)
        return ids, hf_greedy(self.model, ids, MAX_TOKENS, 5, **extra)


@pytest.mark.parametrize("version", ["2", "2.5", "3", "3-moe", "3.5", "3.5-moe"])
def test_images_match_hf(qwen_dirs, version):
    path = qwen_dirs(version)
    hf = _HF(path, version)
    cases = [
        (PROMPT, [_image(1, (40, 56))]),
        (TEXT, []),
        (TWO, [_image(2, (72, 24)), _image(3, (33, 47))]),  # tall; resized to the patch grid
    ]
    refs = [hf.greedy(text, images) for text, images in cases]
    llm = _llm(path)
    prompts = [
        {"prompt": text, "multi_modal_data": {"image": imgs}} if imgs else text
        for text, imgs in cases
    ]
    outs = llm.generate(prompts, _greedy(), use_tqdm=False)
    for (ids, ref), out in zip(refs, outs, strict=True):
        assert out.prompt_token_ids == ids
        assert_matches(f"qwen{version}-vl", out, ref)


def test_mrope_table_equals_hf_rope_index(qwen_dirs):
    path = qwen_dirs()
    hf = _HF(path, "2")
    llm = _llm(path)
    images = [_image(4, (24, 72)), _image(5, (48, 40))]
    ids, extra = hf.inputs(TWO, images)
    want, delta = hf.model.model.get_rope_index(
        torch.tensor([ids]), extra["mm_token_type_ids"], extra["image_grid_thw"]
    )
    processor = llm.llm_engine.input_processor.images
    expanded, done = processor.process(hf.tok.encode(TWO, add_special_tokens=False), images)
    assert expanded == ids
    table = processor.positions(len(ids), done)
    np.testing.assert_array_equal(table.table, want[:, 0].numpy())
    assert table.delta == int(delta) < 0
    assert table.first == ids.index(hf.pad)


@pytest.mark.parametrize("version", ["2.5", "3"])
def test_engine_paths_match_the_plain_run(qwen_dirs, version):
    """8-token chunks through images, a pool too small for all (preempted and recomputed),
    n = 2 forks after the prompt, n-gram drafts at shifted positions, a prefix-cache hit on
    the same image (none past the text for another), and images processed ahead (Qwen3-VL:
    each chunk's deepstack rows at its own image rows)."""
    path = qwen_dirs(version)
    prompts = [
        {"prompt": PROMPT, "multi_modal_data": {"image": _image(i, (24 + 8 * i, 64 - 8 * i))}}
        for i in range(3)
    ] + [{"prompt": TWO, "multi_modal_data": {"image": [_image(7, (16, 80)), _image(8, (40, 40))]}}]
    params = _greedy(0, 32)

    def run(llm, batch=prompts, p=params):
        return [o.outputs[0] for o in llm.generate(batch, p, use_tqdm=False)]

    plain = run(_llm(path))
    chunked = _llm(path, max_num_batched_tokens=8, enable_chunked_prefill=True, max_num_seqs=3)
    assert_same_greedy(plain, run(chunked))
    tight = _llm(
        path,
        max_model_len=160,
        num_gpu_blocks_override=12,
        max_num_batched_tokens=16,
        enable_chunked_prefill=True,
    )
    assert_same_greedy(plain, run(tight))
    assert tight.llm_engine.get_stats().num_preemptions > 0
    ngram = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2}
    assert_same_greedy(plain, run(_llm(path, speculative_config=ngram)))

    cached = _llm(path, enable_prefix_caching=True)
    fork = SamplingParams(temperature=0, n=2, max_tokens=32, ignore_eos=True)
    forked = cached.generate(prompts[:1], fork, use_tqdm=False)[0]
    assert [c.token_ids for c in forked.outputs] == [plain[0].token_ids] * 2
    again = cached.generate(prompts[:1], params, use_tqdm=False)[0]
    assert again.num_cached_tokens >= (len(again.prompt_token_ids) - 1) // 16 * 16
    assert_same_greedy(plain[:1], [again.outputs[0]])
    other = cached.generate(prompts[1:2], params, use_tqdm=False)[0]
    image_start = other.prompt_token_ids.index(
        cached.llm_engine.input_processor.images.image_token_id
    )
    assert other.num_cached_tokens <= image_start // 16 * 16

    images = cached.llm_engine.input_processor.images
    pics = prompts[-1]["multi_modal_data"]["image"]
    expanded, done = images.process(cached.get_tokenizer().encode(TWO), pics)
    ahead = {"prompt_token_ids": expanded, "multi_modal_data": {"image": list(done)}}
    assert_same_greedy(plain[-1:], run(cached, [ahead]))


@pytest.mark.parametrize("parallel", ["tensor_parallel_size", "pipeline_parallel_size"])
def test_parallel_matches_one_process(qwen_dirs, parallel):
    path = qwen_dirs()
    prompts = [
        {"prompt": TWO, "multi_modal_data": {"image": [_image(9, (32, 48)), _image(10, (56, 24))]}}
    ]
    one = [o.outputs[0] for o in _llm(path).generate(prompts, _greedy(0), use_tqdm=False)]
    llm = _llm(path, **{parallel: 2})
    try:
        two = [o.outputs[0] for o in llm.generate(prompts, _greedy(0), use_tqdm=False)]
    finally:
        llm.llm_engine.shutdown()
    assert_same_greedy(one, two)


def test_mm_processor_kwargs_bound_the_image_size(qwen_dirs):
    """vLLM's mm_processor_kwargs: the engine's max_pixels shrinks every image's run (HF's
    processor given the same size agrees, tokens and all); a prompt's own override wins; a
    name the processor does not take, or one that changes the patch layout, is a ValueError
    naming mm_processor_kwargs, and the engine serves on."""
    path = qwen_dirs()
    big = _image(11, (64, 96))
    prompt = {"prompt": PROMPT, "multi_modal_data": {"image": big}}
    plain = _llm(path).generate([prompt], _greedy(0), use_tqdm=False)[0]
    bounded = _llm(path, mm_processor_kwargs={"max_pixels": 32 * 64})
    small = bounded.generate([prompt], _greedy(0), use_tqdm=False)[0]
    hf = _HF(path, "2")
    hf.images.size = {"shortest_edge": hf.images.size.shortest_edge, "longest_edge": 32 * 64}
    ids, ref = hf.greedy(PROMPT, [big])
    assert small.prompt_token_ids == ids
    assert len(ids) < len(plain.prompt_token_ids)
    assert small.outputs[0].token_ids == ref.tokens
    own = {**prompt, "mm_processor_kwargs": {"max_pixels": 64 * 8 * 8}}  # the default
    again = bounded.generate([own], _greedy(0), use_tqdm=False)[0]
    assert again.prompt_token_ids == plain.prompt_token_ids
    for bad, match in [({"merge_size": 1}, "merge_size"), ({"bogus": 1}, "bogus")]:
        with pytest.raises(ValueError, match=rf"mm_processor_kwargs\['{match}'\]"):
            bounded.generate([{**prompt, "mm_processor_kwargs": bad}], _greedy(0))
    with pytest.raises(ValueError, match=r"mm_processor_kwargs\['max_pixels'\]"):
        bounded.generate([{**prompt, "mm_processor_kwargs": {"max_pixels": "x"}}], _greedy(0))
    with pytest.raises(ValueError, match="mm_processor_kwargs"):
        _llm(path, mm_processor_kwargs={"patch_size": 8})
    assert bounded.generate([prompt], _greedy(0), use_tqdm=False)[0].prompt_token_ids == ids


def test_image_embeds_give_the_image_answer(qwen_dirs):
    """vLLM's embedding input, {"image_embeds": rows of all images, "image_grid_thw": grids}
    with HF's own features: the same prompt and tokens as the images; without the grid, or with
    rows that do not fit it, a ValueError naming multi_modal_data."""
    path = qwen_dirs()
    hf = _HF(path, "2")
    images = [_image(12, (40, 56)), _image(13, (24, 64))]
    pixels = hf.images(images=images, return_tensors="pt")
    with torch.no_grad():
        feats = hf.model.get_image_features(pixels["pixel_values"], pixels["image_grid_thw"])
    rows = torch.cat(feats.pooler_output)
    llm = _llm(path)
    raw = {"prompt": TWO, "multi_modal_data": {"image": images}}
    data = {"image_embeds": rows, "image_grid_thw": pixels["image_grid_thw"]}
    embedded = {"prompt": TWO, "multi_modal_data": {"image": data}}
    want, got = llm.generate([raw, embedded], _greedy(0), use_tqdm=False)
    assert got.prompt_token_ids == want.prompt_token_ids
    assert_same_greedy([want.outputs[0]], [got.outputs[0]])
    bad = [
        ({"image_embeds": rows}, "image_grid_thw"),
        ({**data, "image_embeds": rows[:-1]}, "rows"),
        ({**data, "image_embeds": rows[:, :-1]}, "hidden size"),
        ({**data, "pixel_values": rows}, "keys"),
    ]
    for value, match in bad:
        with pytest.raises(ValueError, match=match):
            llm.generate([{"prompt": TWO, "multi_modal_data": {"image": value}}], _greedy(0))


def test_deepstack_layers_must_be_on_the_first_stage():
    """Qwen3-VL's deepstack rows go into the first k layers, where the encoder runs: a first
    pipeline stage with fewer layers is a ValueError naming pipeline_parallel_size."""
    from types import SimpleNamespace

    from paged_engine.worker.worker import check_deepstack

    stage = SimpleNamespace(layers=lambda layers: layers[:1])
    model = SimpleNamespace(model=SimpleNamespace(stage=stage, layers=[0, 1, 2, 3]))
    check_deepstack(SimpleNamespace(num_deepstack=0), model, 2)
    check_deepstack(SimpleNamespace(num_deepstack=1), model, 2)
    with pytest.raises(ValueError, match="pipeline_parallel_size=4"):
        check_deepstack(SimpleNamespace(num_deepstack=3), model, 4)


def test_processor_cache_processes_an_image_once(qwen_dirs, monkeypatch):
    """mm_processor_cache_gb (vLLM's): the same image in two prompts (a chat resending it)
    runs the image processor once and gives the same answer; other processor arguments, or
    the cache off, process it again."""
    path = qwen_dirs()
    image = _image(21, (40, 56))
    llm = _llm(path)
    images = llm.llm_engine.input_processor.images
    assert images.cache is not None  # on by default, as in vLLM
    calls = []

    class Counting:  # the image processor, its calls counted
        def __init__(self, hf) -> None:
            self.hf = hf

        def __call__(self, **kw):
            calls.append(kw)
            return self.hf(**kw)

        def __getattr__(self, name):
            return getattr(self.hf, name)

    monkeypatch.setattr(images, "_hf", Counting(images.hf))
    first = {"prompt": PROMPT, "multi_modal_data": {"image": image}}
    turn = {"prompt": TEXT + PROMPT, "multi_modal_data": {"image": image}}
    a, b = llm.generate([first, turn], _greedy(0), use_tqdm=False)
    assert len(calls) == 1 and images.cache.hits == 1
    plain = _llm(path, mm_processor_cache_gb=0)
    assert plain.llm_engine.input_processor.images.cache is None
    want = plain.generate([first, turn], _greedy(0), use_tqdm=False)
    assert_same_greedy([w.outputs[0] for w in want], [a.outputs[0], b.outputs[0]])
    other = {**first, "mm_processor_kwargs": {"max_pixels": 32 * 64}}
    llm.generate([other], _greedy(0), use_tqdm=False)
    assert len(calls) == 2
    with pytest.raises(ValueError, match="mm_processor_cache_gb"):
        _llm(path, mm_processor_cache_gb=-1)
