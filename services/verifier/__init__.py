"""Verifier service: turns an episode into a reward by inspecting its sandbox workspace.

Consumes `shellrl:episodes` (group `verifier`) and `POST /v1/verify`; produces scored
trajectories on `shellrl:trajectories` (eval ones on `shellrl:evaluations`). See checks.py for the
check semantics, rewards.py for the reward, worker.py for the stream guarantees.
"""

from services.verifier.checks import VERIFIER_VERSION

__all__ = ["VERIFIER_VERSION"]
