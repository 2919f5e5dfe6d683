"""The few exceptions offplan raises for problems a user can fix.

Every one of them becomes a single red message and exit code 1 in the CLI
(`offplan.cli.main`), as does an OSError naming a file that no command caught
(a name longer than the file system allows); anything else is a bug and keeps
its traceback.
"""
from __future__ import annotations

from collections.abc import Iterable

_MAX_LISTED = 20


class OffplanError(Exception):
    """A problem with the user's input or environment, with the fix in its message."""


class InputError(OffplanError):
    """Several problems found in one input, collected and reported at once.

    `problems` holds one line per problem; the message lists up to 20 of them.
    """

    def __init__(self, headline: str, problems: Iterable[str] = ()):
        self.headline = headline
        self.problems = list(problems)
        lines = [headline]
        for problem in self.problems[:_MAX_LISTED]:
            lines.append(f"  - {problem}")
        if len(self.problems) > _MAX_LISTED:
            lines.append(f"  ... and {len(self.problems) - _MAX_LISTED} more")
        super().__init__("\n".join(lines))


class CheckpointError(InputError):
    """The safetensors checkpoint (index or shard headers) is unreadable or inconsistent."""


class PolicyError(InputError):
    """The policy YAML is malformed, breaks the schema, or is inconsistent."""


class HardwareProfileError(InputError):
    """A hardware profile (written by `plan calibrate`) is unreadable or breaks its schema."""


class RoutingProfileError(InputError):
    """A routing profile (written by `plan profile`) is unreadable, breaks its schema, or is another model's."""


class PlanFileError(InputError):
    """A plan file is malformed or breaks `schemas/plan.schema.json`."""


class InconsistentPlanError(PlanFileError):
    """A plan whose parts disagree (`params:` against `layers:`, `summary:`, `prefetch:`): edited by hand."""


class BudgetError(OffplanError):
    """No placement satisfies the GPU budget."""


class StalePlanError(OffplanError):
    """The checkpoint on disk no longer matches the fingerprint recorded in the plan."""


class ModelMismatchError(InputError):
    """The plan and the model being loaded name different parameters."""
