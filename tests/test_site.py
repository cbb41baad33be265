"""The website: a strict offline build with every session, paper, deck, claim and benchmark page."""

from __future__ import annotations

import html
import json
import re
import shutil
from pathlib import Path

from paperclub import ROOT
from paperclub.claims import summary
from paperclub.content import load, split_slides
from paperclub.sitegen import claims_dashboard
from tests.conftest import FIXTURES, make_repo, paperclub, repository_content


def repo():
    """The repository's content, loaded once per test process (tests/conftest.py)."""
    return repository_content()[0]


def test_strict_build_has_no_warnings(built_site):
    log = (built_site / ".build-log").read_text()
    assert not re.search(r"^WARNING\b", log, re.M), log


def test_every_session_has_a_page_and_appears_in_the_index(built_site):
    index = (built_site / "sessions" / "index.html").read_text()
    assert len(repo().sessions) == 26
    for s in repo().sessions:
        assert (built_site / "sessions" / s.folder / "index.html").exists(), s.folder
        assert f'href="{s.folder}/"' in index, f"{s.folder} missing from the sessions index"


def test_sessions_index_is_newest_first(built_site):
    index = (built_site / "sessions" / "index.html").read_text()
    order = [s.folder for s in repo().sessions_newest_first()]
    positions = [index.index(f'href="{f}/"') for f in order]
    assert positions == sorted(positions)


def test_paired_sessions_have_a_deck_of_ten_to_twenty_slides(built_site):
    paired = [s for s in repo().sessions if s.meta.repro]
    assert len(paired) == 8
    for s in paired:
        assert s.deck is not None, f"{s.folder} pairs with a repro but has no slides.md"
        n = len(split_slides(s.deck.read_text()))
        assert 10 <= n <= 20, f"{s.folder}: {n} slides"
        html = (built_site / "slides" / s.folder / "index.html").read_text()
        assert html.count("<section>") == n
        session_page = (built_site / "sessions" / s.folder / "index.html").read_text()
        assert f"slides/{s.folder}/" in session_page, "the session page links its deck"


def test_every_paper_page_bibliography_entry_and_tag(built_site):
    bib = (built_site / "bibliography" / "index.html").read_text()
    tags = (built_site / "tags" / "index.html").read_text()
    for key, paper in repo().papers.items():
        page = (built_site / "papers" / key / "index.html").read_text()
        assert repo().bib[key].title.split(":")[0][:20] in page
        assert f'id="{key}"' in bib
        for t in paper.meta.tags:
            assert f'id="{t}"' in tags


def test_claims_and_benchmarks_pages_list_every_claim_and_result(built_site):
    claims_html = (built_site / "claims" / "index.html").read_text()
    for cid, claim in repo().claims.items():
        assert cid in claims_html
        if not claim.reproducible:
            assert "not reproducible here" in claims_html
    bench_html = (built_site / "benchmarks" / "index.html").read_text()
    for name, repro in repo().repros.items():
        if repro.planned:
            continue
        assert f'id="{name}"' in bench_html
        checks = repro.path / "results" / "gpu-checks.json"
        if checks.exists():
            for check in json.loads(checks.read_text())["checks"].values():
                assert html.escape(check["detail"].split("|")[0][:30], quote=False) in claims_html
        for f in (repro.path / "results").glob("*.json"):
            if f.name not in ("claims.json", "claims-gpu.json", "gpu-checks.json"):
                doc = json.loads(f.read_text())
                assert doc["device"] in bench_html


def test_walkthrough_notebooks_are_executed_into_pages(built_site):
    for name, repro in repo().repros.items():
        if repro.walkthrough is None:
            continue
        page = built_site / "repro" / name / "walkthrough" / "index.html"
        assert page.exists(), name
        html = page.read_text()
        assert "Executed at build time" in html
        assert "<img" in html, f"{name}: the walkthrough should show at least one picture"


def test_search_index_holds_every_papers_key_terms(built_site):
    index = json.loads((built_site / "search" / "search_index.json").read_text())
    by_location: dict[str, str] = {}
    for doc in index["docs"]:
        page = doc["location"].split("#")[0]
        by_location[page] = by_location.get(page, "") + " " + doc["title"] + " " + doc["text"]
    for key in repo().papers:
        text = by_location.get(f"papers/{key}/", "").lower()
        entry = repo().bib[key]
        terms = [w for w in re.findall(r"[a-z][a-z0-9-]{4,}", entry.title.lower())][:4]
        if entry.eprint:
            terms.append(entry.eprint)
        missing = [t for t in terms if t not in text]
        assert not missing, f"search index lacks {missing} for papers/{key}"
    usp = by_location.get("sessions/2025-08-unified-sequence-parallelism/", "")
    assert "Ulysses" in usp


EXTERNAL = re.compile(r"""<(?:script|link|img|iframe)[^>]+(?:src|href)=["'](?:https?:)?//""", re.I)


def test_no_page_loads_anything_from_the_internet(built_site):
    offenders = []
    for page in built_site.rglob("*.html"):
        for m in EXTERNAL.finditer(page.read_text(errors="replace")):
            tag = m.group(0)
            if "<link" in tag.lower() and re.search(r'rel=["\'](?:canonical|alternate)', tag):
                continue
            offenders.append(f"{page.relative_to(built_site)}: {tag}")
    for css in built_site.rglob("*.css"):
        if re.search(r"@import\s+url\(['\"]?https?:", css.read_text(errors="replace")):
            offenders.append(str(css.relative_to(built_site)))
    assert not offenders, offenders[:10]


# ---------------------------------------------------------------- the claims dashboard: CPU and GPU outcomes


def gpu_claims_repo(tmp_path: Path) -> Path:
    """The valid fixture with a reproduction whose claims ran on CPUs only, on a GPU too, or not at all."""
    root = make_repo(tmp_path)
    shutil.copytree(FIXTURES / "gpu-claims" / "repro", root / "repro")
    return root


def render(markdown_text: str) -> str:
    import markdown

    return markdown.markdown(
        markdown_text, extensions=["tables", "md_in_html", "attr_list", "pymdownx.details"]
    )


def test_claim_records_keep_cpu_and_gpu_apart(tmp_path):
    content, problems = load(gpu_claims_repo(tmp_path))
    assert not problems, problems  # claims-gpu.json is a claims record, not a benchmark result
    exact = content.record(content.claims["toy/exact"])
    assert (exact.status, exact.cpu, exact.gpu) == ("failed", "passed", "failed")
    assert exact.gpu_devices == ["NVIDIA H100 80GB HBM3"]
    groups = {g.name: g for g in exact.groups}
    assert set(groups) == {"test_exact", "test_exact_on_gpu"}
    assert len(groups["test_exact"].cases) == 3
    assert (groups["test_exact"].status("cpu"), groups["test_exact"].status("gpu")) == ("passed", "not run")
    on_gpu = groups["test_exact_on_gpu"]
    assert (on_gpu.status("cpu"), on_gpu.status("gpu")) == ("skipped", "failed")
    assert summary(on_gpu, "gpu") == "failed (1 failed, 1 passed)"
    cpu_only = content.record(content.claims["toy/cpu-only"])
    assert (cpu_only.status, cpu_only.cpu, cpu_only.gpu) == ("passed", "passed", "not run")
    checked = content.record(content.claims["toy/gpu-checked"])
    assert (checked.status, checked.cpu, checked.gpu) == ("passed", "passed", "passed")
    # a GPU test written after the GPU run (skipped on CPUs, no GPU outcome) is counted as pending;
    # test_exact_on_gpu, skipped on CPUs too but run on the GPU, is not
    assert (checked.gpu_pending, exact.gpu_pending, cpu_only.gpu_pending) == (1, 0, 0)
    assert content.status(content.claims["toy/big-machine"])[0] == "not reproducible"


def test_a_missing_gpu_record_reads_as_not_run(tmp_path):
    root = gpu_claims_repo(tmp_path)
    (root / "repro/toy/results/claims-gpu.json").unlink()
    content, problems = load(root)
    assert not problems, problems
    for cid in ("toy/exact", "toy/cpu-only", "toy/gpu-checked"):
        rec = content.record(content.claims[cid])
        assert rec.gpu == "not run" and rec.cpu == "passed" and rec.status == "passed", cid
    assert "not run on a GPU" in claims_dashboard(content)


def test_dashboard_shows_where_each_claim_was_checked(tmp_path):
    content, _ = load(gpu_claims_repo(tmp_path))
    page = render(claims_dashboard(content))
    rows = {
        cid: row for row in re.findall(r"<tr>(.*?)</tr>", page, re.S) for cid in content.claims if cid in row
    }
    assert set(rows) == set(content.claims), "one table row per claim"
    cells = {cid: re.findall(r"<td>(.*?)</td>", row, re.S) for cid, row in rows.items()}
    assert all(len(c) == 4 for c in cells.values()), cells  # claim, CPU, GPU, checked by
    # checked on CPUs only reads apart from checked on a GPU (which names the device)
    assert "not run on a GPU" in cells["toy/cpu-only"][2] and "H100" not in cells["toy/cpu-only"][2]
    assert (
        "status-passed" in cells["toy/gpu-checked"][2]
        and "on NVIDIA H100 80GB HBM3" in cells["toy/gpu-checked"][2]
        and "1 case not yet run on a GPU" in cells["toy/gpu-checked"][2]
    )
    assert "not yet run on a GPU" not in cells["toy/exact"][2]
    assert "status-failed" in cells["toy/exact"][2] and "status-passed" in cells["toy/exact"][1]
    # parametrised cases are grouped under their function, with a count and the worst outcome, folded
    exact = cells["toy/exact"][3]
    assert exact.count("<details") == 2 and "test_exact</code></a> ×3" in exact
    summary_gpu = re.search(r"test_exact_on_gpu</code></a> ×2.*?</summary>", exact, re.S).group(0)
    assert "failed (1 failed, 1 passed)" in summary_gpu
    assert "<code>bf16</code>" in exact and "<code>fp16</code>" in exact
    assert "We have no thousand GPUs." in cells["toy/big-machine"][3]
    # the statement is in the claim's own cell, beside its id and section
    assert "The toy kernel equals its reference for every shape." in cells["toy/exact"][0]
    assert (
        "2 claim(s) have tests that ran on a GPU (NVIDIA H100 80GB HBM3); 1 were checked on CPUs only" in page
    )


def test_case_ids_that_would_break_markdown_stay_inside_their_cell(tmp_path):
    """A plain id beside parametrised ones (params '') and an id holding a backtick: each renders as
    its own <code>, and the claims after them still render as HTML (a markdown code span opened by
    '``' once swallowed the rest of the claims page)."""
    root = gpu_claims_repo(tmp_path)
    path = root / "repro/toy/results/claims.json"
    record = json.loads(path.read_text())
    base = dict(record["tests"]["repro/toy/tests/test_toy.py::test_exact[1]"])
    record["tests"]["repro/toy/tests/test_toy.py::test_exact"] = base
    record["tests"]["repro/toy/tests/test_toy.py::test_exact[a`b]"] = base
    path.write_text(json.dumps(record))
    content, problems = load(root)
    assert not problems, problems
    page = render(claims_dashboard(content))
    assert "&lt;span" not in page and "`" not in page
    assert "<code>(no parameters)</code>" in page and "<code>a&#96;b</code>" in page
    rows = [row for row in re.findall(r"<tr>(.*?)</tr>", page, re.S) if "toy/" in row]
    assert len(rows) == len(content.claims)


def test_paperclub_claims_prints_cpu_and_gpu(tmp_path):
    root = gpu_claims_repo(tmp_path)
    out = paperclub("--root", str(root), "claims")
    assert out.returncode == 0, out.stderr
    lines = {
        line.split()[1]: line for line in out.stdout.splitlines() if line.startswith(("passed", "failed"))
    }
    assert "passed on NVIDIA H100 80GB HBM3 (1 not yet run on a GPU)" in lines["toy/gpu-checked"]
    assert "passed    not run" in lines["toy/cpu-only"]
    assert "failed on NVIDIA H100 80GB HBM3" in lines["toy/exact"]
    assert re.search(
        r"test_exact_on_gpu \(2 cases\)\s+CPU skipped; GPU failed \(1 failed, 1 passed\)", out.stdout
    )
    assert re.search(r"test_exact \(3 cases\)\s+CPU passed; GPU not run", out.stdout)
    # the reason of a claim we cannot reproduce is wrapped under it, and a summary ends the list
    assert max(map(len, out.stdout.splitlines())) <= 160
    assert "why: We have no thousand GPUs." in out.stdout
    assert out.stdout.rstrip().splitlines()[-1] == (
        "4 claims: 2 of 3 testable claims pass (1 of them on a GPU too); 1 failed; 1 not reproducible here"
    )


def test_gpu_checks_are_shown_per_package(tmp_path):
    """results/gpu-checks.json (the GPU job's latest test and compute-sanitizer outcome) appears on the
    claims dashboard and the reproduction's page, is not taken for a benchmark result, and a broken
    file is shown as unreadable rather than dropped."""
    import json

    from paperclub.sitegen import gpu_checks_table

    root = gpu_claims_repo(tmp_path)
    checks = {
        "tests": {"status": "ok", "detail": "12 passed in 35.6s", "date": "2026-11-25T02:42:36Z",
                  "device": "NVIDIA H100 80GB HBM3"},
        "sanitizer": {"status": "failed", "detail": "compute-sanitizer errors: 3; ERROR SUMMARY: 3 errors",
                      "date": "2026-11-25T02:42:36Z", "device": "NVIDIA H100 80GB HBM3"},
    }  # fmt: skip
    path = root / "repro/toy/results/gpu-checks.json"
    path.write_text(json.dumps({"checks": checks}))
    content, problems = load(root)
    assert not problems, problems
    page = render(claims_dashboard(content))
    rows = [r for r in re.findall(r"<tr>(.*?)</tr>", page, re.S) if "<td>toy</td>" in r]
    assert len(rows) == 2
    assert "12 passed in 35.6s" in rows[0] and "2026-11-25" in rows[0]
    assert "failed" in rows[1] and "ERROR SUMMARY: 3 errors" in rows[1]
    path.write_text("{not json")
    table = gpu_checks_table({"toy": content.repros["toy"]})
    assert "unreadable" in table and "gpu-checks.json" in table


def test_a_benchmark_plot_is_drawn_once_per_build(monkeypatch):
    """A result's plots appear on the benchmarks, reproduction and paper pages: each figure is drawn
    once per site and reused, and a result whose numbers or plot spec differ is drawn afresh."""
    from paperclub import sitegen

    drawn = []
    monkeypatch.setattr(sitegen, "render_plots", lambda doc, plot: drawn.append(1) or [("t", b"png")])
    doc = {"_file": "repro/toy/results/h100.json", "rows": [{"n": 1, "ms": 2.0}]}
    plot = {"x": "n", "y": "ms", "series": "impl"}
    site = sitegen.Site()
    for _ in range(3):
        assert sitegen.cached_plots(site, doc, plot) == [("t", b"png")]
    assert len(drawn) == 1
    sitegen.cached_plots(site, {**doc, "rows": [{"n": 1, "ms": 3.0}]}, plot)
    sitegen.cached_plots(site, doc, {**plot, "logx": True})
    sitegen.cached_plots(site, {**doc, "_file": "repro/toy/results/h200.json"}, plot)
    assert len(drawn) == 4
    sitegen.cached_plots(sitegen.Site(), doc, plot)  # a new build draws again
    assert len(drawn) == 5


# ---------------------------------------------------------------- what the issue of a new member found


def test_the_build_prints_nothing_to_look_into(built_site):
    """The strict build's log: no false anchor warnings for source-page lines, no list of pages left
    out of the navigation (about 360 lines before)."""
    log = (built_site / ".build-log").read_text()
    assert len(log.splitlines()) < 10, log[:3000]


def test_search_index_leaves_out_source_views_and_formulas(built_site):
    index = json.loads((built_site / "search" / "search_index.json").read_text())
    assert not [d for d in index["docs"] if d["location"].startswith("source/")]
    assert (built_site / "search" / "search_index.json").stat().st_size < 2_000_000
    text = " ".join(d["text"] for d in index["docs"])
    assert "\\frac" not in text and "\\(" not in text


def test_links_to_code_by_symbol_reach_the_definition_line(built_site):
    """papers/gale2022megablocks.md links `route` by name: the link lands on the line that defines it."""
    from paperclub.codelinks import symbol_line

    page = (built_site / "papers" / "gale2022megablocks" / "index.html").read_text()
    line = symbol_line(ROOT / "repro/megablocks/reference.py", "route")
    assert f'source/repro/megablocks/reference.py/#__codelineno-0-{line}"' in page
    source = (built_site / "source/repro/megablocks/reference.py/index.html").read_text()
    assert f'id="__codelineno-0-{line}"' in source


def test_repro_pages_show_claims_and_results_before_files(built_site):
    for name, repro in repo().repros.items():
        if repro.planned:
            continue
        page = (built_site / "repro" / name / "index.html").read_text()
        files = page.index('id="files"')
        for section in ("claims", "benchmarks"):
            if f'id="{section}"' in page:
                assert page.index(f'id="{section}"') < files, f"{name}: {section} after the files"


def test_benchmarks_page_is_an_overview(built_site):
    page = (built_site / "benchmarks" / "index.html").read_text()
    landed = [n for n, r in repo().repros.items() if not r.planned]
    assert page.count("<img") <= 2 * len(landed)
    usp = (built_site / "repro" / "usp" / "index.html").read_text()
    assert "bench-plot" in usp, "a result without declared plots gets a summary chart"


def test_papers_index_leaves_unreproducible_claims_out_of_the_count(built_site):
    page = (built_site / "papers" / "index.html").read_text()
    assert re.search(r"\d+ of \d+ pass; \d+ not reproducible here", page)
    assert not re.search(r"\d+/\d+ passed", page)


def test_empty_plots_are_not_drawn():
    from paperclub import sitegen

    doc = {"_file": "repro/toy/results/x.json", "rows": [{"gates": "varlen", "T": 1, "ms": 2.0}]}
    assert (
        sitegen.render_plots(doc, {"x": "T", "y": "ms", "series": "gates", "where": {"gates": "std"}}) == []
    )
    assert len(sitegen.render_plots(doc, {"x": "T", "y": "ms", "series": "gates"})) == 1


def test_result_headings_tell_files_of_one_package_apart():
    from paperclub.bench import load_results
    from paperclub.sitegen import result_heading

    for name in repo().repros:
        headings = [result_heading(d, name) for d in load_results(name)]
        assert len(headings) == len(set(headings)), f"{name}: {headings}"


def test_slides_split_on_dashes_outside_code_only():
    from paperclub.content import slide_spans

    deck = "# One\n\n---\n\n## Two\n\n```yaml\n---\nkey: value\n---\n```\n\n---\n\n## Three\n"
    spans = slide_spans(deck)
    assert [first for first, _ in spans] == [1, 5, 15]
    assert "key: value" in spans[1][1] and spans[1][1].count("---") == 2
