"""Images through MiniCPM-Llama3-V 2.5 as the Hub ships it (`MiniCPMV` with version 2.5,
remote code: multimodal/minicpmv_remote.py, models/minicpmv_remote_config.py) against a
reference composed here from transformers' and torch's modules, as test_minicpmv_remote.py
composes 2.6's.

What 2.5 changes against 2.6 (vLLM's MiniCPMV2_5, the release's modeling and image
processor): a Llama 3 LM (transformers' LlamaForCausalLM fed inputs_embeds); the SigLIP tower
called without target sizes on the release's reshape_by_patch layout [3, p, L p] (torch's
unfold here), so transformers' Idefics2VisionTransformer buckets its position ids along one
row of L patches; the prompt of the 2.0 / 2.5 processor: no <image_id>, the slices' rows of
<image> ... </image> inside one <slice> ... </slice> (written out below for a small and a
sliced image). The resampler (positions on the keys) and the slicing rules are 2.6's, taken
from test_minicpmv_remote.py. paged must give the reference's prompt ids, greedy tokens and
top-5 logprobs (1e-3, float32). MiniCPM-V 2.0 is refused by its `version`.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from hf_reference import hf_greedy_with_rows
from image_checks import check_config_refused, check_engine_matches_hf, engine
from test_minicpmv_remote import (
    PATCH,
    PATTERN,
    RES,
    VISION,
    WIDTH,
    save_random_release,
    slicing_images,
    tower_and_resampler,
    views,
)
from vlm_checkpoints import finish_checkpoint, tokenizer_with

transformers = pytest.importorskip("transformers")
safetensors = pytest.importorskip("safetensors.torch")

QUERIES = 8  # the release: 96
MARKS = ["<image>", "</image>", "<slice>", "</slice>", "<unk>"]  # 2.5's: no <image_id>
U = "<unk>" * QUERIES
SMALL_TEXT = f"<image>{U}</image>"  # one view: the thumbnail alone
WIDE_TEXT = (  # 3 x 1 slices: the thumbnail, then one row of three in <slice>
    f"<image>{U}</image><slice><image>{U}</image><image>{U}</image><image>{U}</image></slice>"
)
TALL_TEXT = (  # 1 x 4 slices: four rows of one, joined by "\n"
    f"<image>{U}</image><slice><image>{U}</image>\n<image>{U}</image>\n"
    f"<image>{U}</image>\n<image>{U}</image></slice>"
)


def llama_text(vocab_size: int) -> dict:
    """A tiny Llama 3 LM's fields as 2.5's flat config.json carries them."""
    text = {"vocab_size": vocab_size, "hidden_size": WIDTH, "intermediate_size": 96}
    text |= {"num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}
    text |= {"rms_norm_eps": 1e-5, "max_position_embeddings": 1024, "rope_theta": 500000.0}
    text |= {"attention_bias": False, "mlp_bias": False, "hidden_act": "silu"}
    return text | {"tie_word_embeddings": False}


def release_config(text: dict, version: float | None = 2.5) -> dict:
    """config.json as MiniCPM-Llama3-V 2.5 writes it (its fields, tiny values; slicing at the
    top level, an "idefics2" vision_config); `version` None: the first release's, without."""
    top = {"architectures": ["MiniCPMV"], "model_type": "minicpmv", "query_num": QUERIES}
    top |= {"auto_map": {"AutoConfig": "configuration_minicpm.MiniCPMVConfig"}}
    top |= {"slice_mode": True, "max_slice_nums": 9, "scale_resolution": RES}
    top |= {"patch_size": PATCH, "image_size": RES, "drop_vision_last_layer": False}
    top |= {"batch_vision_input": True, "torch_dtype": "float32"}
    top |= {"vision_config": {**VISION, "model_type": "idefics2"}}
    return {**text, **top} | ({} if version is None else {"version": version})


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """(the release-layout dir, the reference: the LM, the tower, the resampler, tokenizer)."""
    path = tmp_path_factory.mktemp("minicpmv_remote_2_5")
    tokenizer, _ = tokenizer_with(MARKS, 5)
    text = llama_text(len(tokenizer))
    torch.manual_seed(0)
    llm = transformers.LlamaForCausalLM(transformers.LlamaConfig(**text)).float().eval()
    vpm, resampler = tower_and_resampler(QUERIES)
    save_random_release(path, 7, llm=llm, vpm=vpm, resampler=resampler)
    (path / "config.json").write_text(json.dumps(release_config(text)))
    pre = {"image_processor_type": "MiniCPMVImageProcessor", "image_feature_size": QUERIES}
    pre |= {"max_slice_nums": 9, "scale_resolution": RES, "patch_size": PATCH, "version": 2.5}
    pre |= {"im_start": "<image>", "im_end": "</image>", "slice_start": "<slice>"}
    pre |= {"slice_end": "</slice>", "unk": "<unk>"}
    pre |= {"norm_mean": [0.5, 0.5, 0.5], "norm_std": [0.5, 0.5, 0.5]}
    (path / "preprocessor_config.json").write_text(json.dumps(pre))
    finish_checkpoint(path, tokenizer)
    llm.generation_config.eos_token_id = None
    return path, (llm, vpm, resampler, tokenizer)


def view_rows(ref, view) -> torch.Tensor:
    """[QUERIES, WIDTH]: the tower on the release's [3, p, L p] row of patches (no target
    sizes: ids bucketed along the row), then the resampler, positions on its keys."""
    _, vpm, rs, _ = ref
    x = torch.from_numpy(np.asarray(view, dtype=np.float32) / 255).permute(2, 0, 1)
    x = (x - 0.5) / 0.5
    h, w = x.shape[-2] // PATCH, x.shape[-1] // PATCH
    cols = torch.nn.functional.unfold(x, (PATCH, PATCH), stride=(PATCH, PATCH))  # [3 p p, L]
    row = cols.reshape(3, PATCH, PATCH, h * w).permute(0, 1, 3, 2).reshape(3, PATCH, -1)
    mask = torch.ones(1, 1, h * w, dtype=torch.bool)  # the release's patch_attn_mask
    table = transformers.models.vit_mae.modeling_vit_mae.build_2d_sinusoidal_position_embedding(
        70, 70, WIDTH
    )
    pos = table.view(70, 70, WIDTH).transpose(0, 1)[:h, :w].reshape(h * w, 1, WIDTH)
    with torch.no_grad():
        feats = vpm(row[None], patch_attention_mask=mask).last_hidden_state[0]  # [h w, D]
        kv = rs["ln_kv"](rs["kv_proj"](feats))[:, None]  # [L, 1, E] (sequence first)
        q = rs["ln_q"](rs.query)[:, None]
        out = rs["attn"](q, kv + pos, kv)[0][:, 0]
        return rs["ln_post"](out) @ rs.proj


def reference(ref, text: str, images: list, expanded: list[str]):
    """(the 2.5 processor's prompt ids: `expanded[k]` for the k-th pattern, Llama's greedy
    with top-5 on the scattered rows)."""
    llm, _, _, tokenizer = ref
    rows = []
    for image, seg in zip(images, expanded, strict=True):
        text = text.replace(PATTERN, seg, 1)
        rows += [view_rows(ref, v) for v in views(image)[1]]
    ids = tokenizer(text).input_ids
    return ids, hf_greedy_with_rows(llm, ids, tokenizer.convert_tokens_to_ids("<unk>"), rows)


def test_images_match_reference(ckpt):
    """A small image (one view), a wide one (3 x 1 slices), a tall one (1 x 4), two images in
    one prompt (no <image_id>: both alike), and text alone."""
    path, ref = ckpt
    small, wide, tall = slicing_images()
    one, two = f"look {PATTERN}\nwhat is it", f"{PATTERN} and {PATTERN} differ"
    cases = [(one, [small], [SMALL_TEXT]), (one, [wide], [WIDE_TEXT])]
    cases += [(one, [tall], [TALL_TEXT]), (two, [wide, small], [WIDE_TEXT, SMALL_TEXT])]
    llm = engine(path, max_model_len=512, limit_mm_per_prompt={"image": 2})
    refs = [reference(ref, t, im, ex) for t, im, ex in cases]
    refs.append(reference(ref, "the sea is wide", [], []))
    cases_in = [(t, im) for t, im, _ in cases] + [("the sea is wide", [])]
    check_engine_matches_hf(llm, cases_in, refs, "minicpmv_remote 2.5")


def test_versions_read_and_refused(ckpt, tmp_path):
    """No `version`: vLLM's guess, 2.5 (a Llama LM, no image ids), or 2.0 where hidden_size
    is 2304 and query_num 64, refused by name like a written 2.0; Llama biases refused."""
    from paged_engine.models.remote_aliases import remote_config

    path, _ = ckpt
    config = json.loads((path / "config.json").read_text())
    unversioned = {k: v for k, v in config.items() if k != "version"}
    (tmp_path / "config.json").write_text(json.dumps(unversioned | {"image_token_id": 3}))
    read = remote_config(tmp_path)
    assert read.version == "2.5" and read.use_image_id is False
    assert read.text_config.model_type == "llama" and read.query_num == QUERIES
    assert read.slice_config["scale_resolution"] == RES
    guessed_2_0 = unversioned | {"hidden_size": 2304, "query_num": 64}
    for n, (bad, field) in enumerate(
        [
            (config | {"version": 2.0}, "version"),
            (guessed_2_0, "version"),
            (config | {"attention_bias": True}, "attention_bias"),
        ]
    ):
        check_config_refused(path, tmp_path / f"bad{n}", bad, field)
