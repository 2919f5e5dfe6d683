"""Writing files safely, and paths as plans store them."""
from __future__ import annotations

import errno
import os
import tempfile
from pathlib import Path

from .errors import OffplanError


def write_atomic(path: str | Path, text: str, what: str = "plan") -> None:
    """Write via a temp file in the same directory and rename: never half a file.

    The file gets the permissions a plain `open(path, "w")` would give (mkstemp's
    are 0600). A symlink to a file in its own folder is written through, as `open` would: the file it names is
    replaced, the link kept (the rename would replace the link itself). One into another folder is refused: a
    plan's and a routing profile's paths are relative to where it lies, so its bytes would be wrong for one of the
    two paths (a hardware profile names none). So is a link to nothing or a loop. An unwritable destination
    raises OffplanError naming the path.
    """
    given = path = Path(path)
    if os.path.islink(given):
        try:
            path = Path(os.path.realpath(given, strict=True))
        except OSError as e:
            raise OffplanError(f"{given}: a symlink to no file ({e.strerror}): write the {what} to a plain "
                               "file") from None
        if path.parent != given.parent.resolve() and what != "hardware profile":  # it names no path
            raise OffplanError(f"{given}: a symlink to {path}, in another folder: the {what}'s paths are relative "
                               f"to where it lies; write it to {path} itself, or to a plain file")
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    except OSError as e:
        fix = (f": {missing_folder(given, what)}" if e.errno == errno.ENOENT else
               f"; write the {what} where you may write" if e.errno in (errno.EACCES, errno.EPERM, errno.EROFS)
               else "")
        raise OffplanError(f"{given}: cannot write the {what}: {e.strerror}{fix}") from None
    try:
        with os.fdopen(fd, "w") as f:  # owns fd from here on, closed whatever happens
            umask = os.umask(0)
            os.umask(umask)
            os.chmod(tmp, 0o666 & ~umask)
            f.write(text)
        os.replace(tmp, path)
    except BaseException as e:
        os.unlink(tmp)
        if isinstance(e, OSError):
            raise OffplanError(f"{given}: cannot write the {what}: {e.strerror}") from None
        raise


def missing_folder(path: Path, what: str) -> str | None:
    """What to do where `path`'s folder does not exist; None where it does."""
    folder = Path(path).parent
    return None if folder.is_dir() else f"its folder {folder} does not exist; create it, or write the {what} elsewhere"


KINDS = ("plan", "routing profile", "hardware profile")  # what offplan writes, each's first line `# offplan KIND`


def written_as(head: str) -> str | None:
    """The kind of file offplan wrote (KINDS) that `head`, a file's beginning, says it is by its first line;
    None for any other (a policy, a user's file)."""
    return next((k for k in KINDS if head.startswith(f"# offplan {k}")), None)


def refuse_to_replace(path: Path, what: str, fix: str) -> None:
    """An existing file at `path` may be replaced by a `what` ("plan", "routing profile", "hardware profile") only
    where it is one (it starts with `# offplan WHAT`, as every one offplan writes does) or is empty: anything else
    there, a policy, a file of a checkpoint's folder or a user's notes, would be destroyed. Raises OffplanError
    naming the file, the line looked for and `fix`."""
    try:
        if not os.path.exists(path) or (os.path.isfile(path) and os.path.getsize(path) == 0):
            return  # nothing there to destroy (`-o "$(mktemp)"`)
        if not os.path.isfile(path):  # a FIFO, a device: opening it could block, and it is no file of ours
            found = ""
        else:
            with open(path, "rb") as f:
                found = f.read(64).decode("utf-8", "replace")
    except OSError:
        return  # unreadable: write_atomic says what it cannot write
    if written_as(found) != what:
        raise OffplanError(f"{path}: exists and is not a {what} (its first line is not the `# offplan {what} ...` line "
                           f"offplan writes): writing the {what} there would destroy it. Nothing was written; {fix}")


def relpath(target: Path, start_dir: Path) -> str:
    """`target` relative to `start_dir` when possible, in POSIX form."""
    try:
        return Path(os.path.relpath(target.resolve(), start_dir.resolve())).as_posix()
    except ValueError:  # another drive on Windows
        return target.resolve().as_posix()
