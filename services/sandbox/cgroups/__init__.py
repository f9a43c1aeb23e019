"""Cgroups of the sandbox: one parent per instance bounding all its sessions, one group per
session. support.py picks the layout (v1.py, v2.py; base.py: what both do the same way). Imports
only host/.
"""
