"""How a plan was built, in the plan: what lets `plan check` answer "up to date" without building it again.

`plan build` writes a stamp below `format_version` (planner.plan.Built):

    built:
      offplan: "0.3.0"                # the version that built it
      inputs: "sha256:..."            # that version, the hardware profile's bytes, config.json's bytes
      digest: "sha256:..."            # the plan's text, this value read as PLACEHOLDER

The checkpoint (its index and shard headers), the policy and the routing
profile have fingerprints of their own in the plan; `inputs` covers what else
a build reads. A build is a function of those inputs and of offplan's version,
so a plan is what `plan build` makes of its inputs now when it was built by
this version, its text is the text that was built (`digest`: not edited by
hand), and each input's fingerprint is the recorded one. `plan check` asks
that first (planfile/staleness.py `up_to_date`): it reads the inputs' bytes and
parses no shard header and plans nothing. Any other answer goes to the full
checks, which build the plan again and say what differs.

Limit: the version is the installed package's. A development checkout whose
planner changed without a new version number gets the quick answer for a plan
its old code built; `plan check --rebuild` compares with a new build instead.
Where the version is unknown (offplan not installed), plans carry no stamp.
"""
from __future__ import annotations

import hashlib
import re
from importlib import metadata
from pathlib import Path

PLACEHOLDER = "sha256:" + "0" * 64  # the digest's value while the text is digested
_DIGEST = re.compile(r'\n  digest: "(sha256:[0-9a-f]{64})"\n')


def version() -> str | None:
    """The installed offplan's version; None when offplan runs uninstalled (then no stamp is written)."""
    try:
        return metadata.version("offplan")
    except metadata.PackageNotFoundError:
        return None


def inputs_fingerprint(offplan: str, hardware: Path | None, checkpoint_root: Path) -> str:
    """sha256 over the version, the hardware profile's bytes (the built-in profile: its name, which the
    version fixes) and the checkpoint's config.json bytes (absent: said so)."""
    digest = hashlib.sha256(b"offplan\0" + offplan.encode())
    digest.update(b"\0hardware\0" + (hardware.read_bytes() if hardware is not None else b"built-in"))
    config = checkpoint_root / "config.json"
    digest.update(b"\0config\0" + (config.read_bytes() if config.is_file() else b"absent"))
    return "sha256:" + digest.hexdigest()


_STAMP = re.compile(r"\nbuilt:\n(?:  .*\n){3}(?=checkpoint:\n)")


def unstamped(text: str) -> str:
    """A plan's text without its stamp: what an offplan of unknown version (not installed) builds of the same
    inputs, where the planner is the same."""
    return _STAMP.sub("\n", text, count=1)


def sign(text: str) -> str:
    """`text`, written with PLACEHOLDER as its digest, with the digest of itself in its place."""
    return text.replace(PLACEHOLDER, "sha256:" + hashlib.sha256(text.encode()).hexdigest(), 1)


def signed(text: str) -> bool:
    """Whether `text` holds a stamp whose digest is the digest of the text (no edit since `plan build`)."""
    cut = text.find("\ncheckpoint:")  # the stamp lies above the checkpoint, first in the file
    found = _DIGEST.search(text, 0, cut + 1) if cut > 0 else None
    if found is None:
        return False
    start, end = found.span(1)
    return sign(text[:start] + PLACEHOLDER + text[end:]) == text
