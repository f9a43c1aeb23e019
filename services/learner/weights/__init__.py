"""The learner's weight sync: the push of each new policy version to every engine and its
publication. weight_sync.py (WeightSync: the push, rotation, publication), push_setup.py (what a
push learns about its engines first: transport, dtype, pause, TP size), weight_transport.py
(WeightStaging: the transports and the buffers kept across pushes), bucket_stream.py (streamed
buckets through two slots), weight_dtype.py (the engines' dtype), engine_load.py (one engine's
load: transfer, session end, read back), engine_groups.py (gloo/NCCL weight-update groups),
engine_rotation.py and engine_membership.py (engines in and out of rotation, registered engines
joining). The rest of the learner uses WeightSync only.
"""
