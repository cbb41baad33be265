"""The claims registry: what each paper claims, and which tests check it.

Each reproduction registers the claims of its paper in ``<package>/claims.yaml``::

    paper: kimiteam2025kimilinear          # bib key of the paper the claims come from
    claims:
      - id: kda/chunk-equals-recurrent     # "<package>/<slug>", unique across the repository
        section: "§2.2, Eq. 7"             # where the paper states it
        statement: Chunkwise KDA equals the token-by-token recurrence.
      - id: kda/b200-throughput
        section: "§5.3"
        statement: ...
        reproducible: false                # registered, shown on the site as not reproduced
        reason: Needs Blackwell GPUs, which we do not have.
      - id: nanoparallel/fault-bounded
        paper: keiblinger2025pccl          # optional: a claim from another paper than the file's
        ...

A property test names the claim it checks with ``@pytest.mark.claim("kda/...", section="§2.2, Eq. 7")``;
the pytest plugin (``paperclub.pytest_claims``) records each test's outcome in
``<package>/results/claims.json``, which the site shows.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from paperclub import ROOT

CLAIM_ID = re.compile(r"^[a-z0-9][a-z0-9_-]*/[a-z0-9][a-z0-9_.-]*$")
RESULTS_NAME = "claims.json"


@dataclass
class Claim:
    id: str
    section: str
    statement: str
    package: str
    paper: str
    reproducible: bool = True
    reason: str = ""
    source: Path | None = None


@dataclass
class ClaimFile:
    package: str
    path: Path
    paper: str
    claims: list[Claim] = field(default_factory=list)


class ClaimsError(ValueError):
    """A claims.yaml that cannot be used; names the file, the field and the fix."""

    def __init__(self, file: str, field: str, message: str):
        super().__init__(f"{file}: field '{field}': {message}" if field else f"{file}: {message}")
        self.file, self.field, self.message = file, field, message


def package_dirs(root: Path = ROOT) -> list[tuple[str, Path]]:
    """Every folder that may hold claims: each ``repro/<name>/`` and ``nanoparallel/``."""
    out: list[tuple[str, Path]] = []
    repro = root / "repro"
    if repro.is_dir():
        for d in sorted(repro.iterdir()):
            if d.is_dir() and not d.name.startswith(("_", ".")) and d.name != "__pycache__":
                out.append((d.name, d))
    if (root / "nanoparallel").is_dir():
        out.append(("nanoparallel", root / "nanoparallel"))
    return out


def load_claim_file(package: str, path: Path, root: Path = ROOT) -> ClaimFile:
    rel = _rel(path, root)
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as exc:
        raise ClaimsError(rel, "", f"is not valid YAML ({exc}); fix the syntax") from None
    if not isinstance(data, dict):
        raise ClaimsError(rel, "", "must be a mapping with 'paper' and 'claims'")
    paper = data.get("paper")
    if not isinstance(paper, str) or not paper:
        raise ClaimsError(rel, "paper", "must be the bib key of the paper these claims come from")
    items = data.get("claims")
    if not isinstance(items, list) or not items:
        raise ClaimsError(rel, "claims", "must be a non-empty list")
    cf = ClaimFile(package=package, path=path, paper=paper)
    seen: set[str] = set()
    for i, item in enumerate(items):
        where = f"claims[{i}]"
        if not isinstance(item, dict):
            raise ClaimsError(rel, where, "expected a mapping with id, section, statement")
        for key in ("id", "section", "statement"):
            if not isinstance(item.get(key), str) or not item[key].strip():
                raise ClaimsError(rel, where, f"field '{key}' is missing or empty; every claim needs it")
        cid = item["id"]
        if not CLAIM_ID.match(cid) or not cid.startswith(package + "/"):
            raise ClaimsError(
                rel, where, f"id '{cid}' must look like '{package}/<slug>' (lowercase, digits, - _ .)"
            )
        if cid in seen:
            raise ClaimsError(rel, where, f"id '{cid}' appears twice in this file")
        seen.add(cid)
        reproducible = item.get("reproducible", True)
        if not isinstance(reproducible, bool):
            raise ClaimsError(rel, where, "field 'reproducible' must be true or false")
        reason = item.get("reason", "") or ""
        if not reproducible and not reason.strip():
            raise ClaimsError(rel, where, f"claim '{cid}' is marked reproducible: false; say why in 'reason'")
        unknown = set(item) - {"id", "section", "statement", "reproducible", "reason", "paper"}
        if unknown:
            raise ClaimsError(
                rel,
                where,
                f"unknown field(s) {sorted(unknown)}; allowed: id, section, statement, reproducible, reason, paper",
            )
        claim_paper = item.get("paper", paper)
        if not isinstance(claim_paper, str) or not claim_paper:
            raise ClaimsError(rel, where, "field 'paper' must be a bib key")
        cf.claims.append(
            Claim(
                id=cid,
                section=item["section"].strip(),
                statement=item["statement"].strip(),
                package=package,
                paper=claim_paper,
                reproducible=reproducible,
                reason=reason.strip(),
                source=path,
            )
        )
    return cf


def load_registry(root: Path = ROOT) -> dict[str, Claim]:
    """All claims by id. Raises ClaimsError on a malformed file or an id registered twice."""
    registry: dict[str, Claim] = {}
    for package, d in package_dirs(root):
        path = d / "claims.yaml"
        if not path.exists():
            continue
        for claim in load_claim_file(package, path, root).claims:
            if claim.id in registry:
                raise ClaimsError(
                    _rel(path, root),
                    claim.id,
                    f"is also registered in {_rel(registry[claim.id].source, root)}",
                )
            registry[claim.id] = claim
    return registry


def results_path(package_dir: Path) -> Path:
    return package_dir / "results" / RESULTS_NAME


def load_results(package_dir: Path) -> dict:
    """The recorded outcomes ``{"tests": {nodeid: {...}}}``; empty when none were recorded."""
    path = results_path(package_dir)
    if not path.exists():
        return {"tests": {}}
    return json.loads(path.read_text(encoding="utf-8"))


def claim_status(claim: Claim, results: dict) -> tuple[str, list[dict]]:
    """Summarise a claim: ('passed' | 'failed' | 'skipped' | 'no test' | 'not reproducible', tests)."""
    tests = [
        dict(t, nodeid=nid)
        for nid, t in sorted(results.get("tests", {}).items())
        if t.get("claim") == claim.id
    ]
    if not claim.reproducible:
        return "not reproducible", tests
    if not tests:
        return "no test", tests
    outcomes = {t["outcome"] for t in tests}
    if "failed" in outcomes:
        return "failed", tests
    if "passed" in outcomes:
        return "passed", tests
    return "skipped", tests


def _rel(path: Path | None, root: Path = ROOT) -> str:
    if path is None:
        return "?"
    try:
        return str(path.resolve().relative_to(root.resolve()))
    except ValueError:
        return str(path)
