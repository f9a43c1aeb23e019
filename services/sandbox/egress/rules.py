"""Egress allow-rules of a sandbox policy (the `egress:` block of a policy in the policy file).

    egress:
      requests_per_minute: 120        # per session; token bucket of that many, refilled evenly
      max_bytes: 67108864             # per session: bytes through the proxy, both directions
      rules:
        - name: local_mirror
          host: 127.0.0.1             # exact host name or IP literal, or "*.example.org"
          ports: [8080]
          methods: [GET, HEAD]        # default [GET, HEAD]; CONNECT must be listed to allow HTTPS
          path_prefix: /simple/       # default "/"; plain HTTP only (CONNECT carries no path)

`EgressPolicy.evaluate(method, host, port, path)` is deterministic: the first rule in file order
that matches host, port, method and path prefix (whole segments: `/ok` allows `/ok` and
`/ok/a`, not `/okay`) allows the request; no match denies it (rule
None). A policy without an `egress` block has no network at all (the default). A rule naming an
internal address (every address that is not globally routable: addresses.py) must name it
literally (an IP literal or `localhost`): a public name that resolves to one is refused by the
proxy. An address in a rule is written as `ipaddress` prints it (`127.0.0.1`, not `0x7f.1` or
`2130706433`; IPv6 compressed or not), and a wildcard rule never matches an IP literal.
"""

from __future__ import annotations

from dataclasses import dataclass

from services.sandbox.egress.addresses import NotAnAddress, is_internal, literal_address

DEFAULT_METHODS = ("GET", "HEAD")
DEFAULT_REQUESTS_PER_MINUTE = 120
DEFAULT_MAX_BYTES = 64 << 20
_RULE_KEYS = {"name", "host", "ports", "methods", "path_prefix"}


@dataclass(frozen=True)
class EgressVerdict:
    """`verdict` "allow" or "deny"; `rule` the allowing rule's name (None when nothing matched
    or a limit refused); `reason` a short machine word (`rule`, `no_rule`, `rate_limit` ...)."""

    verdict: str
    rule: str | None
    reason: str


@dataclass(frozen=True)
class EgressRule:
    name: str
    host: str  # lower case; "*.suffix" matches every name below suffix (not suffix itself)
    ports: tuple[int, ...]
    methods: tuple[str, ...] = DEFAULT_METHODS
    path_prefix: str = "/"

    def matches(self, method: str, host: str, port: int, path: str) -> bool:
        if port not in self.ports or method not in self.methods or not self.host_matches(host):
            return False
        return method == "CONNECT" or under_prefix(path, self.path_prefix)

    def host_matches(self, host: str) -> bool:
        """Exact (case and a trailing dot aside) or below a wildcard's suffix; `host` an IP
        literal as head.py passes it (canonical: `ipaddress`'s form)."""
        host = host.lower().rstrip(".")
        if self.host.startswith("*."):
            return host.endswith(self.host[1:]) and _literal(host) is None
        return host == self.host

    @property
    def names_internal(self) -> bool:
        """True when the rule names an internal address literally (so the proxy may connect to
        one for it)."""
        if self.host == "localhost":
            return True
        address = _literal(self.host)
        return address is not None and is_internal(address)


def under_prefix(path: str, prefix: str) -> bool:
    """`path` is `prefix` or below it, segment by segment: `/ok` takes `/ok` and `/ok/a`, not
    `/okay` (a prefix ending in `/` is a plain string prefix)."""
    if prefix.endswith("/"):
        return path.startswith(prefix)
    return path == prefix or path.startswith(prefix + "/")


def _literal(host: str):
    try:
        return literal_address(host)
    except NotAnAddress:
        return None


@dataclass(frozen=True)
class EgressPolicy:
    rules: tuple[EgressRule, ...]
    requests_per_minute: int = DEFAULT_REQUESTS_PER_MINUTE
    max_bytes: int = DEFAULT_MAX_BYTES

    def evaluate(self, method: str, host: str, port: int, path: str) -> EgressVerdict:
        """Verdict for one request (`method` upper case, `path` decoded, "" for CONNECT)."""
        for rule in self.rules:
            if rule.matches(method, host, port, path):
                return EgressVerdict("allow", rule.name, "rule")
        return EgressVerdict("deny", None, "no_rule")

    def rule(self, name: str | None) -> EgressRule | None:
        return next((r for r in self.rules if r.name == name), None)

    @classmethod
    def parse(cls, where: str, spec: object) -> EgressPolicy:
        """From the YAML mapping; ValueError naming `where` and the rule on any mistake."""
        if not isinstance(spec, dict):
            raise ValueError(f"{where}: egress must be a mapping with 'rules'")
        unknown = set(spec) - {"rules", "requests_per_minute", "max_bytes"}
        if unknown:
            raise ValueError(f"{where}: egress has unknown keys {sorted(unknown)}")
        rules = spec.get("rules") or []
        if not isinstance(rules, list):
            raise ValueError(f"{where}: egress.rules must be a list")
        parsed = tuple(_parse_rule(f"{where} egress rule {i}", r) for i, r in enumerate(rules))
        names = [r.name for r in parsed]
        if len(set(names)) != len(names):
            raise ValueError(f"{where}: egress rule names must be unique, got {names}")
        rpm = spec.get("requests_per_minute", DEFAULT_REQUESTS_PER_MINUTE)
        max_bytes = spec.get("max_bytes", DEFAULT_MAX_BYTES)
        for key, value in (("requests_per_minute", rpm), ("max_bytes", max_bytes)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{where}: egress.{key} must be a positive integer")
        return cls(parsed, rpm, max_bytes)


def _parse_rule(where: str, r: object) -> EgressRule:
    if not isinstance(r, dict) or set(r) - _RULE_KEYS or not {"name", "host", "ports"} <= set(r):
        raise ValueError(
            f"{where}: needs name, host and ports (optionally methods, path_prefix) only"
        )
    name = r["name"]
    host = str(r["host"]).lower().rstrip(".").strip("[]")
    if not host or any(c in host for c in "/@ \t?#%"):
        raise ValueError(f"{where} ({name}): bad host {r['host']!r}")
    try:
        address = literal_address(host)
    except NotAnAddress:
        raise ValueError(
            f"{where} ({name}): bad host {r['host']!r} (numeric, no address)"
        ) from None
    if address is not None and address.version == 4 and str(address) != host:
        raise ValueError(f"{where} ({name}): write the address {r['host']!r} as {address}")
    if address is not None:
        host = str(address)
    if host.startswith("*") and (not host.startswith("*.") or "*" in host[1:] or len(host) < 4):
        raise ValueError(f"{where} ({name}): a wildcard host is '*.suffix', got {r['host']!r}")
    ports = r["ports"]
    if (
        not isinstance(ports, list)
        or not ports
        or not all(isinstance(p, int) and not isinstance(p, bool) and 0 < p < 65536 for p in ports)
    ):
        raise ValueError(f"{where} ({name}): ports must be a non-empty list of 1..65535")
    methods = r.get("methods", list(DEFAULT_METHODS))
    if (
        not isinstance(methods, list)
        or not methods
        or not all(isinstance(m, str) and m.isalpha() for m in methods)
    ):
        raise ValueError(f"{where} ({name}): methods must be a non-empty list of HTTP methods")
    prefix = r.get("path_prefix", "/")
    if not isinstance(prefix, str) or not prefix.startswith("/"):
        raise ValueError(f"{where} ({name}): path_prefix must start with '/'")
    return EgressRule(str(name), host, tuple(ports), tuple(m.upper() for m in methods), prefix)
