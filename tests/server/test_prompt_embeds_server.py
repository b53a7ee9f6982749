"""prompt_embeds over HTTP (vLLM's /v1/completions field, --enable-prompt-embeds): base64 of a
torch.save tensor of the model's token embeddings answers as the same tokens do offline,
beside text prompts in one request (embeddings first, as vLLM orders them), streamed too, with
truncate_prompt_tokens keeping the last rows; without the flag, or with anything that is not
one finite tensor of the embedding's width and a length the context holds, a 400 naming the
field, and the server keeps serving."""

from __future__ import annotations

import base64
import io
import pickle

import pytest
from server_proc import COMMON_ARGS, MAX_MODEL_LEN, serve_in_process

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

IDS = [5, 17, 42, 99, 7, 3, 250, 11, 60, 8, 9, 13, 77]
OTHER = [30, 31, 32, 200, 201, 4]
GREEDY = {"model": "tiny", "max_tokens": 6, "temperature": 0, "ignore_eos": True}


def _saved(t) -> str:
    buf = io.BytesIO()
    torch.save(t, buf)
    return base64.b64encode(buf.getvalue()).decode()


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from paged_engine import LLM, SamplingParams
    from paged_engine.testing import write_tiny_model

    path = write_tiny_model(tmp_path_factory.mktemp("llama"), "llama", seed=1)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    embed = hf.get_input_embeddings().weight.detach()
    llm = LLM(
        str(path),
        dtype="float32",
        max_model_len=MAX_MODEL_LEN,
        num_gpu_blocks_override=64,
        enable_prompt_embeds=True,
    )
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in (IDS, OTHER, IDS[-5:])]
    want = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]
    yield path, embed, llm, want
    llm.llm_engine.shutdown()


def _completion(http, **body) -> tuple[int, dict]:
    status, _, answer = http.request("POST", "/v1/completions", {**GREEDY, **body})
    return status, answer


def test_prompt_embeds_answer_as_their_tokens(model):
    _, embed, llm, (want, want_other, want_tail) = model
    rows = _saved(embed[IDS])
    with serve_in_process([*COMMON_ARGS, "--enable-prompt-embeds"], llm.llm_engine) as (http, _):
        status, body = _completion(http, prompt="", prompt_embeds=rows, return_token_ids=True)
        assert status == 200, body
        (choice,) = body["choices"]
        assert choice["token_ids"] == want
        assert body["usage"]["prompt_tokens"] == len(IDS)
        # a list of them and a token prompt: the embeddings' choices first
        both = [_saved(embed[IDS][None]), _saved(embed[OTHER].half().float())]
        status, body = _completion(http, prompt_embeds=both, prompt=IDS, return_token_ids=True)
        assert status == 200, body
        got = sorted((c["index"], c["token_ids"]) for c in body["choices"])
        assert got == [(0, want), (1, want_other), (2, want)]
        assert body["usage"]["prompt_tokens"] == 2 * len(IDS) + len(OTHER)
        events = http.stream({**GREEDY, "prompt_embeds": rows, "prompt": OTHER})
        texts: dict[int, str] = {}
        for e in events:
            for c in e.get("choices", []):
                texts[c["index"]] = texts.get(c["index"], "") + c["text"]
        tok = llm.llm_engine.tokenizer
        assert texts == {0: tok.decode(want), 1: tok.decode(want_other)}
        openai = pytest.importorskip("openai")
        client = openai.OpenAI(base_url=http.url + "/v1", api_key="EMPTY", max_retries=0)
        answer = client.completions.create(
            model="tiny",
            prompt="",  # the client needs one
            max_tokens=6,
            temperature=0,
            extra_body={"prompt_embeds": rows, "ignore_eos": True},
        )
        assert answer.choices[0].text == tok.decode(want)
        status, body = _completion(
            http, prompt_embeds=rows, truncate_prompt_tokens=5, return_token_ids=True
        )
        assert body["choices"][0]["token_ids"] == want_tail
        assert body["usage"]["prompt_tokens"] == 5


def test_bad_prompt_embeds_are_400s_and_the_server_serves_on(model):
    _, embed, llm, (want, _, _) = model
    width = embed.shape[1]

    class Evil:
        def __reduce__(self):
            return (print, ("pwned",))

    evil = base64.b64encode(pickle.dumps(Evil())).decode()
    # one row viewed MAX_MODEL_LEN * 1000 times: a few bytes on the wire, claiming far more
    huge = embed[IDS[:1]].expand(MAX_MODEL_LEN * 1000, width)
    cases = [
        ("not base64!", "base64", "prompt_embeds[0]"),
        (evil, "could not be read", "prompt_embeds[0]"),
        (_saved({"a": embed[IDS]}), "not one tensor", "prompt_embeds[0]"),
        (_saved(huge), "elements", "prompt_embeds[0]"),
        (_saved(embed[IDS[:1]].expand(40, width)), "a view of", "prompt_embeds[0]"),
        (12, "base64 string", "prompt_embeds"),
        ([], "base64 string", "prompt_embeds"),
        # read, then refused by the engine's checks
        (_saved(torch.randn(3, width + 1)), "shape", None),
        (_saved(torch.full((3, width), float("nan"))), "finite", None),
        (_saved(torch.ones(3, width, dtype=torch.int64)), "float32", None),
        (_saved(torch.zeros(MAX_MODEL_LEN, width)), "context length", "prompt"),
    ]
    with serve_in_process([*COMMON_ARGS, "--enable-prompt-embeds"], llm.llm_engine) as (http, _):
        for value, says, param in cases:
            status, body = _completion(http, prompt_embeds=value)
            assert status == 400, (says, body)
            assert says in body["error"]["message"], body
            if param is not None:
                assert body["error"]["param"] == param, body
        status, body = _completion(http, prompt_embeds=_saved(embed[IDS]), echo=True)
        assert status == 400 and body["error"]["param"] == "echo", body
        chat = {**GREEDY, "messages": [{"role": "user", "content": "hi"}]}
        status, _, body = http.request(
            "POST", "/v1/chat/completions", {**chat, "prompt_embeds": _saved(embed[IDS])}
        )
        assert status == 400 and body["error"]["param"] == "prompt_embeds", body
        status, body = _completion(http, prompt=IDS, return_token_ids=True)
        assert status == 200 and body["choices"][0]["token_ids"] == want
    # a server without the flag reads nothing
    with serve_in_process(COMMON_ARGS, llm.llm_engine) as (http, app):
        app.prompt_embeds_width = None  # (the engine here has the switch on)
        status, body = _completion(http, prompt_embeds=_saved(embed[IDS]))
        assert status == 400 and "--enable-prompt-embeds" in body["error"]["message"], body
