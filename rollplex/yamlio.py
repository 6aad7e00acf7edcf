"""The YAML dialect of config files: PyYAML's safe loader, with ``1e-4`` a float as in YAML 1.2, and
any text that YAML 1.1 and 1.2 (or two readers) would take to mean different things refused
(``AmbiguousYAML``, a ``yaml.MarkedYAMLError`` that names its line): yes/no/on/off, octal-looking
numbers, sexagesimals, and a key twice in one mapping. ``Dumper`` quotes such strings when it writes.
"""
from __future__ import annotations

import re

import yaml


class Loader(yaml.SafeLoader):
    """YAML 1.1 reads ``1e-4`` (no dot) as a string; here it is a float, as in YAML 1.2 and Python."""


class Dumper(yaml.SafeDumper):
    """Quotes strings such as ``"1e-4"`` so that they load back as strings."""


_EXP_FLOAT = re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9][0-9_]*)[eE][-+]?[0-9]+$")
for _cls in (Loader, Dumper):
    _cls.add_implicit_resolver("tag:yaml.org,2002:float", _EXP_FLOAT, list("-+0123456789."))

# Plain scalars that YAML 1.1 (PyYAML) and YAML 1.2 read as different values: yes/no/on/off (a bool or
# a string), 010 (8 or 10), 0o10 (a string or 8), 0b10 (2 or a string), 1:30 (90 or a string).
_AMBIGUOUS = re.compile(r"""^(?:yes|Yes|YES|no|No|NO|on|On|ON|off|Off|OFF
    |[-+]?0[0-7_]+|[-+]?0o[0-7_]+|[-+]?0b[01_]+|[-+]?[0-9][0-9_]*(?::[0-5]?[0-9])+(?:\.[0-9_]*)?)$""", re.X)
_AMBIGUOUS_TAG = "tag:rollplex,2026:ambiguous"


class AmbiguousYAML(yaml.MarkedYAMLError):
    """A YAML text that two readers (or YAML 1.1 and 1.2) would take to mean different things."""


def _resolve(self, kind, value, implicit):
    if kind is yaml.ScalarNode and implicit[0] and _AMBIGUOUS.match(value):
        return _AMBIGUOUS_TAG
    return yaml.SafeLoader.resolve(self, kind, value, implicit)


def _refuse_ambiguous(loader, node):
    value = node.value
    v11 = yaml.load(value, Loader=yaml.SafeLoader)
    digits = value.replace("_", "")
    if re.fullmatch(r"[-+]?0[0-7]+", digits):
        v12 = int(digits, 10)
    elif re.fullmatch(r"[-+]?0o[0-7]+", digits):
        v12 = int(digits.replace("0o", ""), 8)
    else:
        v12 = value
    if v11 == v12:  # e.g. 00: zero either way
        return v11

    def shown(v):
        return f"the string {v!r}" if isinstance(v, str) else str(v).lower()
    raise AmbiguousYAML(None, None, f"{value} is {shown(v11)} in YAML 1.1 and {shown(v12)} in YAML 1.2; write "
                        "the one you mean (a string in quotes)", node.start_mark)


def _construct_mapping(self, node, deep=False):
    """A key twice in one mapping: YAML keeps the last silently, so one of the two is not what runs."""
    if isinstance(node, yaml.MappingNode):
        seen: dict = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key, line = self.construct_object(key_node, deep=True), key_node.start_mark.line + 1
            try:
                first = seen.get(key)
            except TypeError:  # an unhashable key: SafeConstructor names it
                continue
            if first is not None:
                raise AmbiguousYAML(None, None, f"key {key!r} appears twice in one mapping (lines {first} and "
                                    f"{line}); YAML would keep the last silently", key_node.start_mark)
            seen[key] = line
    return yaml.SafeLoader.construct_mapping(self, node, deep)


Loader.resolve = _resolve
Dumper.add_implicit_resolver(_AMBIGUOUS_TAG, _AMBIGUOUS, list("-+0123456789yYnNoO"))  # such strings go quoted
Loader.construct_mapping = _construct_mapping
Loader.add_constructor(_AMBIGUOUS_TAG, _refuse_ambiguous)
