"""Sandbox sessions: the record and the error of a session request (session.py), the registry
(manager.py: create, exec, kill, reset, delete, idle expiry), how a session's commands run and
its processes die (processes.py), what a session is given (session_input.py), admission before
the host runs out (admission.py), and sessions set up ahead of demand (warm_pool.py). The top of
the stage modules: imports host/, cgroups/, workspace/, isolation/, execution/ and egress/.
"""
