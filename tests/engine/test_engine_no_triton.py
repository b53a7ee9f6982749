"""The engine's CPU path (torch attention backend) runs where triton is not installed.

Greedy generation in a fresh interpreter with triton blocked (tests/no_triton.py) must give the
tokens of the same run with triton importable.
"""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

from no_triton import run_python

from paged_engine.testing import write_tiny_model

GENERATE = """
import json
import sys

from paged_engine import LLM, SamplingParams

llm = LLM(model={model!r}, device="cpu", attention_backend="torch", dtype="float32")
params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
prompts = [{{"prompt_token_ids": [5, 17, 42, 9]}}, "hello world"]
outputs = llm.generate(prompts, params, use_tqdm=False)
print(json.dumps([list(out.outputs[0].token_ids) for out in outputs]))
"""


def test_cpu_generation_without_triton(tmp_path: Path):
    model = str(write_tiny_model(tmp_path / "llama", "llama"))
    code = GENERATE.format(model=model)
    without = json.loads(run_python(code, block_triton=True))
    # The same run with triton importable: in this process (triton is not blocked here), which
    # saves a second interpreter's start.
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(code, {})
    with_triton = json.loads(printed.getvalue())
    assert [len(tokens) for tokens in without] == [6, 6]
    assert without == with_triton
