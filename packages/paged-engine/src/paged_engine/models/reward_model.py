"""Qwen2 reward models (vLLM's qwen2_rm.py): Qwen/Qwen2.5-Math-RM-72B's `Qwen2ForRewardModel`
and Qwen/Qwen2.5-Math-PRM-7B's `Qwen2ForProcessRewardModel`.

Both are the Qwen2 decoder (the causal checkpoint's `model.*` names) with a two-layer head in
place of the LM head, run on every token:

    score(h) = score.2(relu(score.0(h)))     score.0: Linear(D, D), score.2: Linear(D, L)
                                             (both with bias, as the remote code's nn.Linear)

    Qwen2ForRewardModel         L = 1: each prompt token's reward, raw (vLLM turns the
                                activation off for it): [num_prompt_tokens, 1]
    Qwen2ForProcessRewardModel  L = 2: STEP pooling, only the rows of the step-tag tokens
                                (`<extra_0>`, id 151651, or the config's `step_tag_id`), each
                                softmaxed over its 2 labels: [num_steps, 2]

vLLM forces num_labels to 1 / 2 whatever the config says, and so does this file. The engine
serves them as per-token classifiers (classification.py `REWARD_MODELS`: task
"token_classify", `LLM.encode` / `LLM.reward`, `/pooling`); they never generate.
`PoolingParams(use_activation=False)` gives a PRM's raw logits. vLLM's `returned_token_ids`
(a column selection) is not supported: paged's PoolingParams has no such field.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from paged_engine.models.qwen2 import Qwen2ForCausalLM
from paged_engine.models.sequence_classifier import ScoreHead


class Qwen2RewardBase(ScoreHead, Qwen2ForCausalLM):
    """The decoder, `ZeroLogits` for the engine's throwaway token, and the reward head
    (`ScoreHead`'s rename_weight and classify)."""

    num_labels: int = 1
    pooling_only = "a reward model"

    def __init__(self, config) -> None:
        config.num_labels = self.num_labels  # as vLLM: the head's width, whatever the config says
        super().__init__(config)
        width = self._drop_lm_head(config)
        self.score = nn.Sequential(
            nn.Linear(width, width), nn.ReLU(), nn.Linear(width, self.num_labels)
        )

    def load_weights(
        self, weights: Iterable[tuple[str, torch.Tensor]], strict: bool = True
    ) -> set[str]:
        head = f"{self.head_name}."  # a checkpoint's LM head, which vLLM ignores too
        return super().load_weights(((n, w) for n, w in weights if not n.startswith(head)), strict)


class Qwen2ForRewardModel(Qwen2RewardBase):
    num_labels = 1


class Qwen2ForProcessRewardModel(Qwen2RewardBase):
    num_labels = 2


REWARD_CLASSES: dict[str, type[nn.Module]] = {
    "Qwen2ForRewardModel": Qwen2ForRewardModel,
    "Qwen2ForProcessRewardModel": Qwen2ForProcessRewardModel,
}
