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


def matches_any(patterns: Iterable[Pattern], name: str) -> bool:
    return any(p.matches(name) for p in patterns)


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
