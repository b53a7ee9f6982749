"""PLaMo 3 (`Plamo3ForCausalLM`, remote code; models/plamo3.py) against transformers' Gemma 3.

transformers has no PLaMo 3 class; HF's Gemma3ForCausalLM is the same computation once its
weights are renamed and re-offset: sliding / full attention layers by the same rule (layer i
full when (i + 1) % sliding_window_pattern == 0), a window counting the query's own position,
per-head q / k RMSNorms before a NeoX RoPE whose base depends on the layer type, four sandwich
norms a layer, a gated MLP (hidden_activation "silu"), attention scaled by head_dim^-0.5
(query_pre_attn_scalar = head_dim), no soft caps. Gemma's norms scale by (1 + w); PLaMo's by
(offset + stored) with offsets 1 (pre norms, q / k norms, final norm), 1/5 (post-mixer) and
1/5^1.5 (post-MLP), so the release's stored weight is w + 1 - offset. Gemma 3 multiplies the
embedding by sqrt(hidden_size): PLaMo's scale_embedding=True, and for the default (False) the
reference's embed_scale is set to 1.

The converted tensors go under the release's names (model.layers.layers.{i}.mixer.qkv_proj,
mlp.gate_up_proj, pre_mixer_norm, ...) beside a config.json in the release's fields, served by
paged (through remote_aliases' translation) and compared in float32: greedy tokens identical,
top-5 logprobs within 1e-3. Tiny model: 3 layers (sliding, sliding, full), window 8, 4 query
heads on 2 KV heads of 16; prompts up to 40 tokens (past the window), in prefill chunks of 16.
A second release takes the other branches: scale_embedding, an untied lm_head padded to a
multiple of 16 rows (vocab 500), YaRN on the full layers (rope_scaling_factor 2; HF's own yarn,
with `truncate` read from the full layers' parameters, where HF's per-layer-type lookup misses
it), and the older field names (rope_global_theta, sliding_window as a per-layer list).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from hf_parity import assert_llm_matches
from hf_reference import hf_greedy

from paged_engine import LLM
from paged_engine.testing import _COMMON, _randomize, build_tiny_tokenizer

transformers = pytest.importorskip("transformers")
from safetensors.torch import save_file  # noqa: E402

TOKENS = 6
CONFIG = {  # a release's config.json, tiny
    "architectures": ["Plamo3ForCausalLM"],
    "auto_map": {
        "AutoConfig": "configuration_plamo3.Plamo3Config",
        "AutoModelForCausalLM": "modeling_plamo3.Plamo3ForCausalLM",
    },
    "model_type": "plamo3",
    "hidden_size": 64,
    "num_hidden_layers": 3,
    "rms_norm_eps": 1e-6,
    "scale_embedding": False,
    "tie_word_embeddings": True,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 2048,
    "window_size": 8,
    "sliding_window_pattern": 3,
    "rope_theta": 1_000_000,
    "rope_local_theta": 10_000,
    "rope_scaling_factor": 1,
    "initial_context_length": None,
    "intermediate_size": 96,
    "vocab_size": 512,
    "tokenizer_class": "Plamo3Tokenizer",
    "torch_dtype": "float32",
    **_COMMON,
}
# the older names, a scaled embedding, an untied head, YaRN on the full layers
SCALED = {
    **{k: v for k, v in CONFIG.items() if k not in ("rope_theta", "window_size")},
    "rope_global_theta": 500_000,
    "sliding_window": [8, 8, None],
    "scale_embedding": True,
    "tie_word_embeddings": False,
    "vocab_size": 500,
    "rope_scaling_factor": 2.0,
    "initial_context_length": 64,
    "max_position_embeddings": 128,
}
# Gemma 3's norm -> (the release's norm, its offset)
NORMS = {
    "input_layernorm": ("pre_mixer_norm", 1.0),
    "post_attention_layernorm": ("post_mixer_norm", 1 / 5),
    "pre_feedforward_layernorm": ("pre_mlp_norm", 1.0),
    "post_feedforward_layernorm": ("post_mlp_norm", 5**-1.5),
}


def _gemma3_config(c: dict):
    """HF Gemma 3's config of the model the release config `c` describes."""
    layers, pattern = c["num_hidden_layers"], c["sliding_window_pattern"]
    full = {"rope_type": "default", "rope_theta": c.get("rope_theta", c.get("rope_global_theta"))}
    if c["rope_scaling_factor"] != 1:
        full |= {"rope_type": "yarn", "factor": c["rope_scaling_factor"], "truncate": False}
        full |= {"original_max_position_embeddings": c["initial_context_length"]}
        full |= {"beta_fast": 32.0, "beta_slow": 1.0}
    names = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "head_dim")
    names += ("num_attention_heads", "num_key_value_heads", "rms_norm_eps")
    return transformers.Gemma3TextConfig(
        **{k: c[k] for k in (*names, "max_position_embeddings", "tie_word_embeddings")},
        **_COMMON,
        query_pre_attn_scalar=c["head_dim"],
        hidden_activation="silu",
        sliding_window=c.get("window_size") or max(w or 0 for w in c["sliding_window"]),
        layer_types=[
            "full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
            for i in range(layers)
        ],
        rope_parameters={
            "full_attention": full,
            "sliding_attention": {"rope_type": "default", "rope_theta": c["rope_local_theta"]},
        },
        final_logit_softcapping=None,
        attn_logit_softcapping=None,
    )


def _release_tensors(state: dict[str, torch.Tensor], c: dict) -> dict[str, torch.Tensor]:
    """Gemma 3's tensors under the release's names and offsets (module docstring)."""
    out = {}
    for name, w in state.items():
        if name.startswith("model.layers."):
            i, rest = name.removeprefix("model.layers.").split(".", 1)
            at, module = f"model.layers.layers.{i}.", rest.split(".weight")[0]
            if module == "self_attn.q_proj":
                qkv = [state[name.replace("q_proj", p)] for p in ("q_proj", "k_proj", "v_proj")]
                out[at + "mixer.qkv_proj.weight"] = torch.cat(qkv)
            elif module == "mlp.gate_proj":
                gate_up = [state[name.replace("gate_proj", p)] for p in ("gate_proj", "up_proj")]
                out[at + "mlp.gate_up_proj.weight"] = torch.cat(gate_up)
            elif module in NORMS:
                ours, offset = NORMS[module]
                out[at + ours + ".weight"] = w + 1.0 - offset
            elif module not in ("self_attn.k_proj", "self_attn.v_proj", "mlp.up_proj"):
                out[at + rest.replace("self_attn.", "mixer.")] = w
        elif name == "lm_head.weight":
            if not c["tie_word_embeddings"]:  # padded to 16 rows, the padding never read
                rows = -(-w.shape[0] // 16) * 16
                out[name] = torch.cat([w, torch.full((rows - w.shape[0], w.shape[1]), 9.0)])
        else:
            out[name] = w
    return {k: v.contiguous() for k, v in out.items()}


def _write(path: Path, c: dict, seed: int):
    """HF Gemma 3 of the release `c` with random weights (norm weights around 0: scales near
    1), saved to `path` as the release; returns the HF model, ready to generate."""
    torch.manual_seed(seed)
    hf = transformers.Gemma3ForCausalLM(_gemma3_config(c)).float().eval()
    with torch.no_grad():
        _randomize(hf, seed)
        for name, p in hf.named_parameters():
            if name.endswith("norm.weight"):
                p.sub_(1.0)
        if not c["scale_embedding"]:
            hf.model.embed_tokens.embed_scale.fill_(1.0)
        if c["rope_scaling_factor"] != 1:  # HF's yarn, truncate read where it is set
            rope = hf.model.rotary_emb
            flat = transformers.PretrainedConfig(
                rope_parameters=hf.config.rope_parameters["full_attention"],
                head_dim=c["head_dim"],
                hidden_size=c["hidden_size"],
                num_attention_heads=c["num_attention_heads"],
                max_position_embeddings=c["max_position_embeddings"],
            )
            inv_freq, scaling = transformers.modeling_rope_utils.ROPE_INIT_FUNCTIONS["yarn"](flat)
            rope.full_attention_inv_freq.copy_(inv_freq)
            rope.full_attention_attention_scaling = scaling
    hf.generation_config.eos_token_id = None
    hf.generation_config.pad_token_id = 0
    save_file(_release_tensors(hf.state_dict(), c), str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(c))
    build_tiny_tokenizer(c["vocab_size"], seed).save_pretrained(path)
    transformers.GenerationConfig(**_COMMON).save_pretrained(path)
    return hf


def _prompts(seed: int, vocab: int) -> list[list[int]]:
    """A prompt of 40 tokens (five windows), one of 27, one of 13."""
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in (40, 27, 13)]


def test_plamo3_matches_gemma3_reference(tmp_path):
    hf = _write(tmp_path, CONFIG, 3)
    prompts = _prompts(3, CONFIG["vocab_size"])
    refs = [hf_greedy(hf, p, TOKENS, 5) for p in prompts]
    llm = LLM(model=str(tmp_path), dtype="float32", max_model_len=96, max_num_batched_tokens=16)
    model = llm.llm_engine.model_runner.model.model
    assert [layer.mixer.attn.sliding_window for layer in model.layers] == [8, 8, None]
    assert_llm_matches("plamo3", llm, prompts, refs)


def test_plamo3_scaled_untied_yarn_matches_gemma3_reference(tmp_path):
    hf = _write(tmp_path, SCALED, 4)
    prompts = _prompts(4, SCALED["vocab_size"])
    refs = [hf_greedy(hf, p, TOKENS, 5) for p in prompts]
    llm = LLM(model=str(tmp_path), dtype="float32", max_model_len=96)
    assert_llm_matches("plamo3-scaled", llm, prompts, refs)


@pytest.mark.parametrize(
    ("name", "value", "match"),
    [
        ("linear_type", "fp8", "linear_type"),
        ("image_token_id", 5, "image_token_id"),
        ("attention_bias", True, "attention_bias"),
        ("rope_scaling_factor", 4.0, "initial_context_length"),  # YaRN needs its length
        ("sliding_window", [8, 4, None], "sliding_window"),  # one window size
        ("sliding_window_pattern", 0, "sliding_window_pattern"),
    ],
)
def test_plamo3_refuses_unserved_fields(name, value, match, tmp_path):
    from paged_engine.models.remote_aliases import remote_config

    (tmp_path / "config.json").write_text(json.dumps({**CONFIG, name: value}))
    with pytest.raises(ValueError, match=match):
        remote_config(tmp_path)
