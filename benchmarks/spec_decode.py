"""Speculative decoding (n-gram prompt lookup) against plain decoding, side by side.

    python -m benchmarks.spec_decode               # the default model (SmolLM2-135M GGUF), CPU
    python -m benchmarks.spec_decode --k 3 5 --batch 1 8
    python -m benchmarks.spec_decode --k 3 --penalties '{"repetition_penalty": 1.05}'

Two workloads on the default chat model:
  repetitive  "copy / edit this text" chat prompts, greedy: the answer repeats most of the
              prompt (both runs emit the same tokens, so the comparison is of time alone)
  random      random token prompts, temperature 1.0 (seeded), ignore_eos: text no n-gram
              predicts, where speculation must switch itself off

`--penalties` adds repetition / frequency / presence penalties to every request (a chat
client's settings; written to spec_decode-penalties.json). For each (workload, batch size, k):
wall time, output tokens/s, target forwards (engine steps
that ran the model) per output token, acceptance rate, and the speedup over plain decoding
measured in the same run. Requests go in groups of `batch` (one group at a time).
"""

from __future__ import annotations

import argparse
import json
import random
import shlex
import sys
import time
from pathlib import Path

from benchmarks.common import environment, write_result

ROOT = Path(__file__).resolve().parent.parent

TEXTS = [
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + "
    "fibonacci(n - 2)\n\nfor i in range(10):\n    print(i, fibonacci(i))\n",
    "The quick brown fox jumps over the lazy dog. The dog sleeps in the sun all afternoon, "
    "and the fox runs back into the forest before the farmer comes home.",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):"
    "\n        self.items.append(item)\n\n    def pop(self):\n        return self.items.pop()\n",
    "Paris is the capital of France. It is known for the Eiffel Tower, the Louvre museum, "
    "and its cafes. Millions of tourists visit Paris every year to see its monuments.",
]
ASKS = [
    "Repeat the following text exactly, with no other words:\n\n{}",
    "Rename every variable to a longer name and return the whole text:\n\n{}",
]


def workloads(tokenizer, vocab: int, n: int) -> dict[str, list]:
    rng = random.Random(0)
    rep = []
    for i in range(n):
        msg = ASKS[i % len(ASKS)].format(TEXTS[i % len(TEXTS)])
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": msg}], add_generation_prompt=True, tokenize=False
        )
        rep.append({"prompt_token_ids": tokenizer.encode(text, add_special_tokens=False)})
    rnd = [
        {"prompt_token_ids": [rng.randrange(100, vocab - 1) for _ in range(64)]} for _ in range(n)
    ]
    return {"repetitive": rep, "random": rnd}


def run(llm, prompts: list, max_tokens: int, batch: int, sampled: bool, penalties: dict) -> dict:
    from paged_engine import SamplingParams

    if sampled:
        params = SamplingParams(
            temperature=1.0, seed=0, max_tokens=max_tokens, ignore_eos=True, **penalties
        )
    else:
        params = SamplingParams(temperature=0, max_tokens=max_tokens, **penalties)
    engine = llm.llm_engine
    steps0 = engine.scheduler._next_step_id
    stats0 = engine.get_stats()
    tokens, out_ids = 0, []
    t0 = time.perf_counter()
    for i in range(0, len(prompts), batch):
        outs = llm.generate(prompts[i : i + batch], params, use_tqdm=False)
        out_ids += [list(o.outputs[0].token_ids) for o in outs]
        tokens += sum(len(o.outputs[0].token_ids) for o in outs)
    elapsed = time.perf_counter() - t0
    stats = engine.get_stats()
    steps = engine.scheduler._next_step_id - steps0
    drafted = stats.spec_decode_num_draft_tokens - stats0.spec_decode_num_draft_tokens
    accepted = stats.spec_decode_num_accepted_tokens - stats0.spec_decode_num_accepted_tokens
    return {
        "elapsed_s": round(elapsed, 3),
        "output_tokens": tokens,
        "output_tokens_per_s": round(tokens / elapsed, 2),
        "forwards_per_output_token": round(steps / tokens, 3),
        "draft_tokens": drafted,
        "accepted_tokens": accepted,
        "acceptance_rate": round(accepted / drafted, 3) if drafted else None,
        "_ids": out_ids,
    }


def main(argv: list[str] | None = None) -> None:
    from paged_engine import LLM

    p = argparse.ArgumentParser(prog="python -m benchmarks.spec_decode", description=__doc__)
    p.add_argument("--model", default=None, help="default: the built-in SmolLM2-135M GGUF")
    p.add_argument("--k", type=int, nargs="+", default=[3, 5])
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    p.add_argument("--num-requests", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument(
        "--penalties", type=json.loads, default={}, help="e.g. '{\"repetition_penalty\": 1.05}'"
    )
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    given = argv if argv is not None else sys.argv[1:]
    name = "spec_decode-penalties.json" if args.penalties else "spec_decode.json"
    out = args.out or ROOT / "docs/benchmarks/cpu" / name
    engines = {"plain": LLM(model=args.model, max_model_len=1024)}
    for k in args.k:
        spec = {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": 4}
        engines[f"ngram k={k}"] = LLM(model=args.model, max_model_len=1024, speculative_config=spec)
    plain = engines["plain"]
    vocab = plain.llm_engine.vocab_size
    loads = workloads(plain.get_tokenizer(), vocab, args.num_requests)
    records = []
    for name, prompts in loads.items():
        for batch in args.batch:
            base = None
            for system, llm in engines.items():
                sampled = name == "random"
                r = run(llm, prompts, args.max_tokens, batch, sampled, args.penalties)
                if base is None:
                    base = r
                else:
                    r["speedup_vs_plain"] = round(base["elapsed_s"] / r["elapsed_s"], 3)
                    r["forward_reduction_vs_plain"] = round(
                        base["forwards_per_output_token"] / r["forwards_per_output_token"], 3
                    )
                    if name != "random":  # sampled: the same distribution, other draws
                        r["identical_tokens"] = r["_ids"] == base["_ids"]
                rec = {"workload": name, "batch": batch, "system": system}
                rec.update({k: v for k, v in r.items() if not k.startswith("_")})
                records.append(rec)
                print(rec, flush=True)
    result = {
        "benchmark": "spec_decode",
        "command": " ".join(["python -m benchmarks.spec_decode", *map(shlex.quote, given)]),
        "model": args.model or "SmolLM2-135M-Instruct (GGUF, built-in default)",
        "workload": f"{args.num_requests} requests per workload (repetitive: greedy; random: "
        f"temperature 1), max_tokens {args.max_tokens}, in groups of `batch`"
        + (f", every request with {args.penalties}" if args.penalties else ""),
        "environment": environment(str(plain.llm_engine.device.type)),
        "records": records,
    }
    write_result(out, result)


if __name__ == "__main__":
    main()
