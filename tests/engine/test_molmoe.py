"""MolmoE-1B (`MolmoForCausalLM` with block_type "moe", remote code: models/molmoe.py,
molmoe_config.py; images: multimodal/molmo_v1.py as Molmo v1's) against a reference composed
from transformers' modules.

transformers has no MolmoE class. Its decoder is OLMoE-1B-7B's, which transformers'
OlmoeForCausalLM runs (pre-norm RMSNorm layers, q / k normed over the whole projection, NeoX
rope, softmax top-k routing without renormalizing, gated SiLU experts); its image side is Molmo
v1's, composed in test_molmo_v1.py (CLIP, the pooling adapter, the release's processor), whose
reference and tiny tower this file reuses with OlmoeForCausalLM in place of Qwen2. The same
random weights are saved in the release's layout: OLMo's names (`att_proj` q | k | v, `attn_out`,
`q_norm` / `k_norm`, `attn_norm` / `ff_norm`) and megablocks' experts
(`ffn.router.layer`, `ffn.experts.mlp.w1` / `v1` / `w2` [E*I, D], w2 transposed), with a
config.json of the release's OLMo field names (d_model, n_heads, mlp_hidden_size,
moe_num_experts, moe_top_k, ...). paged must give the reference's prompt ids, greedy tokens and
top-5 logprobs (1e-3, float32).
"""

from __future__ import annotations

import json

import pytest
import torch
from hf_reference import assert_matches, hf_greedy_from_embeds
from image_checks import check_config_refused, engine, greedy, noise_image
from test_molmo_v1 import ROWS, TEXT, ckpt, reference, release_config, release_state
from vlm_checkpoints import finish_checkpoint

from paged_engine.models.molmo_v1_config import molmo_v1_config
from paged_engine.testing import _randomize

transformers = pytest.importorskip("transformers")
safetensors = pytest.importorskip("safetensors.torch")

__all__ = ["ckpt"]  # test_molmo_v1's fixture: the tower, adapter, tokenizer and image ids
EXPERTS, TOP_K, WIDTH = 4, 2, 96  # WIDTH: the experts' (and the projector's) inner size


@pytest.fixture(scope="module")
def moe_ckpt(ckpt, tmp_path_factory):
    """(the release-layout dir, the reference with OlmoeForCausalLM as its decoder)."""
    path, (dense, clip, adapter, extra, tokenizer, ids) = ckpt
    text = transformers.OlmoeConfig(
        vocab_size=ROWS, hidden_size=64, intermediate_size=WIDTH, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        max_position_embeddings=512, num_experts=EXPERTS, num_experts_per_tok=TOP_K,
        norm_topk_prob=False, tie_word_embeddings=False,
    )  # fmt: skip
    lm = transformers.OlmoeForCausalLM(text).float().eval()
    with torch.no_grad():
        _randomize(lm, 11)
    out = tmp_path_factory.mktemp("molmoe")
    state = {
        k: t
        for k, t in release_state(dense, clip, adapter, extra).items()
        if not k.startswith("model.transformer.")
    }  # the tower, pooling and projector
    state |= molmoe_state(lm, extra)
    safetensors.save_file(state, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(molmoe_config(release_config(dense.config, ids))))
    (out / "preprocessor_config.json").write_text((path / "preprocessor_config.json").read_text())
    finish_checkpoint(out, tokenizer)
    return out, (lm, clip, adapter, extra, tokenizer, ids)


def molmoe_state(lm, extra, per_expert: bool = False) -> dict[str, torch.Tensor]:
    """OlmoeForCausalLM's weights in the release's names (`per_expert`: each expert's matrices
    and the router under transformers' names in the same blocks instead of megablocks')."""
    sd, t = lm.state_dict(), "model.transformer."
    out = {f"{t}wte.embedding": sd["model.embed_tokens.weight"]}
    out[f"{t}wte.new_embedding"] = extra["new_embedding"]
    out[f"{t}ln_f.weight"] = sd["model.norm.weight"]
    out[f"{t}ff_out.weight"] = sd["lm_head.weight"]
    for i in range(lm.config.num_hidden_layers):
        a, b = f"model.layers.{i}.", f"{t}blocks.{i}."
        out[f"{b}att_proj.weight"] = torch.cat([sd[f"{a}self_attn.{p}_proj.weight"] for p in "qkv"])
        out[f"{b}attn_out.weight"] = sd[f"{a}self_attn.o_proj.weight"]
        out[f"{b}q_norm.weight"] = sd[f"{a}self_attn.q_norm.weight"]
        out[f"{b}k_norm.weight"] = sd[f"{a}self_attn.k_norm.weight"]
        out[f"{b}attn_norm.weight"] = sd[f"{a}input_layernorm.weight"]
        out[f"{b}ff_norm.weight"] = sd[f"{a}post_attention_layernorm.weight"]
        gate_up = sd[f"{a}mlp.experts.gate_up_proj"]  # [E, gate I | up I, D]
        down = sd[f"{a}mlp.experts.down_proj"]  # [E, D, I]
        if per_expert:
            out[f"{b}mlp.gate.weight"] = sd[f"{a}mlp.gate.weight"]
            for m in range(EXPERTS):
                e = f"{b}mlp.experts.{m}."
                out[f"{e}gate_proj.weight"] = gate_up[m, :WIDTH]
                out[f"{e}up_proj.weight"] = gate_up[m, WIDTH:]
                out[f"{e}down_proj.weight"] = down[m]
            continue
        out[f"{b}ffn.router.layer.weight"] = sd[f"{a}mlp.gate.weight"]
        out[f"{b}ffn.experts.mlp.w1"] = gate_up[:, :WIDTH].reshape(EXPERTS * WIDTH, -1)
        out[f"{b}ffn.experts.mlp.v1"] = gate_up[:, WIDTH:].reshape(EXPERTS * WIDTH, -1)
        out[f"{b}ffn.experts.mlp.w2"] = down.transpose(1, 2).reshape(EXPERTS * WIDTH, -1)
    return {k: v.detach().clone().contiguous() for k, v in out.items()}


def molmoe_config(dense: dict) -> dict:
    """config.json with the release's OLMo field names (tiny values); the tower's geometry and
    this tokenizer's image ids as test_molmo_v1's."""
    keep = ("vision_backbone", "vit_layers", "torch_dtype")
    out = {k: v for k, v in dense.items() if k in keep or k.startswith("image_")}
    out |= {"architectures": ["MolmoForCausalLM"], "model_type": "molmo", "block_type": "moe"}
    out |= {"d_model": 64, "n_heads": 4, "n_kv_heads": 2, "n_layers": 2, "mlp_ratio": 4}
    out |= {"mlp_hidden_size": 2 * WIDTH, "moe_num_experts": EXPERTS, "moe_top_k": TOP_K}
    out |= {"moe_shared_expert": False, "vocab_size": ROWS, "embedding_size": ROWS}
    out |= {"additional_vocab_size": 128, "max_sequence_length": 512, "layer_norm_eps": 1e-5}
    out |= {"rope": True, "rope_theta": 10000.0, "rope_impl": "llama", "clip_qkv": None}
    out |= {"attention_layer_norm": True, "norm_after": False, "qkv_bias": False}
    out |= {"include_bias": False, "weight_tying": False, "layer_norm_type": "rms"}
    out |= {"activation_type": "swiglu", "image_pooling_2d": "attention-meanq"}
    out |= {"image_projector": "mlp", "image_padding_embed": "pad_and_partial_pad"}
    return out


def test_images_and_text_match_reference(moe_ckpt):
    """A tiled image (2 x 2 crops), two images together, and text alone."""
    path, ref = moe_ckpt
    tall, wide = noise_image(3, (150, 170)), noise_image(2, (90, 200))
    cases = [[tall], [wide, noise_image(5, (60, 400))]]
    llm = engine(path, limit_mm_per_prompt={"image": 2})
    prompts = [{"prompt": TEXT, "multi_modal_data": {"image": c}} for c in cases]
    outs = llm.generate([*prompts, TEXT], greedy(), use_tqdm=False)
    for images, out in zip(cases, outs, strict=False):
        ids, want = reference(ref, images)
        assert out.prompt_token_ids == ids
        assert_matches(f"molmoe {len(images)} image(s)", out, want)
    lm, extra, tokenizer = ref[0], ref[3], ref[4]
    plain = tokenizer.encode(TEXT, add_special_tokens=False)
    assert outs[-1].prompt_token_ids == plain
    table = torch.cat([lm.model.embed_tokens.weight, extra["new_embedding"]]).detach()
    assert_matches("molmoe text", outs[-1], hf_greedy_from_embeds(lm, table[plain][None]))


def test_per_expert_names_load_like_megablocks(moe_ckpt):
    """The experts and router under transformers' per-expert names load the values megablocks'
    stacked w1 / v1 / w2 gave."""
    from paged_engine.loader import load_hf_config, load_model, resolve_model

    path, ref = moe_ckpt
    resolved = resolve_model(str(path))
    model = load_model(resolved, load_hf_config(resolved), dtype=torch.float32, device="cpu")
    want = {n: p.detach().clone() for n, p in model.named_parameters() if ".mlp." in n}
    assert any(".experts." in n for n in want) and any(".gate." in n for n in want)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n in want:
                p.zero_()
    state = molmoe_state(ref[0], ref[3], per_expert=True)
    model.load_weights(((k, t) for k, t in state.items() if ".mlp." in k), strict=False)
    for n, p in model.named_parameters():
        if n in want:
            assert torch.equal(p, want[n]), n


def test_image_ids_default_past_the_table(moe_ckpt):
    """Without image_*_token_id fields the ids lie past embedding_size as the release's
    tokenizer puts them (<im_end>, <im_col>, <im_patch>, <im_start>)."""
    path, _ = moe_ckpt
    raw = json.loads((path / "config.json").read_text())
    raw = {k: v for k, v in raw.items() if not k.endswith("_token_id")} | {"embedding_size": 50304}
    config = molmo_v1_config(raw)
    assert config.image_tokens == [50306, 50307, 50304, 50305]  # patch, start, end, col
    assert config.text_config.model_type == "olmoe"
    assert config.text_config.intermediate_size == WIDTH


@pytest.mark.parametrize(
    ("field", "change"),
    [
        ("rope_impl", {"rope_impl": "cockatoo"}),  # adjacent pairs turned
        ("clip_qkv", {"clip_qkv": 8.0}),  # clamped before the q / k norms
        ("norm_after", {"norm_after": True}),
        ("attention_layer_norm", {"attention_layer_norm": False}),
        ("moe_shared_expert", {"moe_shared_expert": True}),
        ("moe_top_k", {"moe_top_k": EXPERTS + 1}),
        ("qkv_bias", {"qkv_bias": True}),
        ("moe_interleave", {"moe_interleave": True}),  # dense blocks between
        ("moe_dropless", {"moe_dropless": False}),  # capacity-limited experts
    ],
)
def test_unserved_fields_refused_by_name(moe_ckpt, tmp_path, field, change):
    path, _ = moe_ckpt
    config = json.loads((path / "config.json").read_text())
    check_config_refused(path, tmp_path / field, config | change, field)
