"""Regressions found by a review of the second session's shared-code changes: a token
classifier's refusal of an embedding task names its own task (it pointed at LLM.classify, which
refuses it too), and a BART prompt dict's prompt_token_ids must be token ids (a str there was
tokenized as text: engine/encoder_prompt.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from paged_engine import PoolingParams
from paged_engine.classification import ClassifierInfo
from paged_engine.engine.encoder_prompt import EncoderPrompts
from paged_engine.pooling import to_sampling_params

TAGGER = ClassifierInfo(
    "BertForTokenClassification", 3, ("O", "B-PER", "I-PER"), "softmax", "softmax", per_token=True
)


@pytest.mark.parametrize("task", ["embed", "token_embed", "classify"])
def test_a_token_classifier_refusal_names_its_task(task: str) -> None:
    with pytest.raises(ValueError, match="token classifier") as e:
        to_sampling_params(PoolingParams(task=task), None, 32, TAGGER)
    assert "token_classify" in str(e.value) and "LLM.classify" not in str(e.value)
    assert to_sampling_params(PoolingParams(), None, 32, TAGGER).classify  # its own task runs


class _Tokenizer:
    bos_token_id = 0

    def encode(self, text: str) -> list[int]:
        return [0, *(3 + len(w) for w in text.split()), 2]


def _bart_prompts() -> EncoderPrompts:
    config = SimpleNamespace(
        architectures=["BartForConditionalGeneration"],
        decoder_start_token_id=2,
        bos_token_id=0,
        max_position_embeddings=16,
    )
    return EncoderPrompts(_Tokenizer(), config, vocab_size=50)


@pytest.mark.parametrize("where", ["encoder_prompt", "decoder_prompt"])
def test_bart_prompt_token_ids_must_be_ids(where: str) -> None:
    prompts = _bart_prompts()
    bad = {"prompt_token_ids": "two words"}
    prompt = {"encoder_prompt": [5, 6], "decoder_prompt": None, where: bad}
    with pytest.raises(ValueError, match=f"{where}: prompt_token_ids must be a list"):
        prompts.split(prompt)
    split = prompts.split({"prompt_token_ids": (5, 6)})  # a tuple of ids is fine
    assert split.decoder["prompt_token_ids"] == [2, 0]
    assert split.items[0].pixel_values.tolist() == [5, 6]
    split = prompts.split({"prompt": "two words"})  # text: tokenized
    assert split.items[0].pixel_values.tolist() == [0, 6, 8, 2]


def test_vllms_gemma4_mtp_method_is_the_gemma4_assistant() -> None:
    """vLLM's {"method": "gemma4_mtp", "model": <Gemma 4 assistant>} drafts with that assistant;
    read as "mtp" it was refused for naming a model."""
    from paged_engine.spec_decode.config import SpeculativeConfig

    spec = {"method": "gemma4_mtp", "model": "google/gemma-4-E2B-it-assistant"}
    got = SpeculativeConfig.from_dict({**spec, "num_speculative_tokens": 2})
    assert got.is_gemma4_assistant and got.model == spec["model"]
    with pytest.raises(ValueError, match=r"speculative_config\.model must name the draft"):
        SpeculativeConfig.from_dict({"method": "gemma4_mtp", "num_speculative_tokens": 2})
    assert SpeculativeConfig.from_dict({"method": "qwen3_next_mtp"}).is_mtp  # still "mtp"


def test_bart_cache_salt_decoder_beats_encoder() -> None:
    """The decoder prompt's cache_salt keys the request where given, else the encoder prompt's
    (a salt dropped would share prefix-cache blocks across tenants)."""
    prompts = _bart_prompts()
    enc = {"prompt_token_ids": [5, 6], "cache_salt": "enc"}
    split = prompts.split({"encoder_prompt": enc, "decoder_prompt": None})
    assert split.decoder["cache_salt"] == "enc"
    dec = {"prompt_token_ids": [2, 0], "cache_salt": "dec"}
    split = prompts.split({"encoder_prompt": enc, "decoder_prompt": dec})
    assert split.decoder["cache_salt"] == "dec"
    assert "cache_salt" not in prompts.split({"prompt_token_ids": [5, 6]}).decoder
