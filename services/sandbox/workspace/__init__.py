"""A session's files on the host: the size-capped tmpfs workspace, its post-setup snapshot, reset
and safe reads (files.py), and the diff against that snapshot (diff.py). Imports only host/.
"""
