"""Audio through Ultravox (`UltravoxModel`, multimodal/ultravox.py) against a reference composed
from transformers pieces (transformers has no Ultravox class; fixie-ai's is remote code).

The tiny checkpoint: a random 2-layer Whisper encoder (16 mels, max_source_positions 64: a
128-frame window, 1.28 s), a stack factor of 4, the feed-forward projector and a Llama decoder,
saved in Ultravox's layout (`audio_tower.*`, `multi_modal_projector.*`, `language_model.*`) with
a config.json of fixie's fields (text_config / audio_config inline) and processor_config.json's
audio_context_size of one window. The reference runs what fixie's UltravoxProcessor and
UltravoxModel do: features over the whole clip (padding to the hop), windows of 128 frames (the
later ones zero-padded), transformers' WhisperEncoder modules on each window with its padding
masked as keys (fixie's ModifiedWhisperEncoder), frames stacked by 4, the projector written out
below, each window's ceil(L / 8) rows spliced into LlamaForCausalLM's inputs_embeds, greedy
generate. Tokens identical, logprobs within 1e-3 (float32); the chat routes with an input_audio
part; config values paged does not run refused by name.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from audio_checks import check_chat_input_audio, check_matches_hf, held, noise_clip, wav_base64
from hf_reference import Greedy, assert_matches, hf_greedy
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

AUDIO = "<|audio|>"
RESERVED = "<|reserved_special_token_0|>"  # the run's id (config.audio_token_index)
STACK, WINDOW, HOP = 4, 128, 160
TEMPLATE = (  # a user turn's audio part as the placeholder text, as vLLM's string format
    "<|bos|>{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'audio' %}<|audio|>\n"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# the releases' (Llama 3's) kind: string content only, no parts
STRING_TEMPLATE = (
    "<|bos|>{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
ONE = f"<|bos|><|im_start|>user\n{AUDIO}\nWhat is that sound?<|im_end|>\n<|im_start|>assistant\n"
TWO = f"<|bos|><|im_start|>user\n{AUDIO} then{AUDIO}louder?<|im_end|>\n<|im_start|>assistant\n"
TEXT = "<|bos|><|im_start|>user\nSay something about the sea.<|im_end|>\n<|im_start|>assistant\n"


class Projector(nn.Module):
    """fixie's UltravoxProjector: ln_pre -> linear_1 -> act -> ln_mid -> linear_2 -> ln_post
    (RMSNorms: transformers' LlamaRMSNorm, eps 1e-6), "swiglu" = x * silu(gate)."""

    def __init__(self, d_in: int, hidden: int, d_out: int, ln_mid: bool, act: str) -> None:
        super().__init__()
        norm = transformers.models.llama.modeling_llama.LlamaRMSNorm
        self.act = act
        mid = hidden // 2 if act == "swiglu" else hidden
        self.ln_pre = norm(d_in, eps=1e-6)
        self.linear_1 = nn.Linear(d_in, hidden, bias=False)
        self.linear_2 = nn.Linear(mid, d_out, bias=False)
        self.ln_mid = norm(mid, eps=1e-6) if ln_mid else nn.Identity()
        self.ln_post = nn.Identity() if ln_mid else norm(d_out, eps=1e-6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.linear_1(self.ln_pre(x))
        if self.act == "swiglu":
            h, gate = h.chunk(2, dim=-1)
            h = nn.functional.silu(gate) * h
        else:
            h = transformers.activations.get_activation(self.act)(h)
        return self.ln_post(self.linear_2(self.ln_mid(h)))


class Reference(nn.Module):
    """The tiny Ultravox, its modules transformers' (and the projector above)."""

    def __init__(self, tokenizer, ln_mid: bool, act: str, audio_token: str, vocab: int) -> None:
        super().__init__()
        self.audio_id = tokenizer.convert_tokens_to_ids(audio_token)
        self.text = {**_LLAMA_LIKE, "model_type": "llama", "vocab_size": vocab, **_COMMON}
        self.audio = {"model_type": "whisper", "d_model": 16, "encoder_layers": 2}
        self.audio |= {"encoder_attention_heads": 2, "encoder_ffn_dim": 32, "num_mel_bins": 16}
        self.audio |= {"max_source_positions": WINDOW // 2}
        whisper = transformers.models.whisper.modeling_whisper
        self.audio_tower = whisper.WhisperEncoder(transformers.WhisperConfig(**self.audio))
        self.multi_modal_projector = Projector(16 * STACK, 48, 64, ln_mid, act)
        self.language_model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**self.text))
        self.extractor = transformers.WhisperFeatureExtractor(feature_size=16)
        self.tokenizer = tokenizer

    def windows(self, clip: np.ndarray) -> tuple[torch.Tensor, list[int]]:
        """UltravoxProcessor's features: the clip's windows [n, mels, width], their frames."""
        clip = np.pad(clip, (0, max(0, 2 * HOP - clip.size)))
        out = self.extractor(
            clip,
            sampling_rate=16_000,
            padding="longest",
            pad_to_multiple_of=HOP,
            truncation=False,
            return_attention_mask=True,
            return_tensors="pt",
        )
        feats, frames = out["input_features"], int(out["attention_mask"].sum())
        chunks, lens = [], []
        for at in range(0, frames, WINDOW):
            chunk = feats[..., at : at + WINDOW]
            if at:
                chunk = nn.functional.pad(chunk, (0, WINDOW - chunk.shape[-1]))
            chunks.append(chunk)
            lens.append(min(frames - at, WINDOW))
        return torch.cat(chunks), lens

    def tower(self, feats: torch.Tensor, frames: int) -> torch.Tensor:
        """fixie's ModifiedWhisperEncoder on one window: positions cut to its rows, keys past
        its valid rows masked."""
        enc = self.audio_tower
        x = nn.functional.gelu(enc.conv2(nn.functional.gelu(enc.conv1(feats))))
        x = x.transpose(1, 2)
        x = x + enc.embed_positions.weight[: x.shape[1]]
        keep = (frames - 1) // 2 + 1
        mask = torch.zeros(1, 1, x.shape[1], x.shape[1])
        mask[..., keep:] = torch.finfo(torch.float32).min
        for layer in enc.layers:
            x = layer(x, mask)
        return enc.layer_norm(x)

    def audio_rows(self, clip: np.ndarray) -> torch.Tensor:
        feats, lens = self.windows(clip)
        rows = []
        for w, frames in enumerate(lens):
            x = self.tower(feats[w : w + 1], frames)
            x = nn.functional.pad(x, (0, 0, 0, -x.shape[1] % STACK))
            x = self.multi_modal_projector(x.reshape(1, -1, STACK * x.shape[-1]))
            rows.append(x[0, : math.ceil(frames / (2 * STACK))])
        return torch.cat(rows)

    def greedy(self, text: str, clips: list) -> tuple[list[int], Greedy]:
        """UltravoxProcessor's ids and HF generate's greedy tokens over the spliced rows."""
        parts = [self.tokenizer.encode(p, add_special_tokens=False) for p in text.split(AUDIO)]
        assert len(parts) == len(clips) + 1
        with torch.no_grad():
            rows = [self.audio_rows(c) for c in clips]
        ids = parts[0]
        for r, part in zip(rows, parts[1:], strict=True):
            ids = ids + [self.audio_id] * r.shape[0] + part
        lm = self.language_model
        with torch.no_grad():
            # (an audio id past the vocabulary, as the releases' is, embeds nothing: replaced)
            embeds = lm.get_input_embeddings()(
                torch.tensor([ids]).clamp(max=self.text["vocab_size"] - 1)
            )
            at = [i for i, t in enumerate(ids) if t == self.audio_id]
            if rows:
                embeds[0, at] = torch.cat(rows)
        return ids, hf_greedy(lm, ids, 8, 5, inputs_embeds=embeds)

    def save(self, path: Path, **config) -> Path:
        """The checkpoint in Ultravox's layout, config.json as fixie's (fields overridden by
        `config`), processor_config.json with one window."""
        from safetensors.torch import save_file

        path.mkdir(parents=True, exist_ok=True)
        state = {k: v.contiguous() for k, v in self.state_dict().items()}
        save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
        proj = self.multi_modal_projector
        data = {
            "architectures": ["UltravoxModel"],
            "auto_map": {
                "AutoConfig": "ultravox_config.UltravoxConfig",
                "AutoModel": "ultravox_model.UltravoxModel",
                "AutoProcessor": "ultravox_processing.UltravoxProcessor",
            },
            "audio_config": {"_name_or_path": "openai/whisper-large-v3-turbo", **self.audio},
            "audio_latency_block_size": None,
            "audio_model_id": None,
            "audio_model_lora_config": {"lora_alpha": 8, "r": 0, "target_modules": ["k_proj"]},
            "audio_token_index": self.audio_id,
            "hidden_size": proj.linear_1.out_features,
            "ignore_index": -100,
            "initializer_range": 0.02,
            "model_type": "ultravox",
            "norm_init": 0.4,
            "pad_token_id": _COMMON["pad_token_id"],
            "projector_act": proj.act,
            "projector_ln_mid": isinstance(proj.ln_post, nn.Identity),
            "stack_factor": STACK,
            "text_config": {"_name_or_path": "meta-llama/Llama-3.1-8B-Instruct", **self.text},
            "text_model_id": None,
            "text_model_lora_config": {"lora_alpha": 8, "r": 0, "target_modules": ["k_proj"]},
            "torch_dtype": "float32",
            "transformers_version": "4.47.1",
            "vocab_size": self.text["vocab_size"],
        }
        (path / "config.json").write_text(json.dumps({**data, **config}))
        processor = {"audio_context_size": WINDOW, "audio_padding": "longest"}
        processor |= {"encoder_ds_factor": 2, "stack_factor": STACK}
        (path / "processor_config.json").write_text(json.dumps(processor))
        self.extractor.save_pretrained(path)
        self.tokenizer.save_pretrained(path)
        transformers.GenerationConfig(**_COMMON).save_pretrained(path)
        return path


def tiny_ultravox(
    ln_mid: bool = True,
    act: str = "swiglu",
    seed: int = 0,
    audio_token: str = RESERVED,
    template: str = TEMPLATE,
) -> Reference:
    """`audio_token` RESERVED: the run's id is a vocabulary token; AUDIO: "<|audio|>" added to
    the tokenizer past the text model's vocabulary (fixie's tokenizers, Llama 3's 128256)."""
    tokenizer = build_tiny_tokenizer(TINY_VOCAB_SIZE, seed)
    tokenizer.add_special_tokens({"additional_special_tokens": [audio_token]})
    tokenizer.chat_template = template
    torch.manual_seed(seed)
    vocab = len(tokenizer) - (audio_token == AUDIO)
    ref = Reference(tokenizer, ln_mid, act, audio_token, vocab).eval()
    with torch.no_grad():
        _randomize(ref, seed)
    ref.language_model.generation_config.eos_token_id = None
    return ref


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> tuple[Reference, Path]:
    ref = tiny_ultravox()
    return ref, ref.save(tmp_path_factory.mktemp("ultravox"))


def test_audio_matches_the_reference(tiny):
    """One clip of 91 frames (one window at its own width, an odd count: conv2's last tap
    reads no padding), text alone, and a prompt with a clip of 2 hops and one of 2.1 s (210
    frames: a full window and one of 82 frames, zero-padded to 128 and masked): the
    processor's ids, the reference's greedy tokens and top-5 logprobs; HF's ids as
    prompt_token_ids taken as they are."""
    ref, path = tiny
    cases = [
        (ONE, [noise_clip(1, 0.905)]),
        (TEXT, []),
        (TWO, [noise_clip(2, 0.002), noise_clip(3, 2.1)]),
    ]
    refs = [ref.greedy(t, clips) for t, clips in cases]
    llm = engine(path)
    check_matches_hf(llm, cases, refs, "ultravox")
    # 91 frames -> ceil(91 / 8) = 12 rows; 2 hops -> 1; 128 + 82 frames -> 16 + 11
    counts = [ids.count(ref.audio_id) for ids, _ in refs]
    assert counts == [12, 0, 28]
    # chunked prefill through the clips gives the same tokens
    chunked = engine(path, max_num_batched_tokens=8, enable_chunked_prefill=True)
    prompts = [{"prompt": t, "multi_modal_data": {"audio": c}} for t, c in cases if c]
    outs = chunked.generate(prompts, greedy(), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [refs[0][1].tokens, refs[2][1].tokens]


def test_v0_4_projector_matches_the_reference(tmp_path):
    """projector_ln_mid false (v0.4's RMSNorm after linear_2) with a plain activation."""
    ref = tiny_ultravox(ln_mid=False, act="gelu", seed=1)
    path = ref.save(tmp_path / "v0_4")
    clip = noise_clip(4, 1.5)
    ids, want = ref.greedy(ONE, [clip])
    out = engine(path).generate([{"prompt": ONE, "multi_modal_data": {"audio": clip}}], greedy())
    assert out[0].prompt_token_ids == ids
    assert_matches("ultravox v0.4", out[0], want)


def test_audio_token_past_the_vocabulary(tmp_path):
    """The releases' form: "<|audio|>" a tokenizer token one past the text vocabulary,
    audio_token_index that id, a template of string content only. The runs take the
    vocabulary's last id; LLM.chat and the server's chat route (audio parts written as
    "<|audio|>" lines before the text, as vLLM's string format) give the reference's prompt,
    tokens and logprobs."""
    pytest.importorskip("paged_server")
    from server.server_proc import COMMON_ARGS, serve_in_process

    ref = tiny_ultravox(seed=2, audio_token=AUDIO, template=STRING_TEMPLATE)
    assert ref.audio_id == ref.text["vocab_size"]
    path = ref.save(tmp_path / "past")
    clip = noise_clip(8, 0.7)
    ids, want = ref.greedy(ONE, [held(clip)])  # (what the WAV part holds)
    last = ref.text["vocab_size"] - 1
    ids = [last if t == ref.audio_id else t for t in ids]
    part = {"type": "input_audio", "input_audio": {"data": wav_base64(clip), "format": "wav"}}
    messages = [
        {"role": "user", "content": [part, {"type": "text", "text": "What is that sound?"}]}
    ]
    llm = engine(path)
    out = llm.chat(messages, greedy(), use_tqdm=False)
    assert out[0].prompt_token_ids == ids
    assert_matches("ultravox past the vocabulary", out[0], want)
    body = {"model": "tiny", "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    body |= {"return_token_ids": True, "messages": messages}
    try:
        with serve_in_process(COMMON_ARGS, llm.llm_engine) as (http, _):
            status, _, got = http.request("POST", "/v1/chat/completions", body)
            assert status == 200, got
            assert got["prompt_token_ids"] == ids
            assert got["choices"][0]["token_ids"] == want.tokens
    finally:
        llm.llm_engine.shutdown()


def test_chat_input_audio_gives_the_offline_tokens(tiny):
    """LLM.chat and the server's chat route: the template writes "<|audio|>" for the audio
    part, the prompt is encoded whole and split at it as the processor splits its text."""
    _, path = tiny
    llm = engine(path, limit_mm_per_prompt={"audio": 1})
    clip = noise_clip(5, 1.1)
    question = {"type": "text", "text": "What is it?"}
    part = {"type": "input_audio", "input_audio": {"data": wav_base64(clip), "format": "wav"}}
    got = llm.chat([{"role": "user", "content": [part, question]}], greedy(0), use_tqdm=False)
    prompt = f"<|bos|><|im_start|>user\n{AUDIO}\nWhat is it?<|im_end|>\n<|im_start|>assistant\n"
    want = llm.generate([{"prompt": prompt, "multi_modal_data": {"audio": held(clip)}}], greedy(0))
    assert got[0].outputs[0].token_ids == want[0].outputs[0].token_ids
    assert got[0].prompt_token_ids == want[0].prompt_token_ids
    check_chat_input_audio(llm, clip)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("num_projector_layers", 2),
        ("audio_latency_block_size", 10),
        ("stack_factor", 0),
        ("audio_config", {"model_type": "wav2vec2"}),
    ],
)
def test_bad_config_is_refused_by_name(tiny, tmp_path, field, value):
    _, path = tiny
    with pytest.raises(ValueError, match=field):
        engine(_edited(path, tmp_path, "config.json", {field: value}))


def test_bad_processor_settings_serve_text_only(tiny, tmp_path, caplog):
    """A processor window over the tower's context: the engine serves the text model, says
    why (naming audio_context_size), and refuses audio."""
    _, path = tiny
    llm = engine(_edited(path, tmp_path, "processor_config.json", {"audio_context_size": 512}))
    assert "audio_context_size=512" in caplog.text
    assert llm.generate([TEXT], greedy(0))[0].outputs[0].token_ids
    with pytest.raises(ValueError, match="takes no audio"):
        llm.generate([{"prompt": ONE, "multi_modal_data": {"audio": noise_clip(7, 0.3)}}])


def _edited(path: Path, tmp_path: Path, name: str, fields: dict) -> Path:
    """A copy of the checkpoint (links) whose json file `name` has `fields` set."""
    bad = tmp_path / "bad"
    bad.mkdir()
    for f in path.iterdir():
        if f.name != name:
            (bad / f.name).symlink_to(f)
    data = json.loads((path / name).read_text())
    (bad / name).write_text(json.dumps({**data, **fields}))
    return bad


def test_bad_input_is_refused_by_name(tiny):
    _, path = tiny
    llm = engine(path)
    clip = noise_clip(6, 0.5)
    for data, match in [
        ({"audio": [clip, clip]}, r"2 audio\(s\) but the prompt has 1"),
        ({"audio": np.array([np.nan] * 400, dtype=np.float32)}, "NaN"),
    ]:
        with pytest.raises(ValueError, match=match):
            llm.generate([{"prompt": ONE, "multi_modal_data": data}], greedy(0), use_tqdm=False)
    for prompt in ["", "\ud800 broken"]:
        with pytest.raises(ValueError, match="prompt"):
            llm.generate([prompt], greedy(0), use_tqdm=False)
    out = llm.generate([{"prompt": ONE, "multi_modal_data": {"audio": clip}}], greedy(0))[0]
    assert len(out.outputs[0].token_ids) == 8
