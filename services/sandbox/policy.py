"""Deterministic command policy from YAML (`policies/default.yaml` is the packaged default).

`PolicySet.load(path)` reads every named policy; `Policy.evaluate(command)` returns the verdict
before the command runs: the first matching `deny` rule in file order, else the first matching
`flag` rule, else `allow`. Commands are matched as typed and with quotes/backslashes removed.

Cost is linear in the command length, so the verdict never depends on the clock: a rule is an
RE2 pattern (google-re2: automata, no backtracking; no lookaround or backreferences, so a
pattern that needs them fails to load naming the rule), or one of the `BUILTINS` checks written
for what RE2 cannot say (each a few linear passes). RE2 classes are ASCII: `\\s` is
`[\\t\\n\\f\\r ]` (bash splits words on blanks only), `\\w` and `\\b` are ASCII. The search
releases the GIL; the service calls `evaluate` in a worker thread.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Literal

import re2
import yaml

from services.sandbox.egress.rules import EgressPolicy
from shellrl.contract.exec import ALLOW, PolicyVerdict

_VERDICTS = ("deny", "flag")
_UNQUOTE = re.compile(r"[\"'\\]")


def _compile(pattern: str, capture: bool = False):
    options = re2.Options()
    options.log_errors = False  # a bad pattern is reported by the loader, naming the rule
    options.never_capture = not capture
    return re2.compile(pattern, options)


# --- checks RE2 cannot express -------------------------------------------------------------
_FUNCTION_HEADER = _compile(r"[A-Za-z0-9_:.]+\s*\(\s*\)\s*\{")
_PIPE_TO_BACKGROUND = _compile(r"([A-Za-z0-9_:.]+)\s*\|\s*([A-Za-z0-9_:.]+)\s*&", capture=True)
_HEADER_NAME = re.compile(r"[A-Za-z0-9_:.]+")
_NAME_START = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz_:.")


def self_piping_function(text: str) -> bool:
    """A shell function that pipes into itself in the background, `f() { … f | f & … }` (the
    classic fork bomb `:(){ :|:& };:`): the function's name, then `|`, then the name again and
    `&`, all before the first `}` after its `{`. The same language as the former pattern
    `(?<![\\w:.])(?P<f>[A-Za-z_:.][\\w:.]*)\\s*\\(\\s*\\)\\s*\\{[^}]*(?P=f)\\s*\\|\\s*(?P=f)\\s*&` (with
    ASCII classes), decided in linear time: per `}`-free chunk, the end of the first header of
    each name, then every `X | Y &` with Y that name, X ending with it and starting after it."""
    for chunk in text.split("}"):
        if "|" not in chunk or "{" not in chunk:
            continue
        body_start: dict[str, int] = {}
        for header in _FUNCTION_HEADER.finditer(chunk):
            name = _HEADER_NAME.match(header.group()).group()
            if name[0] in _NAME_START:
                body_start.setdefault(name, header.end())
        if not body_start:
            continue
        for pipe in _PIPE_TO_BACKGROUND.finditer(chunk):
            left, right = pipe.group(1), pipe.group(2)
            start = body_start.get(right)
            if start is not None and pipe.start() >= start and left.endswith(right):
                return True
    return False


BUILTINS: dict[str, Callable[[str], bool]] = {"self_piping_function": self_piping_function}


@dataclass(frozen=True)
class Rule:
    """One rule: `pattern` (a compiled RE2 searched in the UTF-8 text) or `builtin` (a name in
    `BUILTINS`), exactly one of them."""

    name: str
    verdict: Literal["flag", "deny"]
    pattern: object | None = None
    description: str = ""
    builtin: str | None = None

    def matches(self, text: str, data: bytes) -> bool:
        if self.pattern is not None:
            return self.pattern.search(data) is not None
        return BUILTINS[self.builtin](text)


@dataclass(frozen=True)
class Policy:
    name: str
    rules: tuple[Rule, ...]
    network: bool = False
    egress: EgressPolicy | None = None  # allow-rules of the egress proxy (egress/); None: none

    def evaluate(self, command: str) -> PolicyVerdict:
        """Verdict for `command` (str; lone surrogates are matched as U+FFFD). Linear in
        len(command): about 1 ms per rule for a 64 KiB command."""
        texts = []
        for text in (command, _UNQUOTE.sub("", command)):
            data = text.encode("utf-8", errors="replace")
            texts.append((text, data))
        for wanted in _VERDICTS:
            for rule in self.rules:
                if rule.verdict == wanted and any(rule.matches(t, d) for t, d in texts):
                    return PolicyVerdict(rule.verdict, rule.name)
        return ALLOW


@dataclass(frozen=True)
class PolicySet:
    policies: dict[str, Policy]

    def get(self, name: str) -> Policy | None:
        return self.policies.get(name)

    @classmethod
    def load(cls, path: Path | None = None) -> PolicySet:
        """Parse a policy file; ValueError naming the policy and rule on any mistake."""
        if path is None:
            text = resources.files("services.sandbox").joinpath("policies/default.yaml").read_text()
            source = "packaged default.yaml"
        else:
            text, source = Path(path).read_text(), str(path)
        raw = yaml.safe_load(text) or {}
        if not isinstance(raw.get("policies"), dict) or not raw["policies"]:
            raise ValueError(f"{source}: top-level 'policies' mapping is missing or empty")
        policies: dict[str, Policy] = {}
        pending = dict(raw["policies"])
        while pending:
            progressed = False
            for name, spec in list(pending.items()):
                parent = (spec or {}).get("extends")
                if parent is not None and parent not in policies:
                    if parent not in pending:
                        raise ValueError(
                            f"{source}: policy {name!r} extends unknown policy {parent!r}"
                        )
                    continue
                policies[name] = _parse_policy(source, name, spec or {}, policies.get(parent))
                del pending[name]
                progressed = True
            if not progressed:
                raise ValueError(f"{source}: 'extends' cycle among {sorted(pending)}")
        return cls(policies)


def _parse_rule(where: str, r: dict) -> Rule:
    keys = set(r)
    if (
        keys - {"name", "verdict", "pattern", "builtin", "description"}
        or not {"name", "verdict"} <= keys
        or len(keys & {"pattern", "builtin"}) != 1
    ):
        raise ValueError(
            f"{where}: needs name, verdict and one of pattern or builtin "
            "(and optionally description) only"
        )
    if r["verdict"] not in _VERDICTS:
        raise ValueError(f"{where}: verdict must be 'deny' or 'flag', got {r['verdict']!r}")
    if "builtin" in r:
        if r["builtin"] not in BUILTINS:
            raise ValueError(
                f"{where}: unknown builtin {r['builtin']!r}; one of {sorted(BUILTINS)}"
            )
        return Rule(r["name"], r["verdict"], None, r.get("description", ""), r["builtin"])
    try:
        pattern = _compile(r["pattern"])
    except re2.error as exc:
        raise ValueError(
            f"{where}: bad pattern (RE2 syntax: no lookaround, no backreferences): {exc}"
        ) from None
    return Rule(r["name"], r["verdict"], pattern, r.get("description", ""))


def _parse_policy(source: str, name: str, spec: dict, parent: Policy | None) -> Policy:
    unknown = set(spec) - {"network", "rules", "extends", "egress"}
    if unknown:
        raise ValueError(f"{source}: policy {name!r} has unknown keys {sorted(unknown)}")
    rules = list(parent.rules) if parent else []
    for i, r in enumerate(spec.get("rules") or []):
        rules.append(_parse_rule(f"{source}: policy {name!r} rule {i} ({r.get('name', '?')})", r))
    network = bool(spec.get("network", parent.network if parent else False))
    egress = parent.egress if parent else None
    if "egress" in spec:
        egress = EgressPolicy.parse(f"{source}: policy {name!r}", spec["egress"])
    if network and egress is not None:
        raise ValueError(
            f"{source}: policy {name!r} has both network: true and egress rules; choose one"
        )
    return Policy(name, tuple(rules), network, egress)
