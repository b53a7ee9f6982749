"""vLLM's command-line forms, rewritten into plain argparse arguments before parsing, so a
`vllm serve` command line or config file starts paged-server unchanged:

- `--config FILE.yaml`: the file's `key: value` pairs become flags placed before the command
  line's own (which win): `true` a switch, `false` its `--no-` form, a list one flag with every
  item, a mapping its JSON;
- `--max_model_len 4096`: underscores in a flag's name read as dashes;
- `--compilation-config.level 3`, `-O.level=3`, `--speculative-config.method ngram`: dotted keys
  of a JSON flag, merged into one JSON object (`key+ a,b` appends to a list; values are JSON,
  else vLLM's human-readable ints such as 8k, else strings);
- `--no-enable-log-requests`: the `--no-` form of a switch that has none here turns it off.
"""

from __future__ import annotations

import argparse
import json
import re
from typing import Any

_DOTTED = re.compile(r"(--?[A-Za-z][\w-]*)((?:\.[\w-]+)+)(\+?)")
_SHORT_JSON = {"-O": "--compilation-config"}  # vLLM's older -O.level form


def normalize(argv: list[str], parser: argparse.ArgumentParser) -> list[str]:
    """`argv` with vLLM's forms (module docstring) as plain arguments; parser.error on a bad
    --config file or dotted value."""
    argv = _with_config_file(argv, parser)
    argv = [_dashes(a) for a in argv]
    argv = _merge_dotted(argv, parser)
    return _drop_no_switches(argv, parser)


def _dashes(arg: str) -> str:
    """`--max_model_len=1` -> `--max-model-len=1` (the name only, up to `=` or a dotted key)."""
    if not arg.startswith("--"):
        return arg
    name, eq, value = arg.partition("=")
    head, dot, keys = name.partition(".")
    return head.replace("_", "-") + dot + keys + eq + value


def _with_config_file(argv: list[str], parser: argparse.ArgumentParser) -> list[str]:
    where = [i for i, a in enumerate(argv) if a == "--config" or a.startswith("--config=")]
    if not where:
        return argv
    if len(where) > 1:
        parser.error("argument --config: given more than once")
    i = where[0]
    if argv[i] == "--config":
        if i + 1 >= len(argv):
            parser.error("argument --config: expected one argument")
        path, rest = argv[i + 1], argv[:i] + argv[i + 2 :]
    else:
        path, rest = argv[i].partition("=")[2], argv[:i] + argv[i + 1 :]
    flags = _config_flags(path, parser)
    # the model stays first; the file's flags come before the command line's, which win
    head = 1 if rest and not rest[0].startswith("-") else 0
    return rest[:head] + flags + rest[head:]


def _config_flags(path: str, parser: argparse.ArgumentParser) -> list[str]:
    if not path.endswith((".yaml", ".yml")):
        parser.error(f"argument --config: {path!r} is not a .yaml / .yml file")
    try:
        import yaml  # PyYAML: installed with transformers, which the engine needs
    except ImportError:
        parser.error("argument --config: reading a YAML file needs PyYAML (pip install pyyaml)")
    try:
        with open(path, encoding="utf-8") as f:
            config = yaml.safe_load(f)
    except (OSError, yaml.YAMLError) as e:
        parser.error(f"argument --config: {path}: {e}")
    if config is None:
        return []
    if not isinstance(config, dict):
        parser.error(f"argument --config: {path} must hold a mapping of flag names to values")
    flags: list[str] = []
    for key, value in config.items():
        flag = "--" + str(key)
        if isinstance(value, bool):
            if value:
                flags.append(flag)
            elif _is_switch(parser, _dashes(flag)) or _dashes("--no-" + str(key)) in _options(
                parser
            ):
                flags.append("--no-" + str(key))
        elif isinstance(value, list):
            if value:
                flags += [flag, *(str(v) for v in value)]
        elif isinstance(value, dict):
            flags += [flag, json.dumps(value)]
        else:
            flags += [flag, str(value)]
    return flags


def _merge_dotted(argv: list[str], parser: argparse.ArgumentParser) -> list[str]:
    out: list[str] = []
    merged: dict[str, dict[str, Any]] = {}
    i = 0
    while i < len(argv):
        arg = argv[i]
        name, eq, text = arg.partition("=")
        match = _DOTTED.fullmatch(name)
        if match is None:
            out.append(arg)
            i += 1
            continue
        if not eq:
            if i + 1 >= len(argv):
                parser.error(f"argument {name}: expected one argument")
            text = argv[i + 1]
            i += 1
        i += 1
        flag, keys, append = match.groups()
        flag = _SHORT_JSON.get(flag, flag)
        value: Any = json.dumps(text.split(",")) if append else text
        try:
            _set(merged.setdefault(flag, {}), keys.lstrip(".").split("."), _value(value))
        except ValueError as e:
            parser.error(f"argument {name}: {e}")
    for flag, obj in merged.items():  # as if each were given as one JSON object, last
        out += [flag, json.dumps(obj)]
    return out


def _value(text: str) -> Any:
    from paged_server.cli_args import human_readable_int

    try:
        return json.loads(text)
    except ValueError:
        pass
    try:
        return human_readable_int(text)
    except argparse.ArgumentTypeError:
        return text


def _set(obj: dict[str, Any], keys: list[str], value: Any) -> None:
    for key in keys[:-1]:
        obj = obj.setdefault(key, {})
        if not isinstance(obj, dict):
            raise ValueError(f"{key!r} was given a value, not keys")
    last = keys[-1]
    if isinstance(value, list) and isinstance(obj.get(last), list):
        obj[last] += value  # `key+` given twice appends
    else:
        obj[last] = value


def _options(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return parser._option_string_actions  # argparse has no public lookup


def _is_switch(parser: argparse.ArgumentParser, flag: str) -> bool:
    """A flag that takes no value and sets True (store_true, or an ignored vLLM switch)."""
    action = _options(parser).get(flag)
    return action is not None and action.nargs == 0 and action.const is True


def _drop_no_switches(argv: list[str], parser: argparse.ArgumentParser) -> list[str]:
    """`--no-X` for a switch `--X` without its own `--no-` form: X off, i.e. an earlier `--X`
    dropped (the last of the two wins, as with vLLM's boolean flags)."""
    out: list[str] = []
    for arg in argv:
        if arg.startswith("--no-") and arg not in _options(parser):
            flag = "--" + arg[len("--no-") :]
            if _is_switch(parser, flag):
                out = [a for a in out if a != flag]
                continue
        out.append(arg)
    return out
