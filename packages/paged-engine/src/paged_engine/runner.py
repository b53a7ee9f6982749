"""Which requests an engine serves: vLLM's `runner` / `convert` options (and the older `task`).

    runner  "generate": generation only; "pooling": pooling requests only (embed, classify,
            score); "auto": a classifier pools, any other model does both (paged runs an
            embedding request on every decoder, as vLLM's `convert="embed"` does)
    convert "classify": a `*ForCausalLM` checkpoint served as its `*ForSequenceClassification`
            (the head from the checkpoint's `score.weight`, or from LM-head rows with
            hf_overrides' classifier_from_token); "embed": pooling its hidden states (runner
            "pooling" unless set); "none" / "auto": the model as its config says
    task    vLLM's older single option: "generate", "embed" / "embedding" (pooling, embed),
            "classify" / "score" (pooling, classify)

No torch here: paged-server reads it.
"""

from __future__ import annotations

from typing import Any

RUNNERS = ("auto", "generate", "pooling")
CONVERTS = ("auto", "none", "embed", "classify")
TASKS = ("auto", "generate", "embed", "embedding", "classify", "score")
_TASK_TO = {  # task -> (runner, convert); "auto" changes neither
    "generate": ("generate", "auto"),
    "embed": ("pooling", "embed"),
    "embedding": ("pooling", "embed"),
    "classify": ("pooling", "classify"),
    "score": ("pooling", "classify"),
}


def runner_and_convert(runner: str, convert: str, task: str | None) -> tuple[str, str]:
    """The options after `task` (which may not contradict an explicit runner or convert)."""
    if task is None or task == "auto":
        return runner, convert
    t_runner, t_convert = _TASK_TO[task]
    if runner not in ("auto", t_runner) or convert not in ("auto", t_convert):
        raise ValueError(
            f"task={task!r} means runner={t_runner!r}, convert={t_convert!r}: it contradicts "
            f"runner={runner!r}, convert={convert!r}"
        )
    return t_runner, t_convert


def convert_architectures(hf_config: Any, convert: str) -> None:
    """convert="classify": each `*ForCausalLM` (GPT-2's `GPT2LMHeadModel`) in the config's
    architectures renamed to its `*ForSequenceClassification`."""
    if convert != "classify":
        return
    archs = list(getattr(hf_config, "architectures", None) or [])
    renamed = []
    for arch in archs:
        if arch == "GPT2LMHeadModel":
            arch = "GPT2ForSequenceClassification"
        elif arch.endswith("ForCausalLM"):
            arch = arch.removesuffix("ForCausalLM") + "ForSequenceClassification"
        renamed.append(arch)
    if not any(a.endswith("ForSequenceClassification") for a in renamed):
        raise ValueError(
            f"convert='classify' needs a *ForCausalLM or *ForSequenceClassification model, got "
            f"architectures {archs}"
        )
    hf_config.architectures = renamed


def serves(runner: str, convert: str, is_classifier: bool, is_encoder: bool = False) -> str:
    """What the engine accepts: "generate", "pooling" or "both"."""
    if is_classifier or is_encoder:
        if runner == "generate":
            what = "a sequence classifier" if is_classifier else "an encoder-only model"
            raise ValueError(
                f"runner='generate': this model is {what}, which only pools (use "
                "runner='pooling' or 'auto')"
            )
        return "pooling"
    if runner == "auto":
        return "pooling" if convert == "embed" else "both"
    return runner
