"""Hostile input to three surfaces a client or a peer controls, kept as regressions.

Structured outputs (structured_output/grammar.py, llguidance_backend.py, params.py):
- llguidance builds a grammar by recursing over its rules in Rust: a Lark chain of 3000 rules
  or a JSON schema whose `$defs` chain 1000 deep overflowed an 8 MB thread stack and killed
  the process (SIGSEGV; the server with it). Builds and checks run on a 256 MB stack and a
  `grammar` is at most MAX_GRAMMAR_CHARS long, so the longest chain that fits is served.
- llguidance's GBNF-to-Lark conversion is quadratic in the rules (2000 rules: 2 s of CPU on
  the caller's thread; 50k rules: never ended): past MAX_GBNF_RULES, a ValueError at once.
- A schema nested past Python's recursion limit raised RecursionError, not a ValueError.
- A counted regex (`a{1000000}`) built its lexer in the engine's first step mask (0.75 s of a
  stalled step); the compile thread builds it now (the step's mask: ~0.2 s).
LoRA adapters (lora/adapter.py, lora/model.py): float8 weights raised NotImplementedError;
`lora_alpha: 1e308` was served, every token NaN-logit garbage; a tensor rank that is not the
config's r was served with PEFT's scale wrong; a 200 MB adapter_config.json was read whole.
KV-transfer block files (kv_transfer/storage.py, written by another process): a header of
nested JSON raised RecursionError in the scheduler's lookup; a huge file was read whole into
memory before its size was checked.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
import tracemalloc
from pathlib import Path

import pytest
import torch

from paged_engine.kv_transfer.storage import MAGIC, check_block, read_block
from paged_engine.structured_output.params import StructuredOutputsParams

pytest.importorskip("llguidance")

# The chains in a child process: before the fix they killed it with SIGSEGV.
_CHAINS = textwrap.dedent(
    """
    import itertools, string, sys
    from transformers import AutoTokenizer
    from paged_engine.structured_output.grammar import MAX_GRAMMAR_CHARS, grammar_text
    from paged_engine.structured_output.llguidance_backend import LLGuidanceBackend
    from paged_engine.structured_output.params import StructuredOutputsParams as P

    tok = AutoTokenizer.from_pretrained(sys.argv[1])
    backend = LLGuidanceBackend(tok, len(tok), [tok.eos_token_id])
    letters = string.ascii_lowercase
    names = ["".join(t) for k in (1, 2, 3) for t in itertools.product(letters, repeat=k)]

    def lark_chain(n):  # start -> a -> b -> ... : n rules deep
        rules = [f"{names[i]}:{names[i + 1]}" for i in range(n)]
        return "\\n".join([f"start: {names[0]}", *rules, f'{names[n]}:"y"'])

    n = 3000
    while len(lark_chain(n + 500)) <= MAX_GRAMMAR_CHARS:
        n += 500
    defs = {f"d{i}": {"type": "object", "properties": {"a": {"$ref": f"#/$defs/d{i + 1}"}},
                      "required": ["a"]} for i in range(2000)}
    defs["d2000"] = {"type": "string"}
    for params in (P(grammar=lark_chain(n)), P(json={"$defs": defs, "$ref": "#/$defs/d0"})):
        backend.compile(grammar_text(params))
        print("compiled", params.kind, flush=True)
    """
)


def test_deep_rule_chains_compile_without_killing_the_process(tiny_llama_dir: Path) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run(
        [sys.executable, "-c", _CHAINS, str(tiny_llama_dir)],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
    assert done.stdout.split("\n")[:2] == ["compiled grammar", "compiled json"], done.stdout


def _grammar_error(**kw) -> tuple[str, float]:
    from paged_engine.structured_output.grammar import grammar_text

    t0 = time.process_time()
    with pytest.raises(ValueError, match=r"structured_outputs\.") as info:
        grammar_text(StructuredOutputsParams(**kw))
    return str(info.value), time.process_time() - t0


def test_grammar_size_and_gbnf_rules_are_bounded() -> None:
    from paged_engine.structured_output.grammar import MAX_GBNF_RULES, MAX_GRAMMAR_CHARS

    n = MAX_GBNF_RULES  # root + n rules: one past the bound
    rules = [f'r{i} ::= "x" r{i + 1}' for i in range(n - 1)]
    gbnf = "\n".join(["root ::= r0", *rules, f'r{n - 1} ::= "y"'])
    msg, cpu = _grammar_error(grammar=gbnf)
    assert f"at most {MAX_GBNF_RULES} GBNF rules" in msg and cpu < 0.1, (msg, cpu)
    msg, cpu = _grammar_error(grammar='start: "a"\n' + "// pad\n" * (MAX_GRAMMAR_CHARS // 7))
    assert f"at most {MAX_GRAMMAR_CHARS} characters" in msg and cpu < 0.1, (msg, cpu)


def test_a_schema_nested_past_pythons_limit_is_a_value_error() -> None:
    deep: dict = {"type": "string"}
    for _ in range(sys.getrecursionlimit() + 100):
        deep = {"type": "array", "items": deep}
    for schema in (deep, "[" * 100_000):
        with pytest.raises(ValueError, match=r"structured_outputs\.json is nested too deeply"):
            StructuredOutputsParams(json=schema)


def test_a_counted_regex_builds_its_lexer_off_the_step_thread(tiny_llama_dir: Path) -> None:
    from transformers import AutoTokenizer

    from paged_engine.structured_output.bitmask import allocate_bitmask
    from paged_engine.structured_output.grammar import grammar_text
    from paged_engine.structured_output.llguidance_backend import LLGuidanceBackend

    tok = AutoTokenizer.from_pretrained(tiny_llama_dir)
    backend = LLGuidanceBackend(tok, len(tok), [tok.eos_token_id])
    text = grammar_text(StructuredOutputsParams(regex="a{10000}"))  # (1e6: refused now)
    t0 = time.process_time()  # CPU time of every thread (llguidance's pool too): load-proof
    template = backend.compile(text)
    compile_cpu = time.process_time() - t0
    bitmask = allocate_bitmask(1, len(tok))
    t0 = time.process_time()
    backend.fill_bitmasks([(template.copy(), 0)], bitmask)  # what the engine's step does
    step_cpu = time.process_time() - t0
    # The lexer (~0.35 s of CPU here) is built by compile, not by the step's first mask
    # (measured: compile 0.37 / step 0.08 s; with the step building it, 0.003 / 0.35 s).
    assert step_cpu < compile_cpu, (compile_cpu, step_cpu)


@pytest.fixture(scope="module")
def lora_llm(tiny_llama_dir: Path):
    from paged_engine import LLM

    llm = LLM(str(tiny_llama_dir), dtype="float32", max_model_len=64, enable_lora=True,
              max_lora_rank=8)  # fmt: skip
    yield llm
    llm.llm_engine.shutdown()


def _bad_adapters(model: Path, root: Path) -> dict[str, tuple[Path, str]]:
    """name -> (adapter dir, a fragment of its ValueError)."""
    from safetensors.torch import load_file, save_file

    from paged_engine.testing import write_lora_adapter

    def adapter(name: str, cfg: dict | None = None, dtype: torch.dtype | None = None) -> Path:
        path = write_lora_adapter(root / name, model, rank=2, seed=1)
        if cfg is not None:
            old = json.loads((path / "adapter_config.json").read_text())
            (path / "adapter_config.json").write_text(json.dumps({**old, **cfg}))
        if dtype is not None:
            st = str(path / "adapter_model.safetensors")
            save_file({k: t.to(dtype) for k, t in load_file(st).items()}, st)
        return path

    huge = adapter("huge-config")
    with open(huge / "adapter_config.json", "a") as f:
        f.truncate(8 << 20)  # sparse: 8 MB of NULs after the JSON
    deep = adapter("deep-config")
    (deep / "adapter_config.json").write_text("[" * 100_000)
    return {
        "float8": (adapter("f8", dtype=torch.float8_e4m3fn), "float8_e4m3fn"),
        "alpha overflow": (adapter("alpha", {"lora_alpha": 1e308}), "overflow"),
        "rank vs r": (adapter("rank", {"r": 4}), "adapter_config.json r=4"),
        "huge config": (huge, "more than a config holds"),
        "deep config": (deep, "unreadable"),
    }


def test_more_bad_adapters_are_refused_and_the_engine_keeps_serving(
    lora_llm, tiny_llama_dir: Path, tmp_path: Path
) -> None:
    from paged_engine import LoRARequest, SamplingParams

    greedy = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    engine = lora_llm.llm_engine
    for k, (name, (path, fragment)) in enumerate(_bad_adapters(tiny_llama_dir, tmp_path).items()):
        lora = LoRARequest(name.replace(" ", "-"), 100 + k, str(path))
        with pytest.raises(ValueError, match="lora_request") as info:
            lora_llm.generate([[5, 6, 7]], greedy, lora_request=lora, use_tqdm=False)
        assert fragment in str(info.value), (name, str(info.value))
        assert 100 + k not in engine.list_loras()
    assert engine.scheduler.num_waiting == 0 and engine.scheduler.num_running == 0
    good = LoRARequest("good", 1, str(tmp_path / "good"))
    from paged_engine.testing import write_lora_adapter

    write_lora_adapter(good.lora_path, tiny_llama_dir, rank=2, seed=1)
    outs = lora_llm.generate([[5, 6, 7]] * 2, greedy, lora_request=[good, None], use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [4, 4]


SPEC = [("k0", "float32", (4, 2, 8)), ("v0", "float32", (4, 2, 8))]


def _block_file(path: Path, header: bytes, body_bytes: int) -> None:
    with open(path, "wb") as f:
        f.write(MAGIC + len(header).to_bytes(8, "little") + header)
        f.truncate(f.tell() + body_bytes)  # sparse


def test_block_files_a_peer_wrote_badly_are_misses(tmp_path: Path) -> None:
    nbytes = 2 * 4 * 2 * 8 * 4
    path = tmp_path / "k.tp0of1.kv"
    good = json.dumps({"key": "k", "tensors": [[n, d, list(s)] for n, d, s in SPEC]}).encode()
    _block_file(path, good, nbytes)
    assert check_block(str(path), "k", SPEC) and read_block(str(path), "k", SPEC) is not None
    _block_file(path, b"[" * 100_000, nbytes)  # nested past Python's recursion limit
    assert not check_block(str(path), "k", SPEC) and read_block(str(path), "k", SPEC) is None
    with open(path, "wb") as f:  # a header length of 2**62
        f.write(MAGIC + (1 << 62).to_bytes(8, "little") + b"{}")
    assert not check_block(str(path), "k", SPEC) and read_block(str(path), "k", SPEC) is None
    _block_file(path, good, 64 << 20)  # 64 MB past the block: never read
    tracemalloc.start()
    try:
        assert read_block(str(path), "k", SPEC) is None and not check_block(str(path), "k", SPEC)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20, peak
