"""Audio through Gemma 3n (multimodal/gemma3n_audio.py) against HF transformers.

A tiny random Gemma3nForConditionalGeneration: tiny_config's Gemma 3n text model (AltUp,
Laurel, per-layer inputs over a table that ends before the media ids, KV-shared layers), the
vision and audio token embedders, and a 2-layer conformer over 16 mel bins (chunks of 4 with 4
rows of left and 2 of right context, a logit cap that bites, reduction 2) whose clips fill runs
of 32 tokens. HF's wrapper builds its vision tower with timm, so the reference is HF's pieces as
its wrapper's forward joins them: Gemma3nAudioEncoder and Gemma3nMultimodalEmbedder on the
extractor's features, the rows at the audio tokens (the rest of each run the last audio id's
embedding), HF's text model on them with per-layer inputs from the ids. The prompt ids are
Gemma3nProcessor's: each <audio_soft_token> replaced in the text by "\\n\\n<start_of_audio>" +
the run + "<end_of_audio>\\n\\n". Greedy tokens and top-5 logprobs within 1e-3 (float32) for
one clip, text alone and two clips of one length; then the engine's paths, TP=2, the
transcription prompt and bad input refused by name.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from audio_checks import check_matches_hf, check_one_two_paths, noise_clip
from hf_reference import Greedy, assert_matches
from image_checks import check_tensor_parallel, engine, greedy

from paged_engine.testing import _COMMON, _randomize, write_tiny_model

transformers = pytest.importorskip("transformers")
pytest.importorskip("transformers.models.gemma3n")
safetensors_torch = pytest.importorskip("safetensors.torch")

MAX_TOKENS, TOP, RUN = 8, 5, 32
MARKS = ["<start_of_audio>", "<end_of_audio>", "<audio_soft_token>"]
AUDIO = {
    "vocab_size": 16,
    "input_feat_size": 16,
    "hidden_size": 16,
    "conf_num_attention_heads": 2,
    "conf_num_hidden_layers": 2,
    "conf_attention_chunk_size": 4,
    "conf_attention_context_left": 5,
    "conf_attention_context_right": 2,
    "conf_attention_logit_cap": 2.0,
    "conf_reduction_factor": 2,
    "sscp_conv_channel_size": [8, 4],
}
ONE = "<|bos|>user\nWhat is that sound?<audio_soft_token>\nmodel\n"
TWO = "<|bos|>user\n<audio_soft_token> then<audio_soft_token> Which is louder?\nmodel\n"
TEXT = "<|bos|>user\nSay something about the sea.\nmodel\n"


def write_tiny_gemma3n_audio(path: Path, seed: int = 0) -> Path:
    """The checkpoint of the module doc: tiny_config's text model under
    `model.language_model.`, the embedders and the audio tower under theirs, a stand-in vision
    tower tensor; the feature extractor's settings in processor_config.json."""
    text_dir = write_tiny_model(path.parent / f"{path.name}_text", "gemma3n", seed=seed)
    path.mkdir(parents=True, exist_ok=True)
    tok = transformers.AutoTokenizer.from_pretrained(text_dir)
    tok.add_special_tokens({"additional_special_tokens": MARKS})
    boa, eoa, soft = tok.convert_tokens_to_ids(MARKS)
    assert soft == eoa + 1, "the audio token must follow <end_of_audio> (the audio offset)"
    text = json.loads((text_dir / "config.json").read_text())
    text["vocab_size"] = eoa + AUDIO["vocab_size"]  # the audio ids end the vocabulary
    vision = {"vocab_offset": eoa - 16, "vocab_size": 16, "hidden_size": 24}
    config = transformers.Gemma3nConfig(
        text_config=text,
        vision_config=vision,
        audio_config={**AUDIO, "vocab_offset": eoa},
        audio_soft_tokens_per_image=RUN,
        boa_token_id=boa,
        eoa_token_id=eoa,
        audio_token_id=soft,
        **_COMMON,
    )
    config.architectures = ["Gemma3nForConditionalGeneration"]
    config.save_pretrained(path)
    hf = _HFParts(config, seed)
    torch.manual_seed(seed)
    lm = transformers.Gemma3nForCausalLM(config.text_config).float()
    with torch.no_grad():
        _randomize(lm, seed)
    weights = {  # (the head is the tied embedding)
        "model.language_model." + k.removeprefix("model."): v
        for k, v in lm.state_dict().items()
        if k.startswith("model.")
    }
    for name, part in (("audio_tower", hf.tower), *hf.embedders.items()):
        weights.update({f"model.{name}.{k}": v for k, v in part.state_dict().items()})
    weights["model.vision_tower.timm_model.conv_stem.conv.weight"] = torch.ones(4, 3, 3, 3)
    weights = {k: v.contiguous() for k, v in weights.items()}
    safetensors_torch.save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
    extractor = transformers.Gemma3nAudioFeatureExtractor(feature_size=16)
    saved = {"feature_extractor": json.loads(extractor.to_json_string())}
    (path / "processor_config.json").write_text(json.dumps(saved))
    tok.save_pretrained(path)
    transformers.GenerationConfig(**_COMMON).save_pretrained(path)
    shutil.rmtree(text_dir)
    return path


class _HFParts:
    """HF's audio tower and token embedders of the wrapper `config`, random weights."""

    def __init__(self, config, seed: int) -> None:
        from transformers.models.gemma3n import modeling_gemma3n as m

        torch.manual_seed(seed)
        self.tower = m.Gemma3nAudioEncoder(config.audio_config).float().eval()
        self.embedders = {
            "embed_vision": m.Gemma3nMultimodalEmbedder(config.vision_config, config.text_config),
            "embed_audio": m.Gemma3nMultimodalEmbedder(config.audio_config, config.text_config),
        }
        with torch.no_grad():
            _randomize(self.tower, seed + 1)
            for i, e in enumerate(self.embedders.values()):
                _randomize(e.float().eval(), seed + 2 + i)


class _HF:
    """HF's wrapper forward from its pieces (see the module doc)."""

    def __init__(self, path: Path) -> None:
        from transformers.models.gemma3n import modeling_gemma3n as m

        self.config = transformers.AutoConfig.from_pretrained(path)
        state = safetensors_torch.load_file(str(path / "model.safetensors"))

        def part(module, prefix):
            module.load_state_dict(
                {k.removeprefix(prefix): v for k, v in state.items() if k.startswith(prefix)}
            )
            return module.float().eval()

        c = self.config
        self.tower = part(m.Gemma3nAudioEncoder(c.audio_config), "model.audio_tower.")
        self.vision = part(
            m.Gemma3nMultimodalEmbedder(c.vision_config, c.text_config), "model.embed_vision."
        )
        self.audio = part(
            m.Gemma3nMultimodalEmbedder(c.audio_config, c.text_config), "model.embed_audio."
        )
        lm = transformers.Gemma3nForCausalLM(c.text_config)
        text = {
            ("model." + k.removeprefix("model.language_model.")): v
            for k, v in state.items()
            if k.startswith("model.language_model.")
        }
        lm.load_state_dict(text, strict=False)
        lm.lm_head.weight = lm.model.embed_tokens.weight  # tied
        self.lm = lm.float().eval()
        self.tok = transformers.AutoTokenizer.from_pretrained(path)
        self.extractor = transformers.Gemma3nAudioFeatureExtractor(feature_size=16)
        boa, soft, eoa = MARKS[0], MARKS[2], MARKS[1]
        self.clip_text = f"\n\n{boa}{soft * RUN}{eoa}\n\n"

    def ids(self, text: str) -> list[int]:
        return self.tok.encode(text.replace(MARKS[2], self.clip_text), add_special_tokens=False)

    def rows(self, clips: list) -> torch.Tensor | None:
        if not clips:
            return None
        out = self.extractor(clips, return_tensors="pt")
        enc = self.tower(out["input_features"], ~out["input_features_mask"], return_dict=True)
        rows = self.audio(inputs_embeds=enc.last_hidden_state)
        filler = self.audio(input_ids=torch.tensor([[self.config.text_config.vocab_size - 1]]))
        rows = torch.where(enc.audio_mel_mask[..., None], filler, rows)
        extra = filler.expand(rows.shape[0], RUN - rows.shape[1], -1)
        return torch.cat([rows, extra], dim=1).reshape(-1, rows.shape[-1])

    def greedy(self, text: str, clips: list) -> tuple[list[int], Greedy]:
        prompt = self.ids(text)
        ids, audio = list(prompt), self.rows(clips)
        tokens, chosen, tops = [], [], []
        cap = self.config.text_config.final_logit_softcapping
        with torch.no_grad():
            for _ in range(MAX_TOKENS):
                t = torch.tensor([ids])
                x = self.lm.model.embed_tokens(t)
                v, a = self.vision, self.audio
                for e, mask in (
                    (v, (t >= v.vocab_offset) & (t < a.vocab_offset)),
                    (a, t >= a.vocab_offset),
                ):
                    rows = e(input_ids=torch.where(mask, t, e.vocab_offset + e.vocab_size - 1))
                    x = torch.where(mask[..., None], rows, x)
                if audio is not None:
                    x[t == self.config.audio_token_id] = audio
                per_layer = self.lm.model.get_per_layer_inputs(t)
                h = self.lm.model(inputs_embeds=x, per_layer_inputs=per_layer).last_hidden_state
                logits = self.lm.lm_head(h[0, -1])
                lp = torch.log_softmax((torch.tanh(logits / cap) * cap).float(), -1)
                token = int(lp.argmax())
                vals, top_ids = lp.topk(TOP)
                tokens.append(token)
                chosen.append(lp[token].item())
                tops.append(dict(zip(top_ids.tolist(), vals.tolist(), strict=True)))
                ids.append(token)
        return prompt, Greedy(tokens, chosen, tops)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return write_tiny_gemma3n_audio(tmp_path_factory.mktemp("gemma3n_audio") / "ckpt", seed=2)


def test_audio_matches_hf(tiny):
    """One clip, text alone, two clips of one length (HF pads a prompt's clips to the longest:
    see the module doc of gemma3n_audio.py): HF's prompt ids, greedy tokens and top-5
    logprobs; HF's expanded ids with the same clips taken as they are."""
    hf = _HF(tiny)
    cases = [
        (ONE, [noise_clip(1, 1.0)]),
        (TEXT, []),
        (TWO, [noise_clip(2, 1.3), noise_clip(3, 1.3)]),
        (ONE, [noise_clip(4, 0.45)]),
    ]
    refs = [hf.greedy(*case) for case in cases]
    llm = engine(tiny)
    check_matches_hf(llm, cases, refs, "gemma3n audio")
    soft = hf.config.audio_token_id
    assert refs[0][0].count(soft) == RUN


def test_engine_paths_match_the_plain_run(tiny):
    check_one_two_paths(tiny, ONE, TWO, longest=1.6)


def test_tensor_parallel_matches_one_process(tiny):
    clips = [noise_clip(14, 0.8), noise_clip(15, 1.7)]
    check_tensor_parallel(tiny, [{"prompt": TWO, "multi_modal_data": {"audio": clips}}], 16, 4)


def test_bad_input_is_refused_by_name(tiny):
    llm = engine(tiny)
    clip = noise_clip(17, 0.5)
    cases = [
        ({"audio": [clip, clip]}, r"2 audio\(s\) but the prompt has 1"),
        ({"audio": (clip, -5)}, "sampling rate"),
        ({"audio": "clip.wav"}, "waveform"),
        ({"audio": np.zeros(100, dtype=np.float32)}, "too short"),
        ({"audio": noise_clip(18, 4.0)}, "audio_soft_tokens_per_image=32"),
    ]
    for data, match in cases:
        with pytest.raises(ValueError, match=match):
            llm.generate([{"prompt": ONE, "multi_modal_data": data}], greedy(0), use_tqdm=False)
    with pytest.raises(ValueError, match="mm_processor_kwargs"):
        prompt = {"prompt": ONE, "multi_modal_data": {"audio": clip}}
        llm.generate([{**prompt, "mm_processor_kwargs": {"fps": 2}}], greedy(0), use_tqdm=False)
    # a processed clip whose frames are not this model's (another mel count)
    audios = llm.llm_engine.input_processor.audios
    ids, (placed,), _ = audios.process(llm.get_tokenizer().encode(ONE), clip)
    bad = dataclasses.replace(placed, pixel_values=placed.pixel_values[:, :8])
    with pytest.raises(ValueError, match="do not match"):
        llm.generate([{"prompt_token_ids": ids, "multi_modal_data": {"audio": bad}}], greedy(0))
    out = llm.generate([{"prompt": ONE, "multi_modal_data": {"audio": clip}}], greedy(0))[0]
    assert len(out.outputs[0].token_ids) == 8


def test_batch_padded_features_give_hf_batched_tokens(tiny):
    """Clips of different lengths as HF's processor pads them (each one's frames to the longest
    clip's, valid frames counted) and handed over processed: HF's batched tokens (the padding
    rows masked as keys and zeroed before the light conv)."""
    from paged_engine.multimodal.layouts import digest

    hf = _HF(tiny)
    clips = [noise_clip(20, 0.5), noise_clip(21, 1.5)]
    ids, ref = hf.greedy(TWO, clips)
    llm = engine(tiny)
    _, placed, _ = llm.llm_engine.input_processor.audios.process(ids, clips)
    batch = hf.extractor(clips, return_tensors="pt")
    padded = []
    for m, f, mask in zip(placed, batch["input_features"], batch["input_features_mask"]):
        size = (int(mask.sum()),)
        padded.append(
            dataclasses.replace(m, pixel_values=f, image_size=size, mm_hash=digest(f, size))
        )
    assert padded[0].image_size[0] < padded[0].pixel_values.shape[0]  # frames past the clip
    prompt = {"prompt_token_ids": ids, "multi_modal_data": {"audio": padded}}
    assert_matches("gemma3n audio", llm.generate([prompt], greedy(), use_tqdm=False)[0], ref)


def test_transcription_prompt(tiny):
    """vLLM's Gemma 3n request, and the engine transcribes a clip with it as HF does."""
    llm = engine(tiny)
    audios = llm.llm_engine.input_processor.audios
    head, tail = (
        "<start_of_turn>user\n",
        ": <audio_soft_token><end_of_turn>\n<start_of_turn>model\n",
    )
    cases = [
        (("fr", "transcribe"), "Transcribe this audio into French"),
        ((None, "transcribe"), "Transcribe this audio"),
        (("xx", "transcribe"), "Transcribe this audio"),
        (("de", "translate"), "Translate this audio from German"),
    ]
    for (language, task), ask in cases:
        assert audios.transcription_prompt(language, task, "") == {"prompt": head + ask + tail}
    for args, match in [(("en", "summarize", ""), "task"), (("en", "transcribe", "hi"), "prompt")]:
        with pytest.raises(ValueError, match=match):
            audios.transcription_prompt(*args)
    clip = noise_clip(22, 1.1)
    request = audios.transcription_prompt("fr", "transcribe", "")
    ids, ref = _HF(tiny).greedy(request["prompt"], [clip])
    out = llm.generate([{**request, "multi_modal_data": {"audio": clip}}], greedy(), use_tqdm=False)
    assert out[0].prompt_token_ids == ids
    assert_matches("gemma3n transcription", out[0], ref)
