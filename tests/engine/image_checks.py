"""Checks shared by the image tests (test_*_images.py): noise images, the engine on a tiny
checkpoint, the engine's own paths with images against its plain run, and the server's chat
path with a data: URL image against the offline answer; the usual cases, HF's references of
them, the usual bad input and config fields the encoder refuses (vlm_checkpoints.py writes
and loads the checkpoints)."""

from __future__ import annotations

import base64
import io
import json
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from hf_reference import assert_matches, assert_same_greedy, hf_greedy

from paged_engine import LLM, SamplingParams

Image = pytest.importorskip("PIL.Image")


def noise_image(seed: int, size: tuple[int, int]):
    """A random RGB image of `size` (height, width)."""
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (*size, 3), dtype=np.uint8))


def greedy(top: int = 5, n: int = 8) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=top)


def engine(path, **kw) -> LLM:
    kw = {"max_model_len": 512, **kw}
    return LLM(model=str(path), dtype="float32", block_size=16, **kw)


def check_matches_hf(path, cases: list[tuple[str, list]], refs: list, name: str) -> None:
    """Each case (prompt text, its images) through the engine gives HF's prompt ids and its
    reference (`refs[i]`: (HF's ids, hf_greedy's result)); the same images with HF's expanded
    ids as `prompt_token_ids` are taken as they are and give the same tokens."""
    check_engine_matches_hf(engine(path), cases, refs, name)


def path_prompts(one: str, two: str, narrow: int = 15) -> list[dict]:
    """check_engine_paths' prompts: `one` with a noise image of (30 + 20 i) x (80 - narrow i)
    pixels for i = 0, 1, 2, then `two` with two (16 x 90 and 64 x 64)."""
    return [
        {
            "prompt": one,
            "multi_modal_data": {"image": noise_image(i, (30 + 20 * i, 80 - narrow * i))},
        }
        for i in range(3)
    ] + [
        {
            "prompt": two,
            "multi_modal_data": {"image": [noise_image(7, (16, 90)), noise_image(8, (64, 64))]},
        }
    ]


def check_chunks_and_prefix_hits(
    path, prompts: list[dict], params: SamplingParams, chunk: int, marker: Callable
) -> tuple[list, LLM, Callable]:
    """Against one plain run of `prompts`: `chunk`-token chunks give the same tokens; a
    prefix-cache hit on prompt 0's media again, and no hit past prompt 1's first media token
    (`marker(input_processor)`: its id). Returns (the plain outputs, the prefix-caching engine
    still serving, `run(llm, batch=prompts)` -> outputs)."""

    def run(llm, batch=prompts):
        return [o.outputs[0] for o in llm.generate(batch, params, use_tqdm=False)]

    plain = run(engine(path))
    chunked = engine(
        path, max_num_batched_tokens=chunk, enable_chunked_prefill=True, max_num_seqs=3
    )
    assert_same_greedy(plain, run(chunked))

    cached = engine(path, enable_prefix_caching=True)
    run(cached, prompts[:1])
    again = cached.generate(prompts[:1], params, use_tqdm=False)[0]
    assert again.num_cached_tokens >= (len(again.prompt_token_ids) - 1) // 16 * 16
    assert_same_greedy(plain[:1], [again.outputs[0]])
    other = cached.generate(prompts[1:2], params, use_tqdm=False)[0]
    first = other.prompt_token_ids.index(marker(cached.llm_engine.input_processor))
    assert other.num_cached_tokens <= first // 16 * 16
    return plain, cached, run


def check_engine_paths(path, prompts: list[dict], two: str, *, chunk: int = 8) -> LLM:
    """Against one plain run of `prompts` (the last holding two images for the text `two`,
    the first two one image each): `chunk`-token chunks through the images; a prefix-cache hit
    on the same image (and none past the text for another image); the last prompt's images
    processed ahead (`ImageProcessor.process`) and handed over with the expanded ids, and
    moved one token (refused). Returns the prefix-caching engine, still serving."""
    params = greedy(0, 24)
    plain, cached, run = check_chunks_and_prefix_hits(
        path, prompts, params, chunk, lambda proc: proc.images.image_token_id
    )
    images = cached.llm_engine.input_processor.images
    pics = prompts[-1]["multi_modal_data"]["image"]
    expanded, done = images.process(cached.get_tokenizer().encode(two), pics)
    ahead = {"prompt_token_ids": expanded, "multi_modal_data": {"image": list(done)}}
    assert_same_greedy(plain[-1:], run(cached, [ahead]))
    moved = {"prompt_token_ids": [5, *expanded], "multi_modal_data": {"image": list(done)}}
    with pytest.raises(ValueError, match="do not fit"):
        cached.generate([moved], params, use_tqdm=False)
    return cached


def check_refused(path, llm: LLM, cases: list[tuple[dict, str]], prompts: list[dict]) -> None:
    """Each (prompt, match) of `cases` is a ValueError matching `match` on `llm`; the last of
    `prompts` (two images) one naming limit_mm_per_prompt on an engine taking one image; `llm`
    then still serves the first of `prompts` (8 tokens)."""
    for bad, match in cases:
        with pytest.raises(ValueError, match=match):
            llm.generate([bad], greedy(0), use_tqdm=False)
    limited = engine(path, limit_mm_per_prompt={"image": 1})
    with pytest.raises(ValueError, match="limit_mm_per_prompt"):
        limited.generate([prompts[-1]], greedy(0), use_tqdm=False)
    out = llm.generate([prompts[0]], greedy(0), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 8


def check_tensor_parallel(
    path, prompts: list[dict], chunk: int | None, n: int = 4, **engine_kw
) -> None:
    """TP=2 (gloo) gives the one-process greedy tokens (`n`) and top-5 logprobs (1e-4) of
    `prompts`, both engines chunking prefill at `chunk` tokens (chunks through the images;
    None: whole prompts) and built with `engine_kw` besides."""
    kw = {"max_num_batched_tokens": chunk, "enable_chunked_prefill": True} if chunk else {}
    kw |= engine_kw
    one = engine(path, **kw).generate(prompts, greedy(5, n), use_tqdm=False)
    llm = engine(path, **kw, tensor_parallel_size=2)
    try:
        two = llm.generate(prompts, greedy(5, n), use_tqdm=False)
    finally:
        llm.llm_engine.shutdown()
    for want, got in zip(one, two, strict=True):
        assert got.outputs[0].token_ids == want.outputs[0].token_ids
        for a, b in zip(got.outputs[0].logprobs, want.outputs[0].logprobs, strict=True):
            assert {t: p.logprob for t, p in a.items()} == pytest.approx(
                {t: p.logprob for t, p in b.items()}, abs=1e-4
            )


def data_url(image) -> str:
    """`image` as a data: URL of its PNG bytes."""
    buf = io.BytesIO()
    image.save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def check_chat_data_url(
    llm: LLM,
    question: list[dict],
    picture,
    *,
    over_limit: bool = False,
    more: Callable[[object, dict, SimpleNamespace], None] | None = None,
) -> SimpleNamespace:
    """The server's chat path over `llm` (shut down after): a user turn of `question`'s parts
    (Hugging Face's form) with its {"type": "image"} part sent as an image_url part holding
    `picture` as a data: URL gives the offline greedy tokens (6) and prompt ids of the chat
    template's prompt with `picture`. With `over_limit` (`llm` has limit_mm_per_prompt one
    image), the image part twice is a 400 naming messages. `more(http, body, want)` runs
    further requests on the same server (`body`: the request that gave the offline answer).
    Returns the offline answer (server_proc.offline_chat: ids, prompt_ids, text)."""
    pytest.importorskip("paged_server")
    from server.server_proc import COMMON_ARGS, offline_chat, serve_in_process

    def ask(content: list[dict]) -> list[dict]:
        return [{"role": "user", "content": content}]

    want = offline_chat(llm, ask(question), {"image": picture}, 6)
    part = {"type": "image_url", "image_url": {"url": data_url(picture)}}
    sent = [part if p == {"type": "image"} else p for p in question]
    request = {"model": "tiny", "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    try:
        with serve_in_process(COMMON_ARGS, llm.llm_engine) as (http, _):
            body = {**request, "messages": ask(sent), "return_token_ids": True}
            status, _, out = http.request("POST", "/v1/chat/completions", body)
            assert status == 200, out
            assert out["choices"][0]["token_ids"] == want.ids
            assert out["prompt_token_ids"] == want.prompt_ids
            if over_limit:
                twice = [q for p in sent for q in ((p, p) if p is part else (p,))]
                status, _, out = http.request(
                    "POST", "/v1/chat/completions", {**request, "messages": ask(twice)}
                )
                assert status == 400 and out["error"]["param"] == "messages", out
            if more is not None:
                more(http, body, want)
    finally:
        llm.llm_engine.shutdown()
    return want


def hf_refs(model, cases: list[tuple[str, list]], inputs: Callable, n: int = 8) -> list:
    """check_matches_hf's `refs` of `cases` (prompt text, its images): (HF's prompt ids,
    hf_greedy's `n` tokens and top-5 logprobs), `inputs(text, images)` giving HF's ids and
    the model's further inputs."""
    refs = []
    for text, images in cases:
        ids, extra = inputs(text, images)
        refs.append((ids, hf_greedy(model, ids, n, 5, **extra)))
    return refs


def processor_inputs(
    processor, text: str, images: list, keys: tuple[str, ...], *, whole: bool = False
) -> tuple[list[int], dict]:
    """HF's prompt ids of `text` with `images` and the `keys` of `processor`'s output. Text
    alone: the tokenizer's ids (no special tokens added), nothing more; with `whole`, the
    processor's ids and the keys it gives."""
    if not images and not whole:
        return processor.tokenizer.encode(text, add_special_tokens=False), {}
    out = processor(text=[text], images=images or None, return_tensors="pt")
    extra = {k: out[k] for k in keys if k in out} if whole else {k: out[k] for k in keys}
    return out["input_ids"][0].tolist(), extra


def usual_refusals(
    prompt: str, two: str, one, *, not_an_image: str = "a cat", bare: bool = False
) -> list[tuple[dict, str]]:
    """check_refused's usual cases: `two` (two image placeholders) with the one image `one`
    (given `bare`, else in a list), `prompt` (one placeholder) with it twice, with the string
    `not_an_image` as its image and with `one` as a video."""
    short = one if bare else [one]
    return [
        ({"prompt": two, "multi_modal_data": {"image": short}}, "2 image placeholder"),
        ({"prompt": prompt, "multi_modal_data": {"image": [one, one]}}, "1 image placeholder"),
        ({"prompt": prompt, "multi_modal_data": {"image": not_an_image}}, "PIL.Image.Image"),
        ({"prompt": prompt, "multi_modal_data": {"video": [one]}}, "takes no videos"),
    ]


def hf_cases(
    prompt: str, text: str, two: str, sizes: tuple = ((40, 56), (72, 24), (33, 47))
) -> list[tuple[str, list]]:
    """check_matches_hf's usual cases: `prompt` with a noise image (seed 1) of `sizes[0]`,
    `text` alone, `two` with two (seeds 2 and 3) of `sizes[1]` and `sizes[2]`."""
    first, second, third = sizes
    return [
        (prompt, [noise_image(1, first)]),
        (text, []),
        (two, [noise_image(2, second), noise_image(3, third)]),
    ]


def grid_path_prompts(one: str, two: str, narrow: int = 0) -> list[dict]:
    """check_engine_paths' prompts for towers at the image's own patch grid: `one` with a
    noise image of (24 + 8 i) x (64 - narrow i) pixels for i = 0, 1, then `two` with one
    16 x 80 image twice."""
    sizes = [(24 + 8 * i, 64 - narrow * i) for i in range(2)]
    return [
        {"prompt": one, "multi_modal_data": {"image": noise_image(i, size)}}
        for i, size in enumerate(sizes)
    ] + [{"prompt": two, "multi_modal_data": {"image": [noise_image(7, (16, 80))] * 2}}]


# hf_cases' sizes for processors that tile: a wide image, a tall one and a small one
WIDE_TALL_SMALL = ((40, 90), (100, 30), (20, 24))


def check_vision_fields_refused(path, cases: list[tuple], build: Callable) -> None:
    """Each (field, value, match) of `cases` set on `path`'s vision_config (a fresh config
    each) makes `build(config)` a ValueError matching `match`."""
    import transformers

    for field, value, match in cases:
        config = transformers.AutoConfig.from_pretrained(path)
        setattr(config.vision_config, field, value)
        with pytest.raises(ValueError, match=match):
            build(config)


def check_grid_host_side_and_encoder(
    llm: LLM, hf_model, prompt: str, images: list, ids: list[int], extra: dict, pixels,
    name_sets: list[dict], build: Callable,
) -> None:  # fmt: skip
    """A Qwen2-VL-style family against HF on `prompt` with `images` (HF's processor gave
    `ids` and `extra`): our processing gives HF's ids, grids, `pixels` (HF's pixel values in
    our row layout) and get_rope_index's table and delta; the encoder's rows equal HF's image
    features (1e-5) with its weights from each of `name_sets`; those rows as image_embeds
    (with image_grid_thw) give the images' tokens."""
    import torch

    ours = llm.llm_engine.input_processor.images
    expanded, done = ours.process(llm.get_tokenizer().encode(prompt), images)
    assert expanded == ids
    assert [list(m.image_size) for m in done] == extra["image_grid_thw"].tolist()
    torch.testing.assert_close(torch.cat([m.pixel_values for m in done]), pixels)
    table = ours.positions(len(ids), done)
    want, delta = hf_model.model.get_rope_index(
        torch.tensor([ids]), extra["mm_token_type_ids"], extra["image_grid_thw"]
    )
    assert table.table.tolist() == want[:, 0].tolist()
    assert table.delta == int(delta)
    with torch.no_grad():
        features = hf_model.model.get_image_features(extra["pixel_values"], extra["image_grid_thw"])
        for names in name_sets:
            encoder = build(hf_model.config).float()
            encoder.load_weights(names.items())
            got = torch.cat(encoder.encode(done))
            torch.testing.assert_close(got, torch.cat(features.pooler_output), atol=1e-5, rtol=0)
    # vLLM's image features input: the encoder's rows with their grids, as the images
    embeds = {"image_embeds": got, "image_grid_thw": extra["image_grid_thw"]}
    outs = llm.generate(
        [{"prompt": prompt, "multi_modal_data": {"image": x}} for x in (images, embeds)],
        greedy(0),
        use_tqdm=False,
    )
    assert outs[0].outputs[0].token_ids == outs[1].outputs[0].token_ids


def check_grid_encoder_matches_hf(path, model, out: dict, merged: int = 1) -> None:
    """The encoder of the checkpoint at `path` (its saved weights) on the images of `out` (a
    processor's pixel_values, each image's t * h * w patch rows in turn, and image_grid_thw)
    gives HF `model`'s image features, image by image (1e-5); an image holds h * w / `merged`
    tokens."""
    import torch
    from vlm_checkpoints import encoder_from_checkpoint

    from paged_engine.multimodal.inputs import ImageInput

    grids = [tuple(g) for g in out["image_grid_thw"].tolist()]
    encoder = encoder_from_checkpoint(path, model.config)
    rows = out["pixel_values"].split([t * h * w for t, h, w in grids])
    images = [
        ImageInput(p, 0, g[1] * g[2] // merged, str(i), g)
        for i, (p, g) in enumerate(zip(rows, grids, strict=True))
    ]
    with torch.no_grad():
        want = model.model.get_image_features(out["pixel_values"], out["image_grid_thw"])
        got = encoder.encode(images)
    for a, b in zip(got, want.pooler_output, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)


def check_paths_and_refusals(
    path, prompt: str, two: str, more: Callable[[list[dict]], list] | None = None, **usual
) -> LLM:
    """check_engine_paths on path_prompts(`prompt`, `two`), then check_refused on its engine
    with usual_refusals (`usual` passed on) of a 20 x 20 noise image (seed 9) and the (prompt,
    match) cases `more(prompts)` besides. Returns the prefix-caching engine, still serving."""
    prompts = path_prompts(prompt, two)
    cached = check_engine_paths(path, prompts, two)
    refused = usual_refusals(prompt, two, noise_image(9, (20, 20)), **usual)
    check_refused(path, cached, refused + (more(prompts) if more else []), prompts)
    return cached


def check_processor_matches_hf(
    path, model, processor, cases: list[tuple[str, list]], keys: tuple[str, ...], name: str,
    *, whole: bool = False,
) -> list:  # fmt: skip
    """check_matches_hf of `cases` against HF's `model` fed by its `processor`
    (processor_inputs of `keys`, `whole` passed on). Returns the refs (hf_refs')."""
    refs = hf_refs(
        model, cases, lambda *case: processor_inputs(processor, *case, keys, whole=whole)
    )
    check_matches_hf(path, cases, refs, name)
    return refs


def compiled_processor_steps(
    model: str, file: str, cls: str, methods: set[str], functions: set[str], **names: object
):
    """An image processor's steps without torchvision: the `methods` of transformers' class
    `cls` (in models/`model`/`file`) and that module's `functions`, compiled from its source
    onto a bare class; returns an instance. The code's globals: math, torch, BatchFeature,
    SizeDict, TensorType (str), group_images_by_shape, reorder_images and `names`. Its
    `rescale_and_normalize` is torch_processors.py's normalize; its `resize` the caller's."""
    import ast
    import importlib.util
    import math
    from pathlib import Path

    import torch
    from transformers.feature_extraction_utils import BatchFeature
    from transformers.image_transforms import group_images_by_shape, reorder_images
    from transformers.image_utils import SizeDict

    from paged_engine.multimodal import torch_processors as tp

    root = importlib.util.find_spec("transformers").submodule_search_locations[0]
    body: list[ast.stmt] = []
    for node in ast.parse(Path(root, "models", model, file).read_text()).body:
        if isinstance(node, ast.FunctionDef) and node.name in functions:
            body.append(node)
        elif isinstance(node, ast.ClassDef) and node.name == cls:
            keep = [n for n in node.body if isinstance(n, ast.FunctionDef) and n.name in methods]
            body.append(ast.ClassDef("Steps", [], [], keep, [], type_params=[]))
    namespace = {
        "math": math,
        "torch": torch,
        "BatchFeature": BatchFeature,
        "SizeDict": SizeDict,
        "TensorType": str,
        "group_images_by_shape": group_images_by_shape,
        "reorder_images": reorder_images,
        **names,
    }
    module = ast.fix_missing_locations(ast.Module(body=body, type_ignores=[]))
    exec(compile(module, f"<{model} steps>", "exec"), namespace)
    steps = namespace["Steps"]()

    def rescale_and_normalize(x, do_rescale, factor, do_normalize, mean, std):
        s = {"do_rescale": do_rescale, "rescale_factor": factor, "do_normalize": do_normalize}
        return tp.normalize(x, {**s, "image_mean": mean, "image_std": std})

    steps.rescale_and_normalize = rescale_and_normalize
    return steps


def qwen2_vl_hf_inputs(
    ids: list[int], images: list, image_processor, pad: int
) -> tuple[list[int], dict]:
    """What Qwen2-VL's processor (it needs torchvision for its video processor) makes of
    tokenized `ids` and `images`: each `pad` id repeated once per merged 2 x 2 patch of its
    image, and HF's inputs (the image processor's pixel values and grids, the image-token
    mask `mm_token_type_ids`); no images: `ids` and no inputs."""
    import torch

    if not images:
        return ids, {}
    out = image_processor(images=images, return_tensors="pt")
    runs = iter(int(g.prod()) // 4 for g in out["image_grid_thw"])
    expanded: list[int] = []
    for t in ids:
        expanded += [t] * next(runs) if t == pad else [t]
    kinds = torch.tensor([[int(t == pad) for t in expanded]])
    extra = {
        "pixel_values": out["pixel_values"],
        "image_grid_thw": out["image_grid_thw"],
        "mm_token_type_ids": kinds,
    }
    return expanded, extra


def check_engine_matches_hf(llm: LLM, cases: list[tuple[str, list]], refs: list, name: str) -> None:
    """check_matches_hf on an engine built by the caller (its limits, kept for more checks):
    each case (prompt text, its images) gives HF's prompt ids and its reference (`refs[i]`:
    (HF's ids, hf_greedy's result)); the images with HF's expanded ids as `prompt_token_ids`
    are taken as they are and give the same tokens."""
    prompts = [
        {"prompt": text, "multi_modal_data": {"image": imgs}} if imgs else text
        for text, imgs in cases
    ]
    outs = llm.generate(prompts, greedy(), use_tqdm=False)
    for (ids, ref), out, (_, imgs) in zip(refs, outs, cases, strict=True):
        assert out.prompt_token_ids == ids
        assert_matches(f"{name} {len(imgs)} image(s)", out, ref)
    with_images = [(r, imgs) for r, (_, imgs) in zip(refs, cases, strict=True) if imgs]
    ahead = [
        {"prompt_token_ids": ids, "multi_modal_data": {"image": imgs}}
        for (ids, _), imgs in with_images
    ]
    outs = llm.generate(ahead, greedy(), use_tqdm=False)
    for out, ((ids, ref), _) in zip(outs, with_images, strict=True):
        assert out.prompt_token_ids == ids
        assert out.outputs[0].token_ids == ref.tokens


def check_config_refused(path: Path, out: Path, config: dict, match: str) -> None:
    """`path`'s checkpoint with `config` as its config.json (its other files linked into the
    folder `out`, made here when missing) fails to load with a ValueError matching `match`."""
    out.mkdir(exist_ok=True)
    for f in path.iterdir():
        if f.name != "config.json":
            (out / f.name).symlink_to(f)
    (out / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=match):
        engine(out)
