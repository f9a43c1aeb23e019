"""`python -m services.learner [--host H] [--port P]`: the learner service (startup.py)."""

from __future__ import annotations

from services.learner.startup import main

if __name__ == "__main__":
    main()
