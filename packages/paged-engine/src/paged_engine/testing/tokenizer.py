"""The tiny byte-level BPE tokenizer, trained in code on a fixed corpus (deterministic per
seed)."""

from __future__ import annotations

from paged_engine.testing.tiny_archs import (
    BOS_ID,
    CHAT_TEMPLATE,
    EOS_ID,
    PAD_ID,
    SPECIAL_TOKENS,
    TINY_VOCAB_SIZE,
)

_CORPUS_TEXT = (
    "the a an of to in and is was for on with as by at from that this it be are or not "
    "paged attention block cache key value token sequence model layer head batch prefill "
    "decode sample greedy beam memory table slot copy write read hello world my name is "
    "capital city France Paris Berlin Rome river mountain ocean number one two three four "
    "five six seven eight nine ten quick brown fox jumps over lazy dog once upon time there "
    "lived king queen castle story end begin user assistant system question answer yes no"
)
_CORPUS_WORDS = _CORPUS_TEXT.split()


def _corpus(seed: int, lines: int = 400) -> list[str]:
    import random

    rng = random.Random(seed)
    out = []
    for _ in range(lines):
        words = [rng.choice(_CORPUS_WORDS) for _ in range(rng.randint(4, 14))]
        if rng.random() < 0.3:
            words.append(str(rng.randint(0, 999)))
        out.append(" ".join(words) + rng.choice([".", "!", "?", ",", "\n"]))
    return out


def build_tiny_tokenizer(vocab_size: int = TINY_VOCAB_SIZE, seed: int = 0):
    """A byte-level BPE `PreTrainedTokenizerFast` with exactly `vocab_size` tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(seed), trainer=trainer)
    missing = vocab_size - tok.get_vocab_size()
    if missing < 0:
        raise ValueError(f"vocab_size={vocab_size} is too small for a byte-level tokenizer")
    if missing:  # a small corpus ran out of merges: fill up with inert tokens
        tok.add_tokens([f"<|extra_{i}|>" for i in range(missing)])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=SPECIAL_TOKENS[BOS_ID],
        eos_token=SPECIAL_TOKENS[EOS_ID],
        pad_token=SPECIAL_TOKENS[PAD_ID],
        chat_template=CHAT_TEMPLATE,
        model_max_length=1024,
    )
