"""The executed-argv trace: what the session's shell actually ran, after expansion.

The command policy (policy.py) judges the command text before it runs, so `r=rm; $r -rf x`,
`eval "$(echo cm0gLXJmIHgK | base64 -d)"` or a function wrapping `rm` pass it. Agent commands
therefore run with bash's xtrace on, written to the session's state file `trace` (fd
BASH_XTRACEFD, truncated at each command's start): one line per simple command the shell ran,
its words expanded (`+ rm -rf x`), including those of eval, functions, subshells and command
substitutions, and the argv of programs it started (`+ bash -c 'rm -rf x'`). After the command the
sandbox evaluates the same policy on the trace (`argv_safety_events`): a deny or flag rule that
the text did not trigger becomes a safety event with `"source": "argv"` (the command has run:
a deny rule found here cannot stop it, it is recorded). The saved-state prelude (preludes.py)
turns tracing on before it reads the saved shell state (a forged state file cannot define a
function standing in for `exec` or `set` there), runs `START_MARKER` last before the command,
and its EXIT trap ends the trace with `END_MARKER`: only the lines between are the command's.

A trace that fills the state tmpfs (STATE_BYTES, about 40,000 traced commands in one exec) is
dropped so the shell state can still be saved: `argv_trace_overflow` (flag). Tracing switched
off is itself a safety event `argv_trace_off` (flag): a `set +x` / `set +o
xtrace` other than the trap's, any mention of BASH_XTRACEFD or of the trace file; so is a trace
without the start marker or the trap's end (`argv_trace_incomplete`; not for a timed-out
command, which is killed before its trap runs), which is what a saved state that switches
tracing off, closing the trace's fd or `exec`ing another program leaves.

What it does not see: commands run by programs other than this shell (a Python `os.system`, a
script file run by a child bash: only its argv `bash script.sh` is traced), and a policy that
deliberately edits its own trace (it runs as the session uid, which owns the file). Only the
first `MAX_TRACE_BYTES` of a trace are evaluated. `fresh_state` execs (the verifier's checks)
are not traced.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from services.sandbox import metrics
from services.sandbox.policy import Policy
from shellrl.contract.exec import PolicyVerdict

TRACE_FILE = "trace"
MAX_TRACE_BYTES = 1 << 20
START_MARKER = ": shellrl-trace-start"
END_MARKER = ": shellrl-trace-end"
_TRACE_OFF = re.compile(r"^\++ set (?:.*\s)?(?:\+[A-Za-z]*x|[+]o xtrace)")
_TAMPER = re.compile(r"BASH_XTRACEFD|/state/trace\b|\bxtrace\b")


def start_steps(state_dir: str) -> list[str]:
    """Prelude steps (bash) that open the trace and switch xtrace on, before the saved state is
    read (no trace, and no error, when the file cannot be opened). What the prelude runs after
    them is traced too: `START_MARKER`, run last before the command, marks where the command's
    own lines begin."""
    return [
        f"{{ exec {{__shellrl_xfd}}>| {state_dir}/{TRACE_FILE} && BASH_XTRACEFD=$__shellrl_xfd"
        " && PS4='+ ' && set -x; } 2>/dev/null"
    ]


TRAP_PREFIX = f"{END_MARKER}; set +o xtrace; "
"""The start of the saved-state EXIT trap: marks the trace's end, then stops tracing."""
OVERFLOW_LINE = "+ : shellrl-trace-overflow"


def overflow_step(state_dir: str) -> str:
    """Bash for the EXIT trap when saving the shell state failed (the state tmpfs, which the
    trace shares, is full): the trace is replaced by `OVERFLOW_LINE` to make room, then the trap
    saves again. The command's argv is lost: `argv_trace_overflow`."""
    return f'echo "{OVERFLOW_LINE}" >| {state_dir}/{TRACE_FILE}'


def read_trace(state_dir: Path) -> str:
    """The first MAX_TRACE_BYTES of the session's trace (as text; '' when it cannot be read).
    The state directory is root's: the session can write the file but not replace it."""
    try:
        fd = os.open(state_dir / TRACE_FILE, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return ""
    try:
        return os.read(fd, MAX_TRACE_BYTES).decode("utf-8", errors="replace")
    finally:
        os.close(fd)


def argv_safety_events(
    trace: str, policy: Policy, text_verdict: PolicyVerdict, timed_out: bool
) -> list[dict]:
    """Safety events the trace adds to those of the command text (module doc); each
    {"rule", "verdict", "command", "source": "argv"}."""
    lines = trace.splitlines()
    if lines == [OVERFLOW_LINE]:
        return [_event("argv_trace_overflow", "flag", "")]
    if "+ " + START_MARKER not in lines:  # the saved state switched the trace off, or no trace
        return [_event("argv_trace_incomplete", "flag", "")] if trace and not timed_out else []
    lines = lines[lines.index("+ " + START_MARKER) + 1 :]
    ended = len(lines) >= 2 and lines[-2] == "+ " + END_MARKER and _TRACE_OFF.match(lines[-1])
    body = lines[:-2] if ended else lines
    events = []
    verdict = policy.evaluate("\n".join(body))
    if verdict.verdict != "allow" and verdict.rule != text_verdict.rule:
        hit = next((line for line in body if policy.evaluate(line).rule == verdict.rule), "")
        events.append(_event(verdict.rule, verdict.verdict, hit))
    off = next((line for line in body if _TRACE_OFF.match(line) or _TAMPER.search(line)), None)
    if off is not None:
        events.append(_event("argv_trace_off", "flag", off))
    elif not ended and not timed_out:
        events.append(_event("argv_trace_incomplete", "flag", lines[-1] if lines else ""))
    return events


def session_events(session, text_verdict: PolicyVerdict, timed_out: bool) -> list[dict]:
    """The safety events of the command `session` (a sessions.Session) just ran, from its
    trace; each counted in shellrl_sandbox_policy_verdicts_total."""
    trace = read_trace(session.workspace.paths.state)
    events = argv_safety_events(trace, session.policy, text_verdict, timed_out)
    for event in events:
        metrics.POLICY_VERDICTS.labels(event["verdict"], event["rule"] or "").inc()
    return events


def _event(rule: str | None, verdict: str, line: str) -> dict:
    return {"rule": rule, "verdict": verdict, "command": line[:2000], "source": "argv"}
