"""Audio through Gemma 4 (multimodal/gemma4_audio.py) against HF transformers.

A tiny random Gemma4ForConditionalGeneration: test_gemma4_images.py's text model (per-layer
inputs, KV-shared layers, use_bidirectional_attention="vision") and vision tower, and a 2-layer
conformer over 16 mel bins: chunks of 4 with 5 rows of left and 2 of right context (so the
relative-position shift and both context bounds matter), a logit cap and clipped projections
that bite. `LLM.generate` with `multi_modal_data={"audio": ...}` must give Gemma4Processor's
prompt ids (<|audio|> -> <|audio> + a run + <audio|>) and HF `generate`'s greedy tokens and
top-5 logprobs (1e-3, float32) for one clip, text alone, two clips of different lengths in one
prompt (the tower batches them, each one's padding masked) and a clip with an image; then the
engine's paths, TP=2, the chat path and bad input refused by name.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from audio_checks import check_chat_input_audio, check_one_two_paths, noise_clip
from hf_reference import assert_matches, hf_greedy
from image_checks import check_tensor_parallel, engine, greedy, noise_image

from paged_engine.testing import (
    _COMMON,
    TINY_VOCAB_SIZE,
    _quiet_progress,
    _randomize,
    build_tiny_tokenizer,
    tiny_config,
)

transformers = pytest.importorskip("transformers")
pytest.importorskip("transformers.models.gemma4")
pytest.importorskip("PIL.Image")
if not hasattr(transformers, "Gemma4AudioFeatureExtractor"):
    pytest.skip("transformers lacks Gemma 4's audio feature extractor", allow_module_level=True)

from test_gemma4_images import TOKENS, _NoVideoProcessor, _pixels  # noqa: E402

MAX_TOKENS = 8
SOFT_TOKENS = 70
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<|turn>"
    "{{ 'model' if message['role'] == 'assistant' else message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<|image|>{% elif part['type'] == 'audio' %}<|audio|>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<turn|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|turn>model\n{% endif %}"
)
ONE = "<|bos|><|turn>user\nWhat is that sound?<|audio|><turn|>\n<|turn>model\n"
TWO = "<|bos|><|turn>user\n<|audio|> then <|audio|> Which is louder?<turn|>\n<|turn>model\n"
BOTH = "<|bos|><|turn>user\n<|audio|> and <|image|> Does it match?<turn|>\n<|turn>model\n"
TEXT = "<|bos|><|turn>user\nSay something about the sea.<turn|>\n<|turn>model\n"
AUDIO = {
    "hidden_size": 16,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "subsampling_conv_channels": [16, 8],
    "conv_kernel_size": 5,
    "attention_chunk_size": 4,
    "attention_context_left": 5,
    "attention_context_right": 2,
    "attention_logit_cap": 2.0,
    "output_proj_dims": 24,
    "use_clipped_linears": True,
}


def write_tiny_gemma4_audio(path: Path, seed: int = 0) -> Path:
    """The checkpoint of the module doc; the image processor's settings in
    preprocessor_config.json, the feature extractor's nested in processor_config.json (as
    transformers 5 saves a processor's)."""
    path.mkdir(parents=True, exist_ok=True)
    base = build_tiny_tokenizer(TINY_VOCAB_SIZE, seed)
    specials = [*TOKENS.values(), "<|video|>", "<|turn>", "<turn|>"]
    base.add_special_tokens({"additional_special_tokens": specials})
    base.save_pretrained(path)
    tok = transformers.AutoTokenizer.from_pretrained(path, extra_special_tokens=TOKENS)
    ids = {k: tok.convert_tokens_to_ids(v) for k, v in TOKENS.items()}
    vocab = len(tok)
    text = tiny_config(
        "gemma4",
        vocab_size=vocab,
        vocab_size_per_layer_input=vocab,
        use_bidirectional_attention="vision",
    ).to_dict()
    vision = {
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 1,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "patch_size": 2,
        "pooling_kernel_size": 3,
        "position_embedding_size": 64,
        "use_clipped_linears": False,
    }
    config = transformers.Gemma4Config(
        text_config=text,
        vision_config=vision,
        audio_config=AUDIO,
        image_token_id=ids["image_token"],
        boi_token_id=ids["boi_token"],
        eoi_token_id=ids["eoi_token"],
        audio_token_id=ids["audio_token"],
        boa_token_id=ids["boa_token"],
        eoa_token_index=ids["eoa_token"],
        video_token_id=tok.convert_tokens_to_ids("<|video|>"),
        **_COMMON,
    )
    torch.manual_seed(seed)
    model = transformers.Gemma4ForConditionalGeneration(config).to(torch.float32)
    _randomize(model, seed)
    with torch.no_grad():  # clip bounds HF leaves unbounded: ones that bite
        for name, b in model.named_buffers():
            if name.startswith("model.audio_tower.") and name.endswith(("_max", "_min")):
                b.fill_(1.0 if name.endswith("_max") else -1.0)
    with _quiet_progress():
        model.save_pretrained(path)
    pil = transformers.Gemma4ImageProcessorPil
    pil(patch_size=2, pooling_kernel_size=3, max_soft_tokens=SOFT_TOKENS).save_pretrained(path)
    extractor = json.loads(
        transformers.Gemma4AudioFeatureExtractor(feature_size=16).to_json_string()
    )
    saved = {"feature_extractor": extractor, "audio_seq_length": 750, "audio_ms_per_token": 40}
    (path / "processor_config.json").write_text(json.dumps(saved))
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(path)
    transformers.GenerationConfig(**_COMMON).save_pretrained(path)
    return path


def hf_processor(path):
    return _NoVideoProcessor(
        feature_extractor=transformers.Gemma4AudioFeatureExtractor(feature_size=16),
        image_processor=transformers.Gemma4ImageProcessorPil.from_pretrained(path),
        tokenizer=transformers.AutoTokenizer.from_pretrained(path),
        video_processor=None,
        image_seq_length=SOFT_TOKENS,
    )


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return write_tiny_gemma4_audio(tmp_path_factory.mktemp("gemma4_audio"), seed=5)


class _HF:
    def __init__(self, path: Path) -> None:
        cls = transformers.Gemma4ForConditionalGeneration
        self.model = cls.from_pretrained(path, dtype=torch.float32).eval()
        self.model.generation_config.eos_token_id = None
        self.processor = hf_processor(path)
        self.path = path

    def greedy(self, text: str, clips: list, images: list):
        if not clips and not images:
            ids = self.processor.tokenizer.encode(text, add_special_tokens=False)
            return ids, hf_greedy(self.model, ids, MAX_TOKENS, 5)
        kw = {"audio": clips} if clips else {}
        if images:
            kw["images"] = [images]
        out = self.processor(text=[text], return_tensors="pt", **kw)
        ids = out["input_ids"][0].tolist()
        keys = ("input_features", "input_features_mask", "mm_token_type_ids", "image_position_ids")
        extra = {k: out[k] for k in keys if k in out}
        if images:  # the engine's pixels (see test_gemma4_images.py)
            extra |= _pixels(self.path, images, out)
        return ids, hf_greedy(self.model, ids, MAX_TOKENS, 5, **extra)


def _prompt(text: str, clips: list, images: list):
    data = ({"audio": clips} if clips else {}) | ({"image": images} if images else {})
    return {"prompt": text, "multi_modal_data": data} if data else text


def test_audio_matches_hf(tiny):
    """One clip, text alone, two clips of different lengths (0.706 s: 70 valid frames, an odd
    35 rows after the first conv, whose padding row the second reads; and 2.3 s) and a clip
    with an image: HF's prompt ids, greedy tokens and top-5 logprobs; HF's expanded ids with
    the same media taken as they are."""
    hf = _HF(tiny)
    cases = [
        (ONE, [noise_clip(1, 1.0)], []),
        (TEXT, [], []),
        (TWO, [noise_clip(2, 0.706), noise_clip(3, 2.3)], []),
        (BOTH, [noise_clip(4, 1.1)], [noise_image(5, (30, 40))]),
    ]
    refs = [hf.greedy(*case) for case in cases]
    llm = engine(tiny)
    prompts = [_prompt(*case) for case in cases]
    for (ids, ref), out in zip(refs, llm.generate(prompts, greedy(), use_tqdm=False), strict=True):
        assert out.prompt_token_ids == ids
        assert_matches("gemma4 audio", out, ref)
    # 1 s: 99 frames of 20 ms every 10 ms -> 50 -> 25 rows
    audio_id = llm.get_tokenizer().convert_tokens_to_ids("<|audio|>")
    assert refs[0][0].count(audio_id) == 25
    ahead = [
        {"prompt_token_ids": ids, "multi_modal_data": prompts[i]["multi_modal_data"]}
        for i, (ids, _) in enumerate(refs)
        if cases[i][1]
    ]
    outs = llm.generate(ahead, greedy(), use_tqdm=False)
    want = [ref.tokens for (_, ref), case in zip(refs, cases, strict=True) if case[1]]
    assert [o.outputs[0].token_ids for o in outs] == want


def test_engine_paths_match_the_plain_run(tiny):
    check_one_two_paths(tiny, ONE, TWO, longest=1.6)


def test_tensor_parallel_matches_one_process(tiny):
    clips = [noise_clip(14, 0.8), noise_clip(15, 1.7)]
    check_tensor_parallel(tiny, [{"prompt": TWO, "multi_modal_data": {"audio": clips}}], 8, 4)


def test_chat_input_audio_gives_the_offline_tokens(tiny):
    """The server's chat path: an input_audio part (base64 WAV) gives the offline tokens of
    the chat template's prompt."""
    check_chat_input_audio(engine(tiny), noise_clip(16, 1.2))


def test_bad_input_is_refused_by_name(tiny):
    llm = engine(tiny)
    clip = noise_clip(17, 0.5)
    cases = [
        ({"audio": [clip, clip]}, r"2 audio\(s\) but the prompt has 1"),
        ({"audio": (clip, -5)}, "sampling rate"),
        ({"audio": np.zeros((2, 3, 4))}, "1-D"),
        ({"audio": "clip.wav"}, "waveform"),
        ({"audio": np.zeros(100, dtype=np.float32)}, "too short"),
    ]
    for data, match in cases:
        with pytest.raises(ValueError, match=match):
            llm.generate([{"prompt": ONE, "multi_modal_data": data}], greedy(0), use_tqdm=False)
    # a clip alone with kwargs no processor of the model takes (the image processor checks)
    with pytest.raises(ValueError, match=r"mm_processor_kwargs.*fps"):
        prompt = {"prompt": ONE, "multi_modal_data": {"audio": clip}}
        llm.generate([{**prompt, "mm_processor_kwargs": {"fps": 2}}], greedy(0), use_tqdm=False)
    # a processed clip whose features do not give its run
    audios = llm.llm_engine.input_processor.audios
    ids, (placed,), _ = audios.process(llm.get_tokenizer().encode(ONE), clip)
    short = dataclasses.replace(placed, pixel_values=placed.pixel_values[:-8])
    with pytest.raises(ValueError, match="do not match"):
        llm.generate([{"prompt_token_ids": ids, "multi_modal_data": {"audio": short}}], greedy(0))
    out = llm.generate([{"prompt": ONE, "multi_modal_data": {"audio": clip}}], greedy(0))[0]
    assert len(out.outputs[0].token_ids) == 8


def test_config_refusals(tiny, monkeypatch):
    """A Gemma 4 config without audio_config (26B / 31B) serves no audio, by name; a tower
    the module does not run is refused by its audio_config field; pipeline parallelism with
    per-layer inputs is refused."""
    from types import SimpleNamespace

    from paged_engine.multimodal import gemma4_audio
    from paged_engine.multimodal.gemma4_audio import Gemma4AudioEncoder

    config = transformers.AutoConfig.from_pretrained(tiny)
    config.audio_config = None
    with pytest.raises(ValueError, match="without audio_config"):
        Gemma4AudioEncoder(config)
    config = transformers.AutoConfig.from_pretrained(tiny)
    config.audio_config.subsampling_conv_channels = [16, 8, 8]
    with pytest.raises(ValueError, match="subsampling_conv_channels"):
        Gemma4AudioEncoder(config)
    config = transformers.AutoConfig.from_pretrained(tiny)
    monkeypatch.setattr(gemma4_audio, "get_parallel_state", lambda: SimpleNamespace(pp_size=2))
    with pytest.raises(ValueError, match="pipeline parallelism"):
        Gemma4AudioEncoder(config)
