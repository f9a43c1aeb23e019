"""How long each part of the test suite took, from the JUnit XML that `make test` writes
(`.shellrl/test-report.xml`): seconds per tests/<part> (setup + call + teardown of each test; a
module's shared fixture counts in the test that started it), tests and failures per part, and
the slowest modules. Under pytest-xdist (`make test`) the seconds are summed over the workers,
so they add up to more than the session's wall time.

    python scripts/suite_times.py [.shellrl/test-report.xml]
"""

from __future__ import annotations

import sys
import xml.etree.ElementTree as ET
from collections import defaultdict


def main(path: str = ".shellrl/test-report.xml") -> None:
    parts: dict[str, list[float]] = defaultdict(lambda: [0.0, 0, 0])
    modules: dict[str, float] = defaultdict(float)
    root = ET.parse(path).getroot()
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    for case in root.iter("testcase"):
        module = case.get("classname", "").split(".")
        part = "/".join(module[:2]) if len(module) > 1 else module[0]
        seconds = float(case.get("time", 0.0))
        parts[part][0] += seconds
        parts[part][1] += 1
        parts[part][2] += any(c.tag in ("failure", "error") for c in case)
        modules[".".join(m for m in module if m[:1].islower())] += seconds
    total = sum(p[0] for p in parts.values())
    print(f"{'part':<16}{'tests':>7}{'failed':>8}{'seconds':>10}{'share':>8}")
    for part, (seconds, count, failed) in sorted(parts.items(), key=lambda kv: -kv[1][0]):
        print(f"{part:<16}{count:>7}{failed:>8}{seconds:>10.0f}{seconds / total:>8.0%}")
    print(f"{'total':<16}{sum(p[1] for p in parts.values()):>7}{'':>8}{total:>10.0f}")
    session = float(suite.get("time", 0.0)) if suite is not None else 0.0
    if session >= total:
        print(f"pytest session {session:.0f} s (collection and imports: {session - total:.0f} s)")
    else:  # pytest-xdist: the workers' tests overlap in time
        print(f"pytest session {session:.0f} s wall; tests {total:.0f} s summed over the workers")
    print("\nslowest modules:")
    for module, seconds in sorted(modules.items(), key=lambda kv: -kv[1])[:12]:
        print(f"  {seconds:7.0f} s  {module}")


if __name__ == "__main__":
    main(*sys.argv[1:])
