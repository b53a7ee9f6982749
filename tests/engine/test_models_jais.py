"""JAIS v1 (`JAISLMHeadModel`, remote code; models/jais.py) against a reference composed here:
transformers has no JAIS class, so the reference is HF GPT-2's exact pieces (its Conv1D, torch
LayerNorms) wired under the release's tensor names, with plain torch for what GPT-2 lacks, as
vLLM's jais.py computes it: the SwiGLU MLP c_proj(c_fc(x) * silu(c_fc2(x))), ALiBi's bias
-slope * |i - j| with the paper's slopes, the muP scalars (embedding times embeddings_scale,
q.k over head_dim when scale_qk_dot_by_d, logits times width_scale). Its weights are written
with the release's names and config.json fields (as literals), served by paged and compared:
greedy tokens identical, top-5 logprobs within 1e-3 (float32).

    alibi     jais-13b's spelling (embeddings_scale, width_scale, scale_qk_dot_by_d), 6 heads
              (slopes past the largest power of two), a tied head, the release's
              relative_pe.slopes buffer in the checkpoint
    learned   jais-family's spelling (mup_*), learned positions, 4 heads, an untied head

Also: the switches models/jais.py does not serve are refused by name.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from hf_parity import assert_llm_matches
from hf_reference import Greedy, greedy_over_logits, random_token_prompts
from torch import nn

from paged_engine import LLM
from paged_engine.testing import _COMMON, TINY_VOCAB_SIZE, _randomize, build_tiny_tokenizer

transformers = pytest.importorskip("transformers")
from safetensors.torch import save_file  # noqa: E402
from transformers.pytorch_utils import Conv1D  # noqa: E402

TOKENS = 6
VOCAB = TINY_VOCAB_SIZE

# config.json as the releases write it, less the sizes (each case's own)
_ALIBI = {
    "position_embedding_type": "alibi",
    "embeddings_scale": 2.5,
    "width_scale": 0.4,
    "scale_qk_dot_by_d": True,
}
_LEARNED = {
    "position_embedding_type": "learned",
    "mup_embeddings_scale": 1.75,
    "mup_output_alpha": 2.0,
    "mup_width_scale": 0.25,  # logits x 0.5
    "mup_scale_qk_dot_by_d": True,
    "tie_word_embeddings": False,
}
CASES = {
    "alibi": (_ALIBI, {"n_embd": 96, "n_head": 6, "n_inner": 160}),
    "learned": (_LEARNED, {"n_embd": 64, "n_head": 4, "n_inner": 128}),
}


def _slopes(n: int) -> list[float]:
    """ALiBi's slopes as vLLM's jais.py derives them: a power of two's geometric sequence
    from 2^(-8/n), else the nearest lower power's plus every other of twice that power's."""
    if math.log2(n).is_integer():
        start = 2 ** (-(2 ** -(math.log2(n) - 3)))
        return [start ** (i + 1) for i in range(n)]
    low = 2 ** math.floor(math.log2(n))
    return _slopes(low) + _slopes(2 * low)[0::2][: n - low]


class _Block(nn.Module):
    def __init__(self, d: int, inner: int):
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = nn.Module()
        self.attn.c_attn, self.attn.c_proj = Conv1D(3 * d, d), Conv1D(d, d)
        self.mlp = nn.Module()
        self.mlp.c_fc, self.mlp.c_fc2 = Conv1D(inner, d), Conv1D(inner, d)
        self.mlp.c_proj = Conv1D(d, inner)


class JaisReference(nn.Module):
    """JAIS under the release's names, recomputing the whole sequence each step."""

    def __init__(self, config: dict):
        super().__init__()
        d, self.cfg = config["n_embd"], config
        self.transformer = nn.Module()
        self.transformer.wte = nn.Embedding(VOCAB, d)
        if config["position_embedding_type"] == "learned":
            self.transformer.wpe = nn.Embedding(config["n_positions"], d)
        blocks = [_Block(d, config["n_inner"]) for _ in range(config["n_layer"])]
        self.transformer.h = nn.ModuleList(blocks)
        self.transformer.ln_f = nn.LayerNorm(d)
        if not config.get("tie_word_embeddings", True):
            self.lm_head = nn.Linear(d, VOCAB, bias=False)

    def scalars(self) -> tuple[float, float]:
        """(embeddings scale, logits scale) from whichever spelling config.json uses."""
        c = self.cfg
        if "embeddings_scale" in c:
            return c["embeddings_scale"], c["width_scale"]
        return c["mup_embeddings_scale"], c["mup_output_alpha"] * c["mup_width_scale"]

    def logits(self, ids: torch.Tensor) -> torch.Tensor:  # [S] -> [S, V]
        c, t = self.cfg, self.transformer
        heads, seq = c["n_head"], ids.shape[0]
        head_dim = c["n_embd"] // heads
        emb_scale, logits_scale = self.scalars()
        x = t.wte(ids)
        if hasattr(t, "wpe"):
            x = x + t.wpe(torch.arange(seq))
        x = x * emb_scale
        qk_by_d = c.get("scale_qk_dot_by_d", c.get("mup_scale_qk_dot_by_d"))
        scale = head_dim ** (-1.0 if qk_by_d else -0.5)
        pos = torch.arange(seq)
        bias = torch.zeros(heads, seq, seq)
        if c["position_embedding_type"] == "alibi":
            dist = (pos[None, :] - pos[:, None]).abs().float()  # [S, S]
            bias = -torch.tensor(_slopes(heads))[:, None, None] * dist
        causal = pos[None, :] > pos[:, None]
        for block in t.h:
            q, k, v = block.attn.c_attn(block.ln_1(x)).split(c["n_embd"], dim=-1)
            q, k, v = (u.view(seq, heads, head_dim).transpose(0, 1) for u in (q, k, v))
            scores = (q @ k.transpose(1, 2)) * scale + bias  # [H, S, S]
            probs = scores.masked_fill(causal, float("-inf")).softmax(-1)
            out = (probs @ v).transpose(0, 1).reshape(seq, -1)
            x = x + block.attn.c_proj(out)
            h = block.ln_2(x)
            mlp = block.mlp
            x = x + mlp.c_proj(mlp.c_fc(h) * nn.functional.silu(mlp.c_fc2(h)))
        head = self.lm_head.weight if hasattr(self, "lm_head") else t.wte.weight
        return t.ln_f(x) @ head.T * logits_scale

    def greedy(self, prompt: list[int], steps: int, top: int = 5) -> Greedy:
        return greedy_over_logits(self.logits, prompt, steps, top)


def _config(case: str) -> dict:
    switches, sizes = CASES[case]
    return {
        "architectures": ["JAISLMHeadModel"],
        "auto_map": {
            "AutoConfig": "configuration_jais.JAISConfig",
            "AutoModelForCausalLM": "modeling_jais.JAISLMHeadModel",
        },
        "model_type": "jais",
        "activation_function": "swiglu",
        "vocab_size": VOCAB,
        "n_layer": 2,
        "n_positions": 128,
        "layer_norm_epsilon": 1e-5,
        "scale_attn_weights": True,
        "scale_attn_by_inverse_layer_idx": False,
        "reorder_and_upcast_attn": False,
        "torch_dtype": "float32",
        **_COMMON,
        **sizes,
        **switches,
    }


def _write(path: Path, case: str, seed: int) -> JaisReference:
    """The reference of `case` with random weights, saved to `path` as a release would be."""
    config = _config(case)
    ref = JaisReference(config).eval()
    with torch.no_grad():
        _randomize(ref, seed)
    state = {k: v.contiguous() for k, v in ref.state_dict().items()}
    if case == "alibi":  # the release's slopes buffer: recomputed by paged, never loaded
        state["transformer.relative_pe.slopes"] = torch.tensor(_slopes(config["n_head"]))
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(config))
    build_tiny_tokenizer(VOCAB, seed).save_pretrained(path)
    transformers.GenerationConfig(**_COMMON).save_pretrained(path)
    return ref


@pytest.mark.parametrize("case", sorted(CASES))
def test_jais_matches_reference(case, tmp_path):
    seed = 41 if case == "alibi" else 42
    ref = _write(tmp_path, case, seed)
    prompts = random_token_prompts(seed, 2)
    refs = [ref.greedy(p, TOKENS) for p in prompts]
    llm = LLM(model=str(tmp_path), dtype="float32", max_model_len=96, block_size=16)
    assert_llm_matches(f"jais-{case}", llm, prompts, refs)


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("activation_function", "gelu_new"),
        ("alibi_scaling", {"type": "linear", "factor": 2.0}),
        ("position_embedding_type", "rotary"),
        ("scale_attn_by_inverse_layer_idx", True),
    ],
)
def test_jais_refuses_unserved_switches(name, value, tmp_path):
    from paged_engine.models.remote_aliases import remote_config

    (tmp_path / "config.json").write_text(json.dumps({**_config("alibi"), name: value}))
    with pytest.raises(ValueError, match=name):
        remote_config(tmp_path)
