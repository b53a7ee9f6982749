"""paged-server on a quantized checkpoint: an AWQ checkpoint served with vLLM's flag
(`--quantization awq_marlin`) answers as the engine does offline on the same weights, and a
flag naming another scheme stops the server at start with an error naming both."""

from __future__ import annotations

import pytest
from int_packers import packed_copy
from server_proc import REAL_ARGS, launch

from paged_engine import LLM, SamplingParams

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def awq_model(tmp_path_factory: pytest.TempPathFactory):
    from paged_engine.testing import write_tiny_model

    root = tmp_path_factory.mktemp("awq")
    src = write_tiny_model(root / "src", "llama", seed=2)
    return packed_copy(src, "awq-g64", root / "awq")


def test_an_awq_checkpoint_is_served_as_the_engine_runs_it(awq_model):
    path, dense = awq_model
    prompt = [5, 6, 7, 9, 11, 40, 41]
    offline = LLM(model=str(dense), dtype="float32", max_model_len=128)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    want = offline.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
    server = launch(["--model", str(path), *REAL_ARGS, "--quantization", "awq_marlin"], fake=False)
    try:
        body = {"prompt": prompt, "max_tokens": 6, "temperature": 0, "ignore_eos": True}
        status, _, answer = server.request("POST", "/v1/completions", body)
        assert status == 200, answer
        assert answer["choices"][0]["text"] == want.outputs[0].text
    finally:
        assert server.stop() == 0, "".join(server.lines[-30:])


def test_a_flag_naming_another_scheme_stops_the_start(awq_model):
    path, _ = awq_model
    with pytest.raises(RuntimeError) as failed:
        launch(["--model", str(path), *REAL_ARGS, "--quantization", "gptq"], fake=False)
    assert "quantization='gptq' but the checkpoint's quant_method is 'awq'" in str(failed.value)
