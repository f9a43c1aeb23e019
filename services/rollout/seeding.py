"""Seeds of the engine's sampling, derived from the job's seed, so one seed gives one run.

Every engine request of an episode carries SGLang's `sampling_params.sampling_seed` (our engine:
a torch.Generator per request, so a row's draws depend on its seed only, not on the batch it
shares; services/engine/sampling.py). The seed of a request is a hash of

    training episode: (sampling_seed, task_id, epoch, sample index), then turn, continuation
    eval episode:     (sampling_seed, "eval", task_id, episode index), then turn, continuation

so it does not depend on timing: group ids (random), admission order, the engine a request went
to and INFRA re-runs (a re-run of a sample draws what the failed attempt would have) play no
part. Two runs with one seed therefore sample the same tokens for as long as
they hold the same weights (without a learner: always). Once a learner trains, a weight update
lands at a time-dependent point of an episode (partial rollout), and from then on the two runs'
weights differ, so their tokens do too; that is the limit "as far as the hardware allows" of an
asynchronous system. The same (task, episode) of the "before" and "after" evaluations gets the
same seed: common random numbers, which narrows the spread of the before/after difference.
"""

from __future__ import annotations

import hashlib

MAX_SEED = 2**63 - 1  # SGLang's sampling_seed and torch.Generator.manual_seed both accept it


def derive_seed(*parts: object) -> int:
    """A seed in [0, 2**63) from the parts' `str` forms (sha256; stable across processes and
    Python versions, unlike `hash`)."""
    digest = hashlib.sha256("\x1f".join(map(str, parts)).encode()).digest()
    return int.from_bytes(digest[:8], "big") & MAX_SEED


def episode_seed(seed: int, task_id: str, epoch: int, index: int) -> int:
    """The seed of sample `index` of `task_id`'s group in epoch `epoch` (every attempt)."""
    return derive_seed(seed, "train", task_id, epoch, index)


def eval_episode_seed(seed: int, task_id: str, episode: int) -> int:
    """The seed of episode `episode` of `task_id` in an evaluation (the same in every one)."""
    return derive_seed(seed, "eval", task_id, episode)


def request_seed(episode: int, turn: int, continuation: int) -> int:
    """The `sampling_seed` of one engine request: turn `turn`, continuation `continuation` (0
    unless a weight update aborted the request and the turn went on in a new one)."""
    return derive_seed(episode, turn, continuation)
