"""jina-reranker-m0 (config.json `JinaVLForRanking`, remote code; vLLM's
`JinaVLForSequenceClassification`): Qwen2-VL's decoder with a two-layer score head on the
last token, served as a cross-encoder (`LLM.score`, `LLM.classify`).

    score(h) = score.2(relu(score.0(h))) - 2.65    h: the final normed hidden state of the
                                                   last prompt token (the appended score token,
                                                   id 100: jina_vl_scoring.py)
    LLM.score / LLM.classify = sigmoid(score(h))   (use_activation=False: score(h) itself)

score.0 is Linear(D, D), score.2 Linear(D, 1), both with bias (the remote code's nn.Linear).
The -2.65 is the release's `LOGIT_BIAS`, which vLLM applies as its pooler_config.logit_bias
default; paged fixes it (a pooler_config `logit_bias` is refused as an unknown key). vLLM
forces num_labels to 1, and so does models/text_wrappers.py's row for the wrapper.

The release saves transformers 4.4x's Qwen2-VL names (`model.X` decoder, `visual.X` tower, no
LM head: its remote code replaces it by an identity) beside `score.0.*` / `score.2.*`. The
wrapper row (text_wrappers.py) serves the decoder as this class and drops `visual.`; the image
path is Qwen2-VL's (multimodal/archs.py KINDS), so images in a prompt run as for
Qwen2VLForConditionalGeneration. The head is the same as Qwen2ForRewardModel's
(models/reward_model.py), run here on the last token only (LAST pooling; other pooling types
are refused by jina_vl_scoring.check_pooler_config).
"""

from __future__ import annotations

import torch

from paged_engine.models.reward_model import Qwen2RewardBase

LOGIT_BIAS = 2.65


class JinaVLForSequenceClassification(Qwen2RewardBase):
    """The Qwen2 decoder and the `score` MLP, its logit shifted by -LOGIT_BIAS."""

    num_labels = 1
    pooling_only = "a cross-encoder (reranker)"

    def classify(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, D] -> [N, 1]
        return self.score(hidden) - LOGIT_BIAS
