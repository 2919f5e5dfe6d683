"""The JSON Schemas of offplan's files, and validation whose messages point at `file:line:column`.

`validate` reports every schema violation with its location (yamlio.Located)
and key path; an unknown key gets a "did you mean". All problems are raised
together, as the caller's error class. What JSON Schema lets through and
offplan refuses: `.nan`, `.inf` where a number is expected ("number" admits
them). Messages it rewrites: `1e3` (text to YAML 1.1), a mapping that needs
one of several keys, numbers out of bounds, wrong types spelled as YAML does.
"""
from __future__ import annotations

import difflib
import json
import math
from functools import lru_cache
from importlib import resources
from pathlib import Path

import jsonschema

from .yamlio import Located, dotted, shown


@lru_cache(maxsize=None)
def schema(name: str) -> dict:
    """A JSON Schema shipped with the package (`planner/schemas/` in a wheel).

    The repository keeps the one copy in `schemas/`; pyproject.toml maps it into the
    package. Run from a source tree (not installed, or installed editable), the
    package has no `schemas/` of its own and the file is read from the repository.
    """
    packaged = resources.files("planner") / "schemas" / name
    text = packaged.read_text() if packaged.is_file() else \
        (Path(__file__).resolve().parents[2] / "schemas" / name).read_text()
    return json.loads(text)


def _finite(checker, instance) -> bool:
    return jsonschema.Draft202012Validator.TYPE_CHECKER.is_type(instance, "number") and (
        not isinstance(instance, float) or math.isfinite(instance))


# JSON Schema's "number" admits NaN and infinities, which YAML spells .nan and .inf.
_Validator = jsonschema.validators.extend(
    jsonschema.Draft202012Validator,
    type_checker=jsonschema.Draft202012Validator.TYPE_CHECKER.redefine("number", _finite))


def validate(doc: Located, schema_name: str, error_cls, headline: str) -> None:
    """Raise `error_cls` listing every schema violation with its location."""
    validator = _Validator(schema(schema_name))
    problems = []
    for err in sorted(validator.iter_errors(_enum_maps_cut(doc.data, schema(schema_name))),
                      key=lambda e: list(map(str, e.absolute_path))):
        if err.validator in ("anyOf", "oneOf") and not _needs_one_of(err):
            err = jsonschema.exceptions.best_match([err])  # the branch that came closest, not "none matched"
        path = list(err.absolute_path)
        if err.validator == "additionalProperties" and isinstance(err.instance, dict):
            known = list(err.schema.get("properties", {}))
            for key in err.instance:
                if key in known:
                    continue
                near = difflib.get_close_matches(str(key), known, n=1, cutoff=0.6)
                hint = f"; did you mean {near[0]!r}?" if near else f" (allowed: {', '.join(known)})"
                where = dotted(path + [str(key)])
                problems.append(f"{doc.key_where(path, key)}: {where}: unknown key{hint}")
            continue
        problems.append(f"{doc.where(path)}: {dotted(path)}: {_message(err)}")
    if problems:
        raise error_cls(headline, problems)


def _enum_maps_cut(data, spec: dict):
    """`data` with each top-level mapping of names to one enum's strings (a plan's `params:`, 92k entries on
    DeepSeek-V3, which jsonschema takes 0.4-0.9 s to descend one by one) cut to its first entry where every value
    is one of the enum's: the schema then finds the same problems, in one pass over the values here."""
    if not isinstance(data, dict):
        return data
    cut = {}
    for key, sub in spec.get("properties", {}).items():
        more, found = sub.get("additionalProperties"), data.get(key)
        values = more.get("enum") if isinstance(more, dict) else None
        if (values is None or set(sub) - {"type", "minProperties", "additionalProperties", "description"}
                or not isinstance(found, dict) or len(found) < 2):
            continue
        allowed = frozenset(v for v in values if isinstance(v, str))
        if all(isinstance(k, str) for k in found) and all(isinstance(v, str) and v in allowed for v in found.values()):
            cut[key] = dict([next(iter(found.items()))])
    return {**data, **cut} if cut else data


def _needs_one_of(err) -> list[str]:
    """The keys of an `anyOf: [{required: [a]}, {required: [b]}]`, else []."""
    branches = err.validator_value
    if err.validator == "anyOf" and all(list(b) == ["required"] and len(b["required"]) == 1 for b in branches):
        return [b["required"][0] for b in branches]
    return []


_TYPE_NAMES = {"number": "a number", "integer": "a whole number", "string": "a string", "array": "a list",
               "object": "a mapping", "boolean": "true or false", "null": "null"}


def _message(err: jsonschema.ValidationError) -> str:
    value = err.instance
    if err.validator == "enum":
        return f"{shown(value)} is not one of {', '.join(map(str, err.validator_value))}"
    if err.validator == "required":
        return err.message.replace("is a required property", "is required")
    if err.validator == "const":
        return f"must be {err.validator_value!r}, not {shown(value)}"
    if err.validator == "minItems":
        return "must not be empty" if err.validator_value == 1 else f"needs at least {err.validator_value} entries"
    if err.validator in ("anyOf", "oneOf") and all("type" in b for b in err.validator_value):
        # a value of none of the branches' types (`gpus: two`: a count or a list of budgets); one meant as a
        # number (`.nan`, `'12'`, `1e3`) is told what the number branch would tell it
        numeric = [b["type"] for b in err.validator_value if b["type"] in ("number", "integer")]
        if numeric and (_is_number(value) if isinstance(value, str) else isinstance(value, float)):
            return _wrong_type(value, numeric)
        kinds = [_TYPE_NAMES.get(b["type"], b["type"]) + (" of numbers" if b["type"] == "array" else "")
                 for b in err.validator_value]
        return f"must be {' or '.join(kinds)}, not {shown(value)}"
    if err.validator == "anyOf":
        keys = _needs_one_of(err)
        props = err.schema.get("properties", {})
        each = [f"`{k}` ({', '.join(props[k]['enum'])})" if "enum" in props.get(k, {}) else f"`{k}`"
                for k in keys]
        return f"needs {' or '.join(each)}{', or both' if len(keys) == 2 else ''}"
    if err.validator in ("maximum", "minimum", "exclusiveMinimum", "exclusiveMaximum"):
        bound = {"maximum": "at most", "minimum": "at least", "exclusiveMinimum": "more than",
                 "exclusiveMaximum": "less than"}[err.validator]
        return f"must be {bound} {err.validator_value}, not {shown(value)}"
    if err.validator == "type":
        return _wrong_type(value, err.validator_value if isinstance(err.validator_value, list) else
                           [err.validator_value])
    return err.message


def _wrong_type(value, types: list[str]) -> str:
    """`value` is of none of `types`: said as YAML spells it, with the fix for numbers YAML reads as text."""
    want = " or ".join(_TYPE_NAMES.get(t, t) for t in types)
    if isinstance(value, float) and not math.isfinite(value):
        spelled = ".nan" if math.isnan(value) else (".inf" if value > 0 else "-.inf")
        return f"must be {want}, not {spelled} (finite numbers only)"
    if isinstance(value, str) and {"number", "integer"} & set(types) and _is_number(value):
        if "e" not in value.lower():
            return f"must be {want}, not the string {value!r}; write it without quotes"
        return (f"{value!r} is text to YAML 1.1, not a number (a number with an exponent needs a "
                f"dot and a signed exponent); write {_spell(value)}")
    return f"must be {want}, not {shown(value)}"


def _is_number(text: str) -> bool:
    try:
        return math.isfinite(float(text))
    except ValueError:
        return False


def _spell(text: str) -> str:
    """How to write `1e3` so that YAML 1.1 reads a number: `1000 or 1.0e+3`."""
    value = float(text)
    mantissa, _, exponent = text.lower().replace("_", "").partition("e")
    if "." not in mantissa:
        mantissa += ".0"
    sci = f"{mantissa}e{exponent if exponent[:1] in '+-' else '+' + exponent}" if exponent else mantissa
    plain = str(int(value)) if value.is_integer() and abs(value) < 1e16 else repr(value)
    return sci if "e" in plain or plain == sci else f"{plain} or {sci}"
