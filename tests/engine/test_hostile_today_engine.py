"""Hostile inputs to the $ref loop check (structured_output/schema_refs.py) and suffix
decoding's config (spec_decode/config.py): refused by name or served, in bounded time and
memory, never an exception the caller does not expect."""

from __future__ import annotations

import tracemalloc

import pytest

from paged_engine.spec_decode.config import SpeculativeConfig
from paged_engine.spec_decode.suffix_proposer import SuffixProposer
from paged_engine.structured_output.schema_refs import check_ref_cycles, ref_cycle


def _deep_properties(depth: int, key_len: int) -> dict:
    schema: dict = {"type": "integer"}
    for i in range(depth):
        key = f"k{i:05d}" * (key_len // 6)
        schema = {"type": "object", "properties": {key: schema}}
    return {**schema, "$ref": "#/$defs/x", "$defs": {"x": {"type": "integer"}}}


def test_deep_schema_with_long_keys_walks_in_linear_memory() -> None:
    # a pointer string per node cost depth^2 / 2 x key length (~100 MB here; 16 MB bodies
    # reached GBs through a structural tag, checked before llguidance sees the schema)
    schema = _deep_properties(200, 5000)
    tracemalloc.start()
    try:
        assert ref_cycle(schema) is None
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 10 << 20, peak


def test_a_loop_is_still_named_by_its_pointers() -> None:
    # pointers are joined from each node's parent for the loop reported
    loop = ref_cycle({"allOf": [{"anyOf": [{"$ref": "#"}]}]})
    assert loop == ["#", "#/allOf/0", "#/allOf/0/anyOf/0", "#"]
    inner = {"anyOf": [{"$ref": "#/properties/p~1q~0"}]}
    loop = ref_cycle({"type": "object", "properties": {"p/q~": inner}})
    assert loop == ["#/properties/p~1q~0", "#/properties/p~1q~0/anyOf/0", "#/properties/p~1q~0"]


def test_a_loop_through_many_defs_gives_a_short_message() -> None:
    n = 10_000
    defs = {f"d{i}": {"$ref": f"#/$defs/d{(i + 1) % n}"} for i in range(n)}
    with pytest.raises(ValueError) as err:
        check_ref_cycles({"$defs": defs, "$ref": "#/$defs/d0"}, "structured_outputs.json")
    message = str(err.value)
    assert message.startswith("structured_outputs.json is invalid: unresolvable $ref cycle")
    assert "#/$defs/d0 -> #/$defs/d1" in message and "more" in message
    assert len(message) < 1000, len(message)


def test_a_loop_deep_under_long_keys_is_named_briefly() -> None:
    # each of the loop's 101 pointers held the 0.5 MB path to it: a 50 MB message
    loop: dict = {"$ref": "#A"}
    for _ in range(100):
        loop = {"anyOf": [loop]}
    schema = {"$anchor": "A", **loop}
    for i in range(100):
        schema = {"type": "object", "properties": {f"k{i:05d}" * 800: schema}}
    tracemalloc.start()
    try:
        with pytest.raises(ValueError, match=r"unresolvable \$ref cycle …") as err:
            check_ref_cycles(schema, "structured_outputs.json")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert "... (95 more)" in str(err.value) and len(str(err.value)) < 2500
    assert peak < 10 << 20, peak


def test_an_id_elsewhere_does_not_switch_the_check_off() -> None:
    # any subschema with its own $id made ref_cycle give up: this schema was accepted, then
    # generation stopped at '{"p": 1, "q": ' (the loop cannot start a value)
    loop = {"anyOf": [{"$ref": "#/$defs/a"}]}
    schema = {
        "type": "object",
        "properties": {
            "p": {"$id": "http://other/", "type": "integer"},
            "q": {"$ref": "#/$defs/a"},
        },
        "required": ["q"],
        "$defs": {"a": loop},
    }
    assert ref_cycle(schema) == ["#/$defs/a", "#/$defs/a/anyOf/0", "#/$defs/a"]


def test_a_subschema_with_its_own_id_is_left_to_llguidance() -> None:
    # inside it "#/$defs/a" and "#A" mean its own $defs / anchors, not the root's loop
    looping = {"a": {"anyOf": [{"$ref": "#/$defs/a"}]}}
    inner = {"$id": "http://other/", "$defs": {"a": {"type": "integer"}}, "$ref": "#/$defs/a"}
    schema = {"type": "object", "properties": {"p": inner}, "$defs": looping}
    assert ref_cycle(schema) is None
    # a root pointer or anchor into it does not read its $refs as the root's
    inner = {"$id": "http://other/", "$anchor": "A", "$ref": "#/$defs/a"}
    schema = {"$defs": {**looping, "b": inner}, "anyOf": [{"$ref": "#/$defs/b"}, {"$ref": "#A"}]}
    assert ref_cycle(schema) is None


@pytest.mark.parametrize("index", ["²", "9" * 5000, "99999999999999999999", "-1", "+0"])
def test_a_pointer_index_that_is_no_index_resolves_to_nothing(index: str) -> None:
    # int("²") and int("9" * 5000) raise ValueError; such a $ref is llguidance's to judge
    schema = {"$ref": f"#/prefixItems/{index}", "prefixItems": [{"type": "integer"}]}
    assert ref_cycle(schema) is None


def test_suffix_tree_depth_is_bounded_by_name() -> None:
    # 1e9 made num_speculative_tokens 1e9 and the proposer allocate a 16 GB array at start
    key = "suffix_decoding_max_tree_depth"
    with pytest.raises(ValueError, match=rf"speculative_config\.{key} must be <= 1024, got 10"):
        SpeculativeConfig.from_dict({"method": "suffix", key: 10**9})
    deepest = SpeculativeConfig.from_dict({"method": "suffix", key: 1024})
    assert deepest.num_speculative_tokens == 1024


@pytest.mark.parametrize("factor", [1e308, 1e300, 1e6])
def test_a_huge_spec_factor_drafts_as_the_depth_allows(factor: float) -> None:
    # 1e308 x a match of 2 is inf: int(inf) raised OverflowError in propose, on the step
    cfg = SpeculativeConfig.from_dict(
        {"method": "suffix", "suffix_decoding_max_spec_factor": factor}
    )
    assert cfg.suffix_decoding_max_spec_factor == 24.0
    proposer = SuffixProposer(
        cfg.suffix_decoding_max_tree_depth,
        cfg.suffix_decoding_max_cached_requests,
        cfg.suffix_decoding_max_spec_factor,
        cfg.suffix_decoding_min_token_prob,
    )
    assert proposer.propose(0, [1, 2, 3, 4] * 4, 5) == [1, 2, 3, 4, 1]


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("suffix_decoding_max_spec_factor", float("inf")),
        ("suffix_decoding_max_spec_factor", float("nan")),
        ("suffix_decoding_max_spec_factor", "1"),
        ("suffix_decoding_min_token_prob", True),
        ("suffix_decoding_max_tree_depth", 24.0),
        ("suffix_decoding_max_cached_requests", None),
    ],
)
def test_suffix_keys_of_the_wrong_kind_are_refused_by_name(key: str, value: object) -> None:
    with pytest.raises(ValueError, match=rf"speculative_config\.{key} must be"):
        SpeculativeConfig.from_dict({"method": "suffix", key: value})
