"""Audited egress of sandbox sessions: a policy's allow-rules, a per-session HTTP(S) proxy, its
audit stream.

    command in the sandbox ──HTTP_PROXY=http://127.0.0.1:3128──▶ loopback listener (doors.py)
                                                                │  (a socket the service made
    command ──curl --unix-socket /run/shellrl/egress.sock──▶   │   inside the session's netns)
                                                                ▼
                      proxy.py: parse, rules.py verdict, limits ──▶ upstream (host network)
                                                                └──▶ audit.py: XADD shellrl:egress,
                                                                     denials as safety events

rules.py: the allow-rules; addresses.py: which addresses are internal (not global); head.py:
request heads (strict bytes, then h11) and refusals; proxy.py: one client connection, its verdict;
relay.py: the bytes of an allowed request; doors.py: the two ways in; audit.py: the audit stream.
Nothing here imports the session manager: it passes what a door needs.
"""
