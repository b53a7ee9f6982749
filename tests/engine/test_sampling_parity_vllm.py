"""Offline-API details where paged follows vLLM's current behaviour: the temperature clamp
(sampling_params.py `_MAX_TEMP`), stop strings tried in list order with no held-back text when
they are kept (v1/engine/detokenizer.py `check_stop_strings`, `stop_buffer_length`), and
`spaces_between_special_tokens=False` on fast tokenizers (`FastIncrementalDetokenizer`)."""

from __future__ import annotations

import logging

import pytest
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from paged_engine.core.core_output import EngineCoreOutput, SeqUpdate
from paged_engine.engine.bytelevel_detokenizer import _CHAR_TO_BYTE
from paged_engine.engine.detokenizer import find_stop
from paged_engine.engine.output_processor import OutputProcessor
from paged_engine.sampling_params import RequestOutputKind, SamplingParams, SamplingType
from paged_engine.testing import build_tiny_tokenizer


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@pytest.fixture
def warnings_logged():
    """Warnings of paged_engine.sampling_params (its package logger may not propagate)."""
    handler = _Records()
    logger = logging.getLogger("paged_engine.sampling_params")
    logger.addHandler(handler)
    try:
        yield handler.messages
    finally:
        logger.removeHandler(handler)


@pytest.mark.parametrize("temperature", [1e-6, 1e-3, 0.00999])
def test_a_temperature_below_one_hundredth_is_raised_to_it(temperature, warnings_logged):
    """vLLM raises 0 < t < 0.01 to 0.01 before deciding greedy: even 1e-6 samples (its top_p /
    top_k stay), and the user is warned."""
    p = SamplingParams(temperature=temperature, top_p=0.5, top_k=5)
    assert p.temperature == 0.01
    assert p.sampling_type == SamplingType.RANDOM and not p.is_greedy
    assert (p.top_p, p.top_k) == (0.5, 5)
    assert len(warnings_logged) == 1 and "temperature" in warnings_logged[0]


def test_zero_and_larger_temperatures_are_kept(warnings_logged):
    greedy = SamplingParams(temperature=0.0, top_p=0.5)
    assert greedy.temperature == 0.0 and greedy.is_greedy and greedy.top_p == 1.0
    assert SamplingParams(temperature=0.01).temperature == 0.01
    assert SamplingParams(temperature=0.7).temperature == 0.7
    assert warnings_logged == []


def test_find_stop_takes_the_first_stop_in_list_order():
    # "xab": both stops end in the new "ab"; the first listed wins, wherever it is
    assert find_stop("xab", 2, ["b", "a"], False) == (2, "b")
    assert find_stop("xab", 2, ["b", "a"], True) == (3, "b")
    assert find_stop("xab", 2, ["a", "b"], False) == (1, "a")
    assert find_stop("xab", 2, ["a", "b"], True) == (2, "a")
    # a listed stop outside the searched tail is no match; the next one is tried
    assert find_stop("bxa", 1, ["b", "a"], False) == (2, "a")


def _tokenizer() -> PreTrainedTokenizerFast:
    tok = build_tiny_tokenizer()
    tok.add_tokens([AddedToken("xyz", normalized=False)])  # one token, three characters
    return tok


def _char_ids(tok: PreTrainedTokenizerFast, text: str) -> list[int]:
    """`text` (ASCII) one byte-level token per character."""
    char_of = {b: c for c, b in _CHAR_TO_BYTE.items()}
    return tok.convert_tokens_to_ids([char_of[b] for b in text.encode()])


def _stream(tok, out: list[int], params: SamplingParams) -> tuple[list[str], str, str, object]:
    """`out` through the output processor one token a step (DELTA): the deltas, the final
    text, finish_reason and stop_reason."""
    processor = OutputProcessor(tok)
    processor.add_request("r", None, [1], params, 0.0, num_returned=1, kind=RequestOutputKind.DELTA)
    deltas: list[str] = []
    finish, stop_reason = None, None
    for k, token in enumerate(out):
        last = k == len(out) - 1
        upd = SeqUpdate(0, [token], finish_reason="length" if last else None)
        co = EngineCoreOutput("r", [upd], finished=last)
        for o in processor.process([co]).request_outputs:
            deltas.append(o.outputs[0].text)
            finish = o.outputs[0].finish_reason or finish
            stop_reason = o.outputs[0].stop_reason or stop_reason
        if finish is not None:
            break
    return deltas, "".join(deltas), finish, stop_reason


@pytest.mark.parametrize("include", [False, True])
def test_one_token_completing_two_stops_ends_at_the_first_listed(include):
    """The token "xyz" completes both "z" and "y": vLLM takes "z" (listed first), not the
    earlier "y"."""
    tok = _tokenizer()
    out = [*_char_ids(tok, "ab"), tok.convert_tokens_to_ids("xyz"), *_char_ids(tok, "cd")]
    params = SamplingParams(stop=["z", "y"], include_stop_str_in_output=include, max_tokens=8)
    _, text, finish, stop_reason = _stream(tok, out, params)
    assert (text, finish, stop_reason) == ("abxyz" if include else "abxy", "stop", "z")


def test_a_kept_stop_string_holds_nothing_back():
    """With include_stop_str_in_output vLLM's buffer is 0: each step's text streams at once,
    even a tail that could grow into the stop string. Without it that tail waits."""
    tok = _tokenizer()
    out = _char_ids(tok, "Hello world!")
    kept = SamplingParams(stop=["world"], include_stop_str_in_output=True, max_tokens=32)
    deltas, text, finish, stop_reason = _stream(tok, out, kept)
    assert deltas[: len("Hello world")] == list("Hello world")
    assert (text, finish, stop_reason) == ("Hello world", "stop", "world")

    cut = SamplingParams(stop=["world"], max_tokens=32)
    deltas, text, finish, _ = _stream(tok, out, cut)
    assert deltas[6:10] == ["", "", "", ""]  # "w", "wo", "wor", "worl" held
    assert (text, finish) == ("Hello ", "stop")


def _wordpiece() -> PreTrainedTokenizerFast:
    """BERT style: its decoder puts a space between tokens, added ones included."""
    vocab = {t: i for i, t in enumerate(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "the", "fox"])}
    tok = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=True)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="[UNK]", sep_token="[SEP]", cls_token="[CLS]"
    )
    fast.add_tokens([AddedToken("<x>", normalized=False)])  # added, not special
    return fast


@pytest.mark.parametrize("kind", [RequestOutputKind.DELTA, RequestOutputKind.FINAL_ONLY])
@pytest.mark.parametrize(
    ("skip", "spaces", "expected"),
    [
        (False, False, " fox [SEP][CLS]<x> fox"),  # vLLM: adjacent added tokens bare
        (False, True, " fox [SEP] [CLS] <x> fox"),
        (True, False, " fox <x> fox"),  # specials skipped: the flag does nothing
    ],
)
def test_spaces_between_special_tokens_on_a_fast_tokenizer(kind, skip, spaces, expected):
    tok = _wordpiece()
    fox, sep, cls, x = tok.convert_tokens_to_ids(["fox", "[SEP]", "[CLS]", "<x>"])
    params = SamplingParams(
        skip_special_tokens=skip, spaces_between_special_tokens=spaces, max_tokens=8
    )
    processor = OutputProcessor(tok)
    prompt = tok.convert_tokens_to_ids(["the"])
    processor.add_request("r", None, prompt, params, 0.0, num_returned=1, kind=kind)
    # four tokens in one step (speculative decoding): each still sees the token before it
    steps = [SeqUpdate(0, [fox, sep, cls, x]), SeqUpdate(0, [fox], finish_reason="length")]
    text = ""
    for k, upd in enumerate(steps):
        co = EngineCoreOutput("r", [upd], finished=k == 1)
        for o in processor.process([co]).request_outputs:
            text += o.outputs[0].text
    assert text == expected
