"""What an episode leaves in Redis is bounded by time or count, never by the run's length
(issue 35: the trajectories stream kept every scored trajectory for good, and each trajectory's
idempotency keys lived 7 days: 3.8 GB of Redis per engine at the GPU job's rate). The bound
itself, measured: `python -m benchmarks.bench_control_plane --trajectories-maxlen 1000`."""

from __future__ import annotations

import inspect

from services.rollout.settings import RolloutSettings
from services.verifier.settings import VerifierSettings
from shellrl.streams.producer import IDEMPOTENCY_TTL_S, StreamProducer


def test_idempotency_keys_outlive_a_retry_window_but_not_a_day():
    assert 600 <= IDEMPOTENCY_TTL_S < 24 * 3600
    default = inspect.signature(StreamProducer).parameters["idempotency_ttl_s"].default
    assert default == IDEMPOTENCY_TTL_S


def test_the_verifier_trims_the_trajectories_stream_as_the_gateway_trims_episodes():
    verifier = VerifierSettings.model_fields["trajectories_stream_maxlen"].default
    assert verifier == RolloutSettings.model_fields["episodes_stream_maxlen"].default
