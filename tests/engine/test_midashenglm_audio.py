"""Audio through MiDashengLM (`MiDashengLMModel`, remote code: multimodal/midashenglm.py)
against a reference written here from vLLM's midashenglm.py (transformers has no class for it).

The tiny checkpoint: a random 2-block Dasheng ViT (8 mels, embed 16, target_length 40: windows
of 10 patches), the 5-row projector and transformers' Qwen2ForCausalLM, saved in the release's
layout (`audio_encoder.*`, `audio_projector.net.{0,2}.*`, `decoder.model.*`,
`decoder.lm_head.*`) with a config.json of the release's fields (text_config /
audio_encoder_config inline, model_type "qwen2_5_omni_text" with an M-RoPE rope_scaling) and
Wav2Vec2FeatureExtractor's settings (do_normalize false). The reference: torchaudio's
MelSpectrogram + AmplitudeToDB(top_db=120) as torch.stft and transformers' HTK mel filters,
BatchNorm2d over the mels, the patch conv, windows with vLLM's frame mask, the blocks, the
projector, vLLM's placeholder count, rows spliced into Qwen2's inputs_embeds, greedy generate.
Tokens identical, logprobs within 1e-3 (float32).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from audio_checks import check_chat_writes_placeholder, check_matches_hf, noise_clip
from hf_reference import Greedy, hf_greedy
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

AUDIO, BOS, EOS = "<|AUDIO|>", "<|audio_bos|>", "<|audio_eos|>"
MELS, DIM, HEADS, TARGET, N_FFT = 8, 16, 2, 40, 512
ONE = f"<|im_start|>user\n{BOS}{AUDIO}{EOS}What is that sound?<|im_end|>\n<|im_start|>assistant\n"
TWO = (
    f"<|im_start|>user\n{BOS}{AUDIO}{EOS} and{BOS}{AUDIO}{EOS}?<|im_end|>\n<|im_start|>assistant\n"
)
TEXT = "<|im_start|>user\nSay something about the sea.<|im_end|>\n<|im_start|>assistant\n"


def vllm_count(samples: int) -> int:
    """vLLM's calculate_mel_frames_dasheng (n_fft 512, hop 160, centred), at least 1."""
    return max(1, int(1 + ((samples + 512 - 512) / 160)) // 4 // 5)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(DIM, eps=1e-6), nn.LayerNorm(DIM, eps=1e-6)
        self.attn = nn.ModuleDict({"qkv": nn.Linear(DIM, 3 * DIM), "proj": nn.Linear(DIM, DIM)})
        self.mlp = nn.ModuleDict({"fc1": nn.Linear(DIM, 4 * DIM), "fc2": nn.Linear(4 * DIM, DIM)})

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        b, n, c = x.shape
        qkv = self.attn["qkv"](self.norm1(x)).reshape(b, n, 3, HEADS, c // HEADS)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)
        m = mask[:, None, None, :] if mask is not None else None
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=m).transpose(1, 2).reshape(b, n, c)
        x = x + self.attn["proj"](o)
        return x + self.mlp["fc2"](F.gelu(self.mlp["fc1"](self.norm2(x))))


class Dasheng(nn.Module):
    """vLLM's DashengAudioTransformer (its front end below, in Reference.mel)."""

    def __init__(self) -> None:
        super().__init__()
        self.init_bn = nn.BatchNorm2d(MELS, momentum=0.01)
        self.patch_embed = nn.Module()
        self.patch_embed.proj = nn.Conv2d(1, DIM, (MELS, 4), (MELS, 4))
        self.time_pos_embed = nn.Parameter(torch.zeros(1, DIM, 1, TARGET // 4))
        self.freq_pos_embed = nn.Parameter(torch.zeros(1, DIM, 1, 1))
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.norm = nn.LayerNorm(DIM, eps=1e-6)

    def forward(self, x: torch.Tensor, length: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.init_bn(x.unsqueeze(1).permute(0, 2, 1, 3)).permute(0, 2, 1, 3)
        x = self.patch_embed.proj(x)
        t = x.shape[-1]
        mask = torch.arange(t)[None] < (length / (160 * 4)).long()[:, None]
        outs = []
        for part, m in zip(x.split(TARGET // 4, -1), mask.split(TARGET // 4, -1), strict=True):
            part = part + self.time_pos_embed[..., : part.shape[-1]] + self.freq_pos_embed
            h = part.flatten(2).permute(0, 2, 1)
            for block in self.blocks:
                h = block(h, m)
            outs.append(self.norm(h))
        return torch.cat(outs, 1), mask


class Reference(nn.Module):
    def __init__(self, tokenizer) -> None:
        super().__init__()
        self.tokenizer = tokenizer
        self.audio_id = tokenizer.convert_tokens_to_ids(AUDIO)
        self.text = {**_LLAMA_LIKE, "vocab_size": len(tokenizer), **_COMMON}
        self.text |= {"rope_theta": 10000.0, "tie_word_embeddings": False}
        self.audio_encoder = Dasheng()
        self.audio_projector = nn.Module()
        hidden = self.text["hidden_size"]
        self.audio_projector.net = nn.Sequential(
            nn.Linear(5 * DIM, hidden), nn.GELU(), nn.Linear(hidden, hidden)
        )
        self.decoder = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**self.text))
        fb = transformers.audio_utils.mel_filter_bank(N_FFT // 2 + 1, MELS, 0.0, 8000.0, 16000)
        self.fb = torch.from_numpy(fb).float()  # [freqs, mels], HTK, no norm (torchaudio's)

    def mel(self, wave: torch.Tensor) -> torch.Tensor:
        """torchaudio's MelSpectrogram (hann, reflect, power 2) + AmplitudeToDB(top_db=120)."""
        spec = (
            torch.stft(
                wave, N_FFT, 160, N_FFT, torch.hann_window(N_FFT), center=True, return_complex=True
            ).abs()
            ** 2
        )
        db = 10 * torch.log10(torch.clamp((spec.mT @ self.fb).mT, min=1e-10))
        return torch.max(db, db.amax(dim=(-2, -1), keepdim=True) - 120)

    def audio_rows(self, clip: np.ndarray) -> torch.Tensor:
        wave = torch.from_numpy(np.pad(clip, (0, max(0, 3200 - clip.size))))[None]
        length = torch.tensor([wave.shape[-1]])
        x, _ = self.audio_encoder(self.mel(wave), length)
        keep = x.shape[1] // 5 * 5
        x = self.audio_projector.net(x[:, :keep].reshape(1, -1, 5 * DIM))
        return x[0, : vllm_count(wave.shape[-1])]

    def greedy(self, text: str, clips: list) -> tuple[list[int], Greedy]:
        parts = text.split(AUDIO)
        with torch.no_grad():
            rows = [self.audio_rows(c) for c in clips]
        expanded = parts[0] + "".join(AUDIO * r.shape[0] + p for r, p in zip(rows, parts[1:]))
        ids = self.tokenizer.encode(expanded, add_special_tokens=False)
        with torch.no_grad():
            embeds = self.decoder.get_input_embeddings()(torch.tensor([ids]))
            if rows:
                embeds[0, [i for i, t in enumerate(ids) if t == self.audio_id]] = torch.cat(rows)
        return ids, hf_greedy(self.decoder, ids, 8, 5, inputs_embeds=embeds)

    def save(self, path: Path, **config) -> Path:
        from safetensors.torch import save_file

        path.mkdir(parents=True, exist_ok=True)
        state = {k: v.contiguous() for k, v in self.state_dict().items()}
        state["audio_encoder.front_end.0.mel_scale.fb"] = self.fb  # (torchaudio's buffer)
        save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
        text = {**self.text, "model_type": "qwen2_5_omni_text"}
        text["rope_scaling"] = {"type": "mrope", "mrope_section": [2, 3, 3]}
        audio = {"embed_dim": DIM, "depth": 2, "num_heads": HEADS, "n_mels": MELS}
        audio |= {"patch_size": [MELS, 4], "patch_stride": [MELS, 4], "target_length": TARGET}
        audio |= {
            "outputdim": 527,
            "init_values": None,
            "model_type": "midashenglm_dasheng_encoder",
        }
        data = {
            "architectures": ["MiDashengLMModel"],
            "auto_map": {"AutoConfig": "configuration_midashenglm.MiDashengLMConfig"},
            "audio_encoder_config": audio,
            "audio_token_id": self.audio_id,
            "model_type": "midashenglm",
            "subsample_factor": 5,
            "text_config": text,
            "torch_dtype": "float32",
            **config,
        }
        (path / "config.json").write_text(json.dumps(data))
        extractor = {"feature_extractor_type": "Wav2Vec2FeatureExtractor", "do_normalize": False}
        extractor |= {"feature_size": 1, "padding_value": 0.0, "sampling_rate": 16000}
        extractor |= {"return_attention_mask": True, "padding_side": "right"}
        (path / "preprocessor_config.json").write_text(json.dumps(extractor))
        self.tokenizer.save_pretrained(path)
        transformers.GenerationConfig(**_COMMON).save_pretrained(path)
        return path


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> tuple[Reference, Path]:
    tokenizer = build_tiny_tokenizer(TINY_VOCAB_SIZE, 0)
    tokenizer.add_special_tokens({"additional_special_tokens": [AUDIO, BOS, EOS]})
    torch.manual_seed(0)
    ref = Reference(tokenizer).eval()
    with torch.no_grad():
        _randomize(ref, 0)
        # statistics near the clips' log-mels (10-30 dB) and a small patch conv: the attention
        # branches (the frame mask) weigh in the rows against the patch embedding
        bn = ref.audio_encoder.init_bn
        bn.running_mean.uniform_(0, 20)
        bn.running_var.uniform_(200, 400)
        ref.audio_encoder.patch_embed.proj.weight.mul_(0.2)
    ref.decoder.generation_config.eos_token_id = None
    return ref, ref.save(tmp_path_factory.mktemp("midashenglm"))


def test_audio_matches_the_reference(tiny):
    """A clip of 22260 samples (140 mel frames: 35 patches in windows of 10, 10, 10, 5; the
    last patch masked as a key, 22260 // 640 = 34, and kept by the projector: 7 rows), text
    alone, and a 0.9 s clip (4 rows) with a 1000-sample one (padded to 3200: 1 row)."""
    ref, path = tiny
    cases = [
        (ONE, [noise_clip(1, 22260 / 16000)]),
        (TEXT, []),
        (TWO, [noise_clip(2, 0.9), noise_clip(3, 1000 / 16000)]),
    ]
    refs = [ref.greedy(t, clips) for t, clips in cases]
    counts = [ids.count(ref.audio_id) for ids, _ in refs]
    assert counts == [7, 0, vllm_count(14400) + 1] == [7, 0, 5]
    check_matches_hf(engine(path), cases, refs, "midashenglm")


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("subsample_factor", 4),
        ("audio_encoder_config", {"patch_size": [4, 4], "patch_stride": [4, 4]}),
        ("audio_encoder_config", {"hop_length": 320}),
        ("text_config", {"rope_scaling": {"rope_type": "yarn", "factor": 2.0}}),
    ],
)
def test_bad_config_is_refused_by_name(tiny, tmp_path, field, value):
    ref, _ = tiny
    data = json.loads((tiny[1] / "config.json").read_text())
    merged = {**data[field], **value} if isinstance(value, dict) else value
    path = ref.save(tmp_path / "bad", **{field: merged})
    name = next(iter(value)) if isinstance(value, dict) else field
    with pytest.raises(ValueError, match=name.split("_")[0]):
        engine(path)


def test_chat_writes_vllms_placeholder(tiny):
    """LLM.chat with an input_audio part under a string-content template: the part becomes
    vLLM's placeholder text before the question, as the prompt written out gives."""
    ref, path = tiny
    clip = noise_clip(4, 0.7)
    placeholder = f"{BOS}{AUDIO}{EOS}"
    check_chat_writes_placeholder(
        engine(path), clip, placeholder, ref.audio_id, vllm_count(clip.size)
    )


def test_normalizing_extractor_serves_text_only(tiny, tmp_path, caplog):
    """do_normalize true (the release's processor refuses it): the text model alone, the
    warning naming the setting, audio refused."""
    ref, _ = tiny
    path = ref.save(tmp_path / "normalized")
    settings = json.loads((path / "preprocessor_config.json").read_text())
    (path / "preprocessor_config.json").write_text(json.dumps({**settings, "do_normalize": True}))
    llm = engine(path)
    assert "do_normalize=True" in caplog.text
    assert llm.generate([TEXT], greedy(0), use_tqdm=False)[0].outputs[0].token_ids
    with pytest.raises(ValueError, match="audio"):
        llm.generate([{"prompt": ONE, "multi_modal_data": {"audio": noise_clip(5, 0.3)}}])
