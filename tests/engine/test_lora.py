"""Multi-LoRA: requests with different adapters (and none) in one batch give HF's greedy tokens
on the base model with each adapter merged into its weights (W + scale * B A); prefix caching
never mixes adapters; max_loras bounds the adapters of a batch; bad adapters are refused with a
ValueError and the engine keeps serving."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch
from hf_reference import hf_greedy, load_hf_model

from paged_engine import LLM, LoRARequest, SamplingParams
from paged_engine.lora.layers import LoRAMapping
from paged_engine.testing import merge_lora_adapter, write_lora_adapter

pytest.importorskip("transformers")

# HF module names of each architecture's attention and MLP projections.
TARGETS = {
    "llama": ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
    "gpt2": ("c_attn", "c_proj", "c_fc"),  # Conv1D: weights stored [in, out]
    "phi3": ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"),  # fused, split by rows
    "gpt_neox": ("query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h"),
    "opt": ("q_proj", "v_proj", "out_proj", "fc1"),  # a subset: k_proj keeps the base weight
}
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=1)


def _lora_llm(model, **options) -> LLM:
    """A float32 engine serving adapters of rank <= 8 (options override the defaults)."""
    kw = {"dtype": "float32", "max_model_len": 128, "enable_lora": True, "max_lora_rank": 8}
    return LLM(str(model), **{**kw, **options})


def _prompts(n: int, seed: int = 0, lo: int = 3, hi: int = 20) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 500) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


@pytest.fixture(scope="module")
def llama_setup(tiny_model_factory, tmp_path_factory):
    model = tiny_model_factory("llama")
    root = tmp_path_factory.mktemp("lora")
    a = write_lora_adapter(root / "a", model, rank=4, seed=1)
    b = write_lora_adapter(root / "b", model, rank=8, alpha=8, seed=2, use_rslora=True)
    # Attention only (an MLP-free adapter leaves gate_up / down at the base weights).
    c = write_lora_adapter(root / "c", model, rank=2, seed=3, target_modules=("q_proj", "v_proj"))
    llm = _lora_llm(model, max_loras=3)
    refs = {
        None: load_hf_model(model),
        1: merge_lora_adapter(load_hf_model(model), a),
        2: merge_lora_adapter(load_hf_model(model), b),
        3: merge_lora_adapter(load_hf_model(model), c),
    }
    loras = {
        1: LoRARequest("a", 1, str(a)),
        2: LoRARequest("b", 2, str(b)),
        3: LoRARequest("c", 3, str(c)),
    }
    return model, llm, loras, refs


def _check(outs, ids, refs, abs_tol=1e-3, max_tokens=GREEDY.max_tokens):
    for out, lora_id in zip(outs, ids, strict=True):
        ref = hf_greedy(refs[lora_id], out.prompt_token_ids, max_tokens)
        got = out.outputs[0]
        assert got.token_ids == ref.tokens, f"adapter {lora_id}: greedy tokens differ from HF"
        lps = [entry[t].logprob for entry, t in zip(got.logprobs, got.token_ids)]
        assert lps == pytest.approx(ref.logprobs, abs=abs_tol), f"adapter {lora_id}: logprobs"


def test_mixed_adapters_in_one_batch_match_hf_merged(llama_setup):
    _, llm, loras, refs = llama_setup
    prompts = _prompts(8)
    ids = [1, None, 2, 3, 1, 2, None, 3]
    outs = llm.generate(prompts, GREEDY, lora_request=[loras.get(i) for i in ids], use_tqdm=False)
    _check(outs, ids, refs)
    assert outs[0].lora_request == loras[1] and outs[1].lora_request is None
    # The adapters change the outputs (the test would pass trivially otherwise).
    base = [hf_greedy(refs[None], p, 8).tokens for p in prompts]
    assert sum(o.outputs[0].token_ids != t for o, t in zip(outs, base)) >= 4


def test_prefix_cache_never_serves_another_adapters_kv(llama_setup):
    """The same 40-token prompt (two full blocks) with adapter a, then none, then b, then a
    again: each matches its own reference, and only the repeat hits the cache."""
    _, llm, loras, refs = llama_setup
    prompt = _prompts(1, seed=5, lo=40, hi=40)[0]
    engine = llm.llm_engine
    for lora_id, cached in ((1, False), (None, False), (2, False), (1, True)):
        hits = engine.get_stats().prefix_cache_hits
        outs = llm.generate([prompt], GREEDY, lora_request=loras.get(lora_id), use_tqdm=False)
        _check(outs, [lora_id], refs)
        assert (engine.get_stats().prefix_cache_hits > hits) == cached, lora_id


def test_async_scheduling_and_chunked_prefill_give_the_same_tokens(llama_setup):
    model, llm, loras, refs = llama_setup
    prompts = _prompts(6, seed=7, lo=20, hi=60)
    ids = [2, 1, None, 3, 2, 1]
    want = llm.generate(prompts, GREEDY, lora_request=[loras.get(i) for i in ids], use_tqdm=False)
    # Prompts of up to 60 tokens run in chunks of a 32-token budget.
    other = _lora_llm(model, max_loras=3, async_scheduling=True, max_num_batched_tokens=32)
    try:
        got = other.generate(
            prompts, GREEDY, lora_request=[loras.get(i) for i in ids], use_tqdm=False
        )
    finally:
        other.llm_engine.shutdown()
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    _check(got, ids, refs)


def test_triton_kernels_give_the_torch_paths_tokens(llama_setup):
    """The CUDA path (paged_kernels.lora_shrink / lora_expand through the static mapping
    buffers), run by the Triton interpreter on the CPU: HF's tokens, as the torch path."""
    pytest.importorskip("triton")
    _, llm, loras, refs = llama_setup
    mapping = llm.llm_engine.model_runner.lora.model.mapping
    mapping.use_kernels = True
    try:
        prompts = _prompts(3, seed=13, lo=3, hi=9)
        ids = [2, None, 3]
        # 4 tokens: a mixed prefill and 3 decode steps, each slow in the interpreter
        params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=1)
        outs = llm.generate(
            prompts, params, lora_request=[loras.get(i) for i in ids], use_tqdm=False
        )
    finally:
        mapping.use_kernels = False
        mapping.set(np.full(0, -1, dtype=np.int64))
    _check(outs, ids, refs, max_tokens=4)


def test_more_adapters_than_max_loras_take_turns(llama_setup):
    """max_loras=1: requests for three adapters and the base model all finish with their own
    adapter's tokens; no step ever runs two adapters; max_cpu_loras=2 unloads idle ones."""
    model, _, loras, refs = llama_setup
    llm = _lora_llm(model, max_loras=1, max_cpu_loras=2)
    engine = llm.llm_engine
    manager = engine.model_runner.lora
    seen: list[int] = []
    set_mapping = manager.set_mapping

    def spy(token_rows):
        set_mapping(token_rows)
        slots = {int(s) for s in manager.row_slot[token_rows] if s >= 0}
        seen.append(len(slots))

    manager.set_mapping = spy
    try:
        prompts = _prompts(6, seed=9)
        ids = [1, 2, 3, None, 1, 2]
        outs = llm.generate(
            prompts, GREEDY, lora_request=[loras.get(i) for i in ids], use_tqdm=False
        )
        _check(outs, ids, refs)
        assert max(seen) == 1
        # All three were needed at once (the cache grew past 2); it shrank back as requests
        # finished (adapter 1's first, so 1 went); the next one makes room.
        assert engine.list_loras() == {2, 3}
        engine.add_lora(LoRARequest("a-again", 4, loras[1].lora_path))
        assert engine.list_loras() == {2, 4}  # 3 was the least recently used
        # A bad adapter is refused before anything is unloaded: the cache keeps both.
        with pytest.raises(ValueError, match="lora"):
            engine.add_lora(LoRARequest("bad", 5, "/nowhere"))
        assert engine.list_loras() == {2, 4}
        # The stats (paged-server's lora_requests_info) name the adapters running and waiting.
        for k, lora_id in enumerate([1, 2, 3]):
            engine.add_request(
                f"s{k}", {"prompt_token_ids": [4, 5]}, GREEDY, lora_request=loras[lora_id]
            )
        engine.step()
        stats = engine.get_stats()
        assert stats.max_loras == 1 and stats.running_lora_adapters == ["a"]
        assert stats.waiting_lora_adapters == ["b", "c"]
        # vLLM's waiting reasons: both wait for a LoRA slot (deferred), not for capacity
        assert stats.num_waiting == 2 and stats.num_waiting_deferred == 2
        while engine.has_unfinished_requests():
            engine.step()
    finally:
        engine.shutdown()


def test_add_remove_and_list_loras(llama_setup, tmp_path):
    model, _, loras, refs = llama_setup
    llm = _lora_llm(model)
    engine = llm.llm_engine
    try:
        assert engine.add_lora(loras[2]) and engine.list_loras() == {2}
        assert engine.remove_lora(2) and engine.list_loras() == set()
        assert not engine.remove_lora(2)  # not loaded
        # An id in use by an unfinished request stays.
        engine.add_request("r", {"prompt_token_ids": [5, 6, 7]}, GREEDY, lora_request=loras[1])
        assert not engine.remove_lora(1)
        while engine.has_unfinished_requests():
            engine.step()
        assert engine.remove_lora(1)
        # Loaded again on demand, with the same result.
        outs = llm.generate([[5, 6, 7]], GREEDY, lora_request=loras[1], use_tqdm=False)
        _check(outs, [1], refs)
    finally:
        engine.shutdown()


def _bad_adapters(model: Path, root: Path) -> dict[str, tuple[Path, str]]:
    """name -> (adapter dir, a fragment of the error it must raise)."""
    bad = {}
    big = write_lora_adapter(root / "big", model, rank=16)
    bad["rank"] = (big, "max_lora_rank=8")
    head = write_lora_adapter(root / "head", model, rank=2, target_modules=("lm_head",))
    bad["lm_head"] = (head, "'lm_head'")
    dora = write_lora_adapter(root / "dora", model, rank=2)
    cfg = json.loads((dora / "adapter_config.json").read_text())
    (dora / "adapter_config.json").write_text(json.dumps({**cfg, "use_dora": True}))
    bad["dora"] = (dora, "DoRA")
    empty = root / "empty"
    empty.mkdir()
    bad["no config"] = (empty, "adapter_config.json")
    bad["missing"] = (root / "nowhere", "not a directory")
    trunc = write_lora_adapter(root / "trunc", model, rank=2)
    (trunc / "adapter_model.safetensors").write_bytes(b"\x08\x00\x00")
    bad["truncated"] = (trunc, "unreadable")
    shape = write_lora_adapter(root / "shape", model, rank=2)
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(shape / "adapter_model.safetensors"))
    key = next(k for k in tensors if "q_proj.lora_B" in k)
    tensors[key] = torch.zeros(tensors[key].shape[0] + 1, 2)  # one output row too many
    save_file(tensors, str(shape / "adapter_model.safetensors"))
    bad["shape"] = (shape, "q_proj")
    return bad


def test_bad_adapters_are_refused_and_the_engine_keeps_serving(llama_setup, tmp_path):
    model, llm, loras, refs = llama_setup
    engine = llm.llm_engine
    for k, (name, (path, fragment)) in enumerate(_bad_adapters(model, tmp_path).items()):
        lora = LoRARequest(name, 100 + k, str(path))
        with pytest.raises(ValueError, match="lora_request") as info:
            engine.add_request(f"bad-{k}", {"prompt_token_ids": [5, 6]}, GREEDY, lora_request=lora)
        assert fragment in str(info.value), (name, str(info.value))
        assert 100 + k not in engine.list_loras()
    # One id names one directory.
    other = LoRARequest("a2", 1, loras[2].lora_path)
    llm.generate([[4, 5]], GREEDY, lora_request=loras[1], use_tqdm=False)
    with pytest.raises(ValueError, match="lora_int_id 1 is loaded from"):
        llm.generate([[4, 5]], GREEDY, lora_request=other, use_tqdm=False)
    with pytest.raises(ValueError, match="one per prompt"):
        llm.generate([[4, 5], [6, 7]], GREEDY, lora_request=[loras[1]], use_tqdm=False)
    assert engine.scheduler.num_waiting == 0 and engine.scheduler.num_running == 0
    outs = llm.generate([[9, 8, 7]], GREEDY, lora_request=loras[3], use_tqdm=False)
    _check(outs, [3], refs)


def test_lora_options_are_checked(tiny_llama_dir):
    with pytest.raises(ValueError, match="enable_lora=True"):
        LLM(str(tiny_llama_dir), max_model_len=64).generate(
            [[1, 2]], GREEDY, lora_request=LoRARequest("x", 1, "/nowhere"), use_tqdm=False
        )
    for kwargs, fragment in (
        ({"max_loras": 0}, "max_loras"),
        ({"max_lora_rank": -1}, "max_lora_rank"),
        ({"max_loras": 2, "max_cpu_loras": 1}, "max_cpu_loras"),
        ({"enable_lora": True, "batch_invariant": True}, "batch_invariant"),
        ({"enable_lora": True, "compilation_config": 1}, "compilation_config"),
    ):
        with pytest.raises(ValueError, match=fragment):
            LLM(str(tiny_llama_dir), **kwargs)
    for args in (("", 1, "/p"), ("x", 0, "/p"), ("x", True, "/p"), ("x", 1, "")):
        with pytest.raises(ValueError):
            LoRARequest(*args)


@pytest.mark.parametrize("arch", ["gpt2", "phi3", "gpt_neox", "opt"])
def test_other_architectures_match_hf_merged(arch, tiny_model_factory, tmp_path):
    model = tiny_model_factory(arch)
    adapter = write_lora_adapter(tmp_path / "a", model, rank=4, target_modules=TARGETS[arch])
    lora = LoRARequest("a", 1, str(adapter))
    llm = LLM(str(model), dtype="float32", max_model_len=64, enable_lora=True, max_lora_rank=4)
    try:
        prompts = _prompts(3, seed=11)
        outs = llm.generate(prompts, GREEDY, lora_request=[lora, None, lora], use_tqdm=False)
    finally:
        llm.llm_engine.shutdown()
    refs = {None: load_hf_model(model), 1: merge_lora_adapter(load_hf_model(model), adapter)}
    _check(outs, [1, None, 1], refs)


def test_mapping_groups_tokens_by_slot():
    m = LoRAMapping(num_slots=3, max_tokens=16, device=torch.device("cpu"))
    m.set(np.array([-1, 2, 2, 2, 0, -1, 0, 2]))
    groups = {slot: (rows, end) for slot, rows, end in m.groups}
    assert groups[0][0].tolist() == [4, 6] and groups[0][1] is None  # gathered
    assert groups[2][0].tolist() == [1, 2, 3, 7] and groups[2][1] is None
    assert m.num_lora_tokens == 6
    m.set(np.array([1, 1, 1]))
    assert m.groups == [(1, 0, 3)]  # one contiguous run: a slice
    m.set(np.array([-1, -1]))
    assert m.groups == [] and m.num_lora_tokens == 0


def test_beam_search_and_n_run_with_the_adapter(llama_setup):
    """Forked sequences (n > 1, beams) keep their request's adapter: n=2 greedy samples are
    HF-merged's greedy tokens, and beam search with the adapter differs from without."""
    from paged_engine import BeamSearchParams

    _, llm, loras, refs = llama_setup
    prompt = _prompts(1, seed=17)[0]
    sp = SamplingParams(n=2, temperature=0, max_tokens=8, ignore_eos=True)
    out = llm.generate([prompt], sp, lora_request=loras[2], use_tqdm=False)[0]
    want = hf_greedy(refs[2], prompt, 8).tokens
    assert [list(c.token_ids) for c in out.outputs] == [want, want]
    params = BeamSearchParams(beam_width=2, max_tokens=6)
    with_lora = llm.beam_search([{"prompt_token_ids": prompt}], params, lora_request=loras[2])
    base = llm.beam_search([{"prompt_token_ids": prompt}], params)
    assert with_lora[0].sequences[0].lora_request == loras[2]
    assert with_lora[0].sequences[0].tokens != base[0].sequences[0].tokens


def test_adapter_churn_under_preemption_and_async_scheduling(llama_setup):
    """Random traffic over three adapters and the base model on two slots, a KV pool small enough
    to preempt, async scheduling, n > 1, aborts and removals: every finished request has the
    tokens it gets alone, and no row keeps an adapter slot once its sequences are gone."""
    model, llm_ref, loras, _ = llama_setup
    llm = _lora_llm(
        model,
        max_loras=2,
        max_cpu_loras=2,
        num_gpu_blocks_override=14,
        max_num_seqs=12,
        max_num_batched_tokens=64,
        async_scheduling=True,
    )
    engine = llm.llm_engine
    rng = random.Random(4)
    system = [rng.randrange(3, 500) for _ in range(32)]
    want: dict[str, tuple] = {}
    alone: dict[tuple, list] = {}

    def check(out) -> None:
        prompt, lora, sp = want.pop(out.request_id)
        key = (tuple(prompt), lora, sp.max_tokens, sp.n)
        if key not in alone:
            ref = llm_ref.generate([prompt], sp, lora_request=loras.get(lora), use_tqdm=False)
            alone[key] = sorted(list(c.token_ids) for c in ref[0].outputs)
        assert sorted(list(c.token_ids) for c in out.outputs) == alone[key], out.request_id

    try:
        for k in range(60):
            prefix = system if rng.random() < 0.5 else []
            prompt = prefix + [rng.randrange(3, 500) for _ in range(rng.randint(2, 30))]
            lora = rng.choice([1, 2, 3, None])
            sp = SamplingParams(
                temperature=0, max_tokens=rng.randint(1, 16), ignore_eos=True, n=rng.choice([1, 2])
            )
            engine.add_request(f"r{k}", prompt, sp, lora_request=loras.get(lora))
            want[f"r{k}"] = (prompt, lora, sp)
            if k % 7 == 3:
                engine.remove_lora(rng.choice([1, 2, 3]))  # refused while in use
            if k % 11 == 5:
                rid = rng.choice(sorted(want))
                engine.abort_request(rid)
                del want[rid]
            for _ in range(rng.randint(0, 3)):
                for out in engine.step():
                    if out.finished:
                        check(out)
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    check(out)
        stats = engine.get_stats()
        assert not want and stats.num_preemptions > 0 and stats.num_used_blocks == 0
        manager, batch = engine.model_runner.lora, engine.model_runner.batch
        live = [c for c in batch.seqs.values() if c.lora_id]  # finished rows drop next step
        assert sum(manager.users.values()) == len(live)
    finally:
        engine.shutdown()


def test_embeddings_run_with_the_adapter(llama_setup):
    """LLM.embed(..., lora_request=...): the adapter's hidden states, HF-merged's last one."""
    model, _, loras, refs = llama_setup
    llm = _lora_llm(model)
    try:
        prompt = _prompts(1, seed=19)[0]
        with_lora, base = llm.embed(
            [{"prompt_token_ids": prompt}] * 2, lora_request=[loras[1], None], use_tqdm=False
        )
    finally:
        llm.llm_engine.shutdown()
    for out, lora_id in ((with_lora, 1), (base, None)):
        with torch.no_grad():
            hf = refs[lora_id](torch.tensor([prompt]), output_hidden_states=True)
        want = torch.nn.functional.normalize(hf.hidden_states[-1][0, -1], dim=-1)
        got = torch.tensor(out.outputs.embedding)
        assert torch.allclose(got, want, atol=1e-4), lora_id


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_speculative_decoding_with_adapters(llama_setup, method):
    """Adapters under speculation: the verification forward runs each row's drafts with its
    adapter (a draft model runs without one: its drafts are only guesses), so every request
    gives HF's merged-adapter tokens, with drafts accepted."""
    model, _, loras, refs = llama_setup
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}
    if method == "draft_model":
        spec = {"model": str(model), "num_speculative_tokens": 3}
    llm = _lora_llm(model, max_loras=3, speculative_config=spec)
    prompts = [[5, 6, 7, 8] * 6, [40, 41] * 9, *_prompts(4, seed=9)]
    ids = [1, 2, 3, None, 1, 2]
    outs = llm.generate(prompts, GREEDY, lora_request=[loras.get(i) for i in ids], use_tqdm=False)
    _check(outs, ids, refs)
    stats = llm.llm_engine.get_stats()
    assert stats.spec_decode_num_accepted_tokens > 0
