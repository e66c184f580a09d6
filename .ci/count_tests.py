"""Fail when a JUnit report shows that no test actually ran (all skipped, or none collected).

pytest exits 0 when every test is skipped, which would let a stack whose dependencies failed to
import pass CI silently. Usage: python .ci/count_tests.py REPORT.xml LABEL
"""

from __future__ import annotations

import sys
import xml.etree.ElementTree as ET


def main() -> int:
    path, label = sys.argv[1], sys.argv[2]
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    total = sum(int(s.get("tests", 0)) for s in suites)
    skipped = sum(int(s.get("skipped", 0)) for s in suites)
    ran = total - skipped
    print(f"{label}: {ran} tests ran, {skipped} skipped")
    if ran <= 0:
        print(f"{label}: no test ran - the stack is broken or nothing was collected", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
