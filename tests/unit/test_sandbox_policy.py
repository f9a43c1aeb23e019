"""Policy engine (services/sandbox/policy.py) and output rendering: pure, no processes."""

from __future__ import annotations

import time

import pytest

from services.sandbox.execution.executor import OutputBuffer, render_output
from services.sandbox.policy import PolicySet, self_piping_function


@pytest.fixture(scope="module")
def default():
    return PolicySet.load().get("default")


@pytest.mark.parametrize(
    "command, verdict, rule",
    [
        ("rm -rf /", "deny", "rm_root"),
        ("rm -rf /*", "deny", "rm_root"),
        ("rm -fr /usr", "deny", "rm_root"),
        ('rm -rf "/"', "deny", "rm_root"),
        ("cd /tmp && rm -r --force / ; echo", "deny", "rm_root"),
        ("rm -rf --no-preserve-root /", "deny", "rm_root"),
        ("mkfs.ext4 /dev/sda1", "deny", "mkfs"),
        ("dd if=/dev/zero of=/dev/sda bs=1M", "deny", "dd_to_device"),
        (":(){ :|:& };:", "deny", "fork_bomb"),
        ("bomb() { bomb | bomb & }; bomb", "deny", "fork_bomb"),
        ("chmod -R 777 /", "deny", "chmod_chown_root"),
        ("rm -rf ~", "flag", "rm_home"),
        ("rm -rf $HOME/", "flag", "rm_home"),
        ("rm -rf build", "flag", "rm_recursive_or_force"),
        ("rm -f out.txt", "flag", "rm_recursive_or_force"),
        ("find . -name '*.o' -delete", "flag", "find_delete"),
        ("git reset --hard HEAD~1", "flag", "git_destructive"),
        ("kill -9 -1", "flag", "kill_all"),
        ("rm notes.txt", "allow", None),
        ("dd if=/dev/zero of=/dev/null count=1", "allow", None),
        ("ls -la / && cat /etc/os-release", "allow", None),
        ("python3 -c 'print(1)'", "allow", None),
    ],
)
def test_default_policy_verdicts(default, command, verdict, rule):
    result = default.evaluate(command)
    assert (result.verdict, result.rule) == (verdict, rule)


def test_deny_wins_over_an_earlier_flag_and_evaluation_is_deterministic(default):
    command = "rm -rf build; rm -rf /"
    assert {default.evaluate(command) for _ in range(5)} == {default.evaluate(command)}
    assert default.evaluate(command).verdict == "deny"


def test_network_policy_extends_default_with_network(tmp_path):
    policies = PolicySet.load()
    assert policies.get("network").network is True and policies.get("default").network is False
    assert [r.name for r in policies.get("network").rules] == [
        r.name for r in policies.get("default").rules
    ]


@pytest.mark.parametrize(
    "text, message",
    [
        ("policies: {}", "missing or empty"),
        ("policies: {p: {rules: [{name: a, verdict: maybe, pattern: x}]}}", "verdict must be"),
        ("policies: {p: {rules: [{name: a, verdict: deny, pattern: '('}]}}", "bad pattern"),
        (
            "policies: {p: {rules: [{name: a, verdict: deny, pattern: 'rm(?=x)'}]}}",
            r"rule 0 \(a\): bad pattern",
        ),
        (
            "policies: {p: {rules: [{name: a, verdict: deny, pattern: '(a)\\1'}]}}",
            "no backreferences",
        ),
        ("policies: {p: {rules: [{name: a, verdict: deny, builtin: nope}]}}", "unknown builtin"),
        (
            "policies: {p: {rules: [{name: a, verdict: deny, builtin: self_piping_function, pattern: x}]}}",
            "one of pattern or builtin",
        ),
        ("policies: {p: {extends: q}}", "unknown policy 'q'"),
        ("policies: {p: {extends: q}, q: {extends: p}}", "cycle"),
        ("policies: {p: {network: true, colour: red}}", "unknown keys"),
    ],
)
def test_policy_file_mistakes_fail_naming_the_policy(tmp_path, text, message):
    path = tmp_path / "policy.yaml"
    path.write_text(text)
    with pytest.raises(ValueError, match=message):
        PolicySet.load(path)


def test_megabyte_commands_are_normalized_and_evaluated(default):
    """Evaluated whole (the former normalization, which hid targets past the 64th word and
    inside tokens of 65+ characters, is gone: RE2 needs no such bound)."""
    assert default.evaluate("x='" + "a" * 1_000_000 + "'; echo ${#x}").verdict == "allow"
    heredoc = "cat > data <<'EOF'\n" + "some data line 12345\n" * 30_000 + "EOF\nrm -rf /"
    assert default.evaluate(heredoc).rule == "rm_root"
    assert default.evaluate("rm -rf " + "w " * 130 + "/").rule == "rm_root"
    assert default.evaluate("dd if=/dev/zero of=/dev/sda" + "1" * 100).rule == "dd_to_device"


# Pathological shapes for a backtracking engine: long runs of blanks, repeated rule prefixes,
# flags and headers that never complete. Every rule is timed on every shape.
_SEEDS = (
    "rm ",
    "rm -r ",
    "chmod -R ",
    "dd ",
    "dd of=/dev/",
    "of=/dev/nul",
    "mkfs",
    "> /dev/",
    "f(){ ",
    "f|",
    "git reset ",
    "git clean ",
    "find ",
    "shred ",
    "kill -9 ",
    "rm --no-preserve-root",
    "rm ~",
    "-r ",
    "/ ",
    "a",
)


def _pathological(size: int = 64 << 10):
    def fill(unit: str, head: str = "", tail: str = "x") -> str:
        return head + unit * ((size - len(head) - len(tail)) // len(unit)) + tail

    for seed in _SEEDS:
        yield fill(" ", seed)
        yield fill(seed, "", "")
        yield fill("a ", seed)
        yield fill("-", seed)
    yield fill("f|", "f(){ ")
    yield "rm" + " " * 6000 + "x"


@pytest.mark.parametrize(
    "policy, rule",
    [(p, r.name) for p in ("default", "permissive") for r in PolicySet.load().get(p).rules],
)
def test_every_rule_is_linear_on_pathological_64kib_inputs(policy, rule):
    rule = next(r for r in PolicySet.load().get(policy).rules if r.name == rule)
    worst_s = 0.0
    for text in _pathological():
        data = text.encode()
        best_s = min(_cpu_s(rule.matches, text, data) for _ in range(3))  # the least disturbed of 3
        worst_s = max(worst_s, best_s)
    # linear: about 0.5 ms of CPU; a backtracking pattern took seconds on such inputs
    assert worst_s < 0.050, f"{rule.name}: {worst_s * 1e3:.1f} ms of CPU on a 64 KiB input"


def _cpu_s(fn, *args) -> float:
    """CPU seconds this process spent in fn(*args): other processes' load does not add to it."""
    start = time.process_time()
    fn(*args)
    return time.process_time() - start


def test_the_verdict_of_a_pathological_command_does_not_depend_on_the_clock(default):
    """`rm` + 6,000 blanks + `x` took 2.3 s and came back denied as `policy_timeout`."""
    command = "rm" + " " * 6000 + "x"
    start = time.process_time()
    assert default.evaluate(command).verdict == "allow"
    assert time.process_time() - start < 0.05  # CPU seconds: 2.3 s before, under 1 ms now
    assert default.evaluate("rm -rf" + " " * 60_000 + "/").rule == "rm_root"


@pytest.mark.parametrize(
    "text, expected",
    [
        (":(){ :|:& };:", True),
        ("bomb() { bomb | bomb & }; bomb", True),
        ("b(){ ab|b& }", True),
        ("a(){ b(){ a|a& }", True),
        ("f () {\n f|f &\n}", True),
        ("f(){ g|g& }", False),
        ("f(){ f|fx& }", False),
        ("f(){ echo }; f|f&", False),
        ("9f(){ 9f|9f& }", False),
        ("f|f& f(){ x; }", False),
        ("run() { make | tee log & }", False),
    ],
)
def test_self_piping_function_is_the_former_backreference_pattern(text, expected):
    assert self_piping_function(text) is expected


def test_output_rendering_keeps_head_and_tail_with_a_marker():
    buffer = OutputBuffer(10)
    for chunk in (b"0123", b"456789", b"abcdefghij"):
        buffer.feed(chunk)
    assert buffer.truncated_bytes == 10
    assert buffer.text() == "01234\n…[truncated 10 bytes]…\nfghij"
    assert render_output(b"a\xffb\x00", b"", 4) == "a\ufffdb\x00"
