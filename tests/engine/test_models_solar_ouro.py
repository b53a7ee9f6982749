"""Solar Pro (models/solar.py) and Ouro (models/ouro.py), two remote-code families with no
transformers class, against references composed here from HF Llama's own modules (a tiny HF
Llama checkpoint rewritten as the release's: Solar's tensors are Llama's names; Ouro adds its
sandwich norms and early-exit gate). The references are plain torch loops over the whole
sequence, no cache, following vLLM's solar.py / ouro.py:

    Solar   before layer i: keep the stream in slot 1 / 2 (i in bskcn_1 / bskcn_2), then blend
            it with slot 1 / 2 (i in bskcn_3 / bskcn_4) at the inference weight bskcn_tv[1];
            logits times logit_scale
    Ouro    the layers run total_ut_steps times, each layer x += in_norm_2(attn(in_norm(x)));
            x += post_norm_2(mlp(post_norm(x))), the final norm after every step; the
            early-exit gate unread

paged serves the rewritten checkpoint; greedy tokens identical, top-5 logprobs within 1e-3
(float32). Also: the configs' bad fields refused by name, and Ouro's one cache per (step,
layer)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from hf_parity import assert_llm_matches
from hf_reference import Greedy, load_hf_model, random_token_prompts

from paged_engine import LLM
from paged_engine.testing import write_tiny_model

transformers = pytest.importorskip("transformers")
from safetensors.torch import load_file, save_file  # noqa: E402
from test_models_llama_remote_more import _llama_fields  # noqa: E402

TOKENS = 6


def _release_config(path: Path, **fields) -> None:
    """config.json rewritten as a remote release's: the tiny Llama's sizes plus `fields`."""
    src = json.loads((path / "config.json").read_text())
    config = _llama_fields(src) | {"hidden_act": "silu", "rope_theta": 10000.0}
    (path / "config.json").write_text(json.dumps(config | {"tie_word_embeddings": False} | fields))


def _greedy(logits_of: Callable[[torch.Tensor], torch.Tensor], prompt: list[int]) -> Greedy:
    """Greedy decoding by re-running `logits_of(ids [T]) -> [V]` over the whole sequence."""
    ids, tokens, chosen, tops = list(prompt), [], [], []
    with torch.no_grad():
        for _ in range(TOKENS):
            lp = torch.log_softmax(logits_of(torch.tensor(ids)).float(), -1)
            token = int(lp.argmax())
            vals, top = lp.topk(5)
            tops.append(dict(zip(top.tolist(), vals.tolist(), strict=True)))
            tokens.append(token)
            chosen.append(lp[token].item())
            ids.append(token)
    return Greedy(tokens, chosen, tops)


def _inputs(hf, ids: torch.Tensor):
    """(embedding [1, T, D], rotary tables, additive causal mask [1, 1, T, T]) of HF Llama."""
    x = hf.model.embed_tokens(ids[None])
    t = ids.shape[0]
    pos = torch.arange(t)[None]
    mask = torch.full((t, t), torch.finfo(x.dtype).min).triu(1)[None, None]
    return x, hf.model.rotary_emb(x, pos), mask


def _serves(path: Path, hf_logits, seed: int, case: str) -> LLM:
    prompts = random_token_prompts(seed, 2)
    refs = [_greedy(hf_logits, p) for p in prompts]
    llm = LLM(model=str(path), dtype="float32", max_model_len=96, block_size=16)
    assert_llm_matches(case, llm, prompts, refs)
    return llm


def _assert_refused(path: Path, config: dict, name: str) -> None:
    from paged_engine.models.remote_aliases import remote_config

    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=name):
        remote_config(path)


# Solar: slot 1 saved at 1 then again at 3 (blend 4 reads layer 3's); layer 2 saves slot 2
# before blending slot 1 into the stream (saves before blends); slot 2 blended at 5
SKIPS = {"bskcn_1": [1, 3], "bskcn_2": [2], "bskcn_3": [2, 4], "bskcn_4": [5]}
TV = [0.9, 0.7]  # [training, inference]: 0.7 is served
LOGIT_SCALE = 0.5


def _solar_logits(hf) -> Callable[[torch.Tensor], torch.Tensor]:
    tv = TV[1]

    def logits(ids: torch.Tensor) -> torch.Tensor:
        x, rope, mask = _inputs(hf, ids)
        saved = {}
        for i, layer in enumerate(hf.model.layers):
            for slot, key in ((1, "bskcn_1"), (2, "bskcn_2")):
                if i in SKIPS[key]:
                    saved[slot] = x
            for slot, key in ((1, "bskcn_3"), (2, "bskcn_4")):
                if i in SKIPS[key]:
                    x = saved[slot] * tv + x * (1 - tv)
            x = layer(x, attention_mask=mask, position_embeddings=rope)
        return hf.lm_head(hf.model.norm(x))[0, -1] * LOGIT_SCALE

    return logits


def test_solar_skip_connections(tmp_path):
    path = write_tiny_model(tmp_path, "llama", seed=31, num_hidden_layers=6)
    hf = load_hf_model(path)
    _release_config(
        path,
        architectures=["SolarForCausalLM"],
        auto_map={"AutoConfig": "configuration_solar.SolarConfig"},
        model_type="solar",
        sliding_window=2047,  # Solar's config class default: not applied (as vLLM)
        bskcn_tv=TV,
        logit_scale=LOGIT_SCALE,
        **SKIPS,
    )
    _serves(path, _solar_logits(hf), 31, "solar")


_SOLAR = {"architectures": ["SolarForCausalLM"], "model_type": "solar", "vocab_size": 128}
_SOLAR |= {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4}
_SOLAR |= {"num_hidden_layers": 6, **SKIPS, "bskcn_tv": TV}


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("bskcn_1", [1, 6]),  # no layer 6
        ("bskcn_3", [0, 4]),  # a blend before slot 1's first save (layer 1)
        ("bskcn_4", [1]),  # a blend before slot 2's first save (layer 2)
        ("bskcn_tv", [0.8]),
    ],
)
def test_solar_refuses_bad_skips(name, value, tmp_path):
    _assert_refused(tmp_path, _SOLAR | {name: value}, name)


STEPS = 3


def _ouro_checkpoint(path: Path) -> dict[str, torch.Tensor]:
    """The tiny Llama's tensors plus Ouro's: a second norm after attention and after the MLP
    of each layer (random weights), and the early-exit gate; written back to `path`."""
    file = path / "model.safetensors"
    state = load_file(file)
    gen = torch.Generator().manual_seed(7)
    extra = {}
    for i in range(2):
        for norm in ("input_layernorm_2", "post_attention_layernorm_2"):
            extra[f"model.layers.{i}.{norm}.weight"] = 1 + 0.5 * torch.randn(64, generator=gen)
    extra["model.early_exit_gate.weight"] = torch.randn(1, 64, generator=gen)
    extra["model.early_exit_gate.bias"] = torch.randn(1, generator=gen)
    save_file(state | extra, file, metadata={"format": "pt"})
    return extra


def _ouro_logits(hf, extra: dict[str, torch.Tensor]) -> Callable[[torch.Tensor], torch.Tensor]:
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    def norm(name: str) -> LlamaRMSNorm:
        module = LlamaRMSNorm(64, eps=hf.config.rms_norm_eps)
        module.weight.data.copy_(extra[name])
        return module

    norms = [
        (
            norm(f"model.layers.{i}.input_layernorm_2.weight"),
            norm(f"model.layers.{i}.post_attention_layernorm_2.weight"),
        )
        for i in range(len(hf.model.layers))
    ]

    def logits(ids: torch.Tensor) -> torch.Tensor:
        x, rope, mask = _inputs(hf, ids)
        for _ in range(STEPS):
            for layer, (after_attn, after_mlp) in zip(hf.model.layers, norms, strict=True):
                a, _ = layer.self_attn(
                    layer.input_layernorm(x), position_embeddings=rope, attention_mask=mask
                )
                x = x + after_attn(a)
                x = x + after_mlp(layer.mlp(layer.post_attention_layernorm(x)))
            x = hf.model.norm(x)
        return hf.lm_head(x)[0, -1]

    return logits


def test_ouro_looped_stack(tmp_path):
    path = write_tiny_model(tmp_path, "llama", seed=32)
    hf = load_hf_model(path)
    extra = _ouro_checkpoint(path)
    _release_config(
        path,
        architectures=["OuroForCausalLM"],
        auto_map={"AutoConfig": "configuration_ouro.OuroConfig"},
        model_type="ouro",
        total_ut_steps=STEPS,
        early_exit_threshold=1.0,
        use_sliding_window=False,
        sliding_window=None,
        max_window_layers=2,
        layer_types=["full_attention"] * 2,
    )
    llm = _serves(path, _ouro_logits(hf, extra), 32, "ouro")
    assert llm.get_stats().num_used_blocks == 0
    _assert_one_attention_per_cache(llm, 2 * STEPS)


def _assert_one_attention_per_cache(llm: LLM, count: int) -> None:
    """`count` paged Attention modules, each handed one cache of its own in a forward (what a
    compiled forward's cache map, worker/cpu_compile.py, needs)."""
    from paged_engine import SamplingParams
    from paged_engine.layers.attention import Attention

    runner = llm.llm_engine.model_runner
    assert len(runner.cache.kv_caches) == count
    seen: dict[int, set[int]] = {}

    def hook(module, args):
        seen.setdefault(id(module), set()).add(id(args[3][0]))

    attention = [m for m in runner.model.modules() if isinstance(m, Attention)]
    handles = [m.register_forward_pre_hook(hook) for m in attention]
    try:
        llm.generate(
            [{"prompt_token_ids": [5, 6, 7]}], SamplingParams(max_tokens=2), use_tqdm=False
        )
    finally:
        for h in handles:
            h.remove()
    assert len(attention) == count and all(len(caches) == 1 for caches in seen.values())
    assert len(set().union(*seen.values())) == count


_OURO = {"architectures": ["OuroForCausalLM"], "model_type": "ouro", "vocab_size": 128}
_OURO |= {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4}
_OURO |= {"num_hidden_layers": 2, "total_ut_steps": STEPS}


@pytest.mark.parametrize(
    ("name", "value"),
    [("use_sliding_window", True), ("head_dim", 32), ("total_ut_steps", 0), ("is_causal", False)],
)
def test_ouro_refuses_unsupported_fields(name, value, tmp_path):
    _assert_refused(tmp_path, _OURO | {name: value}, name)
