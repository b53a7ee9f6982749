"""Run under torchrun: every rank runs this same script (as on every node of a cluster).

    torchrun --nnodes 2 --nproc-per-node 1 --node-rank R --master-addr A --master-port P \
        torchrun_generate.py MODEL OUT.json TP PP

Rank 0 builds the engine and writes the greedy tokens of fixed prompts to OUT.json; in every
other rank `LLM(...)` serves rank 0's engine and ends the process when rank 0 shuts down.
`run_two_nodes` launches it the way the tests do.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from paged_engine import LLM, SamplingParams
from paged_engine.distributed.launch import free_port

PROMPTS = [[5, 6, 7, 8], [100, 3, 42], list(range(10, 40))]


def main() -> None:
    model, out, tp, pp = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    llm = LLM(
        model=model,
        dtype="float32",
        max_model_len=128,
        tensor_parallel_size=tp,
        pipeline_parallel_size=pp,
    )
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    Path(out).write_text(json.dumps([list(o.outputs[0].token_ids) for o in outs]))
    llm.llm_engine.shutdown()


def run_two_nodes(
    model: str, out: str, tp: int, pp: int, timeout: float
) -> tuple[list[int], list[str]]:
    """Two torchrun "nodes" of one rank each on localhost (static rendezvous) running this
    script: their exit codes and output. Both are killed on the way out; a node still running
    after `timeout` raises subprocess.TimeoutExpired."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    launch = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2"]
    launch += ["--nproc-per-node", "1", "--master-addr", "127.0.0.1"]
    launch += ["--master-port", str(free_port())]
    args = [str(Path(__file__)), model, out, str(tp), str(pp)]
    nodes = [
        subprocess.Popen(
            [*launch, "--node-rank", str(rank), *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
        )
        for rank in (0, 1)
    ]
    try:
        logs = [node.communicate(timeout=timeout)[0] for node in nodes]
    finally:
        for node in nodes:
            node.kill()
    return [node.returncode for node in nodes], logs


if __name__ == "__main__":
    main()
