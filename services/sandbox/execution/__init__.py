"""Running a launched command: output capture, timeout and whole-tree kill (executor.py), the
session runner inside a sandbox (runner.py: run by the system python3 as a file, it imports
nothing of shellrl) and the service's end of it (runner_link.py), and exec slots shared fairly
between sessions (slots.py). Imports isolation/ for the launch spec.
"""
