"""The Transformers modeling backend (vLLM's `model_impl="transformers"`): HF's own modeling code
run by paged's engine, each HF attention module's q / k / v handed to paged attention.

    selection.py    which checkpoints the backend runs (`check_transformers_config`) and the
                    engine-start decision that marks a config for it (`select_model_impl`,
                    `IMPL_FIELD`); everything else refused by name
    causal.py       causal LMs (`TransformersForCausalLM`): HF's backbone, the "paged"
                    attention function registered in transformers' `AttentionInterface`,
                    paged's LM head
    experts.py      mixture-of-experts checkpoints: per-expert linears stacked into HF's 3D
                    expert parameters as transformers converts them
    pooling.py      embeddings and sequence classifiers on the same backbone, vLLM's
                    Transformers* architecture names, the class for a marked config
                    (`transformers_model_class`)
    multimodal.py   vision-language wrappers: the decoder on input embeddings and HF's
                    `get_image_features` as the image encoder (`TransformersImageEncoder`)
    encoder.py      encoder-only models (BERT's family) on paged's encoder path

The names other modules use are re-exported here; product code imports them from the
submodules."""

from paged_engine.models.transformers_backend.encoder import (
    TransformersEncoderForSequenceClassification,
)
from paged_engine.models.transformers_backend.multimodal import TransformersImageEncoder
from paged_engine.models.transformers_backend.pooling import transformers_model_class
from paged_engine.models.transformers_backend.selection import (
    IMPL_FIELD,
    check_transformers_config,
    select_model_impl,
)

__all__ = [
    "IMPL_FIELD",
    "TransformersEncoderForSequenceClassification",
    "TransformersImageEncoder",
    "check_transformers_config",
    "select_model_impl",
    "transformers_model_class",
]
