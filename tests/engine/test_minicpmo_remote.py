"""Audio and images through MiniCPM-o 2.6 as the Hub ships it (`MiniCPMO`, remote code:
multimodal/minicpmo_remote.py, models/minicpmo_remote_config.py; its images are MiniCPM-V
2.6's, multimodal/minicpmv_remote.py) against a reference composed here from transformers'
and torch's modules.

transformers has no MiniCPM-o class. Its image path is MiniCPM-V 2.6's, composed as
test_minicpmv_remote.py composes it (its views and view_rows, imported). Its audio path:
transformers' WhisperFeatureExtractor padded to 30 s with its attention mask and cut to the
clip's frames; transformers' WhisperEncoder's own modules (conv1, conv2, embed_positions,
WhisperEncoderLayer, layer_norm) run on those frames under vLLM's block-causal chunk mask
(subsequent_chunk_mask, 50 rows a chunk, as an additive -inf mask); the projection MLP
(linear1 -> relu -> linear2) and torch's AvgPool1d(2). The glue written here from vLLM's
minicpmo.py and the release processor: the "(<audio>./</audio>)" text replaced by
get_audio_placeholder's 1 s chunks of 25 <unk>s in <|audio_start|> ... <|audio_end|>, the
whole text tokenized once, the <unk> rows scattered in prompt order into Qwen2's
inputs_embeds. The same random weights are saved in the release layout (`llm.`, `vpm.`,
`resampler.`, `apm.`, `audio_projection_layer.`, and a `tts.` tensor paged must skip). paged
must give the reference's prompt ids, greedy tokens and top-5 logprobs (float32).
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from hf_reference import assert_matches, hf_greedy_with_rows
from image_checks import check_config_refused, engine, greedy, noise_image
from test_minicpmv_remote import (
    MARKS,
    PATCH,
    QUERIES,
    WIDTH,
    image_text,
    release_config,
    save_random_release,
    tower_and_resampler,
    view_rows,
    views,
)
from test_minicpmv_remote import PATTERN as IMAGE
from vlm_checkpoints import finish_checkpoint, tiny_qwen2_text, tokenizer_with

transformers = pytest.importorskip("transformers")
safetensors = pytest.importorskip("safetensors.torch")

AUDIO = "(<audio>./</audio>)"
SR, HOP, POOL, CHUNK = 16000, 160, 2, 25  # 25 rows a second (pool 2)
APM = {"d_model": 32, "encoder_layers": 2, "encoder_attention_heads": 2}
APM |= {"encoder_ffn_dim": 128, "num_mel_bins": 80, "max_source_positions": 1500}
WHISPER = {"feature_size": 80, "sampling_rate": SR, "hop_length": HOP, "chunk_length": 30}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """(the release-layout dir, the reference: LM, tower, resampler, tokenizer, apm, proj)."""
    path = tmp_path_factory.mktemp("minicpmo_remote")
    tokenizer, _ = tokenizer_with([*MARKS, "<|audio_start|>", "<|audio_end|>"], 3)
    text = tiny_qwen2_text(len(tokenizer), WIDTH)
    torch.manual_seed(0)
    llm = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**text)).float().eval()
    vpm, resampler = tower_and_resampler(QUERIES)
    whisper = transformers.models.whisper.modeling_whisper
    apm = whisper.WhisperEncoder(transformers.WhisperConfig(**APM))
    proj = torch.nn.ModuleDict(
        {
            "linear1": torch.nn.Linear(APM["d_model"], WIDTH),
            "linear2": torch.nn.Linear(WIDTH, WIDTH),
        }
    )
    tts = torch.nn.ModuleDict({"emb_text": torch.nn.Embedding(7, 5)})  # output-only: skipped
    modules = {"llm": llm, "vpm": vpm, "resampler": resampler, "apm": apm}
    save_random_release(path, 4, **modules, audio_projection_layer=proj, tts=tts)
    (path / "config.json").write_text(json.dumps(release_config_o(text)))
    pre = {"image_processor_type": "MiniCPMVImageProcessor", "image_feature_size": QUERIES}
    pre |= {"max_slice_nums": 9, "scale_resolution": 32, "patch_size": PATCH, "version": 2.6}
    pre |= {"use_image_id": True, "slice_mode": True, "norm_mean": [0.5] * 3, "norm_std": [0.5] * 3}
    (path / "preprocessor_config.json").write_text(json.dumps(pre | WHISPER))
    finish_checkpoint(path, tokenizer)
    llm.generation_config.eos_token_id = None
    resampler.on_values = False
    return path, (llm, vpm, resampler, tokenizer, apm, proj)


def release_config_o(text: dict) -> dict:
    """config.json as MiniCPM-o 2.6 writes it (its fields, tiny values)."""
    top = release_config(text, "2.6") | {"architectures": ["MiniCPMO"], "model_type": "minicpmo"}
    top |= {"audio_config": {**APM, "model_type": "whisper", "activation_function": "gelu"}}
    top |= {"audio_pool_step": POOL, "audio_chunk_length": 1.0, "stream_input": False}
    top |= {"init_vision": True, "init_audio": True, "init_tts": True}
    top |= {"tts_config": {"model_type": "conditional_chattts", "llm_dim": WIDTH}}
    return top


def placeholder(samples: int) -> str:
    """The remote get_audio_placeholder(samples, chunk_input=True, chunk_length=1)."""
    n = ((math.ceil(samples / HOP) - 1) // 2 + 1 - POOL) // POOL + 1
    return "".join(
        "<|audio_start|>" + "<unk>" * min(CHUNK, n - k) + "<|audio_end|>"
        for k in range(0, n, CHUNK)
    )


def clip_rows(ref, wave: np.ndarray) -> torch.Tensor:
    """The clip's rows: Whisper's modules on its frames under the chunk mask, the projection,
    AvgPool1d(2)."""
    apm, proj = ref[4], ref[5]
    extractor = transformers.WhisperFeatureExtractor(**WHISPER)
    out = extractor(wave, sampling_rate=SR, padding="max_length", return_attention_mask=True)
    frames = int(np.sum(out["attention_mask"]))
    x = torch.tensor(np.asarray(out["input_features"]))[:, :, :frames]
    with torch.no_grad():
        h = torch.nn.functional.gelu(apm.conv2(torch.nn.functional.gelu(apm.conv1(x))))
        h = h.permute(0, 2, 1)
        t = h.shape[1]
        h = h + apm.embed_positions.weight[:t]
        rows = torch.arange(t)
        seen = rows[None, :] < (rows[:, None] // 50 + 1) * 50
        mask = torch.zeros(t, t).masked_fill(~seen, float("-inf"))[None, None]
        for layer in apm.layers:
            h = layer(h, mask)
        h = proj["linear2"](torch.relu(proj["linear1"](apm.layer_norm(h))))
        h = torch.nn.AvgPool1d(POOL, stride=POOL)(h.transpose(1, 2)).transpose(1, 2)[0]
    n = ((frames - 1) // 2 + 1 - POOL) // POOL + 1
    return h[:n]


def reference(ref, text: str, images: list, clips: list):
    """(the release processor's prompt ids, Qwen2's greedy with top-5 on the scattered rows):
    each marker replaced in prompt order, the whole text tokenized once."""
    llm, tokenizer = ref[0], ref[3]
    rows, image_at, clip_at = [], 0, 0
    while IMAGE in text or AUDIO in text:
        i, a = text.find(IMAGE), text.find(AUDIO)
        if a < 0 or 0 <= i < a:
            grid, vs = views(images[image_at])
            text = text.replace(IMAGE, image_text(image_at, grid), 1)
            rows += [view_rows(ref[:4], v) for v in vs]
            image_at += 1
        else:
            wave = clips[clip_at]
            text = text.replace(AUDIO, placeholder(len(wave)), 1)
            rows.append(clip_rows(ref, wave))
            clip_at += 1
    ids = tokenizer(text).input_ids
    return ids, hf_greedy_with_rows(llm, ids, tokenizer.convert_tokens_to_ids("<unk>"), rows)


def wave_of(seed: int, seconds: float) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return (0.3 * rng.standard_normal(int(seconds * SR))).astype(np.float32)


def test_audio_and_images_match_reference(ckpt):
    """A 1.3 s clip (32 rows: chunks of 25 and 7, the second reading the first through the
    block-causal mask) alone; a 0.6 s clip before an image in one prompt (the image's run moves
    with the clip's); two clips in one prompt; text alone; refusals: a clip past 30 s, a
    pattern short, a video."""
    path, ref = ckpt
    long, short, image = wave_of(1, 1.3), wave_of(2, 0.6), noise_image(1, (20, 24))
    cases = [
        (f"listen {AUDIO}\nwhat is it", [], [long]),
        (f"{AUDIO} and {IMAGE} match?", [image], [short]),
        (f"first {AUDIO} then {AUDIO} same?", [], [short, long]),
        ("the sea is wide", [], []),
    ]
    llm = engine(path, max_model_len=512, limit_mm_per_prompt={"image": 1, "audio": 2})
    prompts = []
    for text, images, clips in cases:
        data = {"audio": [(c, SR) for c in clips]} if clips else {}
        data |= {"image": images} if images else {}
        prompts.append({"prompt": text, "multi_modal_data": data} if data else text)
    outs = llm.generate(prompts, greedy(), use_tqdm=False)
    for (text, images, clips), out in zip(cases, outs, strict=True):
        ids, want = reference(ref, text, images, clips)
        assert out.prompt_token_ids == ids
        assert_matches(f"minicpmo_remote {len(images)} image(s)", out, want)
    with pytest.raises(ValueError, match="longer than 30 s"):
        llm.generate([{"prompt": AUDIO, "multi_modal_data": {"audio": (wave_of(3, 30.1), SR)}}])
    with pytest.raises(ValueError, match="audio placeholder"):
        llm.generate([{"prompt": "no marker", "multi_modal_data": {"audio": (long, SR)}}])
    with pytest.raises(ValueError, match="takes no videos"):
        llm.generate([{"prompt": "x", "multi_modal_data": {"video": [np.zeros((2, 8, 8, 3))]}}])


@pytest.mark.parametrize(
    ("field", "change"),
    [
        ("version", {"version": 4.5}),
        ("init_audio", {"init_audio": False}),
        ("audio_pool_step", {"audio_pool_step": 5}),
        ("audio_chunk_length", {"audio_chunk_length": 2.0}),
        ("encoder_ffn_dim", {"audio_config": {**APM, "encoder_ffn_dim": 96}}),
    ],
)
def test_configs_refused_by_name(ckpt, tmp_path, field, change):
    path, _ = ckpt
    config = json.loads((path / "config.json").read_text())
    check_config_refused(path, tmp_path, config | change, field)
