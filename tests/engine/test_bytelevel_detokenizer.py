"""The byte-level fast path gives exactly the full decode, streamed without broken characters."""

from __future__ import annotations

import gc
import random

import pytest

from paged_engine.engine.bytelevel_detokenizer import (
    ByteLevelDetokenizer,
    byte_level_vocab,
    make_detokenizer,
)
from paged_engine.engine.detokenizer import IncrementalDetokenizer
from paged_engine.testing import build_tiny_tokenizer


@pytest.fixture(scope="module")
def tokenizers_under_test():
    toks = [build_tiny_tokenizer()]
    try:
        from paged_engine.default_model import default_model_path
        from paged_engine.loader import load_tokenizer, resolve_model

        toks.append(load_tokenizer(resolve_model(str(default_model_path()))))
    except Exception:  # the default model is optional here
        pass
    return toks


def test_stream_equals_full_decode(tokenizers_under_test):
    rng = random.Random()
    for tok in tokenizers_under_test:
        table = byte_level_vocab(tok)  # built once per tokenizer, as the output processor does
        for _ in range(400):
            skip = rng.random() < 0.5
            ids = [rng.randrange(len(tok)) for _ in range(rng.randint(1, 16))]
            if rng.random() < 0.5:
                ids += tok.encode("héllo 世界 🙂 ok", add_special_tokens=False)
            det = make_detokenizer(tok, [], skip_special_tokens=skip, vocab=table)
            assert isinstance(det, ByteLevelDetokenizer)
            streamed, i = "", 0
            while i < len(ids):
                k = rng.randint(1, 3)
                streamed += det.add_tokens(ids[i : i + k])
                i += k
                full = tok.decode(ids[:i], skip_special_tokens=skip)
                assert full.startswith(streamed) or "\ufffd" in full
            streamed += det.finalize()
            assert streamed == det.output_text
            assert streamed == tok.decode(ids, skip_special_tokens=skip)


def test_holds_back_a_split_character_and_forks():
    tok = build_tiny_tokenizer()
    ids = tok.encode("🙂🙂", add_special_tokens=False)
    det = make_detokenizer(tok, [])
    for t in ids[:-1]:
        det.add_tokens([t])
    child = det.fork()
    assert "\ufffd" not in det.output_text
    assert det.add_tokens(ids[-1:]) + child.add_tokens(ids[-1:]) == "🙂" * 2 or len(ids) == 1
    assert det.output_text == child.output_text == "🙂🙂"


def test_non_byte_level_tokenizers_use_the_general_path():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    raw = Tokenizer(models.WordLevel({"a": 0, "b": 1, "[UNK]": 2}, unk_token="[UNK]"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    raw.decoder = decoders.WordPiece()
    assert isinstance(make_detokenizer(raw, []), IncrementalDetokenizer)


def test_each_tokenizer_decodes_with_its_own_table():
    """Tokenizers of different vocabularies made and dropped one after another (a new one often
    lands at a dead one's address: a cache keyed by id() decoded with the wrong table) each
    decode with their own, alone and through an engine's output processor."""
    from paged_engine.engine.output_processor import OutputProcessor

    ids = list(range(3, 400))  # byte tokens and merges, which differ between the vocabularies
    # The collection after each drop frees the tokenizer's reference cycles; with the heap as it
    # was before the loop frozen, it walks only what the loop made (a full walk of a test
    # process's heap is ~1 s).
    gc.freeze()
    try:
        for seed in range(16):
            tok = build_tiny_tokenizer(seed=seed)
            expected = tok.decode(ids, skip_special_tokens=True)
            det = make_detokenizer(tok, [])
            assert det.add_tokens(ids) + det.finalize() == expected
            processor = OutputProcessor(tok)
            det = make_detokenizer(tok, [], vocab=processor._byte_vocab)
            assert det.add_tokens(ids) + det.finalize() == expected
            del tok, det, processor
            gc.collect()
    finally:
        gc.unfreeze()
