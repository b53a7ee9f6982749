#!/usr/bin/env bash
# Issue 14's GPU runs, each phase one device call of under 10 minutes (the device tool's limit).
#
#   bash benchmarks/gpu_wheels.sh          # here, once: the packages the GPU image lacks -> .whl/
#   device run (carry [".whl"]):  bash benchmarks/gpu_run.sh phase1
#   device run:                   bash benchmarks/gpu_run.sh diag | final | next | next3
#   device run (carry [".whl-tf"]): bash benchmarks/gpu_run.sh next2 | next4 | next5
#   device run (carry [".whl"]):  bash benchmarks/gpu_run.sh phase2
#   device run:                   bash benchmarks/gpu_run.sh phase3
#   device run:                   bash benchmarks/gpu_run.sh phase4
#   device run:                   bash benchmarks/gpu_run.sh phase5
#   device run:                   bash benchmarks/gpu_run.sh phase6
#   device run:                   bash benchmarks/gpu_run.sh phase7
#   device run:                   bash benchmarks/gpu_run.sh phase8
#   device run:                   bash benchmarks/gpu_run.sh phase9
#   device run:                   bash benchmarks/gpu_run.sh int4
#   device run:                   bash benchmarks/gpu_run.sh audio
#   bash benchmarks/gpu_run.sh rehearse    # on the CPU machine: every step, tiny sizes, same code
#
# phase1: versions and GPU; every kernel test natively; decode-kernel benchmark (vs copy bandwidth and
#         SDPA); the nano-vllm workload on the Qwen3-0.6B config (bf16, seeded random weights)
#         through paged, HF generate and HF continuous batching (the peers on the first 64
#         requests: the whole workload outlasts the call) in one run; a torch-profiler
#         summary at batch 256 (top kernels, host ms per step, GPU idle fraction, engine start).
# diag:   where a batch-256 step's host time goes (cProfile, CUDA runtime calls, sync points) and
#         the engine start's first seconds (imports, config, tokenizer).
# final:  the first GPU session's last call: native tests, kernel_bench --split-sweep,
#         gpu_profile with torch-op norms against the Triton kernel, nano-vllm vs HF continuous.
# next:   what that session left open, and the fused layer epilogues (rope, add + norm, gated
#         SiLU) that came after it: engine and fused-layer tests natively, one engine at a time;
#         gpu_profile at batch 256 with final outputs only (as LLM.generate), fused against
#         --unfused on one machine; the nano-vllm workload against HF continuous batching on
#         16 requests.
# next2:  decode attention's tile sweep (kernel_bench --tile-sweep); gpu_profile at batch 64
#         (two splits in the graphs); the engine start's config step with the image's
#         transformers and a carried 5.21; HF continuous batching with its graphs forced on.
# next3:  after next and next2: the engine tests natively again, the full kernel bench and the
#         batch-256 profile with the decode tile next2's sweep chose, the nano-vllm workload
#         through paged alone.
# next4:  the slow first prefill (3.3 s cold against 0.2-1.2 s later on the same machine):
#         gpu_profile twice on one fresh Triton cache (jit_builds: the kernels each phase
#         built; the prefill's Python functions); the sampler's race kernel against torch's
#         (gpu_profile --torch-sampler, kernel_bench's sampler_race); the split sweep under
#         the new decode tile; nano-vllm on the warm cache; the sampler and engine tests with
#         transformers 5.21 (engines start ~8 s sooner), sleep mode's among them (CUDA graphs
#         captured again after a wake-up, pinned host copies).
# next5:  after the H200 session: the cold prefill's kernel builds (none expected now), the engine
#         tests natively (lazy block pool, the tests' GPU mends), kernel_bench and the split
#         sweep timed by CUDA-graph replay, MLA decode's tile / split sweep, nano-vllm on the
#         warm cache; the rope kernel's fused KV write natively (~570 s of step limits).
# phase2: engine tests natively; the fixed-length workload (1000 x 1024 in / 128 out); serving
#         under Poisson load; the nano-vllm workload on Llama-3.1-8B (paged vs HF static).
# phase3: issue 13's KV memory (benchmarks/kv_memory.py) in bf16 on a random llama: a bf16 vs
#         fp8 / fp8_e5m2 KV cache at one KV budget (blocks, most sequences running at once,
#         preemptions, output tok/s), swap vs recompute preemption on a small pool, the
#         prefix cache's CPU tier in a multi-turn chat. Then issue 12's batch-invariant mode
#         natively: its GPU-marked tests (kernels' rows vs any batch, engine logprobs bit for bit
#         among 1-64 others, bf16, CUDA graphs) and its cost (benchmarks/batch_invariant.py:
#         plain vs batch-invariant engine on the nano-vllm workload, Qwen3-0.6B config; the
#         kernel-level costs are in phase1's kernel bench). Last, what multi-LoRA costs
#         (benchmarks/lora.py: base vs enable_lora unused vs 1 / 4 rank-16 adapters, 4 adapters
#         on 2 slots; nano-vllm workload, Qwen3-0.6B config, bf16, greedy, CUDA graphs).
# phase4: a mixture-of-experts model, the Qwen3-30B-A3B config (61 GB of bf16 dummy weights):
#         the Triton MoE kernel's GPU-marked tests, then gpu_profile at batch 64 with CUDA
#         graphs and eager (decode tok/s, top kernels, host time, GPU idle, engine start).
# phase5: gpt-oss-20b's config (attention with sinks, a MoE in every layer): the attention and
#         MoE kernels' GPU-marked tests, then gpu_profile at batch 64 with CUDA graphs, its
#         experts dense bf16 (42 GB in all) and MXFP4 as its release ships them (~13 GB).
# phase6: weight-only FP8 (`quantization="fp8"`): the fp8 GEMM's GPU-marked tests, then
#         gpu_profile on the Llama-3.1-8B config at batch 64, bf16 weights against FP8 ones.
# phase7: FP8 experts: the MoE kernel's GPU-marked tests, then gpu_profile on Qwen3-30B-A3B's
#         config at batch 64 with quantization="fp8" (~31 GB; phase4 ran it in bf16).
# phase8: multi-head latent attention, DeepSeek-V2-Lite's config (~31 GB of bf16 dummy weights,
#         a 576-entry latent cache a token and layer): mla_attention's GPU-marked tests, then
#         gpu_profile at batch 64 with CUDA graphs and eager (phase1's kernel bench has the
#         kernel alone, `mla_decode`).
# phase9: hybrid linear attention, Qwen3.5-27B's text config (~54 GB of bf16 dummy weights; 48
#         Gated DeltaNet layers with a float32 state of ~154 MB a sequence, 16 full-attention
#         layers): the linear-attention kernels' GPU-marked tests, then gpu_profile at batch 32
#         (max_num_seqs 32: the state pool) with CUDA graphs and eager; prefix caching from
#         state snapshots (benchmarks/prefix_cache.py: Qwen3.5, LFM2 and Qwen3 at hidden 1024,
#         16 layers, 64 chats sharing a system prompt) on or off, its answers compared; the
#         same for the state-space models (Mamba, Mamba2 without KV; Jamba) and the
#         selective_scan kernel's GPU-marked tests.
# int4:   4-bit weights (quantization="int4"; 4-bit GPTQ / AWQ / W4A16 checkpoints keep their
#         codes in the same layout): int4_linear's and the MoE kernel's GPU-marked tests, the
#         packed-checkpoint engine tests natively, then
#         gpu_profile on Llama-3.1-8B's config at batch 1 and 64, bf16 weights against int4
#         (phase6 has the fp8 side).
# audio:  the audio paths against HF transformers (benchmarks/audio.py, bf16, seeded random
#         weights): whisper-large-v3's config, 64 clips of 10-30 s transcribed greedily, 100
#         tokens each, paged vs WhisperForConditionalGeneration.generate batched, and its
#         encoder alone; then Qwen2-Audio-7B's config (17 GB), 64 clips through LLM.generate vs
#         HF generate. Not yet run.
# Results land in $OUT (the device tool brings them back; at most 8 files, 2 folders deep):
# copy them to docs/benchmarks/<device slug>/ and run `python -m benchmarks.report`.
# Every step has its own time limit, so a slow or hung step costs only its own budget.
set -uo pipefail
cd "$(dirname "$0")/.."
PHASE=${1:-phase1}
OUT=${OUT:-$PWD/bench-out/gpu-run}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
export PYTHONPATH="$PWD/packages/paged-kernels/src:$PWD/packages/paged-engine/src:$PWD/packages/paged-server/src:$PWD${PYTHONPATH:+:$PYTHONPATH}"
if [ "$PHASE" != rehearse ] && [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi
PY=${PY:-python3}
MXFP4='{"quantization_config": {"quant_method": "mxfp4"}}'  # gpt-oss's experts kept in MXFP4
HYBRID_SMOKE='{"num_hidden_layers": 4, "hidden_size": 512, "intermediate_size": 1024, "vocab_size": 4096}'
# the rehearsal's Qwen3-30B-A3B: 16 narrower experts (its 128 at full width are ~4.8 GB of float32 a
# layer pair on the CPU); the vocabulary stays, as the config dir's tokenizer was written for it
MOE_SMOKE='{"num_experts": 16, "moe_intermediate_size": 256, "hidden_size": 512, "intermediate_size": 1024}'
LOG="$OUT/log.txt"
T0=$(date +%s)

step() {  # step SECONDS NAME CMD...: run with a limit, log the outcome, never abort the phase
  local limit=$1 name=$2 from
  shift 2
  echo "=== [$(($(date +%s) - T0))s] $name (limit ${limit}s): $*" | tee -a "$LOG"
  # straight into the log: a call the device's 10 minutes cut keeps the step's output so far
  from=$(($(stat -c %s "$LOG") + 1))
  timeout -k 10 "$limit" bash -c '"$@"' _ "$@" >>"$LOG" 2>&1
  local rc=$?
  tail -c +"$from" "$LOG" | grep -E "passed|failed|rror|tok/s|goal|idle|start_s" | tail -n 8
  echo "=== [$(($(date +%s) - T0))s] $name rc=$rc" | tee -a "$LOG"
}

versions() {
  $PY - <<'EOF'
import platform, torch
print("python", platform.python_version(), "torch", torch.__version__, "cuda", torch.version.cuda)
try:
    import triton; print("triton", triton.__version__)
except ImportError:
    print("triton missing")
import transformers; print("transformers", transformers.__version__)
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print("gpu", p.name, round(p.total_memory / 2**30, 1), "GiB", p.multi_processor_count, "SMs")
for m in ("openai", "gguf", "llguidance", "jsonschema", "hypothesis"):
    try:
        __import__(m); print(m, "ok")
    except ImportError:
        print(m, "MISSING")
# next3's start probe compiled ~890 modules from source (4.5 s of builtins.compile) in a process
# that was not the machine's first: can this Python keep bytecode between processes?
import os, pathlib, sys
pkg = pathlib.Path(transformers.__file__).parent
print("bytecode: dont_write", sys.flags.dont_write_bytecode, "pycache_prefix",
      sys.pycache_prefix, "writable", os.access(pkg / "models", os.W_OK), "transformers .py",
      sum(1 for _ in pkg.rglob("*.py")), ".pyc", sum(1 for _ in pkg.rglob("*.pyc")))
EOF
  if command -v nvidia-smi >/dev/null; then
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv
  fi
}
export -f versions

startup_probe() {  # where the engine start's first seconds go: imports, config, tokenizer
  $PY - "$1" <<'EOF2'
import os, sys, time
t = time.perf_counter()
marks = []
mods = len(sys.modules)
def mark(what):
    global t, mods
    now = time.perf_counter(); marks.append(f"{what} {now - t:.2f}s +{len(sys.modules) - mods}m")
    t, mods = now, len(sys.modules)
import torch; mark("import torch")
torch.cuda.is_available() and torch.cuda.init(); mark("cuda init")
import transformers; mark("import transformers")
from paged_engine.loader import load_hf_config, load_tokenizer, resolve_model; mark("import paged_engine.loader")
r = resolve_model(sys.argv[1]); mark("resolve")
import cProfile, pstats  # the config step's first call (its imports included), profiled
prof = cProfile.Profile(); prof.enable(); load_hf_config(r); prof.disable(); mark("config")
load_tokenizer(r); mark("tokenizer")
from paged_engine.engine.generation_defaults import generation_defaults
generation_defaults(r.path); mark("generation defaults")
load_hf_config(r); mark("config again")
from paged_engine import LLM; mark("import paged_engine")
print("transformers", transformers.__version__, "HF_HUB_OFFLINE=" + os.environ.get("HF_HUB_OFFLINE", ""), "; ".join(marks))
pstats.Stats(prof).sort_stats("cumulative").print_stats(15)
EOF2
}
tf_new() {  # transformers 5.21 (.whl-tf, from gpu_wheels.sh) into /tmp/tf-new; false if absent
  ls .whl-tf/*.whl >/dev/null 2>&1 && python3 -m pip install -q --no-index --no-deps \
    --no-compile --no-cache-dir --target /tmp/tf-new .whl-tf/*.whl
}

start_probes() {  # LIMIT: the start probe on the image's transformers, then on a carried 5.21
  local cfg=/tmp/paged-bench/qwen3-0.6b-cfg
  step "$1" startup-probe startup_probe $cfg
  if tf_new; then
    step "$1" startup-probe-tf-new env PYTHONPATH="/tmp/tf-new:$PYTHONPATH" \
      bash -c "startup_probe $cfg"
  fi
}

export -f versions startup_probe
export PY

case "$PHASE" in
  phase1)
    step 20 versions versions
    # every kernel test natively (not only the gpu-marked), 8 processes compiling side by side;
    # run 1 took 71 s for 379 tests, now ~670 (-v: a cut run still logs each test's outcome)
    step 150 kernel-tests $PY -m pytest -v -n 8 -p no:cacheprovider --timeout 60 -rfE \
      -k "not any_batch" tests/kernels
    # timed by CUDA-graph replay since 326ede2 (next5 gives the same command 90 s)
    step 90 kernel-bench $PY -m benchmarks.kernel_bench --out "$OUT/kernels"
    step 100 gpu-profile $PY -m benchmarks.gpu_profile --model-config qwen3-0.6b --out "$OUT"
    # the HF peers on the workload's first 64 requests (one static batch): the whole workload
    # through both would outlast the call
    step 150 nano-vllm $PY -m benchmarks.run_all --only throughput --model-config qwen3-0.6b \
      --workloads nano-vllm --hf-requests 64 --out "$OUT" --no-report --note "issue 14 phase1"
    ;;
  diag)  # one short call: where the host time of a batch-256 step and the engine start go
    step 100 gpu-profile $PY -m benchmarks.gpu_profile --model-config qwen3-0.6b --steps 10 \
      --out "$OUT"
    CFG=/tmp/paged-bench/qwen3-0.6b-cfg
    step 40 startup-probe startup_probe $CFG
    step 40 startup-probe-offline env HF_HUB_OFFLINE=1 bash -c "startup_probe $CFG"
    ;;
  final)  # after phase1 + diag: the fixes checked natively, the norm A/B, the split sweep
    step 20 versions versions
    step 40 native-kernel-tests $PY -m pytest -q -n 8 -p no:cacheprovider --timeout 30 -rfE \
      tests/engine/test_norm.py tests/kernels/test_linear_attention.py \
      -k "gpu or delta_rule_matches or triton_norms"
    # engines one at a time: each sizes its KV cache to 90% of the GPU (gpu_memory_utilization),
    # so 8 xdist workers would starve each other (this session's run did, see issue 14's note)
    step 150 native-engine-tests $PY -m pytest -v -p no:cacheprovider --timeout 60 -rfE \
      tests/engine/test_llm_vs_hf.py tests/engine/test_cuda_graph_logic.py \
      tests/engine/test_async_scheduling.py
    step 40 split-sweep $PY -m benchmarks.kernel_bench --split-sweep --out "$OUT/kernels"
    step 60 profile-torch-norms $PY -m benchmarks.gpu_profile --model-config qwen3-0.6b \
      --torch-norms --out "$OUT/torch-norms"
    step 60 profile-triton-norms $PY -m benchmarks.gpu_profile --model-config qwen3-0.6b \
      --out "$OUT"
    step 150 nano-vllm $PY -m benchmarks.run_all --only throughput --model-config qwen3-0.6b \
      --workloads nano-vllm --systems paged hf-continuous --hf-requests 64 --out "$OUT" \
      --no-report --note "issue 14 final"
    ;;
  next)  # what issue 14's first GPU session left open, in one call of ~9 minutes of limits
    step 20 versions versions
    # the new kernels and the sampler (no engines: 8 processes compiling side by side)
    step 80 native-kernel-tests $PY -m pytest -q -n 8 -p no:cacheprovider --timeout 60 -rfE \
      tests/kernels/test_rotary.py tests/kernels/test_norm_activation.py \
      tests/engine/test_norm.py tests/engine/test_sampler.py
    # engines one at a time: each sizes its KV cache to 90% of the GPU (gpu_memory_utilization);
    # on CUDA they run the fused layer epilogues natively
    step 150 native-engine-tests $PY -m pytest -v -p no:cacheprovider --timeout 60 -rfE \
      tests/engine/test_llm_vs_hf.py tests/engine/test_cuda_graph_logic.py \
      tests/engine/test_async_scheduling.py
    # batch 256 as LLM.generate runs it (final outputs only: less host work a step) for the idle
    # goal, with the fused layer epilogues and without them (the A/B on one machine)
    # (and where the prefill's 1.1 s go: by estimate ~4x what its GEMMs' FLOPs need at half
    # the bf16 peak)
    step 75 profile-final-only $PY -m benchmarks.gpu_profile --model-config qwen3-0.6b \
      --final-only --profile-prefill --out "$OUT/final-only"
    step 60 profile-unfused $PY -m benchmarks.gpu_profile --model-config qwen3-0.6b \
      --final-only --unfused --out "$OUT/unfused"
    # HF continuous batching did not finish 64 requests in ~113 s: 16 this time. With
    # paged|sdpa (the image has no flash-attn) it builds attention masks every step and, by its
    # own heuristic, runs without CUDA graphs (next2 forces them on)
    step 120 nano-vllm $PY -m benchmarks.run_all --only throughput --model-config qwen3-0.6b \
      --workloads nano-vllm --systems paged hf-continuous --hf-requests 16 --out "$OUT" \
      --no-report --note "issue 14 next"
    ;;
  next2)
    step 20 versions versions
    # decode attention under 18 (BLOCK_N, warps, stages) tiles at batch 32-256: the default
    # tile (64, 8, 2) was sized for no spills, never timed against others
    step 120 tile-sweep $PY -m benchmarks.kernel_bench --tile-sweep --out "$OUT/kernels"
    # the two-split heuristic inside the engine's graphs (batch 64, nano-vllm contexts)
    step 60 profile-batch-64 $PY -m benchmarks.gpu_profile --model-config qwen3-0.6b --batch 64 \
      --out "$OUT/batch64"
    # the engine start's config step with the image's transformers (5.17), then with 5.21
    # (carried: .whl-tf, from gpu_wheels.sh), which no longer imports torch._dynamo,
    # torch.distributed.tensor and sympy with any config class; "+Nm": modules imported
    start_probes 40
    step 120 hf-cb-graphs $PY -m benchmarks.run_all --only throughput \
      --model-config qwen3-0.6b --workloads nano-vllm --systems hf-continuous --hf-requests 16 \
      --hf-cb-options '{"use_cuda_graph": true}' --out "$OUT/hf-cb-graphs" --no-report \
      --note "issue 14 next: HF continuous batching with its CUDA graphs forced on"
    ;;
  next3)  # after next + next2: the engine tests again (an engine now releases what a dropped
    # one held), and the decode tile the sweep chose, in the kernel bench and the engine
    step 120 native-engine-tests $PY -m pytest -v -p no:cacheprovider --timeout 60 -rfE \
      tests/engine/test_llm_vs_hf.py tests/engine/test_cuda_graph_logic.py \
      tests/engine/test_async_scheduling.py
    step 70 kernel-bench $PY -m benchmarks.kernel_bench --out "$OUT/kernels"
    step 40 profile-final-only $PY -m benchmarks.gpu_profile --model-config qwen3-0.6b \
      --final-only --out "$OUT/final-only"
    step 60 nano-vllm $PY -m benchmarks.run_all --only throughput --model-config qwen3-0.6b \
      --workloads nano-vllm --systems paged --out "$OUT" --no-report --note "issue 14 next3"
    # next2's start probe again, now with 5.21 carried too (.whl-tf, from gpu_wheels.sh)
    start_probes 30
    ;;
  next4)  # carry [".whl-tf"]: the slow first prefill, the sampler's race kernel, engine tests
    step 20 versions versions
    # the same profile twice on one Triton cache, cold then warm: jit_builds names the kernels
    # each phase built, prefill_profile.host_functions where the prefill's host time goes
    export TRITON_CACHE_DIR=/tmp/triton-cache-next4
    rm -rf "$TRITON_CACHE_DIR"
    step 75 profile-cold $PY -m benchmarks.gpu_profile --model-config qwen3-0.6b --final-only \
      --profile-prefill --out "$OUT/cold"
    step 50 profile-warm $PY -m benchmarks.gpu_profile --model-config qwen3-0.6b --final-only \
      --profile-prefill --out "$OUT/warm"
    # the A/B of the sampler's one-pass race (gumbel_race) against torch's, on the warm cache;
    # on transformers 5.21 (.whl-tf) where carried, so that its engine start beside the warm
    # run's is the config step's A/B too (transformers does not touch the decode step)
    TF=""
    if tf_new; then TF="/tmp/tf-new:"; fi
    step 50 profile-torch-sampler env PYTHONPATH="$TF$PYTHONPATH" $PY -m benchmarks.gpu_profile \
      --model-config qwen3-0.6b --final-only --torch-sampler --out "$OUT/torch-sampler"
    step 60 kernel-bench $PY -m benchmarks.kernel_bench --out "$OUT/kernels"
    # the split counts again under the tile next2 chose (the sweep on record had the old one)
    step 30 split-sweep $PY -m benchmarks.kernel_bench --split-sweep --out "$OUT/kernels"
    step 60 nano-vllm-warm $PY -m benchmarks.run_all --only throughput --model-config qwen3-0.6b \
      --workloads nano-vllm --systems paged --out "$OUT" --no-report \
      --note "issue 14 next4: warm Triton cache, gumbel_race"
    # sleep mode: what level 1 / level 2 / the KV cache free on the GPU, and how long a trip takes
    step 60 sleep-mode $PY -m benchmarks.sleep_mode --device cuda --out "$OUT/sleep_mode.json"
    # with transformers 5.21 (.whl-tf) each engine starts ~8 s sooner (next3's start probe);
    # the sampler's tests first (its race natively), then the engines one at a time
    step 150 native-tests env PYTHONPATH="$TF$PYTHONPATH" $PY -m pytest -v -p no:cacheprovider \
      --timeout 60 -rfE tests/kernels/test_sampling.py tests/engine/test_sampler.py \
      tests/engine/test_async_scheduling.py tests/engine/test_llm_vs_hf.py \
      tests/engine/test_cuda_graph_logic.py tests/engine/test_sleep_mode.py \
      tests/engine/test_llava_images.py
    ;;
  next5)  # carry [".whl-tf"]: what the H200 session (docs/benchmarks/h200) fixed, checked natively
    step 20 versions versions
    # aligned upload views (ef5e371): the cold prefill should build no kernel the start did not
    export TRITON_CACHE_DIR=/tmp/triton-cache-next5
    rm -rf "$TRITON_CACHE_DIR"
    step 75 profile-cold $PY -m benchmarks.gpu_profile --model-config qwen3-0.6b --final-only \
      --profile-prefill --out "$OUT/cold"
    TF=""
    if tf_new; then TF="/tmp/tf-new:"; fi
    # the lazy block pool (7bf08e8) and the tests' GPU mends (6d15470); the thread method
    # prints every thread's stack if a test hangs again
    step 165 native-tests env PYTHONPATH="$TF$PYTHONPATH" $PY -m pytest -q -p no:cacheprovider \
      --timeout 45 --timeout-method thread -rfE tests/engine/test_async_scheduling.py \
      tests/engine/test_sleep_mode.py tests/engine/test_llava_images.py \
      tests/engine/test_llm_vs_hf.py tests/engine/test_cuda_graph_logic.py \
      tests/engine/test_block_pool.py tests/engine/test_step_uploads.py \
      tests/kernels/test_mla_attention.py tests/kernels/test_attention.py
    # the rope kernel storing K/V (one launch a layer fewer): its bits against rope + write
    # natively, and the engine fused against the write kernel apart (Gemma 3 with an e4m3 cache:
    # the test's Qwen3 case is gone)
    step 45 fused-kv-write $PY -m pytest -q -p no:cacheprovider -rfE \
      tests/engine/test_fused_kv_write.py tests/kernels/test_rotary.py \
      -k "(test_rope_kernel_writes and gemma3) or (fused_kv_write and shape1)"
    # EAGLE-3 and MTP heads: greedy identical and their drafts against transformers', with the
    # Triton kernels (and MLA's for MTP)
    step 50 eagle3-mtp $PY -m pytest -q -p no:cacheprovider -rfE tests/engine/test_spec_eagle3.py \
      tests/engine/test_spec_mtp.py -k "(llama and (identical or teacher)) or (own and not tensor)"
    # decode attention and the race by CUDA-graph replay (326ede2): the device's time alone;
    # mla_decode with split keys (b600f93) against the H200's unsplit 9-50%
    step 90 kernel-bench $PY -m benchmarks.kernel_bench --out "$OUT/kernels"
    step 30 split-sweep $PY -m benchmarks.kernel_bench --split-sweep --out "$OUT/kernels"
    # MLA decode: more heads a program (V3's 128 heads read each latent cache 8 times) x tiles
    step 95 mla-sweep $PY -m benchmarks.kernel_bench --mla-sweep --out "$OUT/kernels"
    step 50 nano-vllm-warm $PY -m benchmarks.run_all --only throughput --model-config qwen3-0.6b \
      --workloads nano-vllm --systems paged --out "$OUT" --no-report \
      --note "issue 14 next5: aligned uploads, lazy block pool"
    ;;
  phase2)
    step 150 engine-tests $PY -m pytest -q -p no:cacheprovider tests/engine/test_llm_vs_hf.py \
      tests/engine/test_engine.py tests/engine/test_async_scheduling.py \
      tests/engine/test_cuda_graph_logic.py tests/engine/test_models_moe.py \
      tests/engine/test_lora.py tests/kernels -k "not tensor_parallel_matches"
    step 150 fixed-length $PY -m benchmarks.run_all --only throughput --model-config qwen3-0.6b \
      --workloads fixed-length --out "$OUT/fixed" --no-report --note "issue 14 phase2"
    step 120 serving $PY -m benchmarks.run_all --only serving --model-config qwen3-0.6b \
      --out "$OUT/serving" --no-report --note "issue 14 phase2"
    step 150 llama-8b $PY -m benchmarks.run_all --only throughput --model-config llama-3.1-8b \
      --workloads nano-vllm --out "$OUT/8b" --no-report --note "issue 14 phase2"
    ;;
  phase3)  # issue 13: one device call, well under its 10 minutes
    step 30 versions versions
    step 300 kv-memory $PY -m benchmarks.kv_memory --device cuda --dtype bfloat16 \
      --hidden 1024 --layers 8 --requests 128 --kv-gib 0.25 --swap-blocks 512 --repeat 2 \
      --backends auto --out "$OUT/kv_memory.json"
    step 100 invariant-tests $PY -m pytest -q -m gpu -p no:cacheprovider \
      tests/kernels/test_batch_invariant_kernels.py tests/engine/test_batch_invariant.py
    step 150 invariant-cost $PY -m benchmarks.batch_invariant --model-config qwen3-0.6b \
      --out "$OUT/batch_invariant.json"
    # last: five engines in one process; lora.json is rewritten after each, so a run the 10-minute
    # call limit cuts keeps its part (the call returns $OUT on a timeout too)
    step 150 lora $PY -m benchmarks.lora --device cuda --out "$OUT/lora"
    ;;
  phase4)  # a mixture-of-experts model: Qwen3-30B-A3B (61 GB of bf16 dummy weights; H100 or H200)
    step 30 versions versions
    step 120 moe-tests $PY -m pytest -q -m gpu -p no:cacheprovider tests/kernels/test_fused_moe.py
    # batch 64: 256 nano-vllm prompts would need ~14 GB of KV (98 KB a token) next to the weights
    step 240 moe-profile $PY -m benchmarks.gpu_profile --model-config qwen3-30b-a3b \
      --batch 64 --out "$OUT/moe"
    step 150 moe-profile-eager $PY -m benchmarks.gpu_profile --model-config qwen3-30b-a3b \
      --batch 64 --enforce-eager --steps 10 --out "$OUT/moe-eager"
    ;;
  phase5)  # gpt-oss-20b: bf16 dummy experts (42 GB), then MXFP4 ones as on its release (~13 GB)
    step 30 versions versions
    step 180 gpt-oss-tests $PY -m pytest -q -m gpu -p no:cacheprovider \
      tests/kernels/test_fused_moe.py tests/kernels/test_attention.py
    step 240 gpt-oss-profile $PY -m benchmarks.gpu_profile --model-config gpt-oss-20b \
      --batch 64 --out "$OUT/gpt-oss"
    step 240 gpt-oss-mxfp4 $PY -m benchmarks.gpu_profile --model-config gpt-oss-20b \
      --batch 64 --override-config "$MXFP4" --out "$OUT/gpt-oss-mxfp4"
    ;;
  phase6)  # weight-only FP8 against bf16 weights, Llama-3.1-8B's config
    step 30 versions versions
    step 120 fp8-tests $PY -m pytest -q -m gpu -p no:cacheprovider tests/kernels/test_fp8_gemm.py
    step 200 bf16-profile $PY -m benchmarks.gpu_profile --model-config llama-3.1-8b \
      --batch 64 --out "$OUT/llama-8b-bf16"
    step 200 fp8-profile $PY -m benchmarks.gpu_profile --model-config llama-3.1-8b \
      --batch 64 --quantization fp8 --out "$OUT/llama-8b-fp8"
    ;;
  int4)  # 4-bit weights against bf16 ones, Llama-3.1-8B's config (fp8: phase6)
    step 30 versions versions
    step 100 int4-tests $PY -m pytest -q -m gpu -p no:cacheprovider tests/kernels/test_int4_gemm.py \
      tests/kernels/test_fp8_gemm.py tests/kernels/test_fused_moe.py
    # 4-bit checkpoints end to end on CUDA (their codes kept by default; one GPU: no TP=2)
    step 120 int4-engine $PY -m pytest -q -p no:cacheprovider tests/engine/test_packed_checkpoints.py \
      -k "not tensor_parallelism"
    step 100 bf16-profile-b1 $PY -m benchmarks.gpu_profile --model-config llama-3.1-8b \
      --batch 1 --out "$OUT/llama-8b-bf16-b1"
    step 100 int4-profile-b1 $PY -m benchmarks.gpu_profile --model-config llama-3.1-8b \
      --batch 1 --quantization int4 --out "$OUT/llama-8b-int4-b1"
    step 110 bf16-profile $PY -m benchmarks.gpu_profile --model-config llama-3.1-8b \
      --batch 64 --out "$OUT/llama-8b-bf16"
    step 110 int4-profile $PY -m benchmarks.gpu_profile --model-config llama-3.1-8b \
      --batch 64 --quantization int4 --out "$OUT/llama-8b-int4"
    ;;
  phase7)  # FP8 experts, Qwen3-30B-A3B's config (compare with phase4's bf16 run)
    step 30 versions versions
    step 120 moe-tests $PY -m pytest -q -m gpu -p no:cacheprovider tests/kernels/test_fused_moe.py
    step 300 moe-fp8-profile $PY -m benchmarks.gpu_profile --model-config qwen3-30b-a3b \
      --batch 64 --quantization fp8 --out "$OUT/moe-fp8"
    ;;
  phase8)  # MLA: DeepSeek-V2-Lite's config (latent cache, mla_attention, 64 softmax-routed experts)
    step 30 versions versions
    step 120 mla-tests $PY -m pytest -q -m gpu -p no:cacheprovider tests/kernels/test_mla_attention.py
    step 240 mla-profile $PY -m benchmarks.gpu_profile --model-config deepseek-v2-lite \
      --batch 64 --out "$OUT/mla"
    step 150 mla-profile-eager $PY -m benchmarks.gpu_profile --model-config deepseek-v2-lite \
      --batch 64 --enforce-eager --steps 10 --out "$OUT/mla-eager"
    ;;
  phase9)  # hybrid: Qwen3.5-27B's config (Gated DeltaNet state rows beside the paged KV)
    step 30 versions versions
    step 120 gdn-tests $PY -m pytest -q -m gpu -p no:cacheprovider tests/kernels/test_linear_attention.py \
      tests/kernels/test_kda.py tests/kernels/test_selective_scan.py
    step 240 hybrid-profile $PY -m benchmarks.gpu_profile --model-config qwen3.5-27b \
      --batch 32 --max-num-seqs 32 --out "$OUT/hybrid"
    step 150 hybrid-profile-eager $PY -m benchmarks.gpu_profile --model-config qwen3.5-27b \
      --batch 32 --max-num-seqs 32 --enforce-eager --steps 10 --out "$OUT/hybrid-eager"
    # prefix caching from state snapshots on the native kernels: answers equal to no caching
    step 100 hybrid-prefix-cache $PY -m benchmarks.prefix_cache --archs qwen3_5 lfm2 qwen3 \
      --hidden-size 1024 --layers 16 --conversations 64 --out "$OUT/prefix_cache.json"
    # the state-space models on the native kernels (Mamba's selective_scan, Mamba2's ssd_scan):
    # Mamba and Mamba2 without any KV, Jamba among attention layers; answers equal to no caching
    step 100 ssm-prefix-cache $PY -m benchmarks.prefix_cache --archs mamba mamba2 jamba \
      --hidden-size 1024 --layers 16 --conversations 64 --out "$OUT/ssm_prefix_cache.json"
    # speculative decoding with state backups on the native kernels and verification graphs
    step 120 hybrid-spec $PY -m pytest -q -p no:cacheprovider tests/engine/test_spec_decode_hybrid.py
    ;;
  audio)  # Whisper-large-v3 and Qwen2-Audio-7B configs: paged vs HF generate, the encoder alone
    step 240 audio-whisper $PY -m benchmarks.audio --preset gpu --sections whisper encoder \
      --out "$OUT/audio-whisper" --note "gpu_run.sh audio"
    step 330 audio-llm $PY -m benchmarks.audio --preset gpu --sections llm \
      --out "$OUT/audio-llm" --note "gpu_run.sh audio"
    ;;
  rehearse-diag)  # CPU: the diag phase's steps on tiny sizes
    export CUDA_VISIBLE_DEVICES=""
    step 300 gpu-profile $PY -m benchmarks.gpu_profile --smoke --out "$OUT"
    step 300 gpu-profile-unfused $PY -m benchmarks.gpu_profile --smoke --final-only --unfused \
      --out "$OUT/unfused"
    step 40 startup-probe startup_probe /tmp/paged-bench/qwen3-0.6b-cfg
    step 40 startup-probe-offline env HF_HUB_OFFLINE=1 bash -c "startup_probe /tmp/paged-bench/qwen3-0.6b-cfg"
    ;;
  rehearse)  # CPU: the same steps on tiny sizes, to catch typos before a lease is spent
    export CUDA_VISIBLE_DEVICES=""
    TINY=/tmp/paged-bench/tiny-llama
    step 60 tiny-model $PY -c "from paged_engine.testing import write_tiny_model as w; w('$TINY', 'llama')"
    step 30 versions versions
    step 120 gpu-tests $PY -m pytest -q -m gpu -p no:cacheprovider tests/kernels
    step 300 kernel-bench $PY -m benchmarks.kernel_bench --smoke --out "$OUT/kernels"
    step 300 gpu-profile $PY -m benchmarks.gpu_profile --smoke --out "$OUT"
    step 300 gpu-profile-unfused $PY -m benchmarks.gpu_profile --smoke --final-only --unfused \
      --out "$OUT/unfused"
    step 300 moe-profile $PY -m benchmarks.gpu_profile --smoke --model-config qwen3-30b-a3b \
      --override-config "$MOE_SMOKE" --out "$OUT/moe"
    step 400 nano-vllm $PY -m benchmarks.run_all --smoke --only throughput --model-config "$TINY" \
      --workloads nano-vllm --out "$OUT" --no-report --note "rehearsal"
    step 300 serving $PY -m benchmarks.run_all --smoke --only serving --model-config "$TINY" \
      --rates 2 --out "$OUT/serving" --no-report --note "rehearsal"
    # --smoke: short prompts and outputs (bf16 decode on this CPU took ~0.5 s a step under load;
    # the full sizes outran 300 s). The code paths only: the small pools need not preempt
    step 300 kv-memory $PY -m benchmarks.kv_memory --smoke --dtype bfloat16 --hidden 64 --layers 2 \
      --requests 6 --kv-gib 0.001 --swap-blocks 12 --backends auto --convs 2 --turns 2 \
      --out "$OUT/kv_memory.json"
    step 300 invariant-cost $PY -m benchmarks.batch_invariant --smoke --model-config "$TINY" \
      --out "$OUT/batch_invariant.json"
    step 300 lora $PY -m benchmarks.lora --smoke --out "$OUT/lora"
    step 120 audio $PY -m benchmarks.audio --preset tiny --out "$OUT/audio"
    step 300 gpt-oss-profile $PY -m benchmarks.gpu_profile --smoke --model-config gpt-oss-20b \
      --override-config "$MXFP4" --out "$OUT/gpt-oss"
    step 300 fp8-profile $PY -m benchmarks.gpu_profile --smoke --model-config llama-3.2-1b \
      --quantization fp8 --out "$OUT/fp8"
    step 300 moe-fp8-profile $PY -m benchmarks.gpu_profile --smoke --model-config qwen3-30b-a3b \
      --override-config "$MOE_SMOKE" --quantization fp8 --out "$OUT/moe-fp8"
    step 300 int4-profile $PY -m benchmarks.gpu_profile --smoke --model-config llama-3.2-1b \
      --batch 1 --quantization int4 --out "$OUT/int4"
    step 300 mla-profile $PY -m benchmarks.gpu_profile --smoke --model-config deepseek-v2-lite \
      --out "$OUT/mla"
    # 4 layers (3 linear, 1 full), narrower, a small vocabulary: the 27B's embeddings alone
    # would be 10 GB in float32 here
    step 300 hybrid-profile $PY -m benchmarks.gpu_profile --smoke --model-config qwen3.5-27b \
      --max-num-seqs 8 --override-config "$HYBRID_SMOKE" --out "$OUT/hybrid"
    step 200 hybrid-prefix-cache $PY -m benchmarks.prefix_cache --archs qwen3_5 lfm2 \
      --hidden-size 64 --layers 4 --conversations 3 --turns 2 --system-tokens 40 \
      --max-tokens 4 --out "$OUT/prefix_cache.json"
    step 200 ssm-prefix-cache $PY -m benchmarks.prefix_cache --archs mamba mamba2 jamba \
      --hidden-size 64 --layers 4 --conversations 3 --turns 2 --system-tokens 40 \
      --max-tokens 4 --out "$OUT/ssm_prefix_cache.json"
    ;;
  *)
    echo "usage: $0 phase1|diag|final|next|next2|next3|next4|next5|phase2|phase3|phase4|phase5|phase6|phase7|phase8|phase9|int4|audio|rehearse|rehearse-diag" >&2
    exit 2
    ;;
esac
echo "done in $(($(date +%s) - T0))s; files:" | tee -a "$LOG"
find "$OUT" -maxdepth 2 -type f \( -name "*.json" -o -name "*.png" -o -name "*.txt" \) | tee -a "$LOG"
