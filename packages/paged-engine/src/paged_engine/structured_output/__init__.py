"""Structured outputs (constrained decoding): the output follows a JSON schema, regex, choice
list or grammar, enforced by masking the logits each step.

    params.py              StructuredOutputsParams (vLLM's names; GuidedDecodingParams alias)
    grammar.py             params -> a checked llguidance grammar (ValueError naming the field)
    work_bounds.py         refuses what llguidance would not bound: counted repeats (through
                           grammar rules too), big constants, too many object alternatives
    backend.py             GrammarBackend / GrammarMatcher: the grammar engine's interface
    llguidance_backend.py  the implementation on llguidance (`paged-engine[structured]`)
    manager.py             compile cache and thread; each step's token bitmask
    request_constraint.py  one request's matchers (per sequence) and bad words
    bitmask.py             the [R, ceil(V / 32)] int32 layout; applied to logits in one op

Only `params.py` is imported eagerly (by sampling_params); llguidance loads with the first
constrained request.
"""
