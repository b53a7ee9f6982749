"""Multi-node launch: two torchrun "nodes" on localhost (one rank each, static rendezvous at
MASTER_ADDR:MASTER_PORT) serve one tensor-parallel engine with the single-process tokens."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from torchrun_generate import PROMPTS

from paged_engine import LLM, SamplingParams
from paged_engine.distributed.launch import free_port
from paged_engine.testing import write_tiny_model

SCRIPT = Path(__file__).with_name("torchrun_generate.py")


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
    port = free_port()
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    nodes = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nnodes",
                "2",
                "--nproc-per-node",
                "1",
                "--node-rank",
                str(rank),
                "--master-addr",
                "127.0.0.1",
                "--master-port",
                str(port),
                str(SCRIPT),
                model,
                str(out),
                str(tp),
                str(pp),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
        )
        for rank in (0, 1)
    ]
    logs = []
    for node in nodes:
        try:
            logs.append(node.communicate(timeout=240)[0])
        except subprocess.TimeoutExpired:
            for n in nodes:
                n.kill()
            raise
    assert [n.returncode for n in nodes] == [0, 0], "\n---\n".join(logs)
    assert json.loads(out.read_text()) == single_process_tokens
