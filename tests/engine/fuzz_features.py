"""The per-request features engine_fuzz.py draws on top of its scheduling stream: LoRA adapters
(where the model takes them), structured outputs (choice, regex, a JSON schema), logits shaping
(penalties, logit_bias, allowed_token_ids, bad_words, min_p, custom logits processors), prompts
given as their tokens' embeddings (vLLM's `{"prompt_embeds": tensor}`) and, on a vision-language
model, an image at the head of the prompt (one of a few, so prompts share them: the encoder
cache, prefix-cache keys by image, placeholders cut by chunked prefill and preemption).

Every draw here comes from the seed's second stream (`random.Random(f"features {seed}")`), so
the first stream, and the seeds it found, stay as they were. The reference engine takes every
feature of REFERENCE_FEATURES the model serves (`start_reference` drops the ones it refuses by
name); a seed then turns on a subset (`feature_options`) for the fuzzed engine.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable
from typing import Any

import torch

from paged_engine import LLM, LoRARequest, SamplingParams, StructuredOutputsParams

VOCAB_LO, VOCAB_HI = 3, 200  # prompt tokens: the tiny model's vocabulary, less its specials
IMAGE_TEXT = 40  # an image prompt's most tokens after the image (its placeholders: 25 for LLaVA)

# structured outputs the tiny byte-level tokenizer can spell
CONSTRAINTS = (
    {"choice": ["yes", "no", "maybe"]},
    {"regex": r"[a-z]{3}-[0-9]{2}"},
    {"regex": r"(ab|cd){2,5}x"},
    {
        "json": {
            "type": "object",
            "properties": {"name": {"type": "string", "maxLength": 6}, "n": {"type": "integer"}},
            "required": ["name", "n"],
        },
        "disable_any_whitespace": True,
    },
)
# the reference engine's features: every one a seed may draw (what the model refuses dropped)
REFERENCE_FEATURES: dict[str, dict[str, Any]] = {
    "lora": {"enable_lora": True, "max_loras": 3, "max_lora_rank": 8},
    "prompt_embeds": {"enable_prompt_embeds": True},
    "logits_processors": {
        "logits_processors": [
            "custom_logits_processors:ForceToken",
            "custom_logits_processors:NoRepeat",
        ]
    },
}


def write_adapters(root: str, model_path: str) -> list[LoRARequest]:
    """Three LoRA adapters of the model under `root` (every projection / attention only, ranks
    2-8: REFERENCE_FEATURES' max_lora_rank); none where no layer is one they target."""
    from paged_engine.testing import write_lora_adapter

    adapters: list[LoRARequest] = []
    shapes = [
        (4, {}),
        (8, {"use_rslora": True, "alpha": 8}),
        (2, {"target_modules": ("q_proj", "v_proj")}),
    ]
    try:
        for k, (rank, kw) in enumerate(shapes):
            adapter = write_lora_adapter(f"{root}/lora{k}", model_path, rank=rank, seed=k, **kw)
            adapters.append(LoRARequest(f"a{k}", k + 1, str(adapter)))
    except ValueError:  # no layer the adapters target
        return []
    return adapters


def start_reference(path: str, features: set[str], **kwargs: Any) -> tuple[LLM, set[str]]:
    """The roomy reference engine with every feature of `features` the model takes; (it, the
    features kept). A feature the engine refuses by name is dropped and the engine started
    again."""
    features = set(features)
    while True:
        options = {k: v for f in features for k, v in REFERENCE_FEATURES[f].items()}
        try:
            return LLM(model=path, **kwargs, **options), features
        except ValueError as e:  # refused by name: drop that feature
            named = [f for f in features if any(k in str(e) for k in REFERENCE_FEATURES[f])]
            if not named:
                raise
            features -= set(named)


def token_embedder(path: str) -> Callable[[list[int]], torch.Tensor]:
    """Token ids -> their input embeddings [len, hidden], HF's `get_input_embeddings()`."""
    import transformers

    try:
        hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    except ValueError:  # a vision-language model
        hf = transformers.AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32)
    table = hf.get_input_embeddings()

    def embed(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return table(torch.tensor([ids]))[0]

    return embed


def feature_options(xrng: random.Random, model: Any, options: dict[str, Any]) -> dict[str, Any]:
    """The per-request features' engine options, drawn from the seed's second stream (`model`:
    an engine_fuzz.Model; `options`: the engine options the first stream drew)."""
    extra: dict[str, Any] = {}
    if "lora" in model.features and xrng.random() < 0.5:
        extra.update(enable_lora=True, max_loras=xrng.randint(1, 2))
        extra["max_lora_rank"] = xrng.choice([8, 16])
    if "prompt_embeds" in model.features and xrng.random() < 0.4:
        extra["enable_prompt_embeds"] = True
    # (refused with speculation and async scheduling: they read each step's tokens)
    sync = "speculative_config" not in options and not options["async_scheduling"]
    if "logits_processors" in model.features and sync and xrng.random() < 0.5:
        extra |= REFERENCE_FEATURES["logits_processors"]
    return extra


def shape_params(
    xrng: random.Random, params: dict[str, Any], options: dict[str, Any], texts: list[str]
) -> None:
    """Add structured outputs and logits shaping to a SamplingParams' kwargs."""
    if xrng.random() < 0.2:
        params["structured_outputs"] = StructuredOutputsParams(**xrng.choice(CONSTRAINTS))

    def tokens(k: int) -> list[int]:
        return [xrng.randrange(VOCAB_LO, VOCAB_HI) for _ in range(k)]

    if xrng.random() < 0.15:
        params["repetition_penalty"] = xrng.choice([0.8, 1.3])
    if xrng.random() < 0.15:
        params["presence_penalty"] = xrng.uniform(-1, 1)
    if xrng.random() < 0.15:
        params["frequency_penalty"] = xrng.uniform(-1, 1)
    if xrng.random() < 0.15:
        params["logit_bias"] = {t: xrng.choice([-100, -5, 5, 100]) for t in tokens(3)}
    if "structured_outputs" not in params:  # (a constraint they contradict has no token left)
        if xrng.random() < 0.1:
            params["allowed_token_ids"] = tokens(xrng.randint(1, 30))
        if xrng.random() < 0.1:
            params["bad_words"] = [xrng.choice(texts).strip() for _ in range(2)]
    if params.get("temperature", 1.0) > 0 and xrng.random() < 0.3:
        params["min_p"] = xrng.choice([0.05, 0.2])
    if "logits_processors" in options and xrng.random() < 0.3:
        args = xrng.choice([{"target_token": tokens(1)[0]}, {"no_repeat": True}])
        params["extra_args"] = args


def draw_job_features(xrng: random.Random, job: Any, model: Any, options: dict[str, Any]) -> None:
    """Give an engine_fuzz.Job the adapter and prompt embeds `options` enable (after its
    shaping: the stream's order)."""
    if options.get("enable_lora"):
        job.lora = xrng.choice([None, *model.adapters])
    if options.get("enable_prompt_embeds") and xrng.random() < 0.4:
        if isinstance(job.params, SamplingParams):  # an embedded prompt has no tokens to score
            job.params = dataclasses.replace(job.params, prompt_logprobs=None)
        job.embeds = model.embed(job.prompt)


def draw_image(xrng: random.Random, job: Any, model: Any) -> None:
    """On a model with images, put one of three noise images at the head of a job's token
    prompt (half of them)."""
    if model.image_token is None or job.embeds is not None or xrng.random() < 0.5:
        return
    from image_checks import noise_image  # tests/engine/image_checks.py

    k = xrng.randrange(3)
    job.image = noise_image(k, (24 + 8 * k, 40 - 6 * k))
    job.prompt = [model.image_token, *job.prompt[:IMAGE_TEXT]]


def reference_embeds(job: Any) -> torch.Tensor | None:
    """What the reference runs an embedded prompt as: its tokens (the embeds of tokens must give
    the tokens' outputs), but under a repetition penalty the embeds themselves: the penalty
    counts a prompt's tokens, and an embedded prompt has none (its positions hold no token id,
    as in vLLM; once drawn with the tokens' reference: llama 21, 42, 46, 57)."""
    if job.embeds is None or getattr(job.params, "repetition_penalty", 1.0) == 1.0:
        return None
    return job.embeds
