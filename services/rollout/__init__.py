"""Rollout gateway: REST task submission, staleness-bounded admission, the asynchronous
multi-turn agent loop, evaluations (issue 5; DESIGN.md sections 1-5 and 7)."""
