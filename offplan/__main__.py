"""`python -m offplan` and the `plan` command (pyproject.toml's script): the CLI is imported inside the interrupt
handler, so that Ctrl-C while its imports run ends as quietly as it does later ("interrupted", exit 130)."""
import sys


def run() -> int:
    try:
        from .cli import main
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    return main()


if __name__ == "__main__":
    sys.exit(run())
