"""Reward models: the Qwen2 ones (vLLM's qwen2_rm.py), Qwen/Qwen2.5-Math-RM-72B's
`Qwen2ForRewardModel` and Qwen/Qwen2.5-Math-PRM-7B's `Qwen2ForProcessRewardModel`, and
InternLM2's (vLLM's internlm2.py), internlm/internlm2-1_8b-reward / 7b / 20b's
`InternLM2ForRewardModel`.

The Qwen2 two are the Qwen2 decoder (the causal checkpoint's `model.*` names) with a two-layer
head in place of the LM head, run on every token:

    score(h) = score.2(relu(score.0(h)))     score.0: Linear(D, D), score.2: Linear(D, L)
                                             (both with bias, as the remote code's nn.Linear)

    Qwen2ForRewardModel         L = 1: each prompt token's reward, raw (vLLM turns the
                                activation off for it): [num_prompt_tokens, 1]
    Qwen2ForProcessRewardModel  L = 2: STEP pooling, only the rows of the step-tag tokens
                                (`<extra_0>`, id 151651, or the config's `step_tag_id`), each
                                softmaxed over its 2 labels: [num_steps, 2]

    InternLM2ForRewardModel     the InternLM2 decoder (models/llama_variants.py, packed `wqkv`)
                                with `v_head`: Linear(D, 1), no bias (loaded as our `score`),
                                on every token (ALL pooling): [num_prompt_tokens, 1], through
                                vLLM's default token-classify activation, a sigmoid on the one
                                column (classification.py's REWARD_MODELS row; vLLM has no
                                config override turning it off, unlike Qwen2ForRewardModel's).
                                The remote code's `get_score` appends `reward_token_id` and
                                reads the last token's value: here, as in vLLM, the prompt
                                carries that token and the caller reads its row.

For the Qwen2 two vLLM forces num_labels to 1 / 2 whatever the config says, and so does this
file. The engine serves them all as per-token classifiers (classification.py `REWARD_MODELS`:
task "token_classify", `LLM.encode` / `LLM.reward`, `/pooling`); they never generate.
`PoolingParams(use_activation=False)` gives the raw values. vLLM's `returned_token_ids` (a
column selection) is not supported: paged's PoolingParams has no such field.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from paged_engine.models.llama_variants import InternLM2ForCausalLM
from paged_engine.models.qwen2 import Qwen2ForCausalLM
from paged_engine.models.sequence_classifier import ScoreHead


class RewardHead(ScoreHead):
    """Mixin (before a CausalLMBase subclass): `ZeroLogits` for the engine's throwaway token,
    a checkpoint's LM head skipped (vLLM ignores it too), `ScoreHead`'s classify."""

    pooling_only = "a reward model"

    def load_weights(
        self, weights: Iterable[tuple[str, torch.Tensor]], strict: bool = True
    ) -> set[str]:
        head = f"{self.head_name}."
        kept = ((n, w) for n, w in weights if not self.rename_weight(n).startswith(head))
        return super().load_weights(kept, strict)


class Qwen2RewardBase(RewardHead, Qwen2ForCausalLM):
    """The Qwen2 decoder and the two-layer `score` head."""

    num_labels: int = 1

    def __init__(self, config) -> None:
        config.num_labels = self.num_labels  # as vLLM: the head's width, whatever the config says
        super().__init__(config)
        width = self._drop_lm_head(config)
        self.score = nn.Sequential(
            nn.Linear(width, width), nn.ReLU(), nn.Linear(width, self.num_labels)
        )


class Qwen2ForRewardModel(Qwen2RewardBase):
    num_labels = 1


class Qwen2ForProcessRewardModel(Qwen2RewardBase):
    num_labels = 2


class InternLM2ForRewardModel(RewardHead, InternLM2ForCausalLM):
    """The InternLM2 decoder and `v_head` (the checkpoint's top-level name)."""

    def __init__(self, config) -> None:
        super().__init__(config)
        self.score = nn.Linear(self._drop_lm_head(config), 1, bias=False)  # [N, D] -> [N, 1]

    def rename_weight(self, name: str) -> str:
        return "score.weight" if name == "v_head.weight" else super().rename_weight(name)


REWARD_CLASSES: dict[str, type[nn.Module]] = {
    "Qwen2ForRewardModel": Qwen2ForRewardModel,
    "Qwen2ForProcessRewardModel": Qwen2ForProcessRewardModel,
    "InternLM2ForRewardModel": InternLM2ForRewardModel,
}
