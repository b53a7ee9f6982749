"""How close an fp8 KV cache stays to the float one: teacher-forced argmax agreement and
logprob differences, per architecture and with calibrated scales vs scales of 1.0.

    python -m benchmarks.fp8_accuracy     # writes docs/benchmarks/cpu/fp8_accuracy.json

For each model: greedy outputs (`--tokens` each) of the float32 cache for `--prompts` prompts,
then every output position re-scored by an fp8 engine given the float32 outputs as its prompt
(teacher forcing). Agreement = positions whose fp8 argmax is the float32 token; |dlogprob| = the
difference of that token's logprob. Models: the 7 tiny random-weight architectures (random
token prompts) and, with `--real`, the default model (SmolLM2-135M-Instruct Q4_1, float32
compute; English and code prompts). "unit" runs skip `init_kv_scales` (every scale 1.0, what
the engine did before scales existed): the difference is what the scales buy.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
from pathlib import Path

from benchmarks.common import environment

ROOT = Path(__file__).resolve().parent.parent
REAL_PROMPTS = [
    "The history of the Roman Empire begins with",
    "Photosynthesis is the process by which plants",
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
    "The three primary colors are",
    "In 1969, the Apollo 11 mission",
    "To make a cup of tea, first",
    "The capital of Japan is Tokyo, and the capital of France is",
    "Water boils at 100 degrees Celsius at sea level because",
    "A list of the planets in the solar system: Mercury, Venus,",
    "Machine learning models are trained by",
    "Once upon a time, in a small village by the sea,",
    "The main difference between a virus and a bacterium is",
]


def _greedy(llm, prompts, tokens: int):
    from paged_engine import SamplingParams

    sp = SamplingParams(temperature=0, max_tokens=tokens, logprobs=0, ignore_eos=True)
    out = []
    for o in llm.generate(prompts, sp, use_tqdm=False):
        c = o.outputs[0]
        lps = [lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs)]
        out.append((list(o.prompt_token_ids), list(c.token_ids), lps))
    return out


def _rescore(llm, ref) -> dict:
    from paged_engine import SamplingParams

    full = [{"prompt_token_ids": p + o} for p, o, _ in ref]
    outs = llm.generate(full, SamplingParams(max_tokens=1, prompt_logprobs=1), use_tqdm=False)
    agree, diffs = 0, []
    for (p, o, lps), out in zip(ref, outs):
        for j, (token, lp) in enumerate(zip(o, lps)):
            got = out.prompt_logprobs[len(p) + j][token]
            agree += got.rank == 1
            diffs.append(abs(got.logprob - lp))
    return {
        "agree": agree,
        "positions": len(diffs),
        "agreement": round(agree / len(diffs), 4),
        "dlogprob_mean": round(statistics.mean(diffs), 4),
        "dlogprob_max": round(max(diffs), 3),
    }


def measure(make_llm, prompts, tokens: int, kv_dtypes: list[str]) -> dict:
    """{"<kv>/<calibrated|unit>": metrics} for one model."""
    import paged_engine.worker.worker as worker_mod
    from paged_engine.worker.kv_scales import attention_layers

    llm = make_llm("auto")
    ref = _greedy(llm, prompts, tokens)
    llm.llm_engine.shutdown()
    calibrate = worker_mod.init_kv_scales
    out = {}
    for kv in kv_dtypes:
        for mode in ("calibrated", "unit"):
            if mode == "unit":  # the engine as it was before scales: every scale 1.0
                worker_mod.init_kv_scales = lambda runner: None
            try:
                llm = make_llm(kv)
            finally:
                worker_mod.init_kv_scales = calibrate
            layers = attention_layers(llm.llm_engine.model_runner.model).values()
            metrics = _rescore(llm, ref)
            metrics["k_scale_range"] = [
                min(a.k_scale for a in layers),
                max(a.k_scale for a in layers),
            ]
            metrics["v_scale_range"] = [
                min(a.v_scale for a in layers),
                max(a.v_scale for a in layers),
            ]
            llm.llm_engine.shutdown()
            out[f"{kv}/{mode}"] = metrics
            print(kv, mode, metrics, flush=True)
    return out


def main(argv: list[str] | None = None) -> dict:
    from paged_engine import LLM
    from paged_engine.testing import SUPPORTED_TINY_ARCHS, write_tiny_model

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--prompts", type=int, default=30, help="tiny models: random prompts")
    p.add_argument("--tokens", type=int, default=24)
    p.add_argument("--kv", default="fp8,fp8_e5m2")
    p.add_argument("--real", action="store_true", help="also the default model (SmolLM2-135M)")
    p.add_argument("--archs", default=",".join(SUPPORTED_TINY_ARCHS))
    p.add_argument("--out", default=str(ROOT / "docs/benchmarks/cpu/fp8_accuracy.json"))
    args = p.parse_args(argv)
    kv_dtypes = args.kv.split(",")
    rng = random.Random(0)
    prompts = [
        {"prompt_token_ids": [rng.randrange(3, 500) for _ in range(rng.randrange(5, 60))]}
        for _ in range(args.prompts)
    ]
    models = {}
    with tempfile.TemporaryDirectory() as tmp:
        for arch in args.archs.split(","):
            path = write_tiny_model(Path(tmp) / arch, arch)

            def make(kv, path=path):
                return LLM(model=str(path), dtype="float32", max_model_len=256,
                           kv_cache_dtype=kv, cpu_kv_cache_gib=2**-6)  # fmt: skip

            print(arch, flush=True)
            models[arch] = measure(make, prompts, args.tokens, kv_dtypes)
    if args.real:

        def make_real(kv):
            return LLM(model="SmolLM2-135M-Instruct", max_model_len=512, kv_cache_dtype=kv,
                       cpu_kv_cache_gib=0.25)  # fmt: skip

        models["SmolLM2-135M-Instruct (Q4_1 GGUF, float32)"] = measure(
            make_real, REAL_PROMPTS, 32, kv_dtypes
        )
    tiny = [m for name, m in models.items() if name in SUPPORTED_TINY_ARCHS]
    summary = {}
    for key in tiny[0] if tiny else []:
        agree = sum(m[key]["agree"] for m in tiny)
        total = sum(m[key]["positions"] for m in tiny)
        summary[key] = {
            "agreement": round(agree / total, 4),
            "worst_architecture": min(m[key]["agreement"] for m in tiny),
            "dlogprob_mean": round(
                sum(m[key]["dlogprob_mean"] * m[key]["positions"] for m in tiny) / total, 4
            ),
            "dlogprob_max": max(m[key]["dlogprob_max"] for m in tiny),
        }
    result = {
        "command": "python -m benchmarks.fp8_accuracy " + " ".join(argv or []),
        "environment": environment("cpu"),
        "recipe": f"tiny models: {args.prompts} random prompts x {args.tokens} greedy tokens "
        "(float32 model and cache), re-scored by the fp8 engine (teacher forcing); default "
        "attention backend",
        "tiny_architectures": summary,
        "models": models,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(summary, indent=2))
    return result


if __name__ == "__main__":
    main()
