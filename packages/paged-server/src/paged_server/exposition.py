"""Prometheus exposition formats, apart from what paged measures: escaping, values, the
OpenMetrics 1.0 form of a text (0.0.4) exposition and the merge of several servers' expositions
(the data-parallel front's). Both as Prometheus, prometheus_client and Go's expfmt read them:
one HELP and TYPE per family with all its samples after them, label values escaped.
"""

from __future__ import annotations

import re
from typing import Any

from paged_engine.engine.request_latency import go_float

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
OPENMETRICS_CONTENT_TYPE = "application/openmetrics-text; version=1.0.0; charset=utf-8"
_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
_PAIR = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')  # a label, value escaped


def esc(value: str) -> str:
    """A label value: backslash, double quote and newline escaped."""
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def help_text(text: str) -> str:
    """A HELP text: backslash and newline escaped."""
    return text.replace("\\", "\\\\").replace("\n", "\\n")


def num(v: Any) -> str:
    """A sample value (or `le`) as Prometheus' clients write it: ints bare, floats as
    `go_float` (prometheus_client's, so vLLM's)."""
    return go_float(v) if isinstance(v, float) else str(int(v))


def wants_openmetrics(accept: str) -> bool:
    """prometheus_client's choice (so vLLM's): any `application/openmetrics-text` in Accept,
    whatever its q-value."""
    return any(
        part.split(";")[0].strip().lower() == "application/openmetrics-text"
        for part in accept.split(",")
    )


def to_openmetrics(text: str) -> str:
    """Our text exposition as OpenMetrics 1.0: a counter family is named without its `_total`
    (its samples keep it), and `# EOF` ends the exposition. Label and HELP escapes are the same."""
    lines = [line for line in text.splitlines() if line]  # OpenMetrics has no blank line
    counters = {
        line.split(" ")[2]
        for line in lines
        if line.startswith("# TYPE ") and line.endswith(" counter")
    }
    out = []
    for line in lines:
        if line.startswith(("# HELP ", "# TYPE ")):
            name = line[7:].split(" ", 1)[0]
            if name in counters and name.endswith("_total"):
                line = line[:7] + name[: -len("_total")] + line[7 + len(name) :]
        out.append(line)
    return "".join(line + "\n" for line in out) + "# EOF\n"


def merge_expositions(
    scrapes: list[tuple[str, str]], label: str = "replica", engine: str | None = "engine"
) -> str:
    """Expositions of several servers, (label value, text) each, as one text exposition: each
    sample gets `label="value"` and its `engine` label (vLLM's data-parallel engine index;
    each server writes "0") set to the value; each family's HELP and TYPE come once and all its
    samples follow them together (a parser reads samples that follow another family as a new
    untyped family, so appending server after server breaks histograms)."""
    heads: dict[str, list[str]] = {}  # family -> its HELP / TYPE lines, in first-seen order
    samples: dict[str, list[str]] = {}
    for value, text in scrapes:
        family = ""
        for line in text.splitlines():
            if line.startswith(("# HELP ", "# TYPE ")):
                family = line[7:].split(" ", 1)[0]
                kinds = [h[:7] for h in heads.setdefault(family, [])]
                if line[:7] not in kinds:
                    heads[family].append(line)
                samples.setdefault(family, [])
            elif line and not line.startswith("#"):
                match = _NAME.match(line)
                name = match.group(0) if match else line
                if not family or not name.startswith(family):
                    family = name  # a sample of no declared family: untyped, by its own name
                    heads.setdefault(family, [])
                if engine is not None:
                    line = set_label(line, engine, value)
                samples.setdefault(family, []).append(with_label(line, label, value))
    out = []
    for family, lines in heads.items():
        out += lines + samples[family]
    return "".join(line + "\n" for line in out)  # no scrape: "" (a blank line is no exposition)


def set_label(sample: str, name: str, value: str) -> str:
    """One sample line with its label `name` set to `value`; unchanged when it has none."""
    match = _NAME.match(sample)
    i = match.end() if match else 0
    if sample[i : i + 1] != "{":
        return sample
    i += 1
    while (pair := _PAIR.match(sample, i)) is not None:  # name="value" pairs, in order
        if pair.group(1) == name:
            return f"{sample[: pair.start(2)]}{esc(value)}{sample[pair.end(2) :]}"
        i = pair.end() + (sample[pair.end() : pair.end() + 1] == ",")
    return sample


def with_label(sample: str, name: str, value: str) -> str:
    """One sample line with the label `name="value"` added (its other labels and value kept:
    the label block ends at the first `}` outside a quoted value)."""
    match = _NAME.match(sample)
    end = match.end() if match else 0
    label = f'{name}="{esc(value)}"'
    if sample[end : end + 1] != "{":
        return f"{sample[:end]}{{{label}}}{sample[end:]}"
    i, quoted = end + 1, False
    while i < len(sample):
        c = sample[i]
        if quoted and c == "\\":
            i += 1
        elif c == '"':
            quoted = not quoted
        elif c == "}" and not quoted:
            break
        i += 1
    inner = sample[end + 1 : i].rstrip().rstrip(",")
    sep = "," if inner else ""
    return f"{sample[:end]}{{{inner}{sep}{label}}}{sample[i + 1 :]}"
