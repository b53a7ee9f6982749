"""sentence-transformers model files (modules.json, the Pooling and Dense modules' config.json,
sentence_bert_config.json) as the library writes them and as hostile copies of them.

What sentence-transformers itself makes of each layout decided what is right here; the tests
compare with transformers' own BertModel on the same weights, pooled in torch. A file paged
cannot serve exactly is refused with a ValueError naming the file and field, never served
with another pooling or length."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from paged_engine import LLM, PoolingParams
from paged_engine.testing import write_tiny_encoder

ST = "sentence_transformers.models."
KW = {"device": "cpu", "dtype": "float32", "num_gpu_blocks_override": 64}
PROMPTS = [list(range(5, 30)), [5, 6, 7], list(range(40, 52))]
RAW = PoolingParams(normalize=False)


@pytest.fixture(scope="module")
def bert(tmp_path_factory):
    """A tiny BertModel and its last hidden states for PROMPTS (transformers')."""
    import transformers

    path = write_tiny_encoder(tmp_path_factory.mktemp("st") / "bert", "BertModel")
    model = transformers.BertModel.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        hidden = [model(torch.tensor([p])).last_hidden_state[0] for p in PROMPTS]
    return path, hidden


def st_files(path, pooling: object, *extra: dict, modules: object = None) -> None:
    """modules.json (Transformer, Pooling at 1_Pooling, then `extra`) and the Pooling config."""
    entries = [
        {"idx": 0, "name": "0", "path": "", "type": ST + "Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": ST + "Pooling"},
        *extra,
    ]
    (path / "modules.json").write_text(json.dumps(entries if modules is None else modules))
    (path / "1_Pooling").mkdir(exist_ok=True)
    (path / "1_Pooling" / "config.json").write_text(json.dumps(pooling))


def embed(path, prompts=PROMPTS, **kw) -> list[torch.Tensor]:
    outs = LLM(str(path), **KW, **kw).embed(prompts, pooling_params=RAW, use_tqdm=False)
    return [torch.tensor(o.outputs.embedding) for o in outs]


# sentence-transformers >= 5.4 writes `pooling_mode` (one name, or a list); older versions one
# boolean flag per mode: both are read
@pytest.mark.parametrize(
    ("pooling", "pick"),
    [
        ({"embedding_dimension": 32, "pooling_mode": "mean", "include_prompt": True}, "mean"),
        ({"pooling_mode": ["lasttoken"]}, "last"),
        ({"pooling_mode": "cls", "pooling_mode_mean_tokens": True}, "cls"),  # new key wins
        ({"pooling_mode_cls_token": False, "pooling_mode_mean_tokens": True}, "mean"),
    ],
)
def test_pooling_config_schemas(tmp_path, bert, pooling, pick) -> None:
    path, hidden = bert
    model = tmp_path / "m"
    model.mkdir()
    for f in path.iterdir():
        (model / f.name).symlink_to(f)
    st_files(model, pooling)
    index = {"cls": 0, "last": -1}
    for got, h in zip(embed(model), hidden):
        want = h.mean(0) if pick == "mean" else h[index[pick]]
        assert got.tolist() == pytest.approx(want.tolist(), abs=1e-5)


def _dense(path, n_in: int, weight: torch.Tensor | None = None) -> dict:
    (path / "2_Dense").mkdir()
    cfg = {"in_features": n_in, "out_features": 8, "bias": False}
    (path / "2_Dense" / "config.json").write_text(
        json.dumps({**cfg, "activation_function": "torch.nn.modules.activation.Tanh"})
    )
    w = torch.randn(8, n_in) if weight is None else weight
    save_file({"linear.weight": w}, path / "2_Dense" / "model.safetensors")
    return {"idx": 2, "name": "2", "path": "2_Dense", "type": ST + "Dense"}


MEAN = {"pooling_mode_mean_tokens": True}
ENTRY = {"idx": 1, "name": "1", "path": "1_Pooling", "type": ST + "Pooling"}
TRANSFORMER = {"idx": 0, "name": "0", "path": "", "type": ST + "Transformer"}


# Each hostile file: what sentence-transformers does with it (an error, or other vectors than
# paged's fallback pooling gave) and the ValueError paged gives, naming its file and field.
@pytest.mark.parametrize(
    ("case", "match"),
    [
        ("modules_not_a_list", r"modules.json: expected a list of modules, got str"),
        ("modules_bad_json", r"modules.json cannot be read"),
        ("entry_without_type", r"modules.json\[1\].type: expected a string"),
        ("entry_without_path", r"modules.json\[1\].path: expected a string"),
        ("path_outside", r"modules.json\[1\].path='../../etc': .*inside the model directory"),
        ("unknown_module", r"BertModel: modules.json lists .*'my.Custom' \(2_X\)"),
        ("max_pooling", r"1_Pooling/config.json: pooling_mode_\* selects \['max'\]"),
        ("mean_sqrt_len", r"1_Pooling/config.json: pooling_mode selects \['mean_sqrt_len"),
        ("weightedmean", r"pooling_mode_\* selects \['weightedmean'\]"),
        ("concatenated", r"pooling_mode_\* selects \['cls', 'mean'\]"),
        ("all_modes_false", r"pooling_mode_\* selects \[\]"),
        ("unknown_mode", r"pooling_mode selects \['median'\]"),
        ("pooling_config_a_list", r"1_Pooling/config.json: expected an object, got list"),
        ("pooling_config_missing", r"1_Pooling/config.json: the Pooling module's config cannot"),
        ("dense_nan", r"2_Dense/config.json: the Dense module's weights hold NaN"),
        ("max_seq_length_0", r"sentence_bert_config.json: max_seq_length must be a positive"),
        ("max_seq_length_str", r"sentence_bert_config.json: max_seq_length must be a positive"),
    ],
)
def test_hostile_files_are_refused_by_name(tmp_path, bert, case, match) -> None:
    path = tmp_path / "m"
    path.mkdir()
    for f in bert[0].iterdir():
        (path / f.name).symlink_to(f)
    flags = {
        "max_pooling": {"pooling_mode_max_tokens": True},
        "weightedmean": {"pooling_mode_weightedmean_tokens": True},
        "concatenated": {"pooling_mode_cls_token": True, "pooling_mode_mean_tokens": True},
        "all_modes_false": {"pooling_mode_cls_token": False, "pooling_mode_mean_tokens": False},
        "mean_sqrt_len": {"pooling_mode": "mean_sqrt_len_tokens"},
        "unknown_mode": {"pooling_mode": "median"},
        "pooling_config_a_list": [MEAN],
    }
    modules = {
        "modules_not_a_list": "0_Transformer",
        "entry_without_type": [TRANSFORMER, {"idx": 1, "path": "1_Pooling"}],
        "entry_without_path": [TRANSFORMER, {"idx": 1, "type": ST + "Pooling"}],
        "path_outside": [TRANSFORMER, {**ENTRY, "path": "../../etc"}],
        "unknown_module": [TRANSFORMER, ENTRY, {"path": "2_X", "type": "my.Custom"}],
    }
    st_files(path, flags.get(case, MEAN), modules=modules.get(case))
    if case == "modules_bad_json":
        (path / "modules.json").write_text("[{")
    if case == "pooling_config_missing":
        (path / "1_Pooling" / "config.json").unlink()
    if case == "dense_nan":
        st_files(path, MEAN, _dense(path, 32, torch.full((8, 32), float("nan"))))
    if case.startswith("max_seq_length"):
        n = 0 if case.endswith("0") else "16"
        (path / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": n}))
    with pytest.raises(ValueError, match=match):
        embed(path)


def test_max_seq_length_is_the_context_length(tmp_path, bert) -> None:
    """sentence_bert_config.json's max_seq_length bounds the model's context as vLLM reads it
    (sentence-transformers truncates there): max_model_len defaults to it, within the model's
    positions; a longer prompt is refused unless truncate_prompt_tokens cuts it, and a larger
    max_model_len is refused by name."""
    path = tmp_path / "m"
    path.mkdir()
    for f in bert[0].iterdir():
        (path / f.name).symlink_to(f)
    st_files(path, MEAN)
    settings = path / "sentence_bert_config.json"
    settings.write_text(json.dumps({"max_seq_length": 16, "do_lower_case": False}))
    llm = LLM(str(path), **KW)
    assert llm.llm_engine.config.max_model_len == 16
    with pytest.raises(ValueError, match="prompt is too long: 25 tokens, but max_model_len is 16"):
        llm.embed(PROMPTS[:1], pooling_params=RAW, use_tqdm=False)
    cut = PoolingParams(normalize=False, truncate_prompt_tokens=16)
    (got,) = llm.embed(PROMPTS[:1], pooling_params=cut, use_tqdm=False)
    import transformers

    model = transformers.BertModel.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():  # the first 16 tokens: a pooling runner truncates on the right
        want = model(torch.tensor([PROMPTS[0][:16]])).last_hidden_state[0].mean(0)
    assert got.outputs.embedding == pytest.approx(want.tolist(), abs=1e-5)
    with pytest.raises(ValueError, match=r"max_model_len=64 exceeds max_seq_length=16 of sent"):
        LLM(str(path), max_model_len=64, **KW)
    settings.write_text(json.dumps({"max_seq_length": 999}))  # past the 130 positions
    assert LLM(str(path), **KW).llm_engine.config.max_model_len == 130


def test_a_causal_lm_reads_its_sentence_transformers_files(tmp_path) -> None:
    """Qwen3-Embedding's layout: a `*ForCausalLM` checkpoint with sentence-transformers files.
    Its Pooling module's pooling and max_seq_length are read as for a base model (vLLM reads
    them for any model): the mean here, not the last token; a pooling it cannot run refuses
    the engine's embed requests (runner "auto": it still generates) or the engine ("pooling")."""
    import transformers

    from paged_engine import SamplingParams
    from paged_engine.testing import write_tiny_model

    path = write_tiny_model(tmp_path / "q", "qwen3")
    norm = {"idx": 2, "name": "2", "path": "2_Normalize", "type": ST + "Normalize"}
    st_files(path, {"pooling_mode": "mean"}, norm)
    (path / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 32}))
    llm = LLM(str(path), **KW)
    assert llm.llm_engine.config.max_model_len == 32
    model = transformers.AutoModel.from_pretrained(path, dtype=torch.float32).eval()
    outs = llm.embed(PROMPTS, use_tqdm=False)
    for out, p in zip(outs, PROMPTS, strict=True):
        with torch.no_grad():
            h = model(torch.tensor([p])).last_hidden_state[0]
        want = torch.nn.functional.normalize(h.mean(0), dim=-1)
        assert out.outputs.embedding == pytest.approx(want.tolist(), abs=1e-5)
    st_files(path, {"pooling_mode": "max"}, norm)
    llm = LLM(str(path), **KW)
    with pytest.raises(ValueError, match=r"params: 1_Pooling/config.json: pooling_mode selects"):
        llm.embed(PROMPTS, use_tqdm=False)
    (out,) = llm.generate([[5, 6]], SamplingParams(max_tokens=2), use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 2
    with pytest.raises(ValueError, match=r"1_Pooling/config.json: pooling_mode selects \['max'"):
        LLM(str(path), runner="pooling", **KW)


def test_the_layout_sentence_transformers_6_saves(tmp_path, bert) -> None:
    """sentence-transformers >= 5.4 saves its modules under new class paths
    (`sentence_transformers.base.modules.dense.Dense`, ...) and the Pooling mode as a string:
    the Dense module runs (LaBSE's layout: CLS, tanh Dense, Normalize) as under the old names."""
    path, hidden = bert
    model = tmp_path / "m"
    model.mkdir()
    for f in path.iterdir():
        (model / f.name).symlink_to(f)
    torch.manual_seed(0)
    weight = torch.randn(8, 32)
    dense = {**_dense(model, 32, weight), "type": "sentence_transformers.base.modules.dense.Dense"}
    norm = "sentence_transformers.base.modules.normalize.Normalize"
    pooling = {"embedding_dimension": 32, "pooling_mode": "cls", "include_prompt": True}
    st_files(model, pooling, dense, {"idx": 3, "name": "3", "path": "3_Normalize", "type": norm})
    modules = json.loads((model / "modules.json").read_text())
    modules[0]["type"] = "sentence_transformers.base.modules.transformer.Transformer"
    modules[1]["type"] = "sentence_transformers.sentence_transformer.modules.pooling.Pooling"
    (model / "modules.json").write_text(json.dumps(modules))
    outs = LLM(str(model), **KW).embed(PROMPTS, use_tqdm=False)
    for out, h in zip(outs, hidden, strict=True):
        want = torch.nn.functional.normalize(torch.tanh(weight @ h[0]), dim=-1)
        assert out.outputs.embedding == pytest.approx(want.tolist(), abs=1e-5)


def test_a_model_pooling_its_own_way_skips_the_pooling_files(tmp_path) -> None:
    """SPLADE's files (sentence-transformers' SparseEncoder: MLMTransformer, SpladePooling)
    list modules of its own; BertSpladeSparseEmbeddingModel pools as SPLADE does whatever they
    say, so they are neither refused nor read for a pooling (max_seq_length still is)."""
    path = write_tiny_encoder(tmp_path / "s", "BertForMaskedLM")
    sparse = "sentence_transformers.sparse_encoder.models."
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": sparse + "MLMTransformer"},
        {"idx": 1, "name": "1", "path": "1_SpladePooling", "type": sparse + "SpladePooling"},
    ]
    (path / "modules.json").write_text(json.dumps(modules))
    (path / "1_SpladePooling").mkdir()
    splade = {
        "pooling_strategy": "max",
        "activation_function": "relu",
        "word_embedding_dimension": 512,
    }
    (path / "1_SpladePooling" / "config.json").write_text(json.dumps(splade))
    (path / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 40}))
    overrides = {"architectures": ["BertSpladeSparseEmbeddingModel"]}
    llm = LLM(str(path), hf_overrides=overrides, **KW)
    assert llm.llm_engine.config.max_model_len == 40
    (out,) = llm.embed(PROMPTS[1:2], use_tqdm=False)
    assert len(out.outputs.embedding) == 512  # SPLADE's vocabulary-wide vector


def test_do_lower_case_lowercases_text_prompts(tmp_path, bert) -> None:
    """sentence_bert_config.json's do_lower_case: text prompts are tokenized lowercased, as
    sentence-transformers and vLLM do (the output keeps the text as sent); token ids are not
    touched. Another value than a bool is refused by name."""
    path = tmp_path / "m"
    path.mkdir()
    for f in bert[0].iterdir():
        (path / f.name).symlink_to(f)
    st_files(path, MEAN)
    settings = path / "sentence_bert_config.json"
    texts = ["Hello World, THIS is Paged", "hello world, this is paged"]
    settings.write_text(json.dumps({"max_seq_length": 64, "do_lower_case": False}))
    cased = LLM(str(path), **KW).embed(texts, pooling_params=RAW, use_tqdm=False)
    assert cased[0].prompt_token_ids != cased[1].prompt_token_ids  # the tokenizer keeps case
    settings.write_text(json.dumps({"max_seq_length": 64, "do_lower_case": True}))
    lowered = LLM(str(path), **KW).embed(texts, pooling_params=RAW, use_tqdm=False)
    assert lowered[0].prompt_token_ids == cased[1].prompt_token_ids
    assert lowered[0].outputs.embedding == pytest.approx(cased[1].outputs.embedding, abs=1e-6)
    assert lowered[0].prompt == texts[0]
    settings.write_text(json.dumps({"do_lower_case": "yes"}))
    with pytest.raises(ValueError, match=r"sentence_bert_config\.json: do_lower_case must be"):
        LLM(str(path), **KW)
