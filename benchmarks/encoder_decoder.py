"""BART summarization-shaped generation on a CPU: prompt and output tokens/s, encoder share.

    python -m benchmarks.encoder_decoder                 # bart-base shape, 32 prompts of 200-400
    python -m benchmarks.encoder_decoder --d-model 256 --layers 2 --heads 4 --prompts 16
    python -m benchmarks.encoder_decoder --device cuda --repeats 5

Model: a random-weight `BartForConditionalGeneration` written by transformers (bart-base's
shape by default: d_model 768, 6 encoder + 6 decoder layers, 12 heads, FFN 3072, 1024
positions; a tiny vocabulary, so the head costs next to nothing and the encoder / decoder
layers are what is timed). Workload: `--prompts` encoder prompts of `--min-len` to `--max-len`
random ids (seeded), the default decoder prompt, greedy `--max-tokens` answers (ignore_eos),
all in one `LLM.generate` call. After one warm-up call, each of `--repeats` timed calls gives
wall time, CPU time of the process (`time.process_time`: every thread's, the number to compare
on a loaded machine), prompt (encoder) tokens/s, output tokens/s, and the encoder's wall and
CPU seconds and its share of the wall time: the time spent inside
`BartForConditionalGeneration.encode_cross` (the encoder stack and each decoder layer's cross
K / V projection), measured by wrapping it. Medians of the repeats are printed and written
with the command.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import torch

from benchmarks.common import environment, write_result

ROOT = Path(__file__).resolve().parent.parent


def write_bart(path: Path, args) -> Path:
    """A random BART of the asked shape at `path` (reused where it is there already)."""
    if (path / "config.json").exists():
        return path
    import transformers

    from paged_engine.testing import BOS_ID, EOS_ID, PAD_ID, _quiet_progress, build_tiny_tokenizer

    tokenizer = build_tiny_tokenizer(args.vocab, 0)
    config = transformers.BartConfig(
        vocab_size=len(tokenizer),
        d_model=args.d_model,
        encoder_layers=args.layers,
        decoder_layers=args.layers,
        encoder_attention_heads=args.heads,
        decoder_attention_heads=args.heads,
        encoder_ffn_dim=4 * args.d_model,
        decoder_ffn_dim=4 * args.d_model,
        max_position_embeddings=args.max_positions,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
        decoder_start_token_id=EOS_ID,
        forced_eos_token_id=None,
        architectures=["BartForConditionalGeneration"],
    )
    torch.manual_seed(0)
    model = transformers.BartForConditionalGeneration(config)
    with _quiet_progress():
        model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


class EncoderClock:
    """Wall and CPU seconds spent inside `encode_cross` (a generator: each step is timed)."""

    def __init__(self) -> None:
        from paged_engine.models.bart import BartForConditionalGeneration

        self.cls, self.seconds, self.cpu_seconds = BartForConditionalGeneration, 0.0, 0.0
        self.original = self.cls.encode_cross
        clock = self

        def timed(model, payloads) -> Iterator[tuple[torch.Tensor, ...]]:
            gen = clock.original(model, payloads)
            while True:
                t0, c0 = time.perf_counter(), time.process_time()
                try:
                    item = next(gen)
                except StopIteration:
                    return
                finally:
                    clock.seconds += time.perf_counter() - t0
                    clock.cpu_seconds += time.process_time() - c0
                yield item

        self.cls.encode_cross = timed  # type: ignore[method-assign]

    def close(self) -> None:
        self.cls.encode_cross = self.original  # type: ignore[method-assign]


def run_once(llm, prompts: list[list[int]], max_tokens: int, clock: EncoderClock) -> dict:
    from paged_engine import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    clock.seconds = clock.cpu_seconds = 0.0
    t0, c0 = time.perf_counter(), time.process_time()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    out_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return {
        "wall_s": wall,
        "cpu_s": cpu,
        "prompt_tokens_per_s": sum(map(len, prompts)) / wall,
        "output_tokens_per_s": out_tokens / wall,
        "encoder_s": clock.seconds,
        "encoder_share": clock.seconds / wall,
        "encoder_cpu_s": clock.cpu_seconds,
        "_tokens": [list(o.outputs[0].token_ids) for o in outs],
    }


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(prog="python -m benchmarks.encoder_decoder", description=__doc__)
    p.add_argument("--d-model", type=int, default=768)
    p.add_argument("--layers", type=int, default=6, help="encoder layers = decoder layers")
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--max-positions", type=int, default=1024)
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--min-len", type=int, default=200)
    p.add_argument("--max-len", type=int, default=400)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=0, help="torch threads; 0: torch's default")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument("--work-dir", type=Path, default=None, help="keeps the checkpoint")
    p.add_argument("--out", type=Path, default=None, help="JSON record; none when not given")
    args = p.parse_args(argv)
    from paged_engine import LLM

    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.threads:
        torch.set_num_threads(args.threads)
    rng = random.Random(0)
    lengths = [rng.randint(args.min_len, args.max_len) for _ in range(args.prompts)]
    prompts = [[rng.randrange(3, args.vocab) for _ in range(n)] for n in lengths]
    shape = f"d{args.d_model}-l{args.layers}-h{args.heads}-v{args.vocab}-p{args.max_positions}"
    with tempfile.TemporaryDirectory() as tmp:
        path = write_bart((args.work_dir or Path(tmp)) / f"bart-{shape}", args)
        clock = EncoderClock()  # before the engine binds encode_cross
        try:
            # max_num_seqs: the cross-attention pool holds that many slots of max_positions rows
            llm = LLM(model=str(path), dtype="float32", device=device, max_num_seqs=args.prompts)
            run_once(llm, prompts[:2], 2, clock)  # warm-up: first calls, allocator
            runs = [run_once(llm, prompts, args.max_tokens, clock) for _ in range(args.repeats)]
        finally:
            clock.close()
        del llm
    median = {k: statistics.median(r[k] for r in runs) for k in runs[0] if not k.startswith("_")}
    result = {
        "benchmark": "encoder_decoder",
        "command": " ".join(["python -m benchmarks.encoder_decoder", *(argv or sys.argv[1:])]),
        "model": f"random BartForConditionalGeneration {shape}, float32",
        "workload": f"{args.prompts} encoder prompts of {args.min_len}-{args.max_len} ids "
        f"({sum(lengths)} in all), greedy answers of {args.max_tokens} tokens (ignore_eos), "
        "one LLM.generate call",
        "environment": environment(device) | {"torch_threads": torch.get_num_threads()},
        "median": {k: round(v, 4) for k, v in median.items()},
        "runs": [{k: round(v, 4) for k, v in r.items() if not k.startswith("_")} for r in runs],
        "same_tokens_each_run": all(r["_tokens"] == runs[0]["_tokens"] for r in runs),
    }
    m = result["median"]
    print(
        f"median of {args.repeats}: wall {m['wall_s']:.3f} s, cpu {m['cpu_s']:.3f} s, "
        f"prompt {m['prompt_tokens_per_s']:.1f} tok/s, output {m['output_tokens_per_s']:.2f} "
        f"tok/s, encoder {m['encoder_s']:.3f} s ({100 * m['encoder_share']:.1f}% of wall, "
        f"cpu {m['encoder_cpu_s']:.3f} s)",
        flush=True,
    )
    if args.out is not None:
        write_result(args.out, result)
    return result


if __name__ == "__main__":
    main()
