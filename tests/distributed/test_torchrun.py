"""Multi-node launch: two torchrun "nodes" on localhost (one rank each, static rendezvous at
MASTER_ADDR:MASTER_PORT) serve one tensor-parallel engine with the single-process tokens."""

from __future__ import annotations

import json

import pytest
from torchrun_generate import PROMPTS, run_two_nodes

from paged_engine import LLM, SamplingParams
from paged_engine.testing import write_tiny_model


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    return str(write_tiny_model(tmp_path_factory.mktemp("model"), "gpt_neox", seed=4))


@pytest.fixture(scope="module")
def single_process_tokens(model) -> list[list[int]]:
    llm = LLM(model=model, dtype="float32", max_model_len=128)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    llm.llm_engine.shutdown()
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.mark.parametrize(("tp", "pp"), [(2, 1), (1, 2)], ids=["tp2", "pp2"])
def test_two_torchrun_nodes_give_the_single_process_tokens(
    tmp_path, model, single_process_tokens, tp, pp
):
    out = tmp_path / "tokens.json"
    codes, logs = run_two_nodes(model, str(out), tp, pp, timeout=240)
    assert codes == [0, 0], "\n---\n".join(logs)
    assert json.loads(out.read_text()) == single_process_tokens
