"""Image features over HTTP (vLLM's `image_embeds` chat parts, --enable-mm-embeds): a part
holding base64 of a torch.save tensor or a numpy .npy array gives the greedy tokens of offline
`LLM.generate` with the same tensor as `multi_modal_data`; Qwen2-VL's object form carries the
grid; without the flag, or with anything that is not one finite tensor of the right width, a
400 naming the part, and the server keeps serving."""

from __future__ import annotations

import base64
import io
import pickle
from pathlib import Path

import pytest
from server_proc import COMMON_ARGS, serve_in_process

np = pytest.importorskip("numpy")
torch = pytest.importorskip("torch")

MAX_TOKENS = 6
GREEDY = {"model": "tiny", "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
PLAIN = {**GREEDY, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}


def _saved(t) -> str:
    buf = io.BytesIO()
    torch.save(t, buf)
    return base64.b64encode(buf.getvalue()).decode()


def _npy(t) -> str:
    buf = io.BytesIO()
    np.save(buf, t.numpy())
    return base64.b64encode(buf.getvalue()).decode()


def _ask(*parts: dict) -> list[dict]:
    return [{"role": "user", "content": [*parts, {"type": "text", "text": "What is it?"}]}]


def _part(value) -> dict:
    return {"type": "image_embeds", "image_embeds": value}


def _offline(llm, embeds, images: int = 1) -> list[int]:
    """Offline greedy tokens of the chat prompt with `images` image parts and `embeds`."""
    from paged_engine import SamplingParams

    tok = llm.llm_engine.tokenizer
    parts = [{"type": "image"}] * images + [{"type": "text", "text": "What is it?"}]
    text = tok.apply_chat_template(
        [{"role": "user", "content": parts}], tokenize=False, add_generation_prompt=True
    )
    prompt = {
        "prompt_token_ids": tok.encode(text, add_special_tokens=False),
        "multi_modal_data": {"image": embeds},
    }
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    (out,) = llm.generate([prompt], params, use_tqdm=False)
    return list(out.outputs[0].token_ids)


def _refused(http, messages, param: str) -> str:
    status, _, body = http.request("POST", "/v1/chat/completions", {**GREEDY, "messages": messages})
    assert status == 400, body
    assert body["error"]["param"] == param, body
    ok, _, after = http.request("POST", "/v1/chat/completions", PLAIN)
    assert ok == 200, after
    return body["error"]["message"]


def test_llava_image_embeds_parts(tmp_path: Path) -> None:
    from paged_engine import LLM
    from paged_engine.testing import write_tiny_llava

    path = write_tiny_llava(tmp_path, vision="clip", seed=1)
    llm = LLM(  # vLLM's switch is taken (features are taken offline either way)
        str(path),
        dtype="float32",
        max_model_len=256,
        num_gpu_blocks_override=64,
        enable_mm_embeds=True,
    )
    hidden = llm.llm_engine.hf_config.hidden_size
    rows = torch.randn(7, hidden, generator=torch.Generator().manual_seed(0))
    want = _offline(llm, rows)
    # answered offline before the server's loop runs the engine (two threads would race)
    other = torch.randn(3, hidden, generator=torch.Generator().manual_seed(5))
    want_two = _offline(llm, [rows, other], images=2)
    param = "messages[0].content[0].image_embeds"
    try:
        with serve_in_process([*COMMON_ARGS, "--enable-mm-embeds"], llm.llm_engine) as (http, _):
            image_token = llm.llm_engine.input_processor.images.image_token_id
            for payload in (_saved(rows), _npy(rows), _saved(rows.half())):
                body = http.request(
                    "POST",
                    "/v1/chat/completions",
                    {**GREEDY, "messages": _ask(_part(payload)), "return_token_ids": True},
                )[2]
                assert body["prompt_token_ids"].count(image_token) == 7
                assert body["usage"]["prompt_tokens"] == len(body["prompt_token_ids"])
                if payload != _saved(rows.half()):  # (float16 rows: their own answer)
                    assert body["choices"][0]["token_ids"] == want
            nan = rows.clone()
            nan[0, 0] = float("nan")

            class Evil:
                def __reduce__(self):
                    return (print, ("pwned",))

            evil = base64.b64encode(pickle.dumps(Evil())).decode()
            for value, says, where in [
                ("not base64!", "base64", param),
                (_saved({"a": rows}), "not one tensor", param),
                (evil, "could not be read", param),
                (12, "base64 tensor", param),
                ({"image_embeds": _saved(rows), "x": "1"}, "takes 'image_embeds'", param),
                # read, then refused by the engine's checks (for the prompt as a whole)
                (_saved(torch.randn(3, hidden + 1)), "hidden size", "messages"),
                (_saved(nan), "NaN", "messages"),
                (_saved(torch.ones(3, hidden, dtype=torch.int64)), "float", "messages"),
            ]:
                assert says in _refused(http, _ask(_part(value)), where)
            # the object form without a grid: each part one image's rows
            two = [_part({"image_embeds": _saved(r)}) for r in (rows, other)]
            body = http.request(
                "POST",
                "/v1/chat/completions",
                {**GREEDY, "messages": _ask(*two), "return_token_ids": True},
            )[2]
            assert body["choices"][0]["token_ids"] == want_two
            mixed = _ask(_part(_saved(rows)), {"type": "image_url", "image_url": {"url": "x"}})
            assert "not both" in _refused(http, mixed, "messages[0].content[1].image_url")
        with serve_in_process(COMMON_ARGS, llm.llm_engine) as (http, _):
            assert "--enable-mm-embeds" in _refused(http, _ask(_part(_saved(rows))), param)
    finally:
        llm.llm_engine.shutdown()


def test_qwen2_vl_image_embeds_objects(tmp_path: Path) -> None:
    """Qwen2-VL's `{"image_embeds": rows, "image_grid_thw": grid}` parts, two in a message:
    the offline tokens of the dict form with both images' rows and grids."""
    from paged_engine import LLM
    from paged_engine.testing import write_tiny_qwen2_vl

    path = write_tiny_qwen2_vl(tmp_path, seed=2)
    llm = LLM(str(path), dtype="float32", max_model_len=256, num_gpu_blocks_override=64)
    hidden = llm.llm_engine.hf_config.hidden_size
    gen = torch.Generator().manual_seed(1)
    grids = torch.tensor([[1, 4, 6], [1, 2, 4]])  # 6 and 2 merged rows (2 x 2 merge)
    rows = [torch.randn(6, hidden, generator=gen), torch.randn(2, hidden, generator=gen)]
    want = _offline(llm, {"image_embeds": torch.cat(rows), "image_grid_thw": grids}, images=2)
    parts = [
        _part({"image_embeds": _saved(r), "image_grid_thw": _saved(g[None])})
        for r, g in zip(rows, grids, strict=True)
    ]
    try:
        with serve_in_process([*COMMON_ARGS, "--enable-mm-embeds"], llm.llm_engine) as (http, _):
            status, _, body = http.request(
                "POST",
                "/v1/chat/completions",
                {**GREEDY, "messages": _ask(*parts), "return_token_ids": True},
            )
            assert status == 200, body
            assert body["choices"][0]["token_ids"] == want
            bad = [_part({"image_embeds": _saved(rows[0])})]  # no grid: M-RoPE needs it
            assert "image_grid_thw" in _refused(http, _ask(*bad), "messages")
    finally:
        llm.llm_engine.shutdown()


def test_internvl_image_embeds_parts(tmp_path: Path) -> None:
    """InternVL: a part's rows become <img>, a run of them, </img> (the offline tokens)."""
    from paged_engine import LLM
    from paged_engine.testing import write_tiny_internvl

    path = write_tiny_internvl(tmp_path, seed=3)
    llm = LLM(str(path), dtype="float32", max_model_len=256, num_gpu_blocks_override=64)
    hidden = llm.llm_engine.hf_config.hidden_size
    rows = torch.randn(5, hidden, generator=torch.Generator().manual_seed(2))
    want = _offline(llm, rows)
    try:
        with serve_in_process([*COMMON_ARGS, "--enable-mm-embeds"], llm.llm_engine) as (http, _):
            status, _, body = http.request(
                "POST",
                "/v1/chat/completions",
                {**GREEDY, "messages": _ask(_part(_saved(rows))), "return_token_ids": True},
            )
            assert status == 200, body
            assert body["choices"][0]["token_ids"] == want
            ids = body["prompt_token_ids"]
            image = llm.llm_engine.input_processor.images.image_token_id
            first = ids.index(image)
            assert ids[first : first + 5] == [image] * 5 and ids[first + 5] != image
    finally:
        llm.llm_engine.shutdown()
