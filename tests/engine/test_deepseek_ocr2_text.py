"""DeepSeek-OCR-2 served text-only (models/deepseek_ocr2_text.py through text_wrappers.py's row)
against HF transformers.

A tiny random `DeepseekOcr2ForConditionalGeneration` (its SAM + Qwen2 query tower tiny too, never
run): the decoder's multi-head attention, a dense layer and a DeepSeek-V2 MoE layer (softmax
router, greedy and group-limited top-k, shared experts, routed_scaling_factor) give HF
`generate`'s greedy tokens and top-5 logprobs (1e-3, float32); chunked prefill and a prefix-cache
hit give the plain run's tokens; images, and configs HF cannot run, are refused by name.
"""

from __future__ import annotations

import json

import pytest
from hf_reference import assert_matches, hf_greedy
from image_checks import engine, greedy, noise_image
from vlm_checkpoints import finish_checkpoint, load_hf_vlm

from paged_engine import LLM
from paged_engine.testing import _save_random, build_tiny_tokenizer, tiny_config

transformers = pytest.importorskip("transformers")

PROMPTS = ["the sea is wide and the sky is grey", "one two three four five six seven eight nine"]


def write_tiny_deepseek_ocr2(path, *, seed: int = 0, **text_overrides):
    """A tiny random DeepSeek-OCR-2 checkpoint: a 2-layer decoder (dense, then MoE of 4 experts
    top-2 and a shared one) and a tiny tower."""
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tiny_tokenizer(seed=seed)
    base = tiny_config("llama").to_dict()
    text = {k: base[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
    text |= {"vocab_size": len(tokenizer), "hidden_size": 64, "intermediate_size": 96}
    text |= {"num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}
    text |= {"n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32}
    text |= {"n_shared_experts": 1, "routed_scaling_factor": 1.5, "topk_method": "greedy"}
    text |= {"mlp_layer_types": ["dense", "sparse"], "attention_bias": True}
    text |= {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}
    sam = {"hidden_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2}
    sam |= {"image_size": 64, "output_channels": 8, "global_attn_indexes": [0]}
    sam |= {"downsample_channels": [16, 32]}
    encoder = {"hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 1}
    encoder |= {"num_attention_heads": 2, "num_key_value_heads": 1, "vocab_size": 8}
    config = transformers.DeepseekOcr2Config(
        text_config=text | text_overrides,
        vision_config={"sam_config": sam, "encoder_config": encoder},
        image_token_id=len(tokenizer) - 1,
        **{k: base[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")},
    )
    _save_random(transformers.DeepseekOcr2ForConditionalGeneration, config, seed, path)
    return finish_checkpoint(path, tokenizer)


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return write_tiny_deepseek_ocr2(tmp_path_factory.mktemp("deepseek_ocr2"), seed=5)


@pytest.mark.parametrize("method", ["greedy", "group_limited_greedy"])
def test_text_matches_hf(tmp_path, method):
    kw = {"n_group": 2, "topk_group": 1} if method == "group_limited_greedy" else {}
    path = write_tiny_deepseek_ocr2(tmp_path / method, seed=5, topk_method=method, **kw)
    model = load_hf_vlm(transformers.DeepseekOcr2ForConditionalGeneration, path)
    llm = LLM(model=str(path), dtype="float32", max_model_len=256)
    tok = llm.get_tokenizer()
    ids = [tok.encode(p) for p in PROMPTS]
    outs = llm.generate([{"prompt_token_ids": i} for i in ids], greedy(), use_tqdm=False)
    for prompt, out in zip(ids, outs, strict=True):
        assert_matches("deepseek_ocr2", out, hf_greedy(model, prompt, 8, 5))


def test_chunks_and_prefix_hits_match_the_plain_run(path):
    """Prompts run in 8-token chunks through the MoE layer, then again from the prefix cache
    (a hit of whole blocks): the plain run's tokens."""
    long = [p + " and then " + p for p in PROMPTS]
    params = greedy(0, 12)

    def run(llm):
        return [o.outputs[0].token_ids for o in llm.generate(long, params, use_tqdm=False)]

    want = run(engine(path))
    chunked = engine(path, enable_chunked_prefill=True, max_num_batched_tokens=8, max_num_seqs=2)
    assert run(chunked) == want
    cached = engine(path, enable_prefix_caching=True)
    assert run(cached) == want
    again = cached.generate(long[:1], params, use_tqdm=False)[0]
    assert again.num_cached_tokens >= (len(again.prompt_token_ids) - 1) // 16 * 16 > 0
    assert again.outputs[0].token_ids == want[0]


def test_refuses_by_name(path, tmp_path):
    """An image: a ValueError naming multi_modal_data (the tower does not run), the engine
    serving on; a decoder config HF cannot run: one naming the field."""
    llm = LLM(model=str(path), dtype="float32", max_model_len=256)
    image = {"prompt": PROMPTS[0], "multi_modal_data": {"image": noise_image(0, (32, 32))}}
    with pytest.raises(ValueError, match="multi_modal_data"):
        llm.generate([image], greedy(0), use_tqdm=False)
    assert len(llm.generate(PROMPTS[:1], greedy(0), use_tqdm=False)[0].outputs[0].token_ids) == 8
    config = json.loads((path / "config.json").read_text())
    for field, value in [("mlp_layer_types", None), ("topk_method", "noaux_tc")]:
        bad = tmp_path / field
        bad.mkdir()
        for f in path.iterdir():
            (bad / f.name).symlink_to(f)
        (bad / "config.json").unlink()
        text = config["text_config"] | {field: value}
        (bad / "config.json").write_text(json.dumps(config | {"text_config": text}))
        with pytest.raises(ValueError, match=field):
            LLM(model=str(bad), dtype="float32", max_model_len=256)
