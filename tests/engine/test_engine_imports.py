"""What an engine process imports. README command 1 installs no Pillow (images are the
`images` extra): the engine and the server must import and generate without it. A module that
imports PIL at its top, reachable from the engine's start (video_archs -> a family's video
processor), broke `paged-server` on a fresh machine while every other test, run with Pillow
installed, passed."""

from __future__ import annotations

from no_triton import run_python

BLOCK_PIL = """\
import sys


class _NoPIL:
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] == "PIL":
            raise ModuleNotFoundError(f"No module named {name!r} (blocked by the test)", name=name)
        return None


sys.meta_path.insert(0, _NoPIL())
"""


def test_engine_and_server_run_without_pillow(tmp_path) -> None:
    out = run_python(
        BLOCK_PIL
        + f"""
from paged_engine import LLM, SamplingParams
from paged_engine.testing import write_tiny_model
import paged_server.app, paged_server.cli  # the server's modules, as paged-server loads them

path = write_tiny_model({str(tmp_path)!r}, "llama", seed=0)
llm = LLM(str(path), dtype="float32")
(out,) = llm.generate([{{"prompt_token_ids": [5, 6, 7]}}], SamplingParams(max_tokens=3))
print(len(out.outputs[0].token_ids), "PIL" in sys.modules)
""",
        block_triton=False,
    )
    assert out.split()[-2:] == ["3", "False"], out


def test_importing_the_engine_loads_no_transformers_modeling_code() -> None:
    """The engine's import builds model classes (models/base_model.py `headless`) but must not
    import transformers' modeling modules: a causal class pulls masking_utils and torch._dynamo,
    ~1.4 s added to every process start (each TP rank, every server) for nothing."""
    out = run_python(
        """
import sys
import paged_engine.engine.llm_engine, paged_server.app
modeling = [m for m in sys.modules if m.startswith("transformers.models.") and ".modeling_" in m]
print(sorted(m for m in modeling if not m.startswith("transformers.models.auto.")))  # (maps)
print("transformers.masking_utils" in sys.modules)
""",
        block_triton=False,
    )
    assert out.split("\n")[:2] == ["[]", "False"], out
