"""DeciLM / Nemotron-NAS (models/decilm.py), a remote-code release, against an HF model composed
from transformers' Llama pieces: a tiny LlamaForCausalLM whose layers get, per block config, a
LlamaAttention with the block's own KV head count, a LlamaMLP of the block's own width, a bare
[D, D] linear for `replace_with_linear`, and a zero output with no norm for `no_op` (the stream
passes through, as DeciLM skips the part). Saved under the release's names and config.json (its
config class loaded with trust_remote_code), `LLM` gives the composed model's greedy tokens and
top-5 logprobs (1e-3, float32), with a KV cache of three shapes for the three layers with
attention; prefill in chunks over cached prefix blocks, under preemption, gives the plain
engine's results."""

from __future__ import annotations

import copy
import json
from types import SimpleNamespace

import pytest
import torch
from hf_parity import assert_llm_matches
from hf_reference import (
    assert_same_greedy,
    engine_greedy,
    hf_greedy,
    random_token_prompts,
)
from torch import nn

from paged_engine import LLM
from paged_engine.models.decilm import DeciBlock, deci_blocks
from paged_engine.testing import _randomize, build_tiny_tokenizer, tiny_config

transformers = pytest.importorskip("transformers")

# (attention, ffn) of each layer, the fields a release's block_configs hold
_BLOCKS = [
    ({"n_heads_in_group": 2}, {"ffn_mult": 1.5}),  # 2 KV heads; MLP int(2/3 x 1.5 x 64) -> 256
    ({"no_op": True}, {"ffn_mult": 7.0}),  # MLP 298 -> 512
    ({"n_heads_in_group": 4}, {"no_op": True}),  # 1 KV head, no MLP
    ({"replace_with_linear": True}, {"replace_with_linear": True}),
    ({"n_heads_in_group": 1}, {"ffn_mult": 1.5}),  # 4 KV heads
]

# What those blocks are (the composed reference is built from this, not from the code tested)
_PARTS = [
    DeciBlock("attention", 2, "mlp", 256),
    DeciBlock("none", 0, "mlp", 512),
    DeciBlock("attention", 1, "none", 0),
    DeciBlock("linear", 0, "linear", 0),
    DeciBlock("attention", 4, "mlp", 256),
]

_RELEASE_CONFIG = """
from transformers import PretrainedConfig


class DeciLMConfig(PretrainedConfig):
    model_type = "nemotron-nas"

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
"""


def _block_configs() -> list[dict]:
    attention = {
        "n_heads_in_group": None,
        "no_op": False,
        "num_sink_tokens": None,
        "replace_with_linear": False,
        "sparsify": None,
        "unshifted_sink": False,
        "use_prefill_window_in_sink_attention": False,
        "window_length": None,
    }
    ffn = {"ffn_mult": None, "no_op": False, "replace_with_linear": False, "sparsify": None}
    return [{"attention": {**attention, **a}, "ffn": {**ffn, **f}} for a, f in _BLOCKS]


class _Zero(nn.Module):
    """A no_op part: adds nothing to the stream (HF's layer adds this output)."""

    def forward(self, hidden_states, *args, **kwargs):
        zero = torch.zeros_like(hidden_states)
        return zero if not kwargs and not args else (zero, None)


class _LinearAttention(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.linear_attn = nn.Linear(d, d, bias=False)

    def forward(self, hidden_states, **kwargs):
        return self.linear_attn(hidden_states), None


class _LinearMLP(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.linear_mlp = nn.Linear(d, d, bias=False)

    def forward(self, x):
        return self.linear_mlp(x)


def _composed_hf_model(config, blocks: list[DeciBlock]):
    """HF Llama with each layer's parts replaced as its block says."""
    from transformers.models.llama.modeling_llama import LlamaAttention, LlamaMLP

    model = transformers.LlamaForCausalLM(config)
    d = config.hidden_size
    for i, (layer, b) in enumerate(zip(model.model.layers, blocks, strict=True)):
        if b.attention == "attention":
            c = copy.deepcopy(config)
            c.num_key_value_heads = b.kv_heads
            layer.self_attn = LlamaAttention(c, i)
        elif b.attention == "linear":
            layer.self_attn = _LinearAttention(d)
        else:
            layer.self_attn, layer.input_layernorm = _Zero(), nn.Identity()
        if b.ffn == "mlp":
            c = copy.deepcopy(config)
            c.intermediate_size = b.ffn_width
            layer.mlp = LlamaMLP(c)
        elif b.ffn == "linear":
            layer.mlp = _LinearMLP(d)
        else:
            layer.mlp, layer.post_attention_layernorm = _Zero(), nn.Identity()
    _randomize(model, seed=7)
    model.eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


@pytest.fixture(scope="module")
def decilm(tmp_path_factory):
    """(the release-layout dir, the composed HF model its weights came from)."""
    from safetensors.torch import save_file

    path = tmp_path_factory.mktemp("decilm")
    config = tiny_config("llama", num_hidden_layers=len(_BLOCKS), tie_word_embeddings=False)
    release = {
        **{k: v for k, v in config.to_dict().items() if k not in ("dtype", "torch_dtype")},
        "architectures": ["DeciLMForCausalLM"],
        "auto_map": {"AutoConfig": "configuration_decilm.DeciLMConfig"},
        "model_type": "nemotron-nas",
        "block_configs": _block_configs(),
        "intermediate_size": None,  # the release's config has neither: each block says
        "num_key_value_heads": None,
        "torch_dtype": "float32",
    }
    hf = _composed_hf_model(config, _PARTS)
    state = {k: v.contiguous() for k, v in hf.state_dict().items()}
    assert "model.layers.3.self_attn.linear_attn.weight" in state
    assert not any(k.startswith("model.layers.1.self_attn.") for k in state)
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(release))
    (path / "configuration_decilm.py").write_text(_RELEASE_CONFIG)
    build_tiny_tokenizer(config.vocab_size).save_pretrained(path)
    return path, hf


def test_blocks_read_from_dicts_and_release_objects():
    """The release's config class turns block_configs into objects: the same blocks."""
    dicts = _block_configs()
    objects = [
        SimpleNamespace(
            attention=SimpleNamespace(**b["attention"]), ffn=SimpleNamespace(**b["ffn"])
        )
        for b in dicts
    ]
    base = {"num_hidden_layers": 5, "num_attention_heads": 4, "hidden_size": 64}
    assert deci_blocks(SimpleNamespace(**base, block_configs=dicts)) == _PARTS
    assert deci_blocks(SimpleNamespace(**base, block_configs=objects)) == _PARTS


def _llm(path, **kw) -> LLM:
    return LLM(model=str(path), dtype="float32", max_model_len=128, trust_remote_code=True, **kw)


def test_release_checkpoint_matches_composed_hf(decilm):
    from paged_engine.worker.cache_engine import kv_layers

    path, hf = decilm
    prompts = random_token_prompts("decilm", 3)
    refs = [hf_greedy(hf, p, 10, 5, use_cache=False) for p in prompts]
    llm = _llm(path, block_size=16)
    assert kv_layers(llm.llm_engine.hf_config) == [(2, 16), (1, 16), (4, 16)]
    assert_llm_matches("decilm", llm, prompts, refs)


def test_chunked_prefill_prefix_hits_and_preemption_match_plain(decilm):
    """Prefill in chunks of 8 over cached prefix blocks of 4, preempted in a pool of 20 blocks:
    each layer's cache of its own shape holds the same keys and values."""
    path, _ = decilm
    shared = list(range(7, 26))
    prompts = [shared + [30, 31], shared + [40, 41, 42], *random_token_prompts("deci", 2)]
    kw = {"model": str(path), "max_model_len": 64, "trust_remote_code": True}
    plain = engine_greedy(prompts, 12, enable_prefix_caching=False, **kw)
    stress = {"max_num_batched_tokens": 8, "max_num_seqs": 3, "num_gpu_blocks_override": 20}
    got = engine_greedy(prompts + prompts, 12, block_size=4, **stress, **kw)
    assert_same_greedy(plain + plain, got)


@pytest.mark.parametrize(
    ("attention", "match"),
    [
        ({"window_length": 8}, "window_length"),
        ({"num_sink_tokens": 4}, "num_sink_tokens"),
        ({"n_heads_in_group": 3}, "n_heads_in_group"),
    ],
)
def test_block_variants_not_served_are_refused(attention, match):
    blocks = _block_configs()
    blocks[0]["attention"].update(attention)
    config = SimpleNamespace(
        num_hidden_layers=5, num_attention_heads=4, hidden_size=64, block_configs=blocks
    )
    with pytest.raises(ValueError, match=match):
        deci_blocks(config)
