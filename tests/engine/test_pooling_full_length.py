"""Pooling prompts may fill max_model_len (vLLM's pooling runner): a pooling request samples one
throwaway token that is never run, so, unlike a generation prompt, it needs no room for it.

Against HF transformers on the same weights: a BERT-family encoder (BERT's absolute position
table, RoBERTa's positions past its padding id) and decoder embedding models (Qwen3-Embedding
style LAST pooling, MEAN, GPT-2's learned position table) each embed a prompt of exactly
max_model_len tokens, over chunked prefill and the prefix cache for the decoders; one more
token is still refused by name, `truncate_prompt_tokens=-1` keeps max_model_len tokens, and a
generation prompt still has to leave room for a token.
"""

from __future__ import annotations

import pytest
import torch

from paged_engine import LLM, EmbeddingRequestOutput, PoolingParams, SamplingParams
from paged_engine.testing import BOS_ID, EOS_ID, write_tiny_encoder

KW = {"device": "cpu", "dtype": "float32", "num_gpu_blocks_override": 64}
LIMIT = 80  # the tiny decoders' position limit (max_model_len by default): 5 blocks of 16


def ids_of(n: int, start: int = 5) -> list[int]:
    """n prompt token ids, none a special id (the tiny vocabulary holds 256)."""
    return [(start + 7 * i) % 240 + 10 for i in range(n)]


def encoder_prompt(n: int) -> list[int]:
    """[CLS] text [SEP] of n tokens in all (the tiny tokenizer's BOS / EOS stand for them)."""
    return [BOS_ID, *ids_of(n - 2), EOS_ID]


def hf_encoder_cls(path, arch: str, ids: list[int]) -> torch.Tensor:
    import transformers

    model = getattr(transformers, arch).from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        h = model(torch.tensor([ids])).last_hidden_state[0]
    return torch.nn.functional.normalize(h[0], dim=-1)  # the encoders' default: [CLS], L2


def hf_decoder(path, ids: list[int], pooling: str) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        h = model.base_model(torch.tensor([ids])).last_hidden_state[0]  # [T, D]
    return torch.nn.functional.normalize(h[-1] if pooling == "LAST" else h.mean(0), dim=-1)


def assert_embeds(out, want: torch.Tensor) -> None:
    torch.testing.assert_close(torch.tensor(out.outputs.embedding), want, atol=1e-5, rtol=1e-4)


# (arch, max_model_len): BERT's positions 0..n-1 fill its 130-row table; RoBERTa's count from
# pad_token_id + 1 (the tiny pad id is 2), so 130 - 2 - 1 tokens reach its last row
@pytest.mark.parametrize(("arch", "limit"), [("BertModel", 130), ("XLMRobertaModel", 127)])
def test_encoder_embeds_a_prompt_of_max_model_len(tmp_path, arch, limit) -> None:
    path = write_tiny_encoder(tmp_path / arch, arch)
    llm = LLM(model=str(path), **KW)
    assert llm.llm_engine.config.max_model_len == limit
    full = encoder_prompt(limit)
    (out,) = llm.embed([full], use_tqdm=False)
    assert out.prompt_token_ids == full and out.finished
    assert_embeds(out, hf_encoder_cls(path, arch, full))
    with pytest.raises(ValueError, match=f"{limit + 1} tokens, but max_model_len is {limit}$"):
        llm.embed([encoder_prompt(limit + 1)], use_tqdm=False)
    # -1: the first max_model_len tokens (not one fewer; a pooling runner keeps the start)
    long = encoder_prompt(limit + 9)
    (cut,) = llm.embed([long], PoolingParams(truncate_prompt_tokens=-1), use_tqdm=False)
    assert cut.prompt_token_ids == long[:limit]
    assert_embeds(cut, hf_encoder_cls(path, arch, long[:limit]))
    assert len(llm.embed([encoder_prompt(12)], use_tqdm=False)) == 1  # still serving


@pytest.mark.parametrize(
    ("arch", "limit_key", "pooling"),
    [
        ("qwen3", "max_position_embeddings", "LAST"),  # Qwen3-Embedding's pooling
        ("qwen3", "max_position_embeddings", "MEAN"),
        ("gpt2", "n_positions", "LAST"),  # a learned position table of exactly LIMIT rows
    ],
)
def test_decoder_embeds_a_prompt_of_max_model_len(
    tiny_model_factory, arch, limit_key, pooling
) -> None:
    path = tiny_model_factory(arch, **{limit_key: LIMIT})
    # 32-token steps: the prompt is pooled over 3 chunks, the last one partial
    llm = LLM(
        model=str(path),
        max_num_batched_tokens=32,
        pooler_config={"pooling_type": pooling},
        **KW,
    )
    assert llm.llm_engine.config.max_model_len == LIMIT
    full = ids_of(LIMIT)
    want = hf_decoder(path, full, pooling)
    outs = llm.embed([full, full], use_tqdm=False)
    assert [o.prompt_token_ids for o in outs] == [full, full]
    for out in outs:
        assert_embeds(out, want)
    (again,) = llm.embed([full], use_tqdm=False)  # LAST: its first 4 blocks from the cache
    assert_embeds(again, want)
    hits = llm.get_stats().prefix_cache_hits
    assert hits > 0 if pooling == "LAST" else hits == 0
    with pytest.raises(ValueError, match=f"{LIMIT + 1} tokens, but max_model_len is {LIMIT}$"):
        llm.embed([ids_of(LIMIT + 1)], use_tqdm=False)
    long = ids_of(LIMIT + 20, start=9)
    (cut,) = llm.embed([long], PoolingParams(truncate_prompt_tokens=-1), use_tqdm=False)
    assert cut.prompt_token_ids == long[-LIMIT:]
    assert_embeds(cut, hf_decoder(path, long[-LIMIT:], pooling))


def test_generation_still_leaves_room_for_a_token(tiny_model_factory) -> None:
    path = tiny_model_factory("qwen3", max_position_embeddings=LIMIT)
    llm = LLM(model=str(path), max_num_batched_tokens=32, **KW)
    greedy = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    with pytest.raises(ValueError, match=f"{LIMIT} tokens.*room for at least one generated"):
        llm.generate([ids_of(LIMIT)], greedy, use_tqdm=False)
    (out,) = llm.generate([ids_of(LIMIT - 1)], greedy, use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 1 and out.outputs[0].finish_reason == "length"
    most = SamplingParams(temperature=0, max_tokens=1, truncate_prompt_tokens=-1)
    long = ids_of(LIMIT + 5)
    (cut,) = llm.generate([long], most, use_tqdm=False)
    assert cut.prompt_token_ids == long[-(LIMIT - 1) :]
    # a truncation over max_model_len is refused by name, however short the prompt (vLLM's rule)
    over = f"truncate_prompt_tokens={LIMIT + 1} is greater than max_model_len"
    with pytest.raises(ValueError, match=over):
        llm.generate([[5, 6]], SamplingParams(truncate_prompt_tokens=LIMIT + 1), use_tqdm=False)
    with pytest.raises(ValueError, match=over):
        llm.embed([[5, 6]], PoolingParams(truncate_prompt_tokens=LIMIT + 1), use_tqdm=False)


def test_full_length_embeddings_beside_generation_with_async_scheduling(
    tiny_model_factory,
) -> None:
    """A full-length embedding request and generations in the same steps (async scheduling:
    the next step is planned while the embedding's throwaway token is pending): each gives
    what it gives alone, and the engine frees every block afterwards."""
    path = tiny_model_factory("qwen3", max_position_embeddings=LIMIT)
    llm = LLM(model=str(path), max_num_batched_tokens=32, async_scheduling=True, **KW)
    gen = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    prompts = [ids_of(7, start=3), ids_of(LIMIT - 6, start=4)]
    alone = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, gen, use_tqdm=False)]
    engine, full = llm.llm_engine, ids_of(LIMIT)
    for i, p in enumerate(prompts):
        engine.add_request(f"g{i}", p, gen, final_only=True)
        engine.add_request(f"e{i}", full, PoolingParams(), final_only=True)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    assert [list(done[f"g{i}"].outputs[0].token_ids) for i in range(2)] == alone
    want = hf_decoder(path, full, "LAST")
    for i in range(2):
        assert_embeds(EmbeddingRequestOutput.from_base(done[f"e{i}"]), want)
    assert llm.get_stats().num_used_blocks == 0


def test_prompt_embeds_of_max_model_len_rows_pool(tiny_model_factory) -> None:
    """A pooling prompt given as prompt_embeds (engine/prompt_embeds.py) may fill
    max_model_len rows too; it pools as the tokens whose embeddings the rows are."""
    path = tiny_model_factory("qwen3", max_position_embeddings=LIMIT)
    llm = LLM(model=str(path), max_num_batched_tokens=32, enable_prompt_embeds=True, **KW)
    from transformers import AutoModelForCausalLM

    table = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).get_input_embeddings()
    full = ids_of(LIMIT)
    with torch.no_grad():
        rows = table(torch.tensor(full))
    (by_rows,) = llm.embed([{"prompt_embeds": rows}], use_tqdm=False)
    assert_embeds(by_rows, hf_decoder(path, full, "LAST"))
    with pytest.raises(ValueError, match=f"{LIMIT + 1} prompt_embeds rows"):
        llm.embed([{"prompt_embeds": torch.cat([rows, rows[:1]])}], use_tqdm=False)
    with pytest.raises(ValueError, match="room for at least one generated token"):
        llm.generate([{"prompt_embeds": rows}], SamplingParams(max_tokens=1), use_tqdm=False)


def test_server_embeds_an_input_of_max_model_len(tmp_path) -> None:
    """/v1/embeddings (paged_server/embeddings.py): max_model_len tokens -> 200 with the
    offline embedding; one more -> 400 naming `input`; truncate_prompt_tokens=-1 keeps
    max_model_len tokens."""
    from server.server_proc import COMMON_ARGS, serve_in_process

    path = write_tiny_encoder(tmp_path / "bert", "BertModel")
    llm = LLM(model=str(path), **KW)
    limit = llm.llm_engine.config.max_model_len
    full = encoder_prompt(limit)
    (want,) = llm.embed([full], use_tqdm=False)
    with serve_in_process(COMMON_ARGS, llm.llm_engine) as (http, _):
        body = {"model": "tiny", "input": full, "encoding_format": "float"}
        status, _, r = http.request("POST", "/v1/embeddings", body)
        assert status == 200 and r["usage"]["prompt_tokens"] == limit, r
        assert r["data"][0]["embedding"] == pytest.approx(want.outputs.embedding, abs=1e-6)
        body["input"] = encoder_prompt(limit + 1)
        status, _, r = http.request("POST", "/v1/embeddings", body)
        assert status == 400 and r["error"]["param"] == "input", r
        assert f"{limit + 1} tokens" in r["error"]["message"], r
        status, _, r = http.request(
            "POST", "/v1/embeddings", {**body, "truncate_prompt_tokens": -1}
        )
        assert status == 200 and r["usage"]["prompt_tokens"] == limit, r
        status, _, r = http.request(
            "POST", "/v1/embeddings", {**body, "truncate_prompt_tokens": limit + 1}
        )
        assert status == 400 and r["error"]["param"] == "truncate_prompt_tokens", r
