"""Lark / GBNF grammars with a rule that can never end: refused up front, naming the rule.

`start: "a" x | "b"` with `x: "c" x` passes llguidance's validation, but `x` derives no finite
text. llguidance's Earley parser still predicts it: the mask lets the model write `a`, `c`,
and then nothing completes; the matcher errors and the request ends quietly mid-output
(finish_reason "stop", text "ac"). GBNF (`root ::= "a" r | "z"`, `r ::= "b" r`) is the same
once llguidance converts it to Lark, the text read here (both syntaxes are read as llguidance
reads them; GBNF rules are named as written, `gbnf_names`).

A symbol is *productive* when one of its alternatives holds only terminals and productive symbols:
the least fixed point, each alternative counting down its pending symbols (linear). EBNF groups and
operators are symbols of their own (`x*`, `x?`, `[..]`, `x{0,n}`, `x~0..n` have an empty
alternative; `x+`, `x{m,n}`, `x~m..n` need `x`). Two refusals, each a proof that an output
llguidance admits can never complete (the rule: refuse only on a proof, so a grammar that can always
finish is never refused):

1. `start` is unproductive: no text completes the grammar, and either no token may start it
   or the first one leads nowhere. The loop it runs into is named.
2. A *dead* alternative (holding an unproductive symbol `u`) with a witness: the shortest
   literal text after which the parser predicts that alternative, then the shortest text of
   its items before `u`, then the shortest text `u` writes before it is stuck. llguidance (a
   byte-level tokenizer) takes the witness as a start of the grammar's output, but not of the
   *live* grammar's (the same grammar without unproductive symbols and dead alternatives:
   the same texts complete both, so its prefixes are exactly the completable ones): after the
   witness, generation can only get stuck.

Which admitted prefixes are stuck is undecidable in general (prefix inclusion of context-free
languages); anything without such a proof is left to llguidance: a dead alternative every prefix of
which a live one shares (`start: "a" "c"* | "a" x`), a dead alternative entered without text
(`start: x | "a"`, `x: x`: llguidance offers nothing of x), witnesses that need a regex's text
(`start: /[0-9]+/ x | "1"`), rules with attributes (`[max_tokens=..]`, `[lazy]`, `[stop=..]`: they
end on their own terms) or terminal algebra (`&`, `..` ranges, `~` negation: taken as productive),
and text this reader does not follow (templates, `%extend`, `%override`, a definition given twice,
syntax errors): no verdict at all. The reader (`lark_reader.py`) and every pass here are loops
without recursion, linear in the grammar (the witness search adds a heap). Only grammars with an
unproductive symbol go further: llguidance builds the grammar and its live part once each (~1 ms for
a small grammar, ~100 ms near the 100k characters `grammar_text` allows) and runs at most
MAX_WITNESSES witnesses through them.

vLLM has the same hole: its guidance backend runs llguidance's `validate_grammar` only (the
matcher's error is logged as a warning and the request ends), and xgrammar (0.2.9) compiles
`root ::= "a" r`, `r ::= "b" r` and takes `abbb...` until max_tokens. This check is paged's.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import re
from typing import Any

from paged_engine.structured_output.lark_reader import (
    Grammar,
    Item,
    Lit,
    Raw,
    Unreadable,
    read_lark,
)

logger = logging.getLogger(__name__)
MAX_WITNESSES = 8  # dead alternatives tried, at most
MAX_WITNESS_CHARS = 512
_SHOWN = 8  # rules a named loop shows, at most


def productive(g: Grammar) -> list[bool]:
    """Symbol i is productive when one alternative holds only terminals and productive
    symbols: the least fixed point, each alternative counting down its pending symbols."""
    n = len(g.names)
    done = [False] * n
    pending: list[int] = []  # per alternative: items not yet known productive
    head_of: list[int] = []
    users: list[list[int]] = [[] for _ in range(n)]  # symbol -> alternatives waiting on it
    ready: list[int] = []
    for s in range(n):
        for alt in g.alts[s]:
            a = len(pending)
            head_of.append(s)
            count = 0
            for x in alt:
                if isinstance(x, int):
                    users[x].append(a)
                    count += 1
            pending.append(count)
            if count == 0:
                ready.append(s)
    while ready:
        s = ready.pop()
        if done[s]:
            continue
        done[s] = True
        for a in users[s]:
            pending[a] -= 1
            if pending[a] == 0 and not done[head_of[a]]:
                ready.append(head_of[a])
    return done


def stuck_rules(lark: str, names: dict[str, str] | None = None) -> str | None:
    """Why `lark` (an llguidance Lark grammar) can get stuck, naming its rules (renamed by
    `names`, e.g. back to GBNF's); None if this module finds no proof it can (docstring).
    Builds llguidance matchers: call it on a big stack (grammar.on_big_stack)."""
    try:
        g = read_lark(lark)
    except (Unreadable, ValueError, RecursionError):
        return None
    ok = productive(g)
    start = g.ids["start"]

    def name(i: int) -> str:
        n = g.names[g.owner[i]]
        return (names or {}).get(n, n)

    if not ok[start]:
        return (
            f"rule {name(start)!r} can never end: every alternative runs into the rule loop "
            f"{' -> '.join(_loop(g, ok, start, name))}, which has no alternative leading out "
            "of it, so no output can complete the grammar; give the loop an alternative "
            "without it"
        )
    if all(ok):
        return None
    found = _trap(g, ok, lark)
    if found is None:
        return None
    witness, head, u = found
    loop = _loop(g, ok, u, name)  # u may be a group: the loop's first rule is named
    return (
        f"rule {loop[0]!r} can never end (every alternative runs into the rule loop "
        f"{' -> '.join(loop)}, with no alternative leading out of it), and an alternative "
        f"of rule {name(head)!r} enters it: after the output {witness[:80]!r} nothing can "
        "complete the grammar; give the loop an alternative without it, or drop the "
        "alternative"
    )


def _loop(g: Grammar, ok: list[bool], s: int, name: Any) -> list[str]:
    """The named rules from unproductive `s`, following each one's first unproductive item
    (every alternative of one has such an item) until one repeats."""
    path: list[int] = []
    seen: dict[int, int] = {}
    while s not in seen:
        seen[s] = len(path)
        path.append(s)
        s = next(x for x in g.alts[s][0] if isinstance(x, int) and not ok[x])
    shown = [name(i) for i in path if g.owner[i] == i]
    cycle = [name(i) for i in path[seen[s] :] if g.owner[i] == i] or [name(s)]
    shown.append(cycle[0])
    if len(shown) > _SHOWN:
        shown = [*shown[: _SHOWN - 2], f"... ({len(shown) - _SHOWN + 2} more)", shown[-1]]
    return shown


def _trap(g: Grammar, ok: list[bool], lark: str) -> tuple[str, int, int] | None:
    """(the witness, the rule whose dead alternative it enters, the unproductive symbol) for
    the first dead alternative whose witness is proven stuck; None if none is."""
    ycost, ychoice = _yields(g, ok)
    dist, parent = _contexts(g, ok, ycost)
    lead = _leads(g, ok, ycost)
    live: _Taker | None = None
    full = _Taker(lark)
    tried = 0
    for a in sorted(dist, key=dist.__getitem__):
        for alt in g.alts[a]:
            i = next((j for j, x in enumerate(alt) if isinstance(x, int) and not ok[x]), None)
            if i is None or any(_cost(x, ycost) is None for x in alt[:i]):
                continue
            u = alt[i]
            size = dist[a] + sum(_cost(x, ycost) or 0 for x in alt[:i]) + lead.get(u, (0,))[0]
            if size == 0 or size > MAX_WITNESS_CHARS:
                continue
            text = _context_text(g, a, parent, ychoice) + _text(alt[:i], ychoice)
            text += _lead_text(u, lead, ychoice)
            if live is None:
                live = _Taker(_live_lark(g, ok))
            if live.takes(text) is False and full.takes(text) is True:
                return text, a, u
            tried += 1
            if tried == MAX_WITNESSES:
                return None
    return None


def _cost(x: Item, ycost: list[float]) -> float | None:
    """The length of the shortest literal text item `x` matches; None if unknown."""
    if isinstance(x, Lit):
        return len(x.text)
    if isinstance(x, Raw) or ycost[x] == _INF:
        return None
    return ycost[x]


_INF = float("inf")


def _yields(g: Grammar, ok: list[bool]) -> tuple[list[float], list[list[Item] | None]]:
    """The shortest literal-only text of each symbol (Knuth's Dijkstra over alternatives):
    its length and the alternative giving it."""
    n = len(g.names)
    cost = [_INF] * n
    choice: list[list[Item] | None] = [None] * n
    users: list[list[int]] = [[] for _ in range(n)]
    alts: list[tuple[int, list[Item]]] = []
    pending: list[int] = []
    partial: list[int] = []
    heap: list[tuple[int, int, int]] = []  # (length, symbol, alternative)
    for s in range(n):
        for alt in g.alts[s]:
            if any(isinstance(x, Raw) for x in alt):
                continue
            a = len(alts)
            alts.append((s, alt))
            syms = [x for x in alt if isinstance(x, int)]
            for x in syms:
                users[x].append(a)
            pending.append(len(syms))
            partial.append(sum(len(x.text) for x in alt if isinstance(x, Lit)))
            if not syms:
                heapq.heappush(heap, (partial[a], s, a))
    while heap:
        c, s, a = heapq.heappop(heap)
        if cost[s] != _INF:
            continue
        cost[s], choice[s] = c, alts[a][1]
        for b in users[s]:
            pending[b] -= 1
            partial[b] += c
            if pending[b] == 0 and cost[alts[b][0]] == _INF:
                heapq.heappush(heap, (partial[b], alts[b][0], b))
    return cost, choice


def _contexts(
    g: Grammar, ok: list[bool], ycost: list[float]
) -> tuple[dict[int, int], dict[int, tuple[int, list[Item], int]]]:
    """The shortest literal text after which the parser predicts each symbol (from `start`,
    through the items before it), up to MAX_WITNESS_CHARS: lengths, and each symbol's
    (rule, alternative, position) on that path."""
    start = g.ids["start"]
    dist = {start: 0}
    parent: dict[int, tuple[int, list[Item], int]] = {}
    heap = [(0, start)]
    done: set[int] = set()
    while heap:
        d, s = heapq.heappop(heap)
        if s in done:
            continue
        done.add(s)
        for alt in g.alts[s]:
            prefix = 0
            for j, x in enumerate(alt):
                if isinstance(x, int) and d + prefix < dist.get(x, MAX_WITNESS_CHARS + 1):
                    dist[x] = d + prefix
                    parent[x] = (s, alt, j)
                    heapq.heappush(heap, (d + prefix, x))
                c = _cost(x, ycost)
                if c is None:
                    break
                prefix += int(c)
    return dist, parent


def _leads(g: Grammar, ok: list[bool], ycost: list[float]) -> dict[int, tuple[int, Any]]:
    """For unproductive symbols: the shortest non-empty literal text one writes before it is
    stuck: (length, ("text", items) or ("via", symbol))."""
    lead: dict[int, tuple[int, Any]] = {}
    via: dict[int, list[int]] = {}
    heap: list[tuple[int, int, int, Any]] = []  # (length, symbol, tie-break, how)
    tie = itertools.count()
    for s in range(len(g.names)):
        if ok[s]:
            continue
        for alt in g.alts[s]:
            i = next(j for j, x in enumerate(alt) if isinstance(x, int) and not ok[x])
            costs = [_cost(x, ycost) for x in alt[:i]]
            if any(c is None for c in costs):
                continue
            size = int(sum(costs))  # type: ignore[arg-type]
            if size:
                heapq.heappush(heap, (size, s, next(tie), ("text", alt[:i])))
            else:
                via.setdefault(alt[i], []).append(s)
    while heap:
        size, s, _, how = heapq.heappop(heap)
        if s in lead:
            continue
        lead[s] = (size, how)
        for t in via.get(s, ()):
            if t not in lead:
                heapq.heappush(heap, (size, t, next(tie), ("via", s)))
    return lead


def _text(items: list[Item], ychoice: list[list[Item] | None]) -> str:
    """The shortest literal text of `items` (each has one: a finite `_cost`)."""
    out: list[str] = []
    todo = list(reversed(items))
    while todo:
        x = todo.pop()
        if isinstance(x, Lit):
            out.append(x.text)
        elif isinstance(x, int):
            todo.extend(reversed(ychoice[x] or ()))
    return "".join(out)


def _context_text(g: Grammar, s: int, parent: dict, ychoice: list) -> str:
    parts: list[str] = []
    while s in parent:
        s, alt, j = parent[s]
        parts.append(_text(alt[:j], ychoice))
    return "".join(reversed(parts))


def _lead_text(u: int, lead: dict[int, tuple[int, Any]], ychoice: list) -> str:
    while u in lead:
        kind, what = lead[u][1]
        if kind == "text":
            return _text(what, ychoice)
        u = what
    return ""


def _live_lark(g: Grammar, ok: list[bool]) -> str:
    """The grammar without its unproductive symbols and the alternatives holding one, in
    Lark: it completes the same texts, and takes only prefixes of those. Groups and operators
    are rules of their own; terminals and opaque rules are written back from their source."""
    prefix = "zq"
    while any(n.lower().lstrip("_").startswith(prefix) for n in g.ids):
        prefix += "q"

    def ref(x: int) -> str:
        if g.owner[x] == x:
            return g.names[x]
        upper = g.names[x].lstrip("_")[:1].isupper()
        return f"_{prefix.upper() if upper else prefix}{x}"

    def item(x: Item) -> str:
        return ref(x) if isinstance(x, int) else x.source

    lines = list(g.directives)
    for s in range(len(g.names)):
        if s in g.source:
            lines.append(g.source[s])
            continue
        if not ok[s] or s not in g.defined or g.owner[s] in g.source:
            continue
        live = [a for a in g.alts[s] if all(ok[x] for x in a if isinstance(x, int))]
        form = g.form.get(s)
        if form is None or form in "([":
            body = " | ".join(" ".join(item(x) for x in a) or '""' for a in live)
        else:  # a repetition: [[x, s], [x]] / [[x], []] / [[x, s], []]; x may be dead
            x = g.alts[s][0][0]
            body = f"({item(x)}){form}" if not isinstance(x, int) or ok[x] else '""'
        lines.append(f"{ref(s)}: {body}")
    return "\n".join(lines) + "\n"


_BYTE_TOKENIZER: list[Any] = []


class _Taker:
    """llguidance's matcher for one grammar, built once (on first use) for many witnesses."""

    def __init__(self, lark: str) -> None:
        self.lark = lark
        self.fresh: Any = False  # False: not built yet; None: does not build

    def takes(self, text: str) -> bool | None:
        """Whether llguidance takes `text` (byte by byte) as the start of an output; None if
        it cannot tell (the grammar does not build, is past the size llguidance is given, or
        the parser stops on a limit of its own)."""
        if self.fresh is False:
            self.fresh = _matcher(self.lark)
        if self.fresh is None:
            return None
        matcher = self.fresh.deep_copy()
        if matcher.consume_tokens(list(text.encode())) and not matcher.is_error():
            return True
        # a byte the grammar does not take; any other error (a parser limit) proves nothing
        return False if "doesn't satisfy the grammar" in matcher.get_error() else None


def _matcher(lark: str) -> Any:
    from paged_engine.structured_output.grammar import MAX_GRAMMAR_CHARS, import_llguidance

    if len(lark) > 2 * MAX_GRAMMAR_CHARS:  # llguidance recurses per chained rule
        return None
    llg = import_llguidance()
    if not _BYTE_TOKENIZER:
        _BYTE_TOKENIZER.append(llg.LLTokenizer(llg.TokenizerWrapper(_Bytes()), slices=[]))
    matcher = llg.LLMatcher(_BYTE_TOKENIZER[0], lark, log_level=0)
    return None if matcher.is_error() else matcher


class _Bytes:
    """A tokenizer of one token per byte (and an end token) for llguidance."""

    eos_token_id = 256
    bos_token_id = None
    tokens = (*(bytes([b]) for b in range(256)), b"</s>")
    special_token_ids = (256,)

    def __call__(self, text: bytes) -> list[int]:
        return list(text)


_LARK = re.compile(r"(?m)^\s*(%llguidance\b|start\s*:)")  # as llguidance tells Lark from GBNF
_GBNF_RULE = re.compile(r"(?m)^\s*([A-Za-z0-9_-]+)\s*::=")


def gbnf_names(spec: str) -> dict[str, str] | None:
    """Lark rule name -> GBNF name, as llguidance's conversion renames them (root -> start,
    `a-b` -> a_b, camelCase -> snake_case); None if `spec` is Lark already."""
    if _LARK.search(spec):
        return None
    out: dict[str, str] = {}
    for m in _GBNF_RULE.finditer(spec):
        gbnf = m.group(1)
        lark = "start" if gbnf == "root" else gbnf.replace("-", "_")
        out.setdefault(re.sub(r"([a-z])([A-Z])", r"\1_\2", lark).lower(), gbnf)
    return out


def check_grammar_rules(lark: str, spec: str, where: str) -> None:
    """ValueError naming `where` and the rule if `lark` (llguidance's text of the grammar
    `spec`) has a rule that cannot end and output can enter it (module docstring)."""
    try:
        why = stuck_rules(lark, gbnf_names(spec))
    except Exception:  # a flaw here must not fail the request: llguidance judges alone
        logger.exception("grammar_rules: no verdict on a grammar (%d characters)", len(lark))
        return
    if why is not None:
        raise ValueError(f"{where} is invalid: {why}")
