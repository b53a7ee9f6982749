"""Phi-4-multimodal as the Hub ships it (`Phi4MMForCausalLM`, remote code: models/phi4mm_config.py,
multimodal/phi4mm_remote.py) against transformers' Phi4MultimodalForCausalLM.

test_phi4mm_images.py's tiny random checkpoint, its tower at the release's 448-pixel views of
14-pixel patches (the remote code's fixed crops), its vocabulary grown to the release's 200064
so that the remote placeholder ids 200010 / 200011 exist, the audio attention unchunked (the
release's chunk_size -1). The test converts it into the release's layout: config.json with the
remote fields (embd_layer, img_processor null, audio_processor.config under the remote names,
vision_lora / speech_lora; the tower's geometry as a top-level vision_config), the remote weight
names (glb_GN / sub_GN, img_projection.0 / .2, audio_projection.speech / .vision, net.0.linear /
linear_q ...; the decoder's projections PEFT-wrapped as `base_layer` with random lora_A / lora_B
beside, which serving must drop) and the remote preprocessor_config.json (dynamic_hd and the
feature extractor's rates). `LLM.generate` with numbered tags (an image prompt, an audio
prompt, two of each interleaved) must give the remote processor's ids (the text between tags
tokenized piece by piece, each tag a run of its placeholder) and HF's greedy tokens and top-5
logprobs (1e-3, float32). `LLM.chat` writes vLLM's `<|image_1|>` / `<|audio_1|>`; bad tags and
config values transformers does not compute as the remote code are refused by name.
"""

from __future__ import annotations

import copy
import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from audio_checks import held, noise_clip, wav_base64
from hf_reference import assert_matches, hf_greedy
from image_checks import data_url, greedy, noise_image
from test_phi4mm_images import write_tiny_phi4mm

transformers = pytest.importorskip("transformers")
pytest.importorskip("transformers.models.phi4_multimodal")

VOCAB, IMAGE_ID, AUDIO_ID = 200064, 200010, 200011
DYNAMIC_HD = 4
IMAGE = "<|user|><|image_1|>Describe it.<|end|><|assistant|>"
AUDIO = "<|user|><|audio_1|>What is it?<|end|><|assistant|>"
MIXED = "<|user|><|image_1|><|audio_1|> then <|audio_2|> and <|image_2|>Which?<|end|><|assistant|>"
STRING_TEMPLATE = (  # the release's: string content (vLLM writes the media tags)
    "{% for message in messages %}<|{{ message['role'] }}|>{{ message['content'] }}<|end|>"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
_TAG = re.compile(r"<\|(image|audio)_\d+\|>")


def _release_vocab(path: Path) -> None:
    """The HF checkpoint with 200064 token rows (the release's ids), its placeholder ids the
    release's and the audio attention unchunked (chunk_size -1, as released)."""
    from safetensors.torch import load_file, save_file

    weights = load_file(path / "model.safetensors")
    gen = torch.Generator().manual_seed(3)
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        w = weights[name]
        grown = torch.randn(VOCAB - w.shape[0], w.shape[1], generator=gen) * float(w.std())
        weights[name] = torch.cat([w, grown])
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    config["vocab_size"] = VOCAB
    config["vision_config"]["image_token_id"] = IMAGE_ID
    config["audio_config"] |= {"audio_token_id": AUDIO_ID, "chunk_size": -1}
    (path / "config.json").write_text(json.dumps(config))


def _remote_name(name: str) -> str:
    """transformers' name -> the release's (convert_phi4_multimodal_weights_to_hf.py's and
    vLLM's mapping read backwards)."""
    image, audio = (
        "model.embed_tokens_extend.image_embed.",
        "model.embed_tokens_extend.audio_embed.",
    )
    for ours, theirs in [
        (image + "global_img_feature_extensor", image + "glb_GN"),
        (image + "sub_img_feature_extensor", image + "sub_GN"),
        (image + "img_projection_up.", image + "img_projection.0."),
        (image + "img_projection_down.", image + "img_projection.2."),
        (audio + "up_proj_for_speech.", audio + "audio_projection.speech.0."),
        (audio + "down_proj_for_speech.", audio + "audio_projection.speech.2."),
        (audio + "up_proj_for_vision_speech.", audio + "audio_projection.vision.0."),
        (audio + "down_proj_for_vision_speech.", audio + "audio_projection.vision.2."),
    ]:
        if name.startswith(ours):
            return theirs + name[len(ours) :]
    name = re.sub(r"(feed_forward_(?:in|out))\.gate_up_proj\.", r"\1.net.0.linear.", name)
    name = re.sub(r"(feed_forward_(?:in|out))\.down_proj\.", r"\1.net.2.", name)
    name = re.sub(r"(encoders\.\d+\.self_attn)\.([qkv])_proj\.", r"\1.linear_\2.", name)
    return re.sub(r"(encoders\.\d+\.self_attn)\.o_proj\.", r"\1.linear_out.", name)


def _remote_config(hf: dict) -> dict:
    """The release's config.json fields for the HF config `hf` (to_dict form)."""
    vision, audio = hf["vision_config"], hf["audio_config"]
    text_keys = [
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "max_position_embeddings",
        "original_max_position_embeddings",
        "rms_norm_eps",
        "tie_word_embeddings",
        "bos_token_id",
        "eos_token_id",
        "pad_token_id",
        "hidden_act",
        "sliding_window",
        "resid_pdrop",
        "embd_pdrop",
        "attention_dropout",
        "initializer_range",
    ]
    rope = hf["rope_parameters"]
    out = {k: hf[k] for k in text_keys if k in hf}
    out |= {
        "rope_theta": rope["rope_theta"],
        "partial_rotary_factor": rope["partial_rotary_factor"],
    }
    out |= {
        "architectures": ["Phi4MMForCausalLM"],
        "model_type": "phi4mm",
        "auto_map": {"AutoConfig": "configuration_phi4mm.Phi4MMConfig"},
        "torch_dtype": "float32",
        "attention_bias": False,
        "mlp_bias": False,
        "lm_head_bias": False,
        "full_attn_mod": 1,
        "interpolate_factor": 1,
        "img_processor": None,
        "vision_config": {k: vision[k] for k in ("hidden_size", "intermediate_size")}
        | {k: vision[k] for k in ("num_attention_heads", "num_hidden_layers")},
        "embd_layer": {
            "embedding_cls": "image_audio",
            "image_embd_layer": {
                "crop_size": 448,
                "embedding_cls": "tune_image",
                "enable_gradient_checkpointing": True,
                "hd_transform_order": "sub_glb",
                "image_token_compression_cls": "avg_pool_2d",
                "projection_cls": "mlp",
                "use_hd_transform": True,
                "with_learnable_separator": True,
            },
            "audio_embd_layer": {
                "compression_rate": audio["time_reduction"],
                "downsample_rate": 1,
                "embedding_cls": "audio",
                "enable_gradient_checkpointing": True,
                "projection_cls": "mlp",
                "use_conv_downsample": False,
                "use_qformer": False,
            },
        },
        "audio_processor": {
            "name": "cascades",
            "config": {
                "activation": audio["activation"],
                "activation_checkpointing": {"interval": 1, "module": "transformer"},
                "attention_dim": audio["hidden_size"],
                "attention_heads": audio["num_attention_heads"],
                "batch_norm": False,
                "bias_in_glu": True,
                "causal": True,
                "chunk_size": -1,
                "cnn_layer_norm": True,
                "conv_activation": audio["conv_activation"],
                "conv_glu_type": audio["conv_glu_type"],
                "depthwise_multiplier": 1,
                "depthwise_seperable_out_channel": audio["depthwise_separable_out_channel"],
                "dropout_rate": 0.0,
                "encoder_embedding_config": {"input_size": audio["input_size"]},
                "ext_pw_kernel_size": 1,
                "ext_pw_out_channel": audio["ext_pw_out_channel"],
                "input_layer": "nemo_conv",
                "input_size": audio["input_size"],
                "kernel_size": audio["kernel_size"],
                "left_chunk": 18,
                "linear_units": audio["intermediate_size"],
                "nemo_conv_settings": {"conv_channels": audio["nemo_conv_channels"]},
                "num_blocks": audio["num_blocks"],
                "relative_attention_bias_args": {
                    "t5_bias_max_distance": audio["bias_max_distance"],
                    "type": "t5",
                },
                "time_reduction": audio["time_reduction"],
            },
        },
        "vision_lora": {"dp": 0.0, "layer": "layers.*", "lora_alpha": 8, "r": 4},
        "speech_lora": {"dp": 0.01, "layer": "layers.*", "lora_alpha": 8, "r": 4},
    }
    return out


def write_remote(hf: Path, out: Path) -> Path:
    """The release's layout of the HF checkpoint in `hf` (see the module)."""
    from safetensors.torch import load_file, save_file

    out.mkdir()
    tok = transformers.AutoTokenizer.from_pretrained(hf)
    tok.chat_template = STRING_TEMPLATE
    tok.save_pretrained(out)
    shutil.copy(hf / "generation_config.json", out)
    raw = json.loads((hf / "config.json").read_text())
    (out / "config.json").write_text(json.dumps(_remote_config(raw)))
    processor = {
        "auto_map": {"AutoProcessor": "processing_phi4mm.Phi4MMProcessor"},
        "image_processor_type": "Phi4MMImageProcessor",
        "feature_extractor_type": "Phi4MMAudioFeatureExtractor",
        "processor_class": "Phi4MMProcessor",
        "dynamic_hd": DYNAMIC_HD,
        "audio_compression_rate": 8,
        "audio_downsample_rate": 1,
        "audio_feat_stride": 1,
    }
    (out / "preprocessor_config.json").write_text(json.dumps(processor))
    gen = torch.Generator().manual_seed(5)
    remote = {}
    for name, w in load_file(hf / "model.safetensors").items():
        wrapped = re.match(r"model\.layers\.\d+\.(self_attn|mlp)\.\w+_proj\.weight$", name)
        if not wrapped:
            remote[_remote_name(name)] = w
            continue
        module = name.removesuffix(".weight")
        remote[f"{module}.base_layer.weight"] = w
        for adapter in ("vision", "speech"):  # nonzero: merged by mistake, the tokens change
            remote[f"{module}.lora_A.{adapter}.weight"] = torch.randn(4, w.shape[1], generator=gen)
            remote[f"{module}.lora_B.{adapter}.weight"] = torch.randn(w.shape[0], 4, generator=gen)
    save_file(remote, out / "model.safetensors", metadata={"format": "pt"})
    return out


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("phi4mm-remote")
    hf = write_tiny_phi4mm(root / "hf", seed=8, image_size=448, patch_size=14, crop_size=448)
    _release_vocab(hf)
    return hf, write_remote(hf, root / "remote")


@pytest.fixture(scope="module")
def llm(dirs):
    from image_checks import LLM

    return LLM(model=str(dirs[1]), dtype="float32", block_size=16, max_model_len=4096)


def _hf_inputs(path: Path, text: str, images: list, clips: list) -> tuple[list[int], dict]:
    """The remote processor's ids (each tag its special token, so the text between tags is
    tokenized apart; each token a run) and transformers' inputs, pixels by our torch copy of
    its image processor at the release's settings (transformers' needs torchvision)."""
    from paged_engine.multimodal.phi4mm_processor import Phi4MMTorchProcessor

    tok = transformers.AutoTokenizer.from_pretrained(path)
    extra: dict = {}
    runs = {"image": [], "audio": []}
    if images:
        settings = {"size": {"height": 448, "width": 448}, "patch_size": 14}
        out = Phi4MMTorchProcessor(settings | {"dynamic_hd": DYNAMIC_HD})(images=images)
        runs["image"] = [int(n) for n in out["num_img_tokens"]]
        keys = ("image_pixel_values", "image_sizes", "image_attention_mask")
        extra |= {k: out[k] for k in keys}
    if clips:
        out = transformers.Phi4MultimodalFeatureExtractor()(
            clips, sampling_rate=16000, return_tensors="pt"
        )
        runs["audio"] = [int(n) for n in out["audio_embed_sizes"]]
        extra |= {k: out[k] for k in ("audio_input_features", "audio_embed_sizes")}
    ids: list[int] = []
    at, seen = 0, {"image": 0, "audio": 0}
    for tag in _TAG.finditer(text):
        ids += tok(text[at : tag.start()], add_special_tokens=False).input_ids
        kind = tag.group(1)
        ids += [IMAGE_ID if kind == "image" else AUDIO_ID] * runs[kind][seen[kind]]
        seen[kind] += 1
        at = tag.end()
    return ids + tok(text[at:], add_special_tokens=False).input_ids, extra


def test_remote_release_matches_hf(dirs, llm):
    """Numbered tags, remote names and settings -> HF's ids, greedy tokens and top-5."""
    hf, _ = dirs
    model = transformers.Phi4MultimodalForCausalLM.from_pretrained(hf, dtype=torch.float32)
    model.eval().generation_config.eos_token_id = None
    cases = [
        (IMAGE, [noise_image(1, (300, 520))], []),  # 2 x 1 crops at 448, padded
        (AUDIO, [], [noise_clip(1, 0.9)]),
        (MIXED, [noise_image(2, (60, 90)), noise_image(3, (500, 200))], [noise_clip(2, 0.6)] * 2),
    ]
    refs = [
        (ids, hf_greedy(model, ids, 8, 5, **extra))
        for ids, extra in (_hf_inputs(hf, t, i, c) for t, i, c in cases)
    ]
    prompts = [
        {"prompt": t, "multi_modal_data": {k: v for k, v in (("image", i), ("audio", c)) if v}}
        for t, i, c in cases
    ]
    outs = llm.generate(prompts, greedy(), use_tqdm=False)
    for (text, *_), (ids, ref), out in zip(cases, refs, outs, strict=True):
        assert out.prompt_token_ids == ids, text
        assert_matches(f"Phi4MMForCausalLM {text!r}", out, ref)
    assert outs[0].prompt_token_ids.count(IMAGE_ID) > 545  # a 2 x 1 grid's run


def test_chat_writes_numbered_tags(llm):
    """LLM.chat (image_url and input_audio parts, string content) writes vLLM's
    `<|image_1|>` / `<|audio_1|>` lines and answers as the same text prompt does."""
    image, clip = noise_image(5, (60, 90)), held(noise_clip(5, 0.7))
    parts = [
        {"type": "image_url", "image_url": {"url": data_url(image)}},
        {"type": "input_audio", "input_audio": {"data": wav_base64(clip), "format": "wav"}},
        {"type": "text", "text": "Describe both."},
    ]
    (got,) = llm.chat([{"role": "user", "content": parts}], greedy(), use_tqdm=False)
    text = "<|user|><|image_1|>\n<|audio_1|>\nDescribe both.<|end|><|assistant|>"
    prompt = {"prompt": text, "multi_modal_data": {"image": [image], "audio": [clip]}}
    (want,) = llm.generate([prompt], greedy(), use_tqdm=False)
    assert got.prompt_token_ids == want.prompt_token_ids
    assert IMAGE_ID in got.prompt_token_ids and AUDIO_ID in got.prompt_token_ids
    assert got.outputs[0].token_ids == want.outputs[0].token_ids


def test_bad_tags_are_refused_by_name(llm):
    image = noise_image(6, (40, 40))
    bad = [
        ("<|user|><|image_2|>Hi<|end|><|assistant|>", "image_2"),
        ("<|user|><|image_1|><|image_1|>Hi<|end|><|assistant|>", "image_1"),
        ("<|user|>Hi<|end|><|assistant|>", "placeholder"),
    ]
    for text, named in bad:
        prompt = {"prompt": text, "multi_modal_data": {"image": image}}
        with pytest.raises(ValueError, match=re.escape(named)):
            llm.generate([prompt], greedy(), use_tqdm=False)
    prompt = {"prompt": IMAGE, "multi_modal_data": {"image": image}}
    (out,) = llm.generate([prompt], greedy(), use_tqdm=False)  # the engine serves on
    assert len(out.outputs[0].token_ids) == 8


def test_config_values_without_a_reference_are_refused(dirs):
    from paged_engine.models.phi4mm_config import phi4mm_config

    raw = json.loads((dirs[1] / "config.json").read_text())
    assert phi4mm_config(raw).vision_config.feature_layer == -2
    audio = ("audio_processor", "config")
    for where, value, named in [
        (audio + ("chunk_size",), 16, "chunk_size"),
        (audio + ("causal",), False, "causal"),
        (audio + ("linear_glu_in_convm",), True, "linear_glu_in_convm"),
        (audio + ("attention_glu_type",), "swish", "attention_glu_type"),
        (("embd_layer", "image_embd_layer", "hd_transform_order"), "glb_sub", "hd_transform"),
        (("embd_layer", "audio_embd_layer", "compression_rate"), 4, "compression_rate"),
        (("img_processor",), {"type_feature": "cls"}, "type_feature"),
        (("vision_config", "patch_size"), 16, "vision_config.patch_size"),
        (("attention_bias",), True, "attention_bias"),
        (("vocab_size",), 32064, "vocab_size"),
    ]:
        changed = copy.deepcopy(raw)
        node = changed
        for key in where[:-1]:
            node = node[key]
        node[where[-1]] = value
        with pytest.raises(ValueError, match=re.escape(named)):
            phi4mm_config(changed)
