"""Rope tables as long as positions reach (layers/rotary.py `get_rope`, loader.py
`multi_axis_positions`): a text model built at a small max_model_len holds max_model_len cos /
sin rows whatever its max_position_embeddings says, with every output bit-identical.

- Rows are prefixes: a shorter table's rows are the longer one's, bit for bit, for every
  scaling (the scaling maths still read max_position_embeddings and the context length).
- Llama with max_position_embeddings 10,485,760 (Llama 4 Scout's), plain and yarn-scaled, at
  max_model_len 128: 128 rows, HF's greedy tokens and logprobs on the same weights; a prompt
  whose last position is max_model_len - 1 too.
- MTP speculative decoding up to max_model_len: the plain engine's tokens (a draft position
  past the table would raise on CPU).
- M-RoPE (Qwen2-VL) keeps its max_position_embeddings rows: its positions run past
  max_model_len; so does a rope built outside the loader's bound.
"""

from __future__ import annotations

import json

import pytest
import torch
from config_variant_check import hf_refs
from hf_reference import assert_matches

from paged_engine import LLM, SamplingParams
from paged_engine.layers.rotary import RotaryEmbedding, get_rope, rope_context_len
from paged_engine.loader import multi_axis_positions
from paged_engine.testing import write_tiny_model

pytest.importorskip("transformers")

SCOUT_POSITIONS = 10_485_760  # Llama 4 Scout's max_position_embeddings
MAX_LEN = 128
SCALINGS = {
    "default": None,
    "linear": {"rope_type": "linear", "factor": 4.0},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0},
    "llama3": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    },
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256},
    "longrope": {
        "rope_type": "longrope",
        "short_factor": [1.0 + i / 16 for i in range(8)],
        "long_factor": [2.0 + i / 8 for i in range(8)],
        "original_max_position_embeddings": 256,
    },
}


class _Config:
    def __init__(self, max_position: int, scaling: dict | None) -> None:
        self.model_type = "llama"
        self.max_position_embeddings = max_position
        self.rope_theta = 10000.0
        self.rope_scaling = dict(scaling) if scaling else None


@pytest.mark.parametrize("kind", list(SCALINGS))
@pytest.mark.parametrize("context_len", [100, 300])
def test_bounded_table_is_the_full_tables_prefix(kind, context_len):
    """The bounded table's rows equal the unbounded table's first rows, bit for bit, with the
    same scaling choice (longrope's factor set, dynamic NTK's base, yarn's attention factor)."""
    config = _Config(1024, SCALINGS[kind])
    with rope_context_len(context_len):
        full = get_rope(config, 16)
    with rope_context_len(context_len, bounded_positions=True):
        short = get_rope(config, 16)
    assert short.cos.shape[0] == context_len < full.cos.shape[0]
    assert short.attention_factor == full.attention_factor
    assert torch.equal(short.cos, full.cos[:context_len])
    assert torch.equal(short.sin, full.sin[:context_len])


def test_angle_rows_do_not_depend_on_the_table_length():
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, 128, 2).float() / 128))
    long = torch.outer(torch.arange(4096, dtype=torch.float32), inv_freq)
    short = torch.outer(torch.arange(MAX_LEN, dtype=torch.float32), inv_freq)
    assert torch.equal(long[:MAX_LEN], short)


def test_scout_sized_config_builds_max_model_len_rows():
    config = _Config(SCOUT_POSITIONS, None)
    with rope_context_len(MAX_LEN, bounded_positions=True):
        rope = get_rope(config, 128)
    assert rope.cos.shape == rope.sin.shape == (MAX_LEN, 64)


def test_mrope_and_unbounded_ropes_keep_every_row():
    """M-RoPE positions (video time, text shifted after images) run past max_model_len; a rope
    built outside the loader's bound (context_len None) keeps the config's rows."""
    config = _Config(1024, None)
    config.rope_scaling = {"rope_type": "default", "mrope_section": [2, 3, 3]}
    with rope_context_len(MAX_LEN, bounded_positions=True):
        assert get_rope(config, 16).cos.shape[0] == 1024
    assert get_rope(_Config(1024, None), 16).cos.shape[0] == 1024
    with rope_context_len(MAX_LEN):  # the bound is the caller's to vouch for
        assert get_rope(_Config(1024, None), 16).cos.shape[0] == 1024


def test_which_configs_carry_multi_axis_positions():
    import importlib

    from paged_engine.multimodal import audio_archs
    from paged_engine.multimodal.archs import KINDS
    from paged_engine.multimodal.audio import AudioProcessor
    from paged_engine.multimodal.layout_table import LAYOUTS
    from paged_engine.multimodal.video_archs import VIDEO_PROCESSORS

    def cfg(arch: str):
        return type("C", (), {"architectures": [arch]})()

    assert not multi_axis_positions(cfg("LlamaForCausalLM"))
    assert not multi_axis_positions(cfg("Llama4ForConditionalGeneration"))
    assert multi_axis_positions(cfg("Qwen2_5_VLForConditionalGeneration"))
    assert multi_axis_positions(cfg("HunYuanVLForConditionalGeneration"))
    assert multi_axis_positions(cfg("Qwen2_5OmniThinkerForConditionalGeneration"))
    # audio and video wrappers with plain positions: tables bounded by max_model_len
    for arch in (
        "Qwen3ASRForConditionalGeneration",
        "Gemma3nForConditionalGeneration",
        "Gemma4ForConditionalGeneration",
        "LlavaNextVideoForConditionalGeneration",
    ):
        assert not multi_axis_positions(cfg(arch)), arch
    # The rule's premises. A video processor makes M-RoPE tables iff its wrapper's image
    # layout has M-RoPE (the plain ones return None for any prompt):
    for archs, cls in VIDEO_PROCESSORS:
        for arch in archs:
            mrope = LAYOUTS[KINDS[arch]].mrope
            assert mrope or cls.positions(None, 8, ()) is None, arch  # type: ignore[arg-type]
    # ...and no audio processor makes one (AudioProcessor.positions: None).
    for path in set(audio_archs.HOSTS.values()):
        module, name = path.split(":")
        host = getattr(importlib.import_module(f"paged_engine.multimodal.{module}"), name)
        assert host.positions is AudioProcessor.positions, path


def _rows(llm: LLM) -> set[int]:
    return set(
        llm.apply_model(
            lambda m: sorted(
                {r.cos.shape[0] for r in m.modules() if isinstance(r, RotaryEmbedding)}
            )
        )[0]
    )


@pytest.mark.parametrize(
    "scaling",
    [None, {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 2_621_440}],
    ids=["default", "yarn"],
)
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_scout_positions_match_hf_at_small_max_model_len(scaling, async_scheduling, tmp_path):
    overrides = {"max_position_embeddings": SCOUT_POSITIONS}
    if scaling:
        overrides["rope_scaling"] = scaling
    path = write_tiny_model(tmp_path, "llama", seed=1, **overrides)
    prompts, refs = hf_refs(path, (5, 37))
    # a generation run to max_model_len: its last token runs at position max_model_len - 2
    (long,), (long_ref,) = hf_refs(path, (100,), max_tokens=MAX_LEN - 100, seed=3)
    llm = LLM(
        model=str(path),
        dtype="float32",
        max_model_len=MAX_LEN,
        block_size=16,
        async_scheduling=async_scheduling,
    )
    try:
        assert _rows(llm) == {MAX_LEN}
        params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, logprobs=3)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        for out, ref in zip(outs, refs, strict=True):
            assert_matches("scout-positions", out, ref)
        params = SamplingParams(temperature=0, max_tokens=MAX_LEN, ignore_eos=True, logprobs=3)
        (out,) = llm.generate([{"prompt_token_ids": long}], params, use_tqdm=False)
        assert out.outputs[0].finish_reason == "length"
        assert len(long) + len(out.outputs[0].token_ids) == MAX_LEN
        assert_matches("up to max_model_len", out, long_ref)
    finally:
        llm.llm_engine.shutdown()


def test_pooling_prompt_at_max_model_len_matches_hf(tmp_path):
    """A pooling prompt fills max_model_len: its last token turns by the table's last row."""
    from transformers import AutoModel

    path = write_tiny_model(tmp_path, "llama", seed=1, max_position_embeddings=SCOUT_POSITIONS)
    ids = torch.randint(3, 512, (MAX_LEN,), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        hf = AutoModel.from_pretrained(path, dtype=torch.float32).eval()
        want = torch.nn.functional.normalize(hf(ids[None]).last_hidden_state[0, -1], dim=-1)
    llm = LLM(model=str(path), runner="pooling", dtype="float32", max_model_len=MAX_LEN)
    try:
        assert _rows(llm) == {MAX_LEN}
        (out,) = llm.embed({"prompt_token_ids": ids.tolist()}, use_tqdm=False)
        got = torch.tensor(out.outputs.embedding)
        assert torch.allclose(got, want, atol=1e-5), (got - want).abs().max()
    finally:
        llm.llm_engine.shutdown()


def _spec_to_the_limit(
    path, spec: dict, async_scheduling: bool = False, head_rows: list | None = None
) -> None:
    """Greedy up to max_model_len with `spec`: the plain engine's tokens, drafts proposed (a
    target or draft position past the table would raise on CPU)."""
    gen = torch.Generator().manual_seed(7)
    prompts = [
        {"prompt_token_ids": torch.randint(3, 500, (n,), generator=gen).tolist()}
        for n in (90, 111, 126)
    ]
    params = SamplingParams(temperature=0, max_tokens=MAX_LEN, ignore_eos=True)
    kw = {"dtype": "float32", "max_model_len": MAX_LEN, "block_size": 16, "seed": 0}
    kw["async_scheduling"] = async_scheduling
    plain, spec_llm = LLM(str(path), **kw), LLM(str(path), speculative_config=spec, **kw)
    try:
        assert _rows(plain) == _rows(spec_llm) == {MAX_LEN}
        want = plain.generate(prompts, params, use_tqdm=False)
        got = spec_llm.generate(prompts, params, use_tqdm=False)
        for w, g, p in zip(want, got, prompts, strict=True):
            assert len(p["prompt_token_ids"]) + len(w.outputs[0].token_ids) == MAX_LEN
            assert g.outputs[0].token_ids == w.outputs[0].token_ids
        assert spec_llm.get_stats().spec_decode_num_draft_tokens > 0
        if head_rows is not None:  # the head's ropes (the worker's runner.draft)
            runner = spec_llm.llm_engine.engine_core.executor.worker.model_runner
            draft = runner.draft.model
            head_rows.append(
                {r.cos.shape[0] for r in draft.modules() if isinstance(r, RotaryEmbedding)}
            )
    finally:
        plain.llm_engine.shutdown()
        spec_llm.llm_engine.shutdown()


def test_mtp_drafts_up_to_max_model_len(tmp_path):
    """The target's own MTP layer (its rope bounded with the target's) drafts up to the end."""
    from paged_engine.testing import write_tiny_mtp_target

    path = write_tiny_mtp_target(tmp_path / "mtp")
    config = json.loads((path / "config.json").read_text())
    config["max_position_embeddings"] = SCOUT_POSITIONS
    (path / "config.json").write_text(json.dumps(config))
    rows: list[set[int]] = []
    _spec_to_the_limit(path, {"method": "mtp", "num_speculative_tokens": 2}, head_rows=rows)
    assert rows == [{MAX_LEN}]


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_draft_model_drafts_up_to_max_model_len(async_scheduling, tmp_path):
    """A draft model (the target itself: its drafts are mostly accepted, so steps run several
    positions at once up to the end), its rope bounded by the same rule."""
    path = write_tiny_model(tmp_path, "llama", seed=1, max_position_embeddings=SCOUT_POSITIONS)
    rows: list[set[int]] = []
    spec = {"model": str(path), "num_speculative_tokens": 3}
    _spec_to_the_limit(path, spec, async_scheduling, head_rows=rows)
    assert rows == [{MAX_LEN}]


def test_mrope_model_keeps_its_table(tmp_path):
    """Qwen2-VL's text positions jump past max_model_len after images and along a video's time
    axis: its M-RoPE table keeps max_position_embeddings rows."""
    from paged_engine.testing import write_tiny_qwen2_vl

    path = write_tiny_qwen2_vl(tmp_path / "qwen2-vl", seed=2)
    config = json.loads((path / "config.json").read_text())
    text = config.get("text_config", config)
    llm = LLM(model=str(path), dtype="float32", max_model_len=MAX_LEN, block_size=16)
    try:
        assert _rows(llm) == {int(text["max_position_embeddings"])} != {MAX_LEN}
    finally:
        llm.llm_engine.shutdown()


def _scout_positions(path) -> None:
    config = json.loads((path / "config.json").read_text())
    config["max_position_embeddings"] = SCOUT_POSITIONS
    (path / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_feature_heads_draft_up_to_max_model_len(method, tmp_path):
    """EAGLE-1 / EAGLE-3 heads (spec_decode/head_loader.py) at a 10M-position config: their
    ropes hold max_model_len rows and every position they run fits."""
    from paged_engine.testing import write_tiny_eagle3_head, write_tiny_eagle_head

    target = write_tiny_model(tmp_path / "target", "llama", num_hidden_layers=7)
    _scout_positions(target)
    write = write_tiny_eagle_head if method == "eagle" else write_tiny_eagle3_head
    head = write(tmp_path / "head", target, seed=1)
    _scout_positions(head)
    rows: list[set[int]] = []
    _spec_to_the_limit(
        target,
        {"method": method, "model": str(head), "num_speculative_tokens": 3},
        head_rows=rows,
    )
    assert rows == [{MAX_LEN}]


def _huge_positions(path) -> None:
    """`_scout_positions` at the top level and in a nested text config (an assistant's)."""
    config = json.loads((path / "config.json").read_text())
    config["max_position_embeddings"] = SCOUT_POSITIONS
    if isinstance(config.get("text_config"), dict):
        config["text_config"]["max_position_embeddings"] = SCOUT_POSITIONS
    (path / "config.json").write_text(json.dumps(config))


def test_deepseek_eagle_head_drafts_up_to_max_model_len(tmp_path):
    """A DeepSeek-V3 EAGLE head, built by its own loader (models/deepseek_eagle.py), bounds its
    ropes as the other heads do (spec_decode/head_loader.py `head_ropes`)."""
    from test_spec_eagle_deepseek import write_deepseek_eagle_head

    target = write_tiny_model(tmp_path / "target", "deepseek_v3", seed=3)
    head = write_deepseek_eagle_head(tmp_path / "ds", target, seed=4)
    _huge_positions(target)
    _huge_positions(head)
    rows: list[set[int]] = []
    spec = {"method": "eagle", "model": str(head), "num_speculative_tokens": 2}
    _spec_to_the_limit(target, spec, head_rows=rows)
    assert rows == [{MAX_LEN}]


@pytest.mark.parametrize("arch", ["gemma4", "olmo3", "dbrx", "mimo_v2_flash"])
def test_models_building_their_own_ropes_bound_them(arch, tmp_path):
    """Models that build RotaryEmbedding themselves (per-layer-type ropes, proportional ropes)
    take the same bound (`plain_rope_rows`): max_model_len rows, and a generation run to
    max_model_len gives HF's tokens."""
    path = write_tiny_model(tmp_path, arch, seed=1, max_position_embeddings=65_536)
    (long,), (long_ref,) = hf_refs(path, (100,), max_tokens=MAX_LEN - 100, seed=3)
    llm = LLM(model=str(path), dtype="float32", max_model_len=MAX_LEN)
    assert _rows(llm) == {MAX_LEN}
    params = SamplingParams(temperature=0.0, max_tokens=MAX_LEN - 100, logprobs=3)
    (out,) = llm.generate([{"prompt_token_ids": long}], params, use_tqdm=False)
    assert_matches(arch, out, long_ref)
    llm.llm_engine.shutdown()
