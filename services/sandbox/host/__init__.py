"""What this host gives the sandbox, below any session: its size and what is free now
(capacity.py), this instance's uid block (uids.py), mount(2) wrappers (mounts.py) and the host's
health score (health.py). Imports nothing of the sandbox but its metrics.
"""
