"""YAML in, with line numbers; JSON Schema validation that points at `file:line:column`.

`load(path, schema)` parses the file twice: once to plain data, once to the
node tree that remembers where each value sits. Every schema violation is
reported with its location and key path; an unknown key gets a "did you
mean". All problems are raised together, as the caller's error class.
"""
from __future__ import annotations

import difflib
import json
from dataclasses import dataclass
from functools import lru_cache
from importlib import resources
from pathlib import Path

import jsonschema
import yaml

_Loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


@lru_cache(maxsize=None)
def schema(name: str) -> dict:
    """A JSON Schema shipped with the package (`planner/schemas/` in a wheel).

    The repository keeps the one copy in `schemas/`; pyproject.toml maps it into the
    package. Run from a source tree (not installed, or installed editable), the
    package has no `schemas/` of its own and the file is read from the repository.
    """
    packaged = resources.files("planner") / "schemas" / name
    text = packaged.read_text() if packaged.is_file() else \
        (Path(__file__).resolve().parent.parent / "schemas" / name).read_text()
    return json.loads(text)


@dataclass
class Located:
    """Parsed YAML data plus a way to turn a key path into `file:line:column`.

    The node tree that knows positions is composed on first use only: a valid
    90k-line plan is parsed once.
    """

    file: Path
    data: object
    text: str
    _root: yaml.Node | None = None

    @property
    def root(self) -> yaml.Node | None:
        if self._root is None:
            self._root = yaml.compose(self.text, Loader=_Loader)
        return self._root

    def where(self, path=()) -> str:
        """`file:line:column` of the value at `path`, or of its deepest existing parent."""
        node = last = self.root
        for key in path:
            node = _child(node, key)
            if node is None:
                break
            last = node
        if last is None:  # an empty document
            return str(self.file)
        mark = last.start_mark
        return f"{self.file}:{mark.line + 1}:{mark.column + 1}"

    def key_where(self, path, key) -> str:
        """Location of the key itself (not its value) in the mapping at `path`."""
        node = self.root
        for k in path:
            node = _child(node, k)
        if isinstance(node, yaml.MappingNode):
            for knode, _ in node.value:
                if knode.value == key:
                    m = knode.start_mark
                    return f"{self.file}:{m.line + 1}:{m.column + 1}"
        return self.where(path)


def _child(node, key):
    if isinstance(node, yaml.MappingNode):
        for knode, vnode in node.value:
            if knode.value == key:
                return vnode
    elif isinstance(node, yaml.SequenceNode) and isinstance(key, int) and key < len(node.value):
        return node.value[key]
    return None


def dotted(path) -> str:
    out = ""
    for k in path:
        out += f"[{k}]" if isinstance(k, int) else (f".{k}" if out else str(k))
    return out or "(top level)"


def parse(path: Path, text: str, error_cls) -> Located:
    """Parse YAML text; syntax errors become `error_cls` with `file:line:column`."""
    try:
        data = yaml.load(text, Loader=_Loader)
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark else str(path)
        raise error_cls(f"{where}: invalid YAML: {e.problem or e.context}") from None
    except yaml.YAMLError as e:
        raise error_cls(f"{path}: invalid YAML: {e}") from None
    return Located(path, data, text)


def read(path: Path, error_cls, what: str) -> str:
    try:
        return Path(path).read_text()
    except FileNotFoundError:
        raise error_cls(f"{path}: no such {what} file") from None
    except (OSError, UnicodeDecodeError) as e:
        raise error_cls(f"{path}: cannot read the {what}: {e}") from None


def validate(doc: Located, schema_name: str, error_cls, headline: str) -> None:
    """Raise `error_cls` listing every schema violation with its location."""
    validator = jsonschema.Draft202012Validator(schema(schema_name))
    problems = []
    for err in sorted(validator.iter_errors(doc.data), key=lambda e: list(map(str, e.absolute_path))):
        path = list(err.absolute_path)
        if err.validator == "additionalProperties" and isinstance(err.instance, dict):
            known = list(err.schema.get("properties", {}))
            for key in err.instance:
                if key in known:
                    continue
                near = difflib.get_close_matches(str(key), known, n=1, cutoff=0.6)
                hint = f"; did you mean {near[0]!r}?" if near else f" (allowed: {', '.join(known)})"
                where = dotted(path + [key])
                problems.append(f"{doc.key_where(path, key)}: {where}: unknown key{hint}")
            continue
        problems.append(f"{doc.where(path)}: {dotted(path)}: {_message(err)}")
    if problems:
        raise error_cls(headline, problems)


def _message(err: jsonschema.ValidationError) -> str:
    if err.validator == "enum":
        return f"{err.instance!r} is not one of {', '.join(map(str, err.validator_value))}"
    if err.validator == "required":
        return err.message.replace("is a required property", "is required")
    if err.validator == "const":
        return f"must be {err.validator_value!r}, not {err.instance!r}"
    return err.message


def quote(text: str) -> str:
    """A YAML double-quoted scalar (JSON string syntax is valid YAML)."""
    return json.dumps(text, ensure_ascii=False)
