"""The README's Troubleshooting section names everything the code can tell a user:
every Event reason, every source-check reason and every stager exit code.
A reason added to the code without a line for it here fails this test."""

from __future__ import annotations

import re
from pathlib import Path

from dscache_contract import ExitCode

REPO = Path(__file__).resolve().parents[2]
OPERATOR = REPO / "operator" / "dscache_operator"
NODE_AGENT = REPO / "node-agent" / "dscache_node"


def troubleshooting() -> str:
    readme = (REPO / "README.md").read_text()
    start = readme.index("## Troubleshooting")
    return readme[start : readme.index("\n## ", start + 1)]


def test_every_event_reason_is_documented():
    reasons = set()
    for path in [*OPERATOR.rglob("*.py"), *NODE_AGENT.glob("*.py")]:
        reasons.update(re.findall(r'reason="([A-Za-z]+)"', path.read_text()))
    assert {"Wiped", "WipeFailed", "NodeGone", "Evicted"} <= reasons  # the pattern still finds them
    section = troubleshooting()
    assert [r for r in sorted(reasons) if f"`{r}`" not in section] == []


def test_every_source_check_reason_is_documented():
    # Every CheckResult(ok, "Reason", ...) the source check builds, over line breaks too.
    code = (OPERATOR / "control" / "sourcecheck.py").read_text()
    reasons = set(re.findall(r'CheckResult\(\s*(?:True|False|None)\s*,\s*"([A-Za-z]+)"', code))
    # Pod identity's reasons (cluster/identity.py) become the check's reason as they are.
    identity = (OPERATOR / "cluster" / "identity.py").read_text()
    reasons.update(re.findall(r'IdentityError\(\s*"([A-Za-z]+)"', identity))
    assert {"Listed", "NoIdentity", "SecretForbidden", "SecretNotFound", "SourceError"} <= reasons
    assert {"RoleNotAnnotated", "IdentityRefused", "STSUnreachable", "ServiceAccountNotFound"} <= reasons
    section = troubleshooting()
    assert [r for r in sorted(reasons) if f"`{r}`" not in section] == []


def test_every_stager_exit_code_is_documented():
    codes = troubleshooting().split("exit code", 1)[1]
    missing = [c for c in ExitCode if c is not ExitCode.OK and not re.search(rf"\b{int(c)}\s+[A-Za-z(]", codes)]
    assert missing == []
