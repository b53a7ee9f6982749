"""Speculative decoding with multimodal targets (spec_decode/, mrope_positions.py).

- Greedy, a batch of image and text-only prompts, chunked prefill: n-gram, a text draft model,
  EAGLE-1 and EAGLE-3 heads give the plain engine's tokens on Qwen2.5-VL (M-RoPE), Qwen3-VL
  (interleaved M-RoPE, deepstack) and LLaVA (plain rope); no step fails. A worker-side draft
  lands in a step whose image rows carry their embeddings: its slot must get the draft's own
  embedding (the step's embeddings were made before the drafts existed); the checkpoint as
  its own draft has drafts accepted in such steps. Voxtral Realtime (audio rows added at
  generated positions): a draft's slot keeps its audio row.
- vLLM's `Eagle3Qwen2_5vlForCausalLM` / `Eagle3Qwen3vlForCausalLM` heads (rope with the
  target's `mrope_section`) on Qwen2.5-VL / Qwen3-VL targets: every step's drafts 1 and 2 equal
  a reference built from transformers alone: the stream entering the target's layer 1 from
  HF's model over the images (Qwen3-VL: deepstack rows added before it), HF's M-RoPE positions
  (`get_rope_index`) turning the head's q / k with HF's own rotary, image positions embedding
  the placeholder id (vLLM's Eagle3LlamaForCausalLM does), teacher-forced; text-only and image
  sequences in one batch, chunked prefill.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from draft_heads import eagle3_head_forward, record_drafts
from image_checks import qwen2_vl_hf_inputs

from paged_engine import LLM, SamplingParams
from paged_engine.spec_decode.eagle import Eagle3Runner
from paged_engine.spec_decode.mrope_positions import uses_mrope
from paged_engine.testing import (
    write_tiny_eagle3_head,
    write_tiny_eagle_head,
    write_tiny_llava,
    write_tiny_model,
    write_tiny_qwen2_vl,
)

transformers = pytest.importorskip("transformers")
Image = pytest.importorskip("PIL.Image")
from safetensors.torch import load_file  # noqa: E402

pytestmark = pytest.mark.usefixtures("no_isolated_step_failures")  # conftest.py

QWEN_VISION = "<|vision_start|><|image_pad|><|vision_end|>"
ASK = "<|im_start|>user\n{}What is in it? Tell me.<|im_end|>\n<|im_start|>assistant\n"
TEXT = "<|im_start|>user\nSay something about the sea, the sea.<|im_end|>\n<|im_start|>assistant\n"


def _image(seed: int, size: tuple[int, int]):
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (*size, 3), dtype=np.uint8))


def _prompts(vision: str) -> list:
    """Two image prompts (one with two images) around a text-only one."""
    one = ASK.format(vision)
    two = ASK.format(f"{vision} and {vision}")
    return [
        {"prompt": one, "multi_modal_data": {"image": _image(1, (40, 56))}},
        TEXT,
        {"prompt": two, "multi_modal_data": {"image": [_image(2, (24, 64)), _image(3, (32, 32))]}},
    ]


def _flat_text_config(target, out) -> object:
    """A directory whose config.json is the target's text config (the head writers read the
    target's width, heads and vocabulary from there)."""
    out.mkdir(parents=True, exist_ok=True)
    text = json.loads((target / "config.json").read_text())["text_config"]
    (out / "config.json").write_text(json.dumps({**text, "architectures": ["LlamaForCausalLM"]}))
    return out


def _vl_eagle3_head(target, path, seed: int, arch: str = "Eagle3Qwen2_5vlForCausalLM"):
    """An EAGLE-3 head as trained for a Qwen-VL target: the target's M-RoPE sections in its
    rope config, reading the stream entering layer 1 (of the tiny target's 2) three times."""
    text = json.loads((target / "config.json").read_text())["text_config"]
    rope = {k: v for k, v in text["rope_parameters"].items() if k.startswith("mrope")}
    return write_tiny_eagle3_head(
        path,
        _flat_text_config(target, path.parent / f"{path.name}-flat"),
        seed=seed,
        architectures=[arch],
        rope_scaling={"rope_type": "default", **rope},
        eagle_aux_hidden_state_layer_ids=[1, 1, 1],
    )


def _draft_sharing_tokenizer(target, path):
    """A tiny text Llama over the target's vocabulary, with the target's tokenizer."""
    vocab = json.loads((target / "config.json").read_text())["text_config"]["vocab_size"]
    draft = write_tiny_model(path, "llama", seed=5, vocab_size=vocab)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        (draft / name).unlink(missing_ok=True)
    transformers.AutoTokenizer.from_pretrained(target).save_pretrained(draft)
    return draft


def _run(target, prompts, n: int, **kw) -> tuple[LLM, list[list[int]]]:
    llm = LLM(
        model=str(target),
        dtype="float32",
        max_model_len=512,
        block_size=16,
        max_num_batched_tokens=32,  # image runs split over steps beside decode rows
        enable_chunked_prefill=True,
        seed=0,
        **kw,
    )
    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    return llm, [list(o.outputs[0].token_ids) for o in outs]


def _specs(target, d, methods: list[str]) -> dict[str, dict]:
    flat = _flat_text_config(target, d / "flat")
    made = {
        "ngram": lambda: {"method": "ngram", "prompt_lookup_max": 2},
        "draft_model": lambda: {
            "method": "draft_model",
            "model": str(_draft_sharing_tokenizer(target, d / "draft")),
        },
        # the checkpoint itself: its text model drafts the text-only prompt exactly (all
        # accepted) while image prompts' chunks share its steps
        "itself": lambda: {"method": "draft_model", "model": str(target)},
        "eagle": lambda: {"method": "eagle", "model": str(write_tiny_eagle_head(d / "e1", flat))},
        "eagle3": lambda: {"method": "eagle3", "model": str(_vl_eagle3_head(target, d / "e3", 1))},
    }
    return {m: {**made[m](), "num_speculative_tokens": 3} for m in methods}


@pytest.mark.parametrize(
    ("family", "methods"),
    [
        ("2.5", ["ngram", "draft_model", "itself", "eagle", "eagle3"]),
        ("3", ["draft_model", "eagle3"]),
        ("llava", ["draft_model", "eagle"]),
    ],
)
def test_greedy_with_images_is_token_identical(family, methods, tmp_path):
    if family == "llava":
        target, vision = write_tiny_llava(tmp_path / "t"), "<image>"
    else:
        target = write_tiny_qwen2_vl(tmp_path / "t", version=family, seed=2)
        vision = QWEN_VISION
    prompts = _prompts(vision)
    _, plain = _run(target, prompts, 16)
    for method, spec in _specs(target, tmp_path, methods).items():
        llm, got = _run(target, prompts, 16, speculative_config=spec)
        assert got == plain, method
        stats = llm.get_stats()
        assert stats.spec_decode_num_draft_tokens > 0, method
        assert stats.num_used_blocks == 0, method
        if method == "itself":
            assert stats.spec_decode_num_accepted_tokens > 0
        if method == "eagle3":  # the Qwen-VL head turns by M-RoPE; LLaVA's has none to read
            assert uses_mrope(llm.llm_engine.model_runner.draft.model)


# ---- vLLM's Qwen2.5-VL EAGLE-3 head against a transformers-only reference --------------------
class ReferenceVlHead:
    """The head in plain torch over HF's Qwen2.5-VL / Qwen3-VL: the stream entering the
    target's layer 1 (deepstack rows added before it), HF's M-RoPE positions and rotary."""

    def __init__(self, head_dir, target_dir, version: str) -> None:
        import importlib

        name = {"2.5": "qwen2_5_vl", "3": "qwen3_vl"}[version]
        hf = importlib.import_module(f"transformers.models.{name}.modeling_{name}")
        self.hf = hf
        self.w = load_file(head_dir / "model.safetensors")
        self.cfg = json.loads((head_dir / "config.json").read_text())
        cls = {"2.5": "Qwen2_5_VL", "3": "Qwen3VL"}[version]
        self.model = (
            getattr(transformers, f"{cls}ForConditionalGeneration")
            .from_pretrained(target_dir, dtype=torch.float32)
            .eval()
        )
        text = self.model.config.text_config
        rope = {k: v for k, v in text.rope_parameters.items() if k.startswith("mrope")}
        assert {k: v for k, v in self.cfg["rope_scaling"].items() if k.startswith("mrope")} == rope
        # the head's rope: the target's sections (interleaved for Qwen3-VL)
        rotary = "Qwen2_5_VLRotaryEmbedding" if version == "2.5" else "Qwen3VLTextRotaryEmbedding"
        self.rotary = getattr(hf, rotary)(text)
        self.layer1 = self.model.model.language_model.layers[1]
        self.images = transformers.AutoImageProcessor.from_pretrained(target_dir)
        self.tok = transformers.AutoTokenizer.from_pretrained(target_dir)
        self.pad = self.model.config.image_token_id
        self.embed = self.model.get_input_embeddings().weight.detach()
        self.sequences: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}

    @torch.no_grad()
    def prepare(self, text: str, images: list, seq: list[int]) -> list[int]:
        """HF's prompt ids of `text` and `images`; keeps the stream entering layer 1 and the
        M-RoPE positions of the finished sequence `seq` (its prompt: those ids)."""
        ids, extra = qwen2_vl_hf_inputs(
            self.tok.encode(text, add_special_tokens=False), images, self.images, self.pad
        )
        kinds = torch.zeros(1, len(seq), dtype=torch.long)
        if images:
            kinds[0, : len(ids)] = extra["mm_token_type_ids"][0]
            extra["mm_token_type_ids"] = kinds
        entering: list[torch.Tensor] = []

        def keep(_module, args, kwargs) -> None:
            entering.append(args[0] if args else kwargs["hidden_states"])

        hook = self.layer1.register_forward_pre_hook(keep, with_kwargs=True)
        try:
            self.model(torch.tensor([seq]), **extra)
        finally:
            hook.remove()
        grid = extra.get("image_grid_thw")
        pos, _ = self.model.model.get_rope_index(torch.tensor([seq]), kinds, grid)
        self.sequences[tuple(seq)] = (entering[0][0], pos)  # [L, D], [3, 1, L]
        return ids

    def run(self, next_tokens: list[int], feats: torch.Tensor, pos: torch.Tensor):
        """The head over entries p = 0..n-1 (token p + 1, feature p) turned by the target's
        M-RoPE positions `pos` [3, 1, n]: (logits over the target vocabulary, pre-norm)."""
        cos, sin = self.rotary(feats, pos)  # (feats: the dtype and device only)

        def rotate(q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            q, k = self.hf.apply_rotary_pos_emb(q[None], k[None], cos, sin)  # [1, h, n, hd]
            return q[0], k[0]

        emb = self.embed[torch.tensor(next_tokens)]
        return eagle3_head_forward(self.w, self.cfg, emb, feats, rotate)

    @torch.no_grad()
    def drafts(self, seq: list[int], c: int) -> tuple[int, int]:
        """Drafts 1 and 2 of a step whose row runs its own token seq[c] at position c."""
        stream, pos = self.sequences[tuple(seq)]
        feats = torch.cat([stream[:c]] * 3, dim=-1) @ self.w["fc.weight"].T
        logits, pre = self.run(seq[1 : c + 1], feats, pos[:, :, :c])
        d1 = int(logits[-1].argmax())
        logits2, _ = self.run(
            [*seq[1 : c + 1], d1], torch.cat([feats, pre[-1:]]), pos[:, :, : c + 1]
        )
        return d1, int(logits2[-1].argmax())


@pytest.mark.parametrize(
    ("version", "arch"),
    [("2.5", "Eagle3Qwen2_5vlForCausalLM"), ("3", "Eagle3Qwen3vlForCausalLM")],
)
def test_qwen_vl_eagle3_head_drafts_are_teacher_forced(version, arch, monkeypatch, tmp_path):
    target = write_tiny_qwen2_vl(tmp_path / "t", version=version, seed=2)
    head = _vl_eagle3_head(target, tmp_path / "head", seed=3, arch=arch)
    cases = [
        (ASK.format(QWEN_VISION), [_image(4, (40, 56))]),
        (TEXT, []),
        (
            ASK.format(f"{QWEN_VISION} and {QWEN_VISION}"),
            [_image(5, (24, 64)), _image(6, (32, 32))],
        ),
    ]
    prompts = [{"prompt": t, "multi_modal_data": {"image": i}} if i else t for t, i in cases]
    seen = record_drafts(monkeypatch, Eagle3Runner)
    spec = {"method": "eagle3", "model": str(head), "num_speculative_tokens": 2}
    llm = LLM(
        model=str(target),
        dtype="float32",
        max_model_len=512,
        block_size=16,
        max_num_batched_tokens=32,
        enable_chunked_prefill=True,
        speculative_config=spec,
    )
    assert llm.llm_engine.config.speculative_config["method"] == "eagle3"
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    ref = ReferenceVlHead(head, target, version)
    full = {}
    for (text, images), out in zip(cases, outs, strict=True):
        seq = list(out.prompt_token_ids) + list(out.outputs[0].token_ids)
        assert ref.prepare(text, images, seq) == list(out.prompt_token_ids)
        full[tuple(out.prompt_token_ids)] = seq
    checked = {True: 0, False: 0}  # steps of sequences with / without images
    for prompt, c, drafts in seen:
        seq = full[prompt]
        if c + 1 >= len(seq):
            continue
        d1, d2 = ref.drafts(seq, c)
        assert drafts[0] == d1, (len(prompt), c)
        assert len(drafts) == 1 or drafts[1] == d2, (len(prompt), c)
        checked[ref.pad in prompt] += 1
    assert checked[True] >= 6 and checked[False] >= 3


def test_audio_added_at_generated_positions_stays_under_drafts(tmp_path):
    """Voxtral Realtime adds its clip's rows to the token embeddings of generated positions
    too: a worker-side draft's slot keeps its audio row under the draft's embedding. The
    checkpoint as its own draft (drafts accepted): the plain engine's tokens and logprobs."""
    from audio_checks import noise_clip
    from draft_heads import assert_same_greedy
    from test_voxtral_realtime import PAD, write_tiny_voxtral_realtime

    target = write_tiny_voxtral_realtime(tmp_path / "vox")
    prompts = [
        {"prompt_token_ids": [0] + [PAD] * k, "multi_modal_data": {"audio": noise_clip(s, 1.92)}}
        for s, k in [(1, 5), (2, 9)]
    ]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=2)
    spec = {"method": "draft_model", "model": str(target), "num_speculative_tokens": 3}
    runs = []
    for kw in ({}, {"speculative_config": spec}):
        llm = LLM(str(target), dtype="float32", max_model_len=256, seed=0, **kw)
        runs.append(llm.generate(prompts, params, use_tqdm=False))
    assert_same_greedy(runs[1], runs[0])
    assert llm.get_stats().spec_decode_num_accepted_tokens > 0
