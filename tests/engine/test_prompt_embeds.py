"""vLLM's prompt_embeds input: a prompt given as the model's token embeddings of its tokens gives
the outputs of those tokens, on every kind of embedding a model has; prefix caching keys the rows;
the placeholders are never tokens; bad input fails naming the parameter."""

from __future__ import annotations

import pytest
import torch

from paged_engine import LLM, BeamSearchParams, SamplingParams

transformers = pytest.importorskip("transformers")

PROMPTS = [
    [5, 17, 42, 99, 7, 3, 250, 11, 60, 8, 9, 13, 77],
    [30, 31, 32, 200, 201, 4, 4, 4, 90, 91, 92, 93, 94, 95, 96, 97, 98, 120, 121, 122],
    [66, 67],
]


def _llm(path, **kw) -> LLM:
    kw = {"dtype": "float32", "max_model_len": 96, "block_size": 4, **kw}
    return LLM(model=str(path), enable_prompt_embeds=True, **kw)


def _hf(path):
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def _embeds(hf, ids: list[int]) -> torch.Tensor:
    """HF's input embedding of the tokens, as vLLM's docs make prompt_embeds."""
    with torch.no_grad():
        return hf.get_input_embeddings()(torch.tensor([ids]))[0]


def _summary(out) -> list:
    return [(c.token_ids, c.text, c.finish_reason) for c in out.outputs]


def _logprobs(out) -> list[dict[int, float]]:
    return [{t: lp.logprob for t, lp in d.items()} for d in out.outputs[0].logprobs]


def _assert_same_logprobs(a, b, tol: float) -> None:
    for x, y in zip(_logprobs(a), _logprobs(b), strict=True):
        assert x.keys() == y.keys()
        for t in x:
            assert x[t] == pytest.approx(y[t], abs=tol)


# Each kind of token embedding: plain (Llama), scaled inside HF's input embedding (Gemma 2 / 3,
# Gemma 4 without per-layer embeddings), a narrower projection after it (OPT), position
# embeddings added (GPT-2), a LayerNorm after it (BLOOM), a multiplier after it (Granite,
# Falcon-H1's hybrid), recurrent layers (Qwen3-Next, Mamba).
ARCHS = {
    "llama": {},
    "gemma2": {},
    "gemma3": {},
    "gemma4": {"hidden_size_per_layer_input": 0},
    "opt": {"word_embed_proj_dim": 32},
    "gpt2": {},
    "bloom": {},
    "granite": {"embedding_multiplier": 3.0},
    "falcon_h1": {},
    "qwen3_next": {},
    "mamba": {},
}


@pytest.mark.parametrize("arch", list(ARCHS))
def test_embeddings_of_tokens_give_the_tokens_outputs(tiny_model_factory, arch):
    """One batch of token prompts and the same prompts as embeddings (steps mixing both):
    identical greedy tokens, text and top-2 logprobs."""
    path = tiny_model_factory(arch, **ARCHS[arch])
    hf = _hf(path)
    llm = _llm(path, max_num_batched_tokens=24)  # the long prompt is cut into chunks
    sp = SamplingParams(temperature=0, max_tokens=10, logprobs=2, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    prompts += [{"prompt_embeds": _embeds(hf, p)} for p in PROMPTS]
    outs = llm.generate(prompts, sp, use_tqdm=False)
    n = len(PROMPTS)
    for by_ids, by_rows, ids in zip(outs[:n], outs[n:], PROMPTS):
        assert _summary(by_rows) == _summary(by_ids)
        _assert_same_logprobs(by_rows, by_ids, 1e-4)
        assert by_rows.prompt_token_ids is None and by_rows.prompt is None
        assert by_rows.num_prompt_tokens == len(ids) == by_ids.num_prompt_tokens
    # the tiny model is not degenerate: the outputs would show wrong rows
    assert len({tuple(o.outputs[0].token_ids) for o in outs[:n]}) == n
    assert any(lp < -0.05 for d in _logprobs(outs[0]) for lp in d.values())
    llm.llm_engine.shutdown()


@pytest.fixture(scope="module")
def llama(tiny_model_factory):
    path = tiny_model_factory("llama")
    return path, _hf(path)


def test_matches_hf_generate_from_inputs_embeds(llama, monkeypatch):
    """HF's generate(inputs_embeds=...) is the reference, penalties included: the
    placeholders under the rows are no tokens a penalty counts (made the reference's own first
    token here, so counting them would change the output)."""
    from paged_engine.engine import prompt_embeds

    path, hf = llama
    llm = _llm(path)
    e = _embeds(hf, PROMPTS[1])
    for penalty in (1.0, 1.8):
        with torch.no_grad():
            ref = hf.generate(
                inputs_embeds=e[None],
                max_new_tokens=12,
                do_sample=False,
                repetition_penalty=penalty,
                pad_token_id=2,
                eos_token_id=None,
            )[0].tolist()
        monkeypatch.setattr(prompt_embeds, "PLACEHOLDER", ref[0])
        sp = SamplingParams(
            temperature=0, max_tokens=12, repetition_penalty=penalty, ignore_eos=True
        )
        out = llm.generate({"prompt_embeds": e}, sp, use_tqdm=False)[0]
        assert list(out.outputs[0].token_ids) == ref
    llm.llm_engine.shutdown()


def _penalized_by_hand(hf, e, steps: int, rep: float, pres: float, freq: float) -> list[int]:
    """Greedy tokens after an embedded prompt, penalties applied by hand to the logits over
    the generated tokens only (the prompt's positions hold no token)."""
    out: list[int] = []
    for _ in range(steps):
        rows = torch.cat([e, _embeds(hf, out)]) if out else e
        with torch.no_grad():
            x = hf(inputs_embeds=rows[None]).logits[0, -1].clone()
        for t in set(out):
            x[t] = x[t] / rep if x[t] > 0 else x[t] * rep
            x[t] -= freq * out.count(t) + pres
        out.append(int(x.argmax()))
    return out


@pytest.mark.parametrize("rep,pres,freq", [(1.8, 0.7, 0.4), (0.9, -0.5, -0.6)])
def test_penalties_count_no_placeholder(llama, monkeypatch, rep, pres, freq):
    """Repetition, presence and frequency penalties over an embedded prompt against the logits
    penalized by hand (pushing repeats away, or drawing them): its placeholders (made the
    expected first token, so counting them changes the output) are no tokens, also in a row
    a token prompt with penalties held before."""
    from paged_engine.engine import prompt_embeds

    path, hf = llama
    e = _embeds(hf, PROMPTS[0])
    want = _penalized_by_hand(hf, e, 8, rep, pres, freq)
    monkeypatch.setattr(prompt_embeds, "PLACEHOLDER", want[0])
    llm = _llm(path, max_num_seqs=1)
    sp = SamplingParams(
        temperature=0,
        max_tokens=8,
        repetition_penalty=rep,
        presence_penalty=pres,
        frequency_penalty=freq,
        ignore_eos=True,
    )
    llm.generate({"prompt_token_ids": [want[0]] * 12}, sp, use_tqdm=False)  # the row's last
    out = llm.generate({"prompt_embeds": e}, sp, use_tqdm=False)[0]
    assert list(out.outputs[0].token_ids) == want
    llm.llm_engine.shutdown()


def test_custom_logits_processors_get_no_prompt_ids(llama):
    """A custom logits processor is told an embedded prompt has no token ids (None, vLLM's
    BatchUpdate), not its placeholders; a token prompt beside it gets its ids."""
    from custom_logits_processors import RecordPrompts

    path, hf = llama
    llm = _llm(path, logits_processors=[RecordPrompts], async_scheduling=False)
    RecordPrompts.seen.clear()
    sp = SamplingParams(temperature=0, max_tokens=2)
    prompts = [{"prompt_embeds": _embeds(hf, PROMPTS[0])}, {"prompt_token_ids": PROMPTS[2]}]
    llm.generate(prompts, sp, use_tqdm=False)
    assert RecordPrompts.seen == [None, PROMPTS[2]]
    llm.llm_engine.shutdown()


def test_rows_share_prefix_cache_blocks_only_with_equal_rows(llama):
    """Blocks are keyed by their rows: a prompt with the same leading rows reuses them, one
    whose first row differs (same placeholders, same length) reuses nothing and still gets its
    own tokens' outputs."""
    path, hf = llama
    llm = _llm(path, enable_prefix_caching=True)
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    base = PROMPTS[1]
    first = llm.generate({"prompt_embeds": _embeds(hf, base)}, sp, use_tqdm=False)[0]
    longer = base + [7, 8, 9]
    again = llm.generate({"prompt_embeds": _embeds(hf, longer)}, sp, use_tqdm=False)[0]
    assert again.num_cached_tokens == len(base) // 4 * 4
    other = [base[0] + 1] + base[1:]
    fresh = llm.generate({"prompt_embeds": _embeds(hf, other)}, sp, use_tqdm=False)[0]
    assert fresh.num_cached_tokens == 0
    want = llm.generate(
        [{"prompt_token_ids": p} for p in (base, longer, other)], sp, use_tqdm=False
    )
    assert [_summary(o) for o in (first, again, fresh)] == [_summary(o) for o in want]
    llm.llm_engine.shutdown()


def test_forks_beams_and_preemption(llama):
    """n > 1 (seeded), beam search, and a pool too small for the batch (preempted sequences
    recompute their rows): the token prompts' outputs."""
    path, hf = llama
    llm = _llm(path, num_gpu_blocks_override=16, max_model_len=48, max_num_seqs=8)
    params = [
        SamplingParams(temperature=1.0, seed=3, n=2, max_tokens=10, ignore_eos=True),
        BeamSearchParams(beam_width=2, max_tokens=8, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=18, ignore_eos=True),
    ]
    by_ids = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    rows = [{"prompt_embeds": _embeds(hf, p)} for p in PROMPTS]
    by_rows = llm.generate(rows, params, use_tqdm=False)
    assert [_summary(o) for o in by_rows] == [_summary(o) for o in by_ids]
    assert llm.get_stats().num_preemptions > 0
    assert llm.get_stats().num_used_blocks == 0
    # vLLM's LLM.beam_search: a sequence's tokens hold the prompt's, which rows have none
    beams = BeamSearchParams(beam_width=2, max_tokens=4, ignore_eos=True)
    (want,) = llm.beam_search([{"prompt_token_ids": PROMPTS[0]}], beams)
    (got,) = llm.beam_search([rows[0]], beams)
    n = len(PROMPTS[0])
    assert [s.tokens for s in got.sequences] == [s.tokens[n:] for s in want.sequences]
    llm.llm_engine.shutdown()


def test_dtypes_and_shapes_accepted(llama):
    """bfloat16 / float16 rows (cast to the model's dtype) and HF's [1, L, D] batch of one."""
    path, hf = llama
    llm = _llm(path)
    sp = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    e = _embeds(hf, PROMPTS[0])
    want = llm.generate({"prompt_embeds": e}, sp, use_tqdm=False)[0]
    batched = llm.generate({"prompt_embeds": e[None]}, sp, use_tqdm=False)[0]
    assert _summary(batched) == _summary(want)
    half = llm.generate({"prompt_embeds": e.half()}, sp, use_tqdm=False)[0]
    assert half.num_prompt_tokens == len(PROMPTS[0])
    mutated = e.clone()
    out = llm.generate({"prompt_embeds": mutated}, sp, use_tqdm=False)[0]
    mutated.zero_()  # the engine holds its own copy
    assert _summary(out) == _summary(want)
    llm.llm_engine.shutdown()


def test_bad_input_names_the_parameter_and_the_engine_serves_on(llama):
    path, hf = llama
    e = _embeds(hf, PROMPTS[0])
    plain = LLM(model=str(path), dtype="float32", max_model_len=32)
    with pytest.raises(ValueError, match="enable_prompt_embeds=True"):
        plain.generate({"prompt_embeds": e}, use_tqdm=False)
    plain.llm_engine.shutdown()
    llm = _llm(path, max_model_len=32)
    width = e.shape[1]
    bad = [
        ([1.0] * width, "must be a torch.Tensor"),
        (e[0], "shape"),
        (torch.zeros(3, width + 1), "shape"),
        (torch.zeros(0, width), "shape"),
        (torch.zeros(2, 3, width), "shape"),
        (torch.ones(4, width, dtype=torch.int64), "float32, bfloat16 or float16"),
        (torch.full((3, width), float("nan")), "finite"),
        (torch.zeros(32, width), "too long"),
        (e.to_sparse(), "dense"),
    ]
    for value, match in bad:
        with pytest.raises(ValueError, match=match):
            llm.generate({"prompt_embeds": value}, use_tqdm=False)
    with pytest.raises(ValueError, match="comes alone"):
        llm.generate({"prompt_embeds": e, "prompt_token_ids": [5]}, use_tqdm=False)
    with pytest.raises(ValueError, match="prompt_logprobs"):
        llm.generate({"prompt_embeds": e}, SamplingParams(prompt_logprobs=1), use_tqdm=False)
    sp = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    out = llm.generate([{"prompt_embeds": e}, {"prompt_token_ids": PROMPTS[0]}], sp)
    assert _summary(out[0]) == _summary(out[1])
    llm.llm_engine.shutdown()


def test_models_whose_layers_read_token_ids_refuse_at_start(tiny_model_factory):
    path = tiny_model_factory("gemma4")  # per-layer embeddings of the token ids
    with pytest.raises(ValueError, match=r"enable_prompt_embeds: .*per-layer"):
        LLM(model=str(path), max_model_len=32, enable_prompt_embeds=True)


def test_beside_images_in_one_step(tmp_path):
    """A vision-language checkpoint: an image prompt, a prompt given as rows and the same
    tokens in one step (image features after the embedding, rows in its output); each gives
    what it gives alone."""
    pytest.importorskip("PIL.Image")
    import numpy as np
    from PIL import Image

    from paged_engine.testing import write_tiny_llava

    path = write_tiny_llava(tmp_path / "llava", seed=3)
    hf = transformers.AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32)
    image = Image.fromarray(np.random.default_rng(0).integers(0, 256, (40, 52, 3), np.uint8))
    llm = _llm(path, max_model_len=256)
    sp = SamplingParams(temperature=0, max_tokens=8, logprobs=2, ignore_eos=True)
    pictured = {
        "prompt": "USER: <image>\nWhat is it?\nASSISTANT:",
        "multi_modal_data": {"image": image},
    }
    ids = PROMPTS[1]
    alone = llm.generate([pictured, {"prompt_token_ids": ids}], sp, use_tqdm=False)
    both = llm.generate([pictured, {"prompt_embeds": _embeds(hf, ids)}], sp, use_tqdm=False)
    assert [_summary(o) for o in both] == [_summary(o) for o in alone]
    _assert_same_logprobs(both[1], alone[1], 1e-4)
    llm.llm_engine.shutdown()
