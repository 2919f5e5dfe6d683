"""Parameter-name patterns, with vLLM's segment semantics.

A plain pattern `p` matches a tensor name `n` iff `"." + p + "."` is a
substring of `"." + n + "."`: it must cover whole dot-separated segments.
`experts` and `experts.w2_weight` match `mlp.experts.w2_weight`; `expert`,
`w2` and (for `mlp.experts.w2_weight_scale`) `w2_weight` do not.

Extension: `re:<regex>` is a Python regular expression searched in the name.
"""
from __future__ import annotations

import difflib
import re
from collections.abc import Iterable
from dataclasses import dataclass
from functools import cached_property

_NUM = re.compile(r"(?<=\.)\d+(?=\.|$)")


@dataclass(frozen=True)
class Pattern:
    text: str
    regex: re.Pattern | None = None

    def matches(self, name: str) -> bool:
        if self.regex is not None:
            return self.regex.search(name) is not None
        return f".{self.text}." in f".{name}."


def compile_pattern(text: str) -> Pattern:
    """Compile one pattern; raises re.error for a bad `re:` expression."""
    if text.startswith("re:"):
        return Pattern(text, re.compile(text[3:]))
    return Pattern(text)


class Names:
    """A checkpoint's tensor names, joined once so that patterns scan all of them in C.

    A plain pattern set becomes one multiline regex whose matches are whole
    lines (`(^|.)p(.|$)` within a line is exactly the segment rule), so
    selecting among 90k names is a single `finditer` instead of 90k Python calls.
    `re:` patterns are searched name by name, as their anchors mean. Both are
    made when a pattern first needs them: a policy whose patterns are single
    segments is matched per layer template (layers/alike.py `select`), never here.
    """

    def __init__(self, names: Iterable[str]):
        self._given = names

    @cached_property
    def names(self) -> list[str]:
        return list(self._given)

    @cached_property
    def text(self) -> str:
        return "\n".join(self.names)

    def select(self, patterns: Iterable[Pattern]) -> set[str]:
        """The names that any of `patterns` matches."""
        patterns = list(patterns)
        plain = [p.text for p in patterns if p.regex is None]
        out: set[str] = set()
        if plain:
            out.update(_lines(plain).findall(self.text))
        for p in patterns:
            if p.regex is not None:
                search = p.regex.search
                out.update(n for n in self.names if search(n))
        return out

    def any_match(self, pattern: Pattern) -> bool:
        if pattern.regex is None:
            return _lines([pattern.text]).search(self.text) is not None
        return any(pattern.regex.search(n) for n in self.names)


def _lines(plain: list[str]) -> re.Pattern:
    """A multiline regex matching the whole names in which one of `plain` covers whole segments."""
    alternation = "|".join(re.escape(t) for t in sorted(plain, key=len, reverse=True))
    return re.compile(rf"^(?:[^\n]*\.)?(?:{alternation})(?:\.[^\n]*)?$", re.M)


def closest(pattern: str, names: Iterable[str], n: int = 3) -> list[str]:
    """Spellings close to `pattern` among the names' segment runs, for "did you mean".

    Layer and expert numbers are folded to `N` first, so a 90k-tensor checkpoint
    gives a few hundred distinct templates to compare against. Each suggestion is
    a real run of some name (`experts.0.down_proj`, never `experts.N.down_proj`),
    so it is a pattern that matches.
    """
    width = pattern.count(".") + 1
    examples: dict[str, str] = {}  # folded name -> the first real name with that template
    for name in names:
        examples.setdefault(_NUM.sub("N", "." + name)[1:], name)
    runs: dict[str, str] = {}  # folded run -> a real run
    for template, name in examples.items():
        folded, real = template.split("."), name.split(".")
        for i in range(len(folded) - width + 1):
            runs.setdefault(".".join(folded[i:i + width]), ".".join(real[i:i + width]))
    near = difflib.get_close_matches(pattern, sorted(runs), n=n, cutoff=0.6)
    return list(dict.fromkeys(runs[r] for r in near))
