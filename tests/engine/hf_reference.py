"""HF transformers as the reference: greedy continuations and their logprobs, and the checks
that `LLM.generate` reproduces them (the method of every HF-parity test)."""

from __future__ import annotations

import json
import random
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch


def load_hf_model(path: str | Path):
    """The HF model of a model dir in float32, generating exactly max_new_tokens (no EOS)."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


@dataclass
class Greedy:
    tokens: list[int]
    logprobs: list[float]  # of each chosen token
    tops: list[dict[int, float]]  # per step, the `top` most likely {token: logprob}


def hf_greedy(model, prompt: list[int], max_new_tokens: int, top: int = 0, **kw) -> Greedy:
    """HF `generate`'s greedy continuation of `prompt` (kw: more generate() arguments)."""
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
            **kw,
        )
    tokens = out.sequences[0, len(prompt) :].tolist()
    steps = [torch.log_softmax(s[0].float(), -1) for s in out.logits]
    tops = []
    for lp in steps if top else []:
        vals, ids = lp.topk(top)
        tops.append(dict(zip(ids.tolist(), vals.tolist(), strict=True)))
    return Greedy(tokens, [lp[t].item() for lp, t in zip(steps, tokens)], tops)


def assert_matches(name: str, out, ref: Greedy, abs_tol: float = 1e-3) -> None:
    """`out` (a RequestOutput with logprobs) has HF's greedy tokens, and the chosen tokens'
    logprobs (and, when `ref` holds them, the top-k logprobs) within `abs_tol`."""
    ours = out.outputs[0]
    assert ours.token_ids == ref.tokens, f"{name}: greedy tokens differ from HF"
    got = [entry[t].logprob for entry, t in zip(ours.logprobs, ours.token_ids)]
    assert got == pytest.approx(ref.logprobs, abs=abs_tol), f"{name}: logprobs differ from HF"
    for entry, want in zip(ours.logprobs, ref.tops, strict=bool(ref.tops)):
        got_top = {t: lp.logprob for t, lp in entry.items() if t in want}
        assert len(got_top) == len(want), f"{name}: top-{len(want)} tokens differ from HF"
        assert got_top == pytest.approx(want, abs=abs_tol), f"{name}: top logprobs differ"


def random_token_prompts(seed: int | str, n: int) -> list[list[int]]:
    """`n` prompts of 12-40 random token ids of the tiny vocabulary."""
    rng = random.Random(seed)
    return [[rng.randrange(3, 512) for _ in range(rng.randint(12, 40))] for _ in range(n)]


def assert_tiny_case_matches_hf(
    case: str,
    arch: str,
    overrides: dict,
    tmp_path: Path,
    *,
    seed: int | str | None = None,
    num_prompts: int = 3,
    max_tokens: int = 10,
) -> None:
    """A tiny `arch` model (config `overrides`) served by `LLM` gives HF's greedy tokens and
    top-5 logprobs (1e-3, float32) on `num_prompts` random prompts (`seed`; by default the
    case name's length), `max_tokens` each; every block free afterwards."""
    from paged_engine import LLM, SamplingParams
    from paged_engine.testing import write_tiny_model

    path = write_tiny_model(tmp_path, arch, seed=1, **overrides)
    hf = load_hf_model(path)
    prompts = random_token_prompts(len(case) if seed is None else seed, num_prompts)
    refs = [hf_greedy(hf, p, max_tokens, 5) for p in prompts]
    llm = LLM(model=str(path), dtype="float32", max_model_len=128, block_size=16)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=5)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for out, ref in zip(outs, refs, strict=True):
        assert_matches(case, out, ref)
    assert llm.get_stats().num_used_blocks == 0


def assert_file_logprobs_match_hf(name: str, path, hf, seed: int) -> None:
    """LLM(model=path) (a GGUF file) gives `hf`'s greedy tokens and logprobs (1e-4), 6 a
    prompt, on random prompts of 9 and 23 tokens."""
    from paged_engine import LLM, SamplingParams

    gen = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, 512, (n,), generator=gen).tolist() for n in (9, 23)]
    refs = [hf_greedy(hf, p, 6) for p in prompts]
    llm = LLM(model=str(path), dtype="float32", max_model_len=64, block_size=16)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for out, ref in zip(outs, refs, strict=True):
        assert_matches(name, out, ref, abs_tol=1e-4)


def assert_file_greedy_matches_hf(path, hf, seed: int, lengths: tuple[int, ...]) -> None:
    """LLM(model=path) (a GGUF file: config, tokenizer and weights from it) gives `hf`'s greedy
    tokens, 8 a prompt, on random prompts of `lengths` tokens."""
    from paged_engine import LLM, SamplingParams

    gen = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, 512, (n,), generator=gen).tolist() for n in lengths]
    want = []
    for prompt in prompts:
        with torch.no_grad():
            out = hf.generate(
                torch.tensor([prompt]),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                max_new_tokens=8,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )
        want.append(out[0, len(prompt) :].tolist())
    llm = LLM(model=str(path), dtype="float32", max_model_len=128, block_size=16)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    results = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [r.outputs[0].token_ids for r in results] == want


def engine_greedy(prompts: list[list[int]], max_tokens: int, **engine_kwargs) -> list:
    """The CompletionOutput of each prompt, greedy (EOS ignored, each chosen token's logprob),
    from an `LLM(dtype="float32", **engine_kwargs)` that is shut down afterwards."""
    from paged_engine import LLM, SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=0)
    llm = LLM(**{"dtype": "float32", **engine_kwargs})
    try:
        requests = [{"prompt_token_ids": p} for p in prompts]
        return [o.outputs[0] for o in llm.generate(requests, params, use_tqdm=False)]
    finally:
        llm.llm_engine.shutdown()


def assert_same_greedy(want: list, got: list, abs_tol: float = 1e-4) -> None:
    """Two engines' greedy CompletionOutputs of the same requests: identical tokens, each
    token's logprob within `abs_tol`."""
    for w, g in zip(want, got, strict=True):
        assert g.token_ids == w.token_ids
        lps = [[e[t].logprob for e, t in zip(c.logprobs, c.token_ids)] for c in (w, g)]
        assert lps[1] == pytest.approx(lps[0], abs=abs_tol)


def assert_same_tokens_and_scores(want: list, got: list, abs_tol: float = 1e-4) -> None:
    """Two engines' RequestOutputs of the same requests (beams included): each completion's
    tokens identical, its cumulative logprob within `abs_tol` (None on both without one)."""
    for w, g in zip(want, got, strict=True):
        assert [c.token_ids for c in g.outputs] == [c.token_ids for c in w.outputs]
        for a, b in zip(g.outputs, w.outputs):
            if b.cumulative_logprob is None:  # sampled without logprobs
                assert a.cumulative_logprob is None
            else:
                assert a.cumulative_logprob == pytest.approx(b.cumulative_logprob, abs=abs_tol)


def assert_tp_matches_one_process(
    path, prompts: list[list[int]], max_tokens: int, max_model_len: int, abs_tol: float = 1e-4
) -> None:
    """tensor_parallel_size=2 (gloo on the CPU) gives the one-process engine's greedy tokens,
    logprobs within `abs_tol`."""
    kw = {"model": str(path), "max_model_len": max_model_len}
    one, two = (engine_greedy(prompts, max_tokens, tensor_parallel_size=tp, **kw) for tp in (1, 2))
    assert_same_greedy(one, two, abs_tol)


def assert_lora_matches_hf_merged(
    path,
    tmp_path: Path,
    prompt: list[int],
    max_tokens: int,
    top: int,
    tp: int = 1,
    targets: tuple[str, ...] = ("down_proj",),
) -> None:
    """A rank-4 adapter on `targets` (by default every down_proj: dense MLPs' and shared
    experts', whose partial sums leave the reduce to their MoE block): `LLM.generate` with it
    gives HF's greedy tokens and top-`top` logprobs on the model with the adapter merged, at
    tensor_parallel_size `tp`."""
    from paged_engine import LLM, LoRARequest, SamplingParams
    from paged_engine.testing import merge_lora_adapter, write_lora_adapter

    adapter = write_lora_adapter(tmp_path / "adapter", path, rank=4, target_modules=targets)
    ref = hf_greedy(merge_lora_adapter(load_hf_model(path), adapter), prompt, max_tokens, top)
    llm = LLM(
        model=str(path),
        dtype="float32",
        max_model_len=64,
        tensor_parallel_size=tp,
        enable_lora=True,
        max_lora_rank=4,
    )
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=top)
    try:
        out = llm.generate(
            [{"prompt_token_ids": prompt}],
            params,
            lora_request=LoRARequest("adapter", 1, str(adapter)),
            use_tqdm=False,
        )[0]
    finally:
        llm.llm_engine.shutdown()
    assert_matches(f"{Path(path).name} lora tp={tp}", out, ref)


def assert_hf_names_load_like_checkpoint(path, *hf_suffixes: str) -> None:
    """Our model of the tiny checkpoint `path`, its parameters zeroed and reloaded from HF's
    in-memory state dict (transformers 5's names: fused experts and the like), holds the values
    the checkpoint's own names gave. The state dict must hold a name ending in each of
    `hf_suffixes` (so the renames under test are exercised)."""
    from paged_engine.loader import load_hf_config, load_model, resolve_model

    resolved = resolve_model(str(path))
    model = load_model(resolved, load_hf_config(resolved), dtype=torch.float32, device="cpu")
    want = {name: p.detach().clone() for name, p in model.named_parameters()}
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    state = load_hf_model(path).state_dict()
    for suffix in hf_suffixes:
        assert any(name.endswith(suffix) for name in state), suffix
    model.load_weights(state.items())
    for name, p in model.named_parameters():
        assert torch.equal(p, want[name]), name


def assert_chunks_prefix_hits_and_preemption_match_plain(
    path, more_prompts: list[list[int]]
) -> None:
    """Prefill in chunks of 8 over cached prefix blocks of 4, preempted in a pool of 20 blocks
    (each request twice, 3 at a time): the plain engine's greedy tokens and logprobs (1e-4),
    12 a prompt, on two prompts sharing their first 19 tokens and `more_prompts`."""
    shared = list(range(7, 26))
    prompts = [shared + [30, 31], shared + [40, 41, 42], *more_prompts]
    kw = {"model": str(path), "max_model_len": 64}
    plain = engine_greedy(prompts, 12, enable_prefix_caching=False, **kw)
    stress = {"max_num_batched_tokens": 8, "max_num_seqs": 3, "num_gpu_blocks_override": 20}
    got = engine_greedy(prompts + prompts, 12, block_size=4, **stress, **kw)
    assert_same_greedy(plain + plain, got)


def exec_transformers_module(model: str, file: str, tvf: object, drop: str = "") -> dict:
    """The namespace of transformers' models/<model>/<file> run from its source (read, not
    imported: it needs torchvision), `tvf` standing for its `tvF` (torchvision's functional
    module), `drop` (an unconditional torchvision import) cut from the source, and
    transformers' `auto_docstring` a no-op while it runs (it wants the real module)."""
    import importlib.util

    import transformers.utils as utils

    root = importlib.util.find_spec("transformers").submodule_search_locations[0]
    source = Path(root, "models", model, file).read_text()
    if drop:
        assert drop in source, f"{model}/{file} no longer has {drop!r}"
        source = source.replace(drop, "")
    namespace = {
        "__name__": f"transformers.models.{model}.{Path(file).stem}_copy",
        "__package__": f"transformers.models.{model}",
        "tvF": tvf,
    }
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(utils, "auto_docstring", lambda obj=None, **kw: obj or (lambda f: f))
        exec(compile(source, file, "exec"), namespace)
    return namespace


def hf_greedy_from_embeds(model, embeds: torch.Tensor, steps: int = 8, top: int = 5) -> Greedy:
    """HF's greedy continuation of `embeds` [1, T, D] (media rows already in): `model` run
    over the whole sequence each step (for classes whose generate takes no inputs_embeds),
    each chosen token's row appended from its input embedding table."""
    table = model.get_input_embeddings()
    tokens, chosen, tops = [], [], []
    with torch.no_grad():
        for _ in range(steps):
            lp = torch.log_softmax(model(inputs_embeds=embeds).logits[0, -1].float(), -1)
            token = int(lp.argmax())
            values, ids = lp.topk(top)
            tokens.append(token)
            chosen.append(lp[token].item())
            tops.append(dict(zip(ids.tolist(), values.tolist(), strict=True)))
            embeds = torch.cat([embeds, table(torch.tensor([[token]]))], dim=1)
    return Greedy(tokens, chosen, tops)


def hf_greedy_with_rows(model, ids: list[int], token: int, rows: list[torch.Tensor]) -> Greedy:
    """HF's greedy continuation of `ids` (8 tokens, top-5 logprobs) with the input embeddings
    at each `token` position replaced, in order, by the rows of `rows` ([n_i, D] each, as many
    in all as `ids` holds `token`); no rows: the plain prompt."""
    if not rows:
        return hf_greedy(model, ids, 8, 5)
    with torch.no_grad():
        embeds = model.get_input_embeddings()(torch.tensor([ids]))
        embeds[0, torch.tensor(ids) == token] = torch.cat(rows)
    return hf_greedy(model, ids, 8, 5, inputs_embeds=embeds)


@torch.no_grad()
def greedy_over_logits(
    logits: Callable[[torch.Tensor], torch.Tensor], prompt: list[int], steps: int, top: int = 5
) -> Greedy:
    """Greedy continuation of `prompt` by a hand-written reference: `logits(ids)` is its
    uncached forward over the whole sequence ([S] -> [S, V]), rerun at each of `steps` steps;
    the chosen tokens, their logprobs and each step's `top` most likely."""
    ids, tokens, chosen, tops = list(prompt), [], [], []
    for _ in range(steps):
        lp = logits(torch.tensor(ids))[-1].log_softmax(-1)
        token = int(lp.argmax())
        vals, top_ids = lp.topk(top)
        tops.append(dict(zip(top_ids.tolist(), vals.tolist(), strict=True)))
        tokens.append(token)
        chosen.append(lp[token].item())
        ids.append(token)
    return Greedy(tokens, chosen, tops)


def hf_greedy_with_img_runs(
    model, tok, text: str, rows: list[torch.Tensor]
) -> tuple[list[int], Greedy]:
    """(the prompt ids vLLM makes of `text` for InternVL-style releases: each "<image>" as
    <img>, one "<image>" per row of its entry of `rows` ([n_i, D]), </img>, then tokenized;
    `model`'s greedy continuation with top-5 logprobs, those rows scattered in)."""
    start, end, ctx = tok.convert_tokens_to_ids(["<img>", "</img>", "<image>"])
    pieces = text.split("<image>")
    expanded = pieces[0] + "".join(
        "<img>" + "<image>" * r.shape[0] + "</img>" + piece
        for r, piece in zip(rows, pieces[1:], strict=True)
    )
    ids = tok(expanded).input_ids
    assert ids.count(start) == ids.count(end) == len(rows)
    return ids, hf_greedy_with_rows(model, ids, ctx, rows)


def hf_greedy_with_tower_runs(
    ref, text: str, images: list, placeholder: str, merge: int
) -> tuple[list[int], Greedy]:
    """(the prompt ids of `text` with its i-th `placeholder` repeated once per merged patch of
    image i (t h w / merge^2 of its image_grid_thw), then tokenized; the LM's greedy with top-5
    logprobs over the tower's pooled rows scattered in) for a Qwen2-VL-style release. `ref`:
    (LM, tower, tokenizer, image processor, the placeholder's id)."""
    llm, tower, tokenizer, pixels, pad = ref
    rows = []
    for image in images:
        out = pixels(images=[image], return_tensors="pt")
        t, h, w = out["image_grid_thw"][0].tolist()
        head, _, rest = text.partition(placeholder)
        text = head + "<|RUN|>" * (t * h * w // merge**2) + rest  # a run not partitioned again
        with torch.no_grad():
            rows.append(tower(out["pixel_values"], grid_thw=out["image_grid_thw"]).pooler_output)
    ids = tokenizer(text.replace("<|RUN|>", placeholder)).input_ids
    return ids, hf_greedy_with_rows(llm, ids, pad, rows)


def hf_generate_greedy(model, n: int, top: int = 5, **inputs) -> Greedy:
    """HF `generate`'s greedy continuation of one sequence (`inputs`: generate's keyword
    inputs), `n` tokens with no end-of-text stop: each step's argmax, its logprob and the `top`
    most likely; asserts the last `n` tokens of the generated sequence are those argmaxes."""
    with torch.no_grad():
        out = model.generate(
            max_new_tokens=n,
            do_sample=False,
            eos_token_id=None,
            output_logits=True,
            return_dict_in_generate=True,
            **inputs,
        )
    tokens, lps, tops = [], [], []
    for step in out.logits:
        lp = torch.log_softmax(step[0].float(), -1)
        t = int(lp.argmax())
        vals, ids = lp.topk(top)
        tokens.append(t)
        lps.append(lp[t].item())
        tops.append(dict(zip(ids.tolist(), vals.tolist(), strict=True)))
    assert out.sequences[0, -n:].tolist() == tokens
    return Greedy(tokens, lps, tops)


def edited_checkpoint(src: Path, dst: Path, **fields) -> Path:
    """A copy of checkpoint `src` at `dst` whose config.json has `fields` changed."""
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**cfg, **fields}))
    return dst


def hf_generate_enc_dec(model, n: int, **inputs) -> Greedy:
    """`hf_generate_greedy` for an encoder-decoder (BART-style) `model` with what its generation
    config adds beyond vLLM turned off: beams, n-gram blocking, forced BOS / EOS, min_length."""
    return hf_generate_greedy(
        model,
        n,
        num_beams=1,
        no_repeat_ngram_size=0,
        forced_bos_token_id=None,
        forced_eos_token_id=None,
        min_length=0,
        **inputs,
    )
