"""offplan's command line, `plan`: above the planner (planner/) and the runtime (runtime/), see cli.py."""
