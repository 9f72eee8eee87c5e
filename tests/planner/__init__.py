"""The planner's tests (``tiled-mlp plan``): its predictions against real CPU steps, its search, output and
errors. A package so that pytest puts tests/ on the path, where their shared helpers are (planner_checks.py,
cli_errors.py)."""
