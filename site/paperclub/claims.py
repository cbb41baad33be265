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
``<package>/results/claims.json`` for runs on CPU machines (Triton kernels run through its
interpreter there) and in ``<package>/results/claims-gpu.json`` for runs on a GPU (each entry
``{"claim", "outcome", "since", "platform"}``, the platform naming the device). The two are
different statements: :func:`claim_record` reads both (a missing file means "not run there") and
groups the parametrised cases of each test function, which the site and ``paperclub claims`` show.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from paperclub import ROOT

CLAIM_ID = re.compile(r"^[a-z0-9][a-z0-9_-]*/[a-z0-9][a-z0-9_.-]*$")
RESULTS_NAME = "claims.json"  # outcomes of runs on CPU machines
GPU_RESULTS_NAME = "claims-gpu.json"  # outcomes of runs on a GPU (same schema; the platform names the GPU)
GPU_CHECKS_NAME = "gpu-checks.json"  # the GPU job's latest test and compute-sanitizer outcome per package


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
    """A claims.yaml that cannot be used; names the file (and line), the field and the fix."""

    def __init__(self, file: str, field: str, message: str, line: int | None = None):
        where = f"{file}:{line}" if line else file
        super().__init__(f"{where}: field '{field}': {message}" if field else f"{where}: {message}")
        self.file, self.field, self.message, self.line = file, field, message, line


class UniqueKeyLoader(yaml.SafeLoader):
    """Safe YAML that refuses a mapping with the same key twice (PyYAML keeps the last one silently)."""

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            seen: dict = {}
            for key_node, _ in node.value:
                if not isinstance(key_node, yaml.ScalarNode):
                    continue
                key = key_node.value
                if key in seen and key != "<<":
                    raise yaml.constructor.ConstructorError(
                        None,
                        None,
                        f"key '{key}' appears twice (first on line {seen[key] + 1}); keep one",
                        key_node.start_mark,
                    )
                seen[key] = key_node.start_mark.line
        return super().construct_mapping(node, deep)


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
        data = yaml.load(path.read_text(encoding="utf-8"), Loader=UniqueKeyLoader)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        if "appears twice" not in problem:
            problem = f"is not valid YAML: {problem}; fix the syntax"
        raise ClaimsError(rel, "", problem, mark.line + 1 if mark else None) from None
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


def gpu_results_path(package_dir: Path) -> Path:
    return package_dir / "results" / GPU_RESULTS_NAME


def load_results(package_dir: Path, name: str = RESULTS_NAME) -> dict:
    """The recorded outcomes ``{"tests": {nodeid: {...}}}`` of ``results/<name>``.

    Empty when the file is missing or unreadable (``paperclub check`` reports a file that is not JSON).
    """
    path = package_dir / "results" / name
    if not path.exists():
        return {"tests": {}}
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError):
        return {"tests": {}}
    if not isinstance(doc, dict) or not isinstance(doc.get("tests"), dict):
        return {"tests": {}}
    return doc


def claim_status(claim: Claim, results: dict) -> tuple[str, list[dict]]:
    """Summarise a claim: ('passed' | 'failed' | 'skipped' | 'no test' | 'not reproducible', tests)."""
    tests = [
        dict(t, nodeid=nid)
        for nid, t in sorted(results.get("tests", {}).items())
        if isinstance(t, dict) and t.get("claim") == claim.id
    ]
    if not claim.reproducible:
        return "not reproducible", tests
    if not tests:
        return "no test", tests
    return _claim_level({t.get("outcome") for t in tests}), tests


# ---------------------------------------------------------------- where each test ran: CPU and GPU

NOT_RUN = "not run"
# a group of cases shows its worst outcome: a failure outweighs a skip, a skip outweighs a pass
_WORST_FIRST = ("failed", "skipped", "passed")


def _claim_level(outcomes: set) -> str:
    """A claim holds on a machine when one of its tests passed there and none failed."""
    if "failed" in outcomes:
        return "failed"
    if "passed" in outcomes:
        return "passed"
    return "skipped" if outcomes else NOT_RUN


def worst(outcomes) -> str:
    """The worst of some outcomes (failed, then skipped, then passed); ``'not run'`` when there are none."""
    seen = set(outcomes)
    for o in _WORST_FIRST:
        if o in seen:
            return o
    return NOT_RUN


def device_of(platform: str) -> str:
    """The device part of a recorded platform: ``'NVIDIA H100 80GB HBM3, torch 2.11, x86_64'`` -> the GPU."""
    return (platform or "").split(",")[0].strip()


def is_gpu_platform(platform: str) -> bool:
    dev = device_of(platform).lower()
    return bool(dev) and dev != "cpu" and not dev.startswith(("x86", "aarch64", "arm"))


@dataclass
class CaseOutcome:
    """One test id (a parametrised case, or the whole test when it has no parameters)."""

    nodeid: str
    params: str  # "1-shm-ll" for "...::test_x[1-shm-ll]", "" when not parametrised
    cpu: dict | None  # the record from claims.json ({"outcome", "since", "platform"}), None if not run
    gpu: dict | None  # the record from claims-gpu.json, None if not run on a GPU


@dataclass
class FunctionGroup:
    """The cases of one test function: ``path::[Class::]test_fn``."""

    function: str
    cases: list[CaseOutcome] = field(default_factory=list)

    @property
    def file(self) -> str:
        return self.function.split("::")[0]

    @property
    def name(self) -> str:
        return self.function.split("::")[-1]

    def status(self, where: str) -> str:
        """Worst outcome of the cases run on ``where`` ('cpu' or 'gpu'); 'not run' when none ran there."""
        return worst(r["outcome"] for r in self.records(where))

    def records(self, where: str) -> list[dict]:
        return [r for c in self.cases if (r := getattr(c, where)) is not None]

    def counts(self, where: str) -> dict[str, int]:
        out: dict[str, int] = {}
        for r in self.records(where):
            out[r["outcome"]] = out.get(r["outcome"], 0) + 1
        return out

    def devices(self, where: str) -> list[str]:
        return sorted({device_of(r.get("platform", "")) for r in self.records(where)} - {""})


def summary(group: FunctionGroup, where: str) -> str:
    """``'passed'``, ``'failed (1 of 18; 17 passed)'``, ``'not run'``: one group's statement on CPU or GPU."""
    counts = group.counts(where)
    status = worst(counts)
    if not counts or len(group.cases) == 1 or (len(counts) == 1 and sum(counts.values()) == len(group.cases)):
        return status
    parts = [f"{n} {o}" for o, n in sorted(counts.items(), key=lambda kv: _WORST_FIRST.index(kv[0]))]
    missing = len(group.cases) - sum(counts.values())
    if missing:
        parts.append(f"{missing} {NOT_RUN}")
    return f"{status} ({', '.join(parts)})"


@dataclass
class ClaimRecord:
    """A claim with where and how its tests ran: the statement on CPUs and the statement on GPUs."""

    claim: Claim
    status: str  # overall: not reproducible | no test | failed | passed | skipped
    cpu: str  # on CPUs (Triton kernels through its interpreter): passed | failed | skipped | not run
    gpu: str  # on a GPU: passed | failed | skipped | not run
    groups: list[FunctionGroup] = field(default_factory=list)

    @property
    def gpu_pending(self) -> int:
        """Cases skipped on CPUs with no GPU outcome: GPU tests written but not yet run on a GPU (or
        opt-in tests never run). A claim's GPU status counts only the cases that ran there, so a
        'passed' beside new, unrun GPU tests says how many are still to run."""
        return sum(
            c.gpu is None and c.cpu is not None and c.cpu.get("outcome") == "skipped"
            for g in self.groups
            for c in g.cases
        )

    @property
    def gpu_devices(self) -> list[str]:
        return sorted({d for g in self.groups for d in g.devices("gpu")})

    @property
    def tests(self) -> list[dict]:
        """Every recorded case as one dict (nodeid, claim, outcome, since, platform), CPU record first."""
        return [dict(c.cpu or c.gpu, nodeid=c.nodeid) for g in self.groups for c in g.cases]


def claim_record(claim: Claim, cpu_results: dict, gpu_results: dict | None = None) -> ClaimRecord:
    """Where the claim's tests ran and what they said there.

    ``cpu_results`` is ``results/claims.json`` (runs on CPU machines), ``gpu_results`` is
    ``results/claims-gpu.json`` (runs on a GPU; may be missing). An entry of claims.json whose
    platform names a GPU (recorded before GPU runs had their own file) counts as a GPU outcome.
    """
    cpu: dict[str, dict] = {}
    gpu: dict[str, dict] = {}
    for nid, t in (cpu_results or {}).get("tests", {}).items():
        if isinstance(t, dict) and t.get("claim") == claim.id:
            (gpu if is_gpu_platform(t.get("platform", "")) else cpu)[nid] = t
    for nid, t in (gpu_results or {}).get("tests", {}).items():
        if isinstance(t, dict) and t.get("claim") == claim.id:
            gpu[nid] = t
    groups: dict[str, FunctionGroup] = {}
    for nid in sorted(set(cpu) | set(gpu)):
        function, _, params = nid.partition("[")
        group = groups.setdefault(function, FunctionGroup(function))
        group.cases.append(CaseOutcome(nid, params.removesuffix("]"), cpu.get(nid), gpu.get(nid)))
    on_cpu = _claim_level({t.get("outcome") for t in cpu.values()})
    on_gpu = _claim_level({t.get("outcome") for t in gpu.values()})
    if not claim.reproducible:
        status = "not reproducible"
    elif not groups:
        status = "no test"
    else:
        status = _claim_level({t.get("outcome") for t in [*cpu.values(), *gpu.values()]})
    return ClaimRecord(claim, status, on_cpu, on_gpu, list(groups.values()))


def _rel(path: Path | None, root: Path = ROOT) -> str:
    if path is None:
        return "?"
    try:
        return str(path.resolve().relative_to(root.resolve()))
    except ValueError:
        return str(path)
