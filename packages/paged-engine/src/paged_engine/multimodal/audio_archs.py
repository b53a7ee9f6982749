"""The checkpoints whose audio paged runs, and which audio path each takes.

    Qwen2AudioForConditionalGeneration   "qwen2_audio"   multimodal/qwen2_audio.py
    AudioFlamingo3ForConditionalGeneration  "audioflamingo3"  multimodal/audioflamingo3.py
    GlmAsrForConditionalGeneration       "glmasr"        multimodal/glmasr.py
    MusicFlamingoForConditionalGeneration  "musicflamingo"  multimodal/musicflamingo.py
    VoxtralForConditionalGeneration      "voxtral"       multimodal/voxtral.py
    VoxtralRealtimeForConditionalGeneration  "voxtral_realtime"  multimodal/voxtral_realtime.py
    GraniteSpeechForConditionalGeneration  "granite_speech"  multimodal/granite_speech.py
    GraniteSpeechPlusForConditionalGeneration  "granite_speech_plus"
      multimodal/granite_speech.py (host), multimodal/granite_speech_plus.py (encoder)
    FunAsrNanoForConditionalGeneration   "fun_asr_nano"  multimodal/fun_asr_nano.py
    Gemma4ForConditionalGeneration       "gemma4"        multimodal/gemma4_audio.py
    Gemma3nForConditionalGeneration      "gemma3n"       multimodal/gemma3n_audio.py
    Qwen2_5OmniThinkerForConditionalGeneration,  "qwen2_5_omni"  multimodal/omni_audio.py
      Qwen2_5OmniForConditionalGeneration (its thinker_config)
    Qwen3OmniMoeThinkerForConditionalGeneration,  "qwen3_omni"   multimodal/omni_audio.py
      Qwen3OmniMoeForConditionalGeneration (its thinker_config)
    Qwen3ASRForConditionalGeneration     "qwen3_asr"     multimodal/qwen3_asr.py
    Phi4MultimodalForCausalLM            "phi4mm"        multimodal/phi4mm_audio.py
    Phi4MMForCausalLM                    "phi4mm_remote" multimodal/phi4mm_remote.py (the Hub's
      remote-code release on phi4mm_audio.py's path)
    WhisperForConditionalGeneration      "whisper"       multimodal/whisper.py (host only:
      an encoder-decoder, its model encodes and cross-attends; worker/cross_attention.py)
    MoonshineForConditionalGeneration    "moonshine"     multimodal/moonshine.py (host only,
      as Whisper: models/moonshine.py encodes)
    CohereAsrForConditionalGeneration    "cohere_asr"    multimodal/cohere_asr.py (host only,
      as Moonshine: models/cohere_asr.py encodes with the Parakeet encoder)
    UltravoxModel                        "ultravox"      multimodal/ultravox.py (fixie-ai's remote
      code; its config: models/ultravox_config.py)
    EmbeddingGemma2Model                 "gemma4"        multimodal/gemma4_audio.py (Gemma 4's
      tower into EmbeddingGemma 2's encoder, models/embedding_gemma2.py)
    NemotronH_Omni_Reasoning_V3          "nemotron_h_omni"  multimodal/nemotron_h_omni_audio.py
      (Parakeet / FastConformer; with an audio_config only)
    MiniCPMO                             "minicpmo_remote"  multimodal/minicpmo_remote.py
      (MiniCPM-o 2.6, remote code: Whisper-medium `apm`, projection, pooling)
    MiDashengLMModel                     "midashenglm"   multimodal/midashenglm.py (remote
      code: the Dasheng ViT over log-mel patches; its config: models/midashenglm_config.py)
    MoonshotKimiaForCausalLM             "kimi_audio"    multimodal/kimi_audio.py (remote code:
      Kimi-Audio's text output as vLLM serves it; its config: models/kimi_audio_config.py)

A kind names its host side (`HOSTS`: an AudioProcessor subclass, multimodal/audio.py) and its
worker side (`ENCODERS`: the tower and projector, `encode(clips)` and `load_weights`), each as
"module:callable" under paged_engine.multimodal. Other checkpoints refuse
multi_modal_data['audio'] by name.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

from torch import nn

# architecture -> audio kind
KINDS: dict[str, str] = {
    "Qwen2AudioForConditionalGeneration": "qwen2_audio",
    "AudioFlamingo3ForConditionalGeneration": "audioflamingo3",
    "GlmAsrForConditionalGeneration": "glmasr",
    "MusicFlamingoForConditionalGeneration": "musicflamingo",
    "VoxtralForConditionalGeneration": "voxtral",
    "VoxtralRealtimeForConditionalGeneration": "voxtral_realtime",
    "GraniteSpeechForConditionalGeneration": "granite_speech",
    "GraniteSpeechPlusForConditionalGeneration": "granite_speech_plus",
    "FunAsrNanoForConditionalGeneration": "fun_asr_nano",
    "Gemma4ForConditionalGeneration": "gemma4",  # E2B / E4B: the others have no audio_config
    "Gemma3nForConditionalGeneration": "gemma3n",
    # the Omni thinkers; the whole models' configs are read as their thinker_config
    "Qwen2_5OmniThinkerForConditionalGeneration": "qwen2_5_omni",
    "Qwen2_5OmniForConditionalGeneration": "qwen2_5_omni",
    "Qwen3OmniMoeThinkerForConditionalGeneration": "qwen3_omni",
    "Qwen3OmniMoeForConditionalGeneration": "qwen3_omni",
    "Qwen3ASRForConditionalGeneration": "qwen3_asr",
    "Phi4MultimodalForCausalLM": "phi4mm",
    "Phi4MMForCausalLM": "phi4mm_remote",
    # encoder-decoder: no placeholders, no ENCODERS row (the model encodes; models/whisper.py)
    "WhisperForConditionalGeneration": "whisper",
    "MoonshineForConditionalGeneration": "moonshine",
    "CohereAsrForConditionalGeneration": "cohere_asr",
    "UltravoxModel": "ultravox",
    "EmbeddingGemma2Model": "gemma4",  # EmbeddingGemma 2: Gemma 4's audio tower, an encoder
    "NemotronH_Omni_Reasoning_V3": "nemotron_h_omni",  # with an audio_config (Parakeet)
    "MiniCPMO": "minicpmo_remote",  # remote code: models/minicpmo_remote_config.py
    "MiDashengLMModel": "midashenglm",  # remote code: models/midashenglm_config.py
    "MoonshotKimiaForCausalLM": "kimi_audio",  # remote code: models/kimi_audio_config.py
}
AUDIO_ARCHS = tuple(KINDS)

HOSTS: dict[str, str] = {
    "qwen2_audio": "qwen2_audio:Qwen2Audio",
    "audioflamingo3": "audioflamingo3:AudioFlamingo3",
    "glmasr": "glmasr:GlmAsr",
    "musicflamingo": "musicflamingo:MusicFlamingo",
    "voxtral": "voxtral:Voxtral",
    "voxtral_realtime": "voxtral_realtime:VoxtralRealtime",
    "granite_speech": "granite_speech:GraniteSpeechAudio",
    "granite_speech_plus": "granite_speech:GraniteSpeechAudio",
    "fun_asr_nano": "fun_asr_nano:FunAsrNanoAudio",
    "gemma4": "gemma4_audio:Gemma4Audio",
    "gemma3n": "gemma3n_audio:Gemma3nAudio",
    "qwen2_5_omni": "omni_audio:Qwen2_5OmniAudio",
    "qwen3_omni": "omni_audio:Qwen3OmniAudio",
    "qwen3_asr": "qwen3_asr:Qwen3Asr",
    "phi4mm": "phi4mm_audio:Phi4MMAudio",
    "phi4mm_remote": "phi4mm_remote:Phi4MMRemoteAudio",
    "whisper": "whisper:WhisperAudio",
    "moonshine": "moonshine:MoonshineAudio",
    "cohere_asr": "cohere_asr:CohereAsrAudio",
    "ultravox": "ultravox:Ultravox",
    "nemotron_h_omni": "nemotron_h_omni_audio:NemotronOmniAudio",
    "minicpmo_remote": "minicpmo_remote:MiniCPMORemoteAudio",
    "midashenglm": "midashenglm:MiDashengLM",
    "kimi_audio": "kimi_audio:KimiAudio",
}

ENCODERS: dict[str, str] = {
    "qwen2_audio": "qwen2_audio:Qwen2AudioEncoder",
    "audioflamingo3": "audioflamingo3:AudioFlamingo3Encoder",
    "glmasr": "glmasr:GlmAsrEncoder",
    "musicflamingo": "musicflamingo:MusicFlamingoEncoder",
    "voxtral": "voxtral:VoxtralEncoder",
    "voxtral_realtime": "voxtral_realtime:VoxtralRealtimeEncoder",
    "granite_speech": "granite_speech_encoder:GraniteSpeechEncoder",
    "granite_speech_plus": "granite_speech_plus:GraniteSpeechPlusEncoder",
    "fun_asr_nano": "fun_asr_nano_encoder:FunAsrNanoEncoder",
    "gemma4": "gemma4_audio:Gemma4AudioEncoder",
    "gemma3n": "gemma3n_audio_tower:Gemma3nAudioEncoder",
    "qwen2_5_omni": "omni_audio:Qwen2_5OmniAudioEncoder",
    "qwen3_omni": "omni_audio:Qwen3OmniAudioEncoder",
    "qwen3_asr": "qwen3_asr:Qwen3AsrEncoder",
    "phi4mm": "phi4mm_audio:Phi4MMAudioEncoder",
    "phi4mm_remote": "phi4mm_remote:Phi4MMRemoteAudioEncoder",
    "ultravox": "ultravox:UltravoxEncoder",
    "nemotron_h_omni": "nemotron_h_omni_audio:NemotronOmniAudioEncoder",
    "minicpmo_remote": "minicpmo_remote:MiniCPMORemoteAudioEncoder",
    "midashenglm": "midashenglm:MiDashengLMEncoder",
    "kimi_audio": "kimi_audio:KimiAudioEncoder",
}


def audio_kind(config: Any) -> str | None:
    """The audio path (a KINDS value) of a wrapper config, None where audio does not run."""
    archs = getattr(config, "architectures", None) or []
    return next((KINDS[a] for a in archs if a in KINDS), None)


def _load(spec: str) -> Any:
    module, name = spec.split(":")
    return getattr(importlib.import_module(f"paged_engine.multimodal.{module}"), name)


def build_audio_host(
    path: Path, config: Any, tokenizer: Any, limit: int | None
) -> Any:  # an AudioProcessor
    kind = audio_kind(config)
    assert kind is not None, config.architectures
    return _load(HOSTS[kind])(path, config, tokenizer, limit)


def build_audio_encoder(config: Any) -> nn.Module:
    """The checkpoint's audio encoder, built in the current default dtype and device."""
    kind = audio_kind(config)
    assert kind is not None, config.architectures
    return _load(ENCODERS[kind])(config)
