"""Audio through Kimi-Audio (`MoonshotKimiaForCausalLM`, remote code: multimodal/kimi_audio.py)
against a reference composed here as vLLM's kimi_audio.py computes the text output:
transformers' WhisperFeatureExtractor (unpadded) and WhisperForConditionalGeneration's encoder
modules, the VQ adaptor in plain torch (Linear -> GELU -> Linear -> LayerNorm), the fused run
((embed(blank) + row) * sqrt(2) for the first min(P, E) placeholders), Qwen2ForCausalLM on
inputs_embeds, greedy generate.

The tiny checkpoint: Qwen2 (flat config.json of the release's fields and kimia_* ones, random
MIMO weights beside to be passed over), `model.vq_adaptor.layers.{0,3,4}.*`, and a
`whisper-large-v3/` subfolder holding a 2-layer Whisper (8 mels, d_model 16) and its feature
extractor. Tokens identical, logprobs within 1e-3 (float32).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from audio_checks import check_chat_writes_placeholder, check_matches_hf, noise_clip
from hf_reference import hf_greedy_with_rows
from image_checks import engine, greedy
from torch import nn

transformers = pytest.importorskip("transformers")

from paged_engine.testing import (  # noqa: E402
    _COMMON,
    _LLAMA_LIKE,
    TINY_VOCAB_SIZE,
    _randomize,
    build_tiny_tokenizer,
)

BEGIN, BLANK, END = "<|im_media_begin|>", "<|im_kimia_text_blank|>", "<|im_media_end|>"
MELS, D = 8, 16
ONE = f"<|im_start|>user\n{BEGIN}{BLANK}{END}What is it?<|im_end|>\n<|im_start|>assistant\n"
TEXT = "<|im_start|>user\nSay something about the sea.<|im_end|>\n<|im_start|>assistant\n"


def vllm_count(frames: int) -> int:
    """vLLM's _get_feat_extract_output_lengths of `frames` mel frames."""
    leave = frames % 100
    feat = (leave - 1) // 2 + 1
    return ((feat - 1) // 2 + 1 - 1) // 2 + 1 + frames // 100 * 13


class Reference(nn.Module):
    def __init__(self, tokenizer) -> None:
        super().__init__()
        self.tokenizer = tokenizer
        self.blank = tokenizer.convert_tokens_to_ids(BLANK)
        self.text = {**_LLAMA_LIKE, "vocab_size": len(tokenizer), **_COMMON}
        self.text |= {"rope_theta": 10000.0, "tie_word_embeddings": False}
        self.decoder = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**self.text))
        self.whisper_config = transformers.WhisperConfig(
            num_mel_bins=MELS, d_model=D, encoder_layers=2, encoder_attention_heads=2,
            encoder_ffn_dim=32, decoder_layers=1, decoder_attention_heads=2, decoder_ffn_dim=32,
            vocab_size=64, max_source_positions=1500, max_target_positions=32, pad_token_id=0,
            bos_token_id=0, eos_token_id=1, decoder_start_token_id=0,
        )  # fmt: skip
        self.whisper = transformers.WhisperForConditionalGeneration(self.whisper_config)
        hidden = self.text["hidden_size"]
        self.adaptor = nn.Sequential(  # vLLM's KimiAudioMultiModalProjector
            nn.Linear(4 * D, hidden), nn.GELU(), nn.Dropout(0.0), nn.Linear(hidden, hidden),
            nn.LayerNorm(hidden),
        )  # fmt: skip
        self.extractor = transformers.WhisperFeatureExtractor(feature_size=MELS)

    def run(self, clip: np.ndarray) -> torch.Tensor:
        """vLLM's run rows for one clip: [P, hidden]."""
        wave = np.pad(clip, (0, -clip.size % 160))
        out = self.extractor(
            wave, sampling_rate=16000, padding=True, return_attention_mask=True,
            return_tensors="pt",
        )  # fmt: skip
        frames = int(out["attention_mask"].sum())
        enc = self.whisper.model.encoder
        x = F.gelu(enc.conv1(out["input_features"]))
        x = F.gelu(enc.conv2(x)).transpose(1, 2)
        x = x + enc.embed_positions.weight[: x.shape[1]]
        for layer in enc.layers:
            x = layer(x, None)
            x = x[0] if isinstance(x, tuple) else x
        x = enc.layer_norm(x)[0]
        x = F.pad(x, (0, 0, 0, -x.shape[0] % 4))
        rows = self.adaptor(x.reshape(-1, 4 * D))
        p = vllm_count(frames)
        blank = self.decoder.get_input_embeddings().weight[self.blank]
        run = blank.expand(p, -1).clone()
        n = min(p, rows.shape[0])
        run[:n] = (blank + rows[:n]) * 2**0.5
        return run

    def greedy(self, text: str, clips: list):
        with torch.no_grad():
            rows = [self.run(c) for c in clips]
        head, _, tail = text.partition(BLANK)
        expanded = head + BLANK * rows[0].shape[0] + tail if rows else text
        ids = self.tokenizer.encode(expanded, add_special_tokens=False)
        return ids, hf_greedy_with_rows(self.decoder, ids, self.blank, rows)

    def save(self, path: Path, **config) -> Path:
        from safetensors.torch import save_file

        path.mkdir(parents=True, exist_ok=True)
        state = {k: v.contiguous() for k, v in self.decoder.state_dict().items()}
        state |= {f"model.vq_adaptor.layers.{k}": v for k, v in self.adaptor.state_dict().items()}
        hidden = self.text["hidden_size"]
        state["model.mimo_layers.0.mlp.up_proj.weight"] = torch.randn(8, hidden)  # passed over
        state["model.mimo_norm.weight"] = torch.ones(hidden)
        state["mimo_output.weight"] = torch.randn(self.text["vocab_size"], hidden)
        save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
        data = {
            **self.text,
            "architectures": ["MoonshotKimiaForCausalLM"],
            "auto_map": {"AutoConfig": "configuration_moonshot_kimia.KimiAudioConfig"},
            "model_type": "kimi_audio",
            "kimia_adaptor_input_dim": 4 * D,
            "kimia_media_begin": self.tokenizer.convert_tokens_to_ids(BEGIN),
            "kimia_media_end": self.tokenizer.convert_tokens_to_ids(END),
            "kimia_mimo_layers": 1,
            "kimia_mimo_transformer_from_layer_index": 0,
            "kimia_token_offset": self.text["vocab_size"],
            "use_whisper_feature": True,
            "torch_dtype": "float32",
            **config,
        }
        (path / "config.json").write_text(json.dumps(data))
        self.whisper.save_pretrained(path / "whisper-large-v3")
        self.extractor.save_pretrained(path / "whisper-large-v3")
        self.tokenizer.save_pretrained(path)
        transformers.GenerationConfig(**_COMMON).save_pretrained(path)
        return path


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> tuple[Reference, Path]:
    tokenizer = build_tiny_tokenizer(TINY_VOCAB_SIZE, 0)
    tokenizer.add_special_tokens({"additional_special_tokens": [BEGIN, BLANK, END]})
    torch.manual_seed(0)
    ref = Reference(tokenizer).eval()
    with torch.no_grad():
        _randomize(ref, 0)
    ref.decoder.generation_config.eos_token_id = None
    return ref, ref.save(tmp_path_factory.mktemp("kimi_audio"))


def test_audio_matches_the_reference(tiny):
    """A 2.5 s clip (250 frames: P 33 run tokens, E 32 rows, one plain blank left), text alone,
    and a 0.93 s clip (93 frames, odd: 47 frames after conv2, P = E = 12)."""
    ref, path = tiny
    cases = [(ONE, [noise_clip(1, 2.5)]), (TEXT, []), (ONE, [noise_clip(2, 0.93)])]
    refs = [ref.greedy(t, clips) for t, clips in cases]
    assert [ids.count(ref.blank) for ids, _ in refs] == [33, 0, 12]
    check_matches_hf(engine(path), cases, refs, "kimi_audio")


def test_bad_input_is_refused_by_name(tiny, tmp_path):
    """Two clips a prompt (vLLM's limit is one); an adaptor width other than 4 * d_model;
    use_whisper_feature false; the Whisper subfolder missing."""
    ref, path = tiny
    llm = engine(path)
    two = f"{BEGIN}{BLANK}{END}{BEGIN}{BLANK}{END}"
    clips = [noise_clip(3, 0.4), noise_clip(4, 0.4)]
    with pytest.raises(ValueError, match="one a prompt"):
        llm.generate([{"prompt": two, "multi_modal_data": {"audio": clips}}], greedy(0))
    assert llm.generate([TEXT], greedy(0), use_tqdm=False)[0].outputs[0].token_ids
    for name, config in [
        ("kimia_adaptor_input_dim", {"kimia_adaptor_input_dim": 3 * D}),
        ("use_whisper_feature", {"use_whisper_feature": False}),
    ]:
        with pytest.raises(ValueError, match=name):
            engine(ref.save(tmp_path / name, **config))
    bare = ref.save(tmp_path / "bare")
    for file in (bare / "whisper-large-v3").iterdir():
        file.unlink()
    with pytest.raises(ValueError, match="whisper-large-v3"):
        engine(bare)


def test_chat_writes_vllms_placeholder(tiny):
    """LLM.chat with an input_audio part: the part becomes vLLM's placeholder text, as the
    prompt written out gives."""
    ref, path = tiny
    clip = noise_clip(5, 0.7)
    placeholder = f"{BEGIN}{BLANK}{END}"
    check_chat_writes_placeholder(
        engine(path), clip, placeholder, ref.blank, vllm_count(clip.size // 160)
    )
