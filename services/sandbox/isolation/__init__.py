"""How one command is isolated and started: the layers (layers.py: bubblewrap, unshare,
process group), the start-up probe that picks one (probe.py), the launch spec (launch.py), the
bash run before each command and the environments (preludes.py), the executed-argv trace
(argv_trace.py), the seccomp filter (seccomp.py) and what a session sees of /proc (proc_view.py).
Imports host/ and workspace/, never sessions/.
"""
