"""YAML in, with line numbers; JSON Schema validation that points at `file:line:column`.

`read` + `parse` turn a file into plain data; the node tree that remembers
where each value sits is composed only when a message needs a location.
What YAML lets through and offplan refuses: duplicate keys in a mapping
(PyYAML keeps the last one silently); and the message it rewrites: a tab in
the indentation. Checking the data against a JSON Schema is schema.py.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import yaml

_FastLoader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


class _Loader(_FastLoader):
    """libyaml's safe loader that records duplicate keys instead of keeping the last one.

    The check costs one length comparison per mapping (the keys of a mapping
    without merge keys are distinct iff the dict is as long as the node list),
    so a 90k-line plan loads as fast as with the plain loader.
    """

    def __init__(self, stream):
        super().__init__(stream)
        self.duplicates: list[tuple[object, yaml.Mark, yaml.Mark]] = []  # (key, first, again)

    def construct_mapping(self, node, deep=False):
        own = node.value if isinstance(node, yaml.MappingNode) else None
        mapping = super().construct_mapping(node, deep=deep)
        # Merge keys (`<<: *base`) rebind node.value to merged + own pairs; `own` is what the file says.
        if own is not None and (node.value is not own or len(mapping) < len(own)):
            first: dict = {}
            for key_node, _ in own:
                key = self.construct_object(key_node)  # already built: a cache lookup
                if key in first:
                    self.duplicates.append((key, first[key], key_node.start_mark))
                else:
                    first[key] = key_node.start_mark
        return mapping


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
                if knode.value == str(key):
                    m = knode.start_mark
                    return f"{self.file}:{m.line + 1}:{m.column + 1}"
        return self.where(path)


def _child(node, key):
    if isinstance(node, yaml.MappingNode):
        for knode, vnode in node.value:
            if knode.value == str(key):
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
    """Parse YAML text; syntax errors and duplicate keys become `error_cls` with `file:line:column`."""
    loader = _Loader(text)
    try:
        data = loader.get_single_data()
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        tab = _tab(text, mark)
        if tab is not None:
            raise error_cls(f"{path}:{tab[0]}:{tab[1]}: a tab in the indentation: YAML indents with "
                            "spaces only; replace the tab with spaces") from None
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark else str(path)
        raise error_cls(f"{where}: invalid YAML: {e.problem or e.context}") from None
    except yaml.reader.ReaderError as e:  # a character YAML does not allow (NUL, other controls)
        line = text.count("\n", 0, e.position) + 1
        column = e.position - text.rfind("\n", 0, e.position)
        code = ord(e.character) if isinstance(e.character, str) else e.character
        raise error_cls(f"{path}:{line}:{column}: invalid YAML: character U+{code:04X} is not allowed "
                        "(a control character: is this a text file?)") from None
    except yaml.YAMLError as e:
        raise error_cls(f"{path}: invalid YAML: {e}") from None
    finally:
        loader.dispose()
    if loader.duplicates:
        raise error_cls(f"{path}: duplicate keys (YAML would keep the last one silently); keep one of each", [
            f"{path}:{again.line + 1}:{again.column + 1}: {key!r} again (first at {first.line + 1}:{first.column + 1})"
            for key, first, again in loader.duplicates])
    return Located(path, data, text)


def _tab(text: str, mark) -> tuple[int, int] | None:
    """(line, column), 1-based, of a tab in the indentation of the line a YAML error points at."""
    if mark is None:
        return None
    lines = text.splitlines()
    if mark.line >= len(lines):
        return None
    line = lines[mark.line]
    indent = line[: len(line) - len(line.lstrip(" \t"))]
    if "\t" in indent:
        return mark.line + 1, indent.index("\t") + 1
    if line[mark.column: mark.column + 1] == "\t":
        return mark.line + 1, mark.column + 1
    return None


def read(path: Path, error_cls, what: str) -> str:
    """A YAML file's text; a missing, unreadable or binary file becomes `error_cls` naming it."""
    path = Path(path)
    try:
        return path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise error_cls(f"{path}: no such {what} file") from None
    except IsADirectoryError:
        raise error_cls(f"{path}: is a directory, not a {what} file") from None
    except UnicodeDecodeError as e:
        raise error_cls(f"{path}: not a text file (byte {e.object[e.start]:#04x} at offset {e.start} is not "
                        f"UTF-8); a {what} is YAML text") from None
    except OSError as e:
        raise error_cls(f"{path}: cannot read the {what}: {e.strerror}") from None


def kind(data) -> str | None:
    """Which offplan file a parsed document is, from its top-level keys: "plan", "policy",
    "hardware profile", "routing profile", or None when it is none of them."""
    if not isinstance(data, dict):
        return None
    if "params" in data:
        return "plan"
    if "recorded" in data:  # checked before the checkpoint mapping, which plans and profiles both have
        return "routing profile"
    if isinstance(data.get("checkpoint"), dict):  # a policy's checkpoint is a path
        return "plan"
    if "h2d_copy_gbps" in data or ("format_version" in data and "name" in data and "checkpoint" not in data):
        return "hardware profile"  # (one written by hand may hold a name and a few figures)
    if "checkpoint" in data:
        return "policy"
    return None


def wrong_kind(path: Path, data, expected: str) -> str | None:
    """The message for another kind of offplan file passed where `expected` belongs, else None."""
    found = kind(data)
    if found is None or found == expected:
        return None
    use = {"plan": f"review it with `plan show {path}`, load it with `plan apply {path}`",
           "policy": f"build a plan from it with `plan build {path}`",
           "hardware profile": f"name it in a policy: `hardware: {path.name}`",
           "routing profile": f"name it in a policy: `workload: {{routing: {path.name}}}`"}[found]
    policy = data.get("policy")
    if found == "plan" and expected == "policy" and isinstance(policy, dict) and isinstance(policy.get("path"), str):
        use = f"its policy is {path.parent / policy['path']}"
    return f"{path}: this is a {found}, not a {expected}: {use}"


def load_mapping(path: Path, error_cls, what: str, how: str) -> tuple[str, Located]:
    """(text, parsed document) of a `what` file whose top level is a mapping. A missing or unreadable file, bad
    YAML, another kind of offplan file, or a top level that is no mapping is one `error_cls` naming the file
    (`how`: how to make a right one)."""
    text = read(path, error_cls, what)
    doc = parse(path, text, error_cls)
    wrong = wrong_kind(path, doc.data, what)
    if wrong:
        raise error_cls(wrong)
    if not isinstance(doc.data, dict):
        found = "the file is empty" if doc.data is None else f"it holds {shown(doc.data)}"
        raise error_cls(f"{path}: a {what} is a YAML mapping but {found}; {how}")
    return text, doc


def shown(value) -> str:
    """A value as YAML spells it, for messages: null, true, 'text', 2.5, a list, a mapping."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list):
        return "a list"
    if isinstance(value, dict):
        return "a mapping"
    return f"{value!r:.60}"


_PLAIN = re.compile(r"^[A-Za-z_][A-Za-z0-9_./\-]*$")
_RESERVED = {"true", "false", "null", "yes", "no", "on", "off", "y", "n", "~"}


_PLAIN_BYTES = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_./-\n"  # _PLAIN's, and newlines
# after a newline: what may not start a plain line, or a line that may be reserved (checked against _RESERVED)
_LINE_START = re.compile(r"\n(?:[^A-Za-z_]|([fFnNoOtTyY][A-Za-z]{0,4})(?=\n))")


def all_plain(lines: str) -> bool:
    """Whether `scalar` writes every line of `lines` (strings joined by newlines) plain, in a few scans in C rather
    than one per line: every character one of _PLAIN's (or a newline), and each line, read between newlines added at
    both ends, starting as _PLAIN says and no reserved word (no empty line either: a newline follows a newline)."""
    if not lines.isascii() or lines.encode().translate(None, _PLAIN_BYTES):
        return False
    return all(m[1] is not None and m[1].lower() not in _RESERVED for m in _LINE_START.finditer(f"\n{lines}\n"))


def scalar(text: str) -> str:
    """A string as offplan's files write it: plain when YAML reads it back as that string
    (`model.layers.0`), else double-quoted (`"sha256:..."`, `"yes"`)."""
    if _PLAIN.match(text) and text.lower() not in _RESERVED:
        return text
    return quote(text)


def quote(text: str) -> str:
    """A YAML double-quoted scalar (JSON string syntax is valid YAML)."""
    return json.dumps(text, ensure_ascii=False)
