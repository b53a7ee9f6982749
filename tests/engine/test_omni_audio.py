"""Audio through the Qwen2.5-Omni and Qwen3-Omni thinkers (multimodal/omni_audio.py) against HF.

The tiny thinkers of test_qwen_omni_images.py (`write_tiny_omni`) with their audio towers given
short windows: Qwen2.5-Omni chunks of 50 frames (n_window 25: 25 rows a chunk, pooled in
pairs), a 3-second extractor window; Qwen3-Omni chunks of 100 frames (13 rows) and attention
windows of two chunks (n_window_infer 200), no extractor window (its processor pads a prompt's
clips to the longest). The WhisperFeatureExtractor shares preprocessor_config.json with the
image processor, as on the Hub. HF's Omni processors need torchvision (their video processor),
so the reference prompt is built by their rule: the extractor called as `_process_audio` calls
it, each <|AUDIO|> / <|audio_pad|> expanded to `_get_feat_extract_output_lengths` of the
clip's valid frames. `LLM.generate` must give those ids and HF `generate`'s greedy tokens and
top-5 logprobs (1e-3, float32) on one clip, text alone, a clip and an image, two clips of
different lengths (several chunks and windows) and a clip over the window; the M-RoPE table of
an audio + image prompt equals get_rope_index's. Then chunks through clips, prefix caching,
clips processed ahead, TP=2, the server's chat path with an input_audio part, the whole
model's names, and bad input refused by name.
"""

from __future__ import annotations

import json
from functools import partial
from pathlib import Path

import numpy as np
import pytest
import torch
from audio_checks import check_audio_paths, check_chat_input_audio, noise_clip
from hf_reference import assert_matches, hf_greedy
from image_checks import check_tensor_parallel, engine, greedy, noise_image

transformers = pytest.importorskip("transformers")
pytest.importorskip("transformers.models.qwen2_5_omni")
pytest.importorskip("transformers.models.qwen3_omni_moe")

from test_qwen_omni_images import CLASSES, MARKS, write_tiny_omni  # noqa: E402

from paged_engine.testing import _COMMON, _save_random  # noqa: E402

MAX_TOKENS = 8
ENCODERS = {"2.5": "Qwen2_5OmniAudioEncoder", "3": "Qwen3OmniAudioEncoder"}
BOS_EOS = "audio_tower.audio_bos_eos_token.weight"  # Qwen2.5-Omni's, the talker's: not read
# the towers' windows, shortened (config.json audio_config fields)
AUDIO = {"2.5": {"n_window": 25}, "3": {"n_window_infer": 200}}


def _template(version: str) -> str:
    """The chat template of write_tiny_omni's tokenizer with audio parts."""
    bos, eos, image, _, audio = MARKS[version]
    return (
        "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
        "{% if message['content'] is string %}{{ message['content'] }}"
        "{% else %}{% for part in message['content'] %}"
        f"{{% if part['type'] == 'image' %}}{bos}{image}{eos}"
        f"{{% elif part['type'] == 'audio' %}}<|audio_bos|>{audio}<|audio_eos|>"
        "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
        "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )


def write_tiny_omni_audio(path: Path, version: str) -> Path:
    """`write_tiny_omni` with short audio windows, a WhisperFeatureExtractor (16 mel bins, a
    3-second window) beside the image processor in preprocessor_config.json, and a chat
    template that writes audio parts."""
    write_tiny_omni(path, version)
    (path / "chat_template.jinja").write_text(_template(version))
    config = json.loads((path / "config.json").read_text())
    config["audio_config"] |= AUDIO[version]  # (window sizes: no weight changes shape)
    (path / "config.json").write_text(json.dumps(config, indent=1))
    extractor = transformers.WhisperFeatureExtractor(feature_size=16, chunk_length=3)
    saved = {k: v for k, v in extractor.to_dict().items() if k != "mel_filters"}
    images = json.loads((path / "preprocessor_config.json").read_text())
    (path / "preprocessor_config.json").write_text(json.dumps({**images, **saved}, indent=1))
    return path


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    cache: dict[str, Path] = {}

    def make(version: str) -> Path:
        if version not in cache:
            where = tmp_path_factory.mktemp(f"omni_audio{version}")
            cache[version] = write_tiny_omni_audio(where, version)
        return cache[version]

    return make


def _prompts(version: str) -> dict[str, str]:
    bos, eos, image, _, audio = MARKS[version]
    clip = f"<|audio_bos|>{audio}<|audio_eos|>"
    user, end = "<|im_start|>user\n", "<|im_end|>\n<|im_start|>assistant\n"
    return {
        "one": f"{user}{clip}What is that sound?{end}",
        "two": f"{user}{clip} then {clip} Which is louder?{end}",
        "mixed": f"{user}{clip} and {bos}{image}{eos} Does it fit?{end}",
        "text": f"{user}Say something about the sea.{end}",
    }


class _HF:
    """HF's thinker with the prompt built by its processor's rule."""

    def __init__(self, path: Path, version: str) -> None:
        cls = getattr(transformers, CLASSES[version])
        self.version = version
        self.model = cls.from_pretrained(path, dtype=torch.float32).eval()
        self.model.generation_config.eos_token_id = None
        self.images = transformers.AutoImageProcessor.from_pretrained(path)
        self.extractor = transformers.AutoFeatureExtractor.from_pretrained(path)
        self.tok = transformers.AutoTokenizer.from_pretrained(path)
        config = self.model.config
        self.image_pad, self.audio_pad = config.image_token_id, config.audio_token_id

    def audio_runs(self, clips: list) -> tuple[list[int], dict]:
        if self.version == "2.5":
            from transformers.models.qwen2_5_omni import processing_qwen2_5_omni as proc

            kw: dict = {"padding": "max_length"}
            lengths = proc._get_feat_extract_output_lengths
        else:
            from transformers.models.qwen3_omni_moe import processing_qwen3_omni_moe as proc

            kw = {"padding": True, "truncation": False}
            n_window = self.model.config.audio_config.n_window
            lengths = partial(proc._get_feat_extract_output_lengths, n_window=n_window)
        out = self.extractor(
            clips, sampling_rate=16_000, return_attention_mask=True, return_tensors="pt", **kw
        )
        mask = out["attention_mask"]
        runs = [int(n) for n in lengths(mask.sum(-1))]
        return runs, {"input_features": out["input_features"], "feature_attention_mask": mask}

    def inputs(self, text: str, images: list, clips: list) -> tuple[list[int], dict]:
        ids = self.tok.encode(text, add_special_tokens=False)
        extra: dict = {}
        runs = {self.image_pad: iter(()), self.audio_pad: iter(())}
        if images:
            out = self.images(images=images, return_tensors="pt")
            runs[self.image_pad] = iter(int(g.prod()) // 4 for g in out["image_grid_thw"])
            extra |= {k: out[k] for k in ("pixel_values", "image_grid_thw")}
        if clips:
            audio, features = self.audio_runs(clips)
            runs[self.audio_pad] = iter(audio)
            extra |= features
        expanded: list[int] = []
        for t in ids:
            expanded += [t] * next(runs[t]) if t in runs else [t]
        return expanded, extra

    def greedy(self, text: str, images: list, clips: list):
        ids, extra = self.inputs(text, images, clips)
        return ids, hf_greedy(self.model, ids, MAX_TOKENS, 5, **extra)


def _request(text: str, images: list, clips: list) -> dict | str:
    data = {"image": images} if images else {}
    data |= {"audio": clips} if clips else {}
    return {"prompt": text, "multi_modal_data": data} if data else text


@pytest.mark.parametrize("version", ["2.5", "3"])
def test_audio_matches_hf(dirs, version):
    """HF's prompt ids, greedy tokens and top-5 logprobs: one clip, text alone, an image and a
    clip, two clips of different lengths off a multiple of the hop (Qwen3-Omni: the shorter's
    frame count and last frames as the processor pads it beside the longer; two and three
    chunks, the longer in two attention windows; Qwen2.5-Omni: 155 and 278 frames, chunks of
    50, the last of 5 (odd: conv2 reads a masked frame) and an odd row count pooled), a clip
    over the window (Qwen2.5-Omni cuts it to 3 s, Qwen3-Omni keeps all 4 s). Then the M-RoPE
    table of the image + clip prompt equals get_rope_index's."""
    path = dirs(version)
    hf = _HF(path, version)
    p = _prompts(version)
    pic = noise_image(1, (40, 56))
    cases = [
        (p["one"], [], [noise_clip(1, 1.0)]),
        (p["text"], [], []),
        (p["mixed"], [pic], [noise_clip(2, 1.2)]),
        (p["two"], [], [noise_clip(3, 1.5412), noise_clip(4, 2.7705)]),
        (p["one"], [], [noise_clip(5, 4.0)]),
    ]
    refs = [hf.greedy(*case) for case in cases]
    llm = engine(path)
    outs = llm.generate([_request(*case) for case in cases], greedy(), use_tqdm=False)
    for (ids, ref), out in zip(refs, outs, strict=True):
        assert out.prompt_token_ids == ids
        assert_matches(f"omni{version} audio", out, ref)
    runs = [ids.count(hf.audio_pad) for ids, _ in refs]
    # Qwen2.5-Omni: 100 frames -> 50 rows -> 25; 4 s cut to 300 frames -> 75
    # Qwen3-Omni: 100 frames -> 13; 400 frames -> 4 full chunks, 52
    assert (runs[0], runs[-1]) == ((25, 75) if version == "2.5" else (13, 52))

    text, images, clips = cases[2]
    ids, extra = hf.inputs(text, images, clips)
    want, delta = hf.model.get_rope_index(
        torch.tensor([ids]),
        extra["image_grid_thw"],
        attention_mask=torch.ones(1, len(ids), dtype=torch.long),
        audio_seqlens=extra["feature_attention_mask"].sum(-1),
    )
    processor = llm.llm_engine.input_processor
    request = processor.make_request("rope", _request(*cases[2]), None, None).request
    np.testing.assert_array_equal(request.mrope.table, want[:, 0].numpy())
    assert request.mrope.delta == int(delta) < 0


@pytest.mark.parametrize("version", ["2.5", "3"])
def test_engine_paths_match_the_plain_run(dirs, version):
    """8-token chunks through clips (Qwen3-Omni: an image's deepstack rows in the same step
    as a clip's), prefix-cache hits, clips processed ahead."""
    p = _prompts(version)
    prompts: list[dict] = [
        {"prompt": p["one"], "multi_modal_data": {"audio": noise_clip(10 + i, 0.7 + 0.6 * i)}}
        for i in range(2)
    ]
    mixed = {"image": noise_image(6, (24, 40)), "audio": noise_clip(12, 0.9)}
    prompts.append({"prompt": p["mixed"], "multi_modal_data": mixed})
    two = [noise_clip(13, 0.5), noise_clip(14, 2.2)]
    prompts.append({"prompt": p["two"], "multi_modal_data": {"audio": two}})
    check_audio_paths(dirs(version), prompts, p["two"])


def test_tensor_parallel_matches_one_process(dirs):
    p = _prompts("3")
    data = {"image": noise_image(7, (32, 48)), "audio": noise_clip(15, 1.4)}
    check_tensor_parallel(dirs("3"), [{"prompt": p["mixed"], "multi_modal_data": data}], 8, 4)


def test_chat_input_audio_gives_the_offline_tokens(dirs):
    """The server's chat path: an input_audio part (base64 WAV) gives the offline tokens of
    the chat template's prompt (<|audio_bos|><|AUDIO|><|audio_eos|> expanded)."""
    check_chat_input_audio(engine(dirs("2.5")), noise_clip(16, 1.2))


WHOLE = {
    "2.5": ("Qwen2_5OmniConfig", "Qwen2_5OmniForConditionalGeneration"),
    "3": ("Qwen3OmniMoeConfig", "Qwen3OmniMoeForConditionalGeneration"),
}


@pytest.mark.parametrize("version", ["2.5", "3"])
def test_whole_model_takes_audio_through_its_thinker(dirs, tmp_path, version):
    """The whole-model class (`thinker.audio_tower.*` names, the config's thinker_config) gives
    HF's `.thinker` tokens and logprobs on a clip."""
    thinker_dir = dirs(version)
    config_cls, model_cls = (getattr(transformers, n) for n in WHOLE[version])
    thinker = transformers.AutoConfig.from_pretrained(thinker_dir)
    config = config_cls(thinker_config=thinker.to_dict(), enable_audio_output=False)
    whole = tmp_path / "whole"
    _save_random(model_cls, config, 0, whole)
    for f in thinker_dir.iterdir():
        if f.name not in ("config.json", "model.safetensors", "generation_config.json"):
            (whole / f.name).write_bytes(f.read_bytes())
    transformers.GenerationConfig(**_COMMON).save_pretrained(whole)
    torch.save({}, whole / "spk_dict.pt")  # Qwen2.5-Omni's loader reads its speakers
    hf = _HF.__new__(_HF)
    hf.version = version
    hf.model = model_cls.from_pretrained(whole, dtype=torch.float32).eval().thinker
    hf.model.generation_config.eos_token_id = None
    hf.extractor = transformers.AutoFeatureExtractor.from_pretrained(whole)
    hf.tok = transformers.AutoTokenizer.from_pretrained(whole)
    hf.image_pad, hf.audio_pad = hf.model.config.image_token_id, hf.model.config.audio_token_id
    text, clips = _prompts(version)["two"], [noise_clip(20, 0.8), noise_clip(21, 1.9)]
    ids, ref = hf.greedy(text, [], clips)
    out = engine(whole).generate([_request(text, [], clips)], greedy(), use_tqdm=False)[0]
    assert out.prompt_token_ids == ids
    assert_matches(f"whole {version} audio", out, ref)


def test_bad_input_is_refused_by_name(dirs):
    """A clip count off the prompt's placeholders, a clip too short for a pooled row, configs
    the towers could not run as HF runs them, a checkpoint missing a tower weight: ValueErrors
    naming what is wrong; the engine serves on."""
    from paged_engine.multimodal import omni_audio

    path = dirs("2.5")
    llm = engine(path)
    p = _prompts("2.5")
    clip = noise_clip(30, 0.5)
    cases = [
        ({"audio": [clip, clip]}, r"2 audio\(s\) but the prompt has 1"),
        ({"audio": np.zeros(300, dtype=np.float32)}, r"\['audio'\]\[0\]: the clip is too short"),
    ]
    for data, match in cases:
        with pytest.raises(ValueError, match=match):
            llm.generate([{"prompt": p["one"], "multi_modal_data": data}], greedy(0))
    out = llm.generate([{"prompt": p["one"], "multi_modal_data": {"audio": clip}}], greedy(0))
    assert len(out[0].outputs[0].token_ids) == MAX_TOKENS

    for version, field, value, match in [
        ("3", "n_window", 10, r"audio_config\.n_window=10"),
        ("3", "n_window_infer", 50, r"audio_config\.n_window_infer=50"),
        ("2.5", "max_source_positions", 8, r"audio_config\.max_source_positions=8"),
        ("2.5", "output_dim", 32, r"audio_config\.output_dim=32"),
    ]:
        config = transformers.AutoConfig.from_pretrained(dirs(version))
        setattr(config.audio_config, field, value)
        with pytest.raises(ValueError, match=match):
            getattr(omni_audio, ENCODERS[version])(config)

    from safetensors.torch import load_file

    for version in ("2.5", "3"):  # every tower weight read (Qwen3-Omni's key bias too)
        config = transformers.AutoConfig.from_pretrained(dirs(version))
        weights = load_file(str(dirs(version) / "model.safetensors"))
        encoder = getattr(omni_audio, ENCODERS[version])(config)
        tower = {n for n in weights if n.startswith("audio_tower.")}
        assert encoder.load_weights(weights.items()) == tower - {BOS_EOS}
    config = transformers.AutoConfig.from_pretrained(path)
    weights = load_file(str(path / "model.safetensors"))
    dropped = ((n, t) for n, t in weights.items() if n != "audio_tower.ln_post.weight")
    with pytest.raises(ValueError, match=r"audio_tower\.ln_post\.weight"):
        omni_audio.Qwen2_5OmniAudioEncoder(config).load_weights(dropped)
