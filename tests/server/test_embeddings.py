"""/v1/embeddings with the official `openai` client against a real server on a tiny llama,
checked against HF transformers' final hidden state of the same weights (last token, L2)."""

from __future__ import annotations

import base64
import struct
import time

import pytest
import torch
from server_proc import MAX_MODEL_LEN, ServerProc

openai = pytest.importorskip("openai")

TEXTS = ["Hello, my name is", "The capital of France is", "one two three"]


@pytest.fixture(scope="module")
def client(real_server: ServerProc):
    return openai.OpenAI(base_url=real_server.url + "/v1", api_key="EMPTY", max_retries=0)


@pytest.fixture(scope="module")
def hf(tiny_model: str):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(tiny_model)


def reference(hf, ids: list[int]) -> torch.Tensor:
    model, _ = hf
    with torch.no_grad():
        h = model.base_model(torch.tensor([ids])).last_hidden_state[0, -1]
    return torch.nn.functional.normalize(h, dim=-1)


def test_openai_client_embeddings_match_hf(client, hf) -> None:
    tok = hf[1]
    r = client.embeddings.create(model="tiny", input=TEXTS)  # the client asks for base64
    assert r.object == "list" and r.model == "tiny" and [d.index for d in r.data] == [0, 1, 2]
    ids = [tok.encode(t) for t in TEXTS]
    assert r.usage.prompt_tokens == r.usage.total_tokens == sum(len(i) for i in ids)
    for d, i in zip(r.data, ids):
        assert d.object == "embedding"
        torch.testing.assert_close(
            torch.tensor(d.embedding), reference(hf, i), atol=1e-5, rtol=1e-4
        )
    floats = client.embeddings.create(model="tiny", input=TEXTS[0], encoding_format="float")
    torch.testing.assert_close(
        torch.tensor(floats.data[0].embedding), torch.tensor(r.data[0].embedding)
    )


def test_token_id_inputs(client, hf) -> None:
    one = client.embeddings.create(model="tiny", input=[5, 6, 7, 8], encoding_format="float")
    assert len(one.data) == 1 and one.usage.prompt_tokens == 4
    torch.testing.assert_close(
        torch.tensor(one.data[0].embedding), reference(hf, [5, 6, 7, 8]), atol=1e-5, rtol=1e-4
    )
    many = client.embeddings.create(model="tiny", input=[[5, 6, 7, 8], [9, 10]])
    assert len(many.data) == 2 and many.usage.prompt_tokens == 6
    torch.testing.assert_close(
        torch.tensor(many.data[0].embedding), torch.tensor(one.data[0].embedding)
    )


def test_raw_http_shape_base64_and_truncation(real_server: ServerProc, hf) -> None:
    body = {"model": "tiny", "input": "one two three", "encoding_format": "base64"}
    status, _, r = real_server.request("POST", "/v1/embeddings", body)
    assert status == 200 and r["object"] == "list" and r["id"].startswith("embd-")
    (d,) = r["data"]
    raw = base64.b64decode(d["embedding"])
    vec = torch.tensor(struct.unpack(f"<{len(raw) // 4}f", raw))
    torch.testing.assert_close(
        vec, reference(hf, hf[1].encode("one two three")), atol=1e-5, rtol=1e-4
    )
    long_ids = list(range(3, 3 + MAX_MODEL_LEN + 10))
    body = {"input": long_ids, "truncate_prompt_tokens": 5, "encoding_format": "float"}
    status, _, r = real_server.request("POST", "/v1/embeddings", body)
    assert status == 200 and r["usage"]["prompt_tokens"] == 5
    torch.testing.assert_close(
        torch.tensor(r["data"][0]["embedding"]), reference(hf, long_ids[-5:]), atol=1e-5, rtol=1e-4
    )


def test_pooling_token_embed_gives_a_row_per_token(real_server: ServerProc, hf) -> None:
    ids = hf[1].encode("one two three four")
    with torch.no_grad():
        ref = hf[0].base_model(torch.tensor([ids])).last_hidden_state[0]
    ref = torch.nn.functional.normalize(ref, dim=-1)
    for fmt in ("float", "base64"):
        body = {"input": ids, "task": "token_embed", "encoding_format": fmt}
        status, _, r = real_server.request("POST", "/pooling", body)
        assert status == 200, r
        data = r["data"][0]["data"]
        if fmt == "base64":
            raw = base64.b64decode(data)
            got = torch.tensor(struct.unpack(f"<{len(raw) // 4}f", raw)).view(len(ids), -1)
        else:
            got = torch.tensor(data)
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-4)
    status, _, r = real_server.request("POST", "/pooling", {"input": ids, "task": "token_classify"})
    assert status == 400 and r["error"]["param"] == "task", r


def test_chat_messages_are_embedded_as_the_template_renders_them(
    real_server: ServerProc, hf
) -> None:
    """vLLM's chat form: `messages` through the chat template (no generation prompt by default,
    no extra special tokens), one embedding; /tokenize renders the same ids."""
    messages = [
        {"role": "system", "content": "Represent this question for retrieval."},
        {"role": "user", "content": "Where is the Eiffel tower?"},
    ]
    for extra in ({}, {"add_generation_prompt": True}):
        status, _, r = real_server.request(
            "POST", "/v1/embeddings", {"messages": messages, "encoding_format": "float", **extra}
        )
        assert status == 200, r
        want = {"add_generation_prompt": False, **extra}
        _, _, tok = real_server.request("POST", "/tokenize", {"messages": messages, **want})
        ids = tok["tokens"]
        assert r["usage"]["prompt_tokens"] == len(ids) and len(r["data"]) == 1
        ref = reference(hf, ids)
        torch.testing.assert_close(
            torch.tensor(r["data"][0]["embedding"]), ref, atol=1e-5, rtol=1e-4
        )
    status, _, pooled = real_server.request("POST", "/pooling", {"messages": messages})
    assert status == 200 and len(pooled["data"]) == 1, pooled


@pytest.mark.parametrize(
    "body, param",
    [
        ({"input": "hi", "messages": [{"role": "user", "content": "hi"}]}, "messages"),
        ({"input": "hi", "chat_template_kwargs": {}}, "chat_template_kwargs"),
        ({"messages": "hi"}, "messages"),
        (
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [{"type": "image_url", "image_url": {"url": "data:,"}}],
                    }
                ]
            },
            "messages[0].content",
        ),
    ],
)
def test_bad_chat_form_names_the_field(real_server: ServerProc, body, param) -> None:
    status, _, r = real_server.request("POST", "/v1/embeddings", body)
    assert status == 400 and r["error"]["param"] == param, r


@pytest.mark.parametrize(
    "body, param",
    [
        ({"input": "hi", "dimensions": 3}, "dimensions"),
        ({"input": ""}, "input"),
        ({"input": []}, "input"),
        ({"input": [["a"]]}, "input"),
        ({"input": [1, 2, 10**9]}, "input"),
        ({"input": "hi", "encoding_format": "int8"}, "encoding_format"),
        ({"input": "hi", "bogus": 1}, "bogus"),
        ({"input": list(range(3, 4 + MAX_MODEL_LEN))}, "input"),  # max_model_len fits
        ({"model": "other", "input": "hi"}, "model"),
        ({"input": "hi", "priority": "high"}, "priority"),
        ({"input": "hi", "priority": 2}, "priority"),  # needs --scheduling-policy priority
    ],
)
def test_bad_requests_name_the_field(real_server: ServerProc, body, param) -> None:
    status, _, r = real_server.request("POST", "/v1/embeddings", body)
    assert status in (400, 404), r
    assert r["error"]["param"] == param, r
    status, _, r = real_server.request("POST", "/v1/embeddings", {"input": "still serving"})
    assert status == 200 and len(r["data"]) == 1


def test_a_request_the_engine_refuses_is_not_logged_as_aborted(real_server: ServerProc) -> None:
    """dimensions is checked where the engine takes the request: its 400 aborted nothing."""
    status, _, r = real_server.request("POST", "/v1/embeddings", {"input": "hi", "dimensions": 3})
    assert status == 400 and r["error"]["param"] == "dimensions", r
    deadline = time.monotonic() + 10
    while not (logged := [x for x in real_server.lines if "POST /v1/embeddings 400" in x]):
        assert time.monotonic() < deadline, "no request log line"
        time.sleep(0.05)
    assert "aborted" not in logged[-1], logged[-1]


def test_dimensions_equal_to_the_hidden_size_is_accepted(real_server: ServerProc) -> None:
    status, _, r = real_server.request("POST", "/v1/embeddings", {"input": "x"})
    size = len(r["data"][0]["embedding"])
    body = {"input": "x", "dimensions": size}
    status, _, r2 = real_server.request("POST", "/v1/embeddings", body)
    assert status == 200 and r2["data"][0]["embedding"] == r["data"][0]["embedding"]


def test_embeddings_beside_running_generations(real_server: ServerProc) -> None:
    """Embeddings finishing in the same steps as decoding requests: every request succeeds (a
    pooling output carries no token metrics; observing them used to fail the whole step)."""
    from concurrent.futures import ThreadPoolExecutor

    def generate(i: int):
        body = {"prompt": f"count {i}", "max_tokens": 24, "ignore_eos": True, "stream": True}
        events = real_server.stream(body)
        assert not [e for e in events if "error" in e], events[-1]
        return [c["finish_reason"] for e in events for c in e["choices"] if c["finish_reason"]]

    def embed(i: int):
        return real_server.request("POST", "/v1/embeddings", {"input": [f"text {i}"] * 2})

    with ThreadPoolExecutor(12) as pool:
        gens = [pool.submit(generate, i) for i in range(4)]
        embeds = [pool.submit(embed, i) for i in range(8)]
        for f in embeds:
            status, _, r = f.result()
            assert status == 200 and len(r["data"]) == 2, r
        assert [f.result() for f in gens] == [["length"]] * 4


def test_a_base_model_dir_serves_embeddings_and_refuses_generation(tmp_path) -> None:
    """A headless `Qwen2Model` checkpoint (gte-Qwen2's form: models/base_model.py) from the
    command line: /v1/embeddings is HF's last hidden state of the last token, normalized."""
    import transformers
    from server_proc import COMMON_ARGS, serve_in_process

    from paged_engine.testing import build_tiny_tokenizer, tiny_config
    from paged_server.cli import build_engine, parse_args

    torch.manual_seed(0)
    hf = transformers.Qwen2Model(tiny_config("qwen2")).eval()
    hf.save_pretrained(tmp_path)
    build_tiny_tokenizer(hf.config.vocab_size).save_pretrained(tmp_path)
    engine = build_engine(parse_args([str(tmp_path), "--dtype", "float32", *COMMON_ARGS]))
    try:
        with serve_in_process(COMMON_ARGS, engine) as (http, _app):
            body = {"input": [5, 6, 7, 8], "encoding_format": "float"}
            status, _, r = http.request("POST", "/v1/embeddings", body)
            assert status == 200, r
            with torch.no_grad():
                h = hf(torch.tensor([[5, 6, 7, 8]])).last_hidden_state[0, -1]
            torch.testing.assert_close(
                torch.tensor(r["data"][0]["embedding"]),
                torch.nn.functional.normalize(h, dim=-1),
                atol=1e-5,
                rtol=1e-4,
            )
            status, _, r = http.request("POST", "/v1/completions", {"prompt": "a", "max_tokens": 2})
            assert status == 400 and "does not generate" in r["error"]["message"], r
    finally:
        engine.shutdown()


def test_a_nomic_embed_release_serves_embeddings(tmp_path) -> None:
    """nomic-embed-text-v1.5's form (models/nomic_bert.py: GPT-2-named config.json, the
    release's tensor names) from the command line: /v1/embeddings is HF NomicBertModel's [CLS]
    row, normalized; `dimensions` cuts it to a Matryoshka size."""
    import json

    import transformers
    from server_proc import COMMON_ARGS, serve_in_process

    from paged_engine.testing import build_tiny_tokenizer
    from paged_server.cli import build_engine, parse_args

    torch.manual_seed(0)
    dims = {"hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 4}
    config = transformers.NomicBertConfig(vocab_size=512, intermediate_size=48, **dims)
    hf = transformers.NomicBertModel(config).eval()
    hf.save_pretrained(tmp_path)  # the release's tensor names (emb_ln, attn.Wqkv, fc11...)
    build_tiny_tokenizer(512).save_pretrained(tmp_path)
    release = {"architectures": ["NomicBertModel"], "model_type": "nomic_bert", "n_embd": 32}
    release |= {"n_head": 4, "n_layer": 1, "n_inner": 48, "n_positions": 128, "vocab_size": 512}
    release |= {"activation_function": "swiglu", "matryoshka_dimensions": [32, 16]}
    (tmp_path / "config.json").write_text(json.dumps(release))
    engine = build_engine(parse_args([str(tmp_path), "--dtype", "float32", *COMMON_ARGS]))
    try:
        with serve_in_process(COMMON_ARGS, engine) as (http, _app):
            with torch.no_grad():
                h = hf(torch.tensor([[5, 6, 7, 8]])).last_hidden_state[0, 0]
            for size in (None, 16):
                body = {"input": [5, 6, 7, 8], "encoding_format": "float", "dimensions": size}
                status, _, r = http.request("POST", "/v1/embeddings", body)
                assert status == 200, r
                torch.testing.assert_close(
                    torch.tensor(r["data"][0]["embedding"]),
                    torch.nn.functional.normalize(h[:size], dim=-1),
                    atol=1e-5,
                    rtol=1e-4,
                )
    finally:
        engine.shutdown()
