"""The results log (paperclub.results_log): every committed run of a reproduction, newest first, with
what was run and its headline rows, generated from the result files."""

from __future__ import annotations

import json

from paperclub.results_log import command_text, entries, headline, results_log_page


def _doc(date: str, title: str, rows: list[dict], columns: list[str], command: str, notes: str = "") -> dict:
    return {"schema": 1, "package": "fa4", "title": title, "date": date, "device": "NVIDIA H100 80GB HBM3",
            "device_count": 1, "environment": {"torch": "2.11.0", "triton": "3.6.0", "cuda": "13.0",
            "packages": {"torch": "2.11.0", "flash-attn-4": "4.0.0b4", "megablocks": "not installed"}},
            "peer": "cuDNN", "columns": columns, "rows": rows, "plots": [], "notes": notes, "command": command}  # fmt: skip


def test_results_log_lists_runs_newest_first_with_their_headline(tmp_path):
    cols = ["impl", "pass", "S", "ms", "check", "vs_cudnn"]
    rows = [
        {"impl": "ours", "pass": "fwd", "S": 4096, "ms": 2.0, "check": "ok", "vs_cudnn": 0.9},
        {"impl": "ours", "pass": "fwd", "S": 8192, "ms": 7.0, "check": "ok", "vs_cudnn": 1.1},
        {"impl": "ours", "pass": "bwd", "S": 8192, "ms": None, "check": "failed: AssertionError: dq", "vs_cudnn": None},
        {"impl": "cudnn", "pass": "fwd", "S": 4096, "ms": 1.8, "check": "ok", "vs_cudnn": 1.0},
    ]  # fmt: skip
    (tmp_path / "dev-bwd.json").write_text(json.dumps(_doc(
        "2026-11-27T17:29:41+00:00", "Backward run", rows, cols,
        "/work/main/repro/fa4/bench.py --only bwd --out /root/out --rounds 9",
        notes="TFLOP/s ... Not measured (time budget of 280 s): S=16384 causal=True. More.")))  # fmt: skip
    sweep_rows = [
        {"status": "ran", "rel_err_vs_fa2": 1e-5},
        {"status": "failed (exit 1): an illegal instruction"},
    ]
    (tmp_path / "dev-sweep.json").write_text(json.dumps(_doc(
        "2026-11-25T10:56:22+00:00", "Sweep", sweep_rows, ["status", "rel_err_vs_fa2"], "-")))  # fmt: skip
    (tmp_path / "claims.json").write_text("{}")  # the claims records are not runs
    (tmp_path / "gpu-checks.json").write_text(json.dumps({"checks": {"tests": {
        "date": "2026-11-26T09:00:00Z", "device": "NVIDIA H100 80GB HBM3", "status": "ok",
        "detail": "93 passed, 49 skipped", "versions": {"torch": "2.11.0"}}}}))  # fmt: skip
    (tmp_path / "dev-ncu-8k.csv").write_text("ID,Kernel Name\n")
    log = entries("fa4", tmp_path)
    assert [e.get("title", e.get("name")) for e in log] == ["Backward run", "tests", "Sweep"]
    page = results_log_page("fa4", tmp_path)
    first, second, third = (page.index(x) for x in ("Backward run", "GPU job, tests: ok", "**Sweep**"))
    assert first < second < third
    assert "`python -m repro.fa4.bench --only bwd --rounds 9`" in page and "/root/out" not in page
    assert "Not measured (time budget of 280 s): S=16384 causal=True." in page
    assert "versions: torch 2.11.0, triton 3.6.0, cuda 13.0, flash-attn-4 4.0.0b4" in page  # no duplicates
    assert "| ours (fwd) | 0.9 | 1.1 | 2 |  |" in page  # the range of the headline ratio, per pass
    assert "| ours (bwd) |  |  | 1 | 1 |" in page  # a row that failed its check is counted
    assert "status: ran: 1; failed (exit 1): an illegal instruction: 1" in page
    assert "run: `(not recorded)`" in page and "93 passed, 49 skipped" in page
    assert "## Other files" in page and "`dev-ncu-8k.csv`" in page and "claims.json" not in page
    assert results_log_page("fa4", tmp_path / "none").rstrip().endswith("No results have been committed yet.")


def test_headline_and_command_text():
    doc = {"columns": ["config", "tflops", "ms"], "rows": [{"config": "a", "tflops": 10.0, "ms": 1.0},
           {"config": "a", "tflops": float("nan"), "ms": 2.0}, {"config": "b", "tflops": 30.0, "ms": 3.0}]}  # fmt: skip
    series, metric, groups = headline(doc)
    assert (series, metric) == ("config", "tflops")
    assert [(g["name"], g["min"], g["max"], g["rows"]) for g in groups] == [
        ("a", 10.0, 10.0, 2),
        ("b", 30.0, 30.0, 1),
    ]
    assert (
        command_text("/x/nanoparallel/bench.py --out=/y --size 8", "nanoparallel")
        == "python -m nanoparallel.bench --size 8"
    )
    assert command_text(".gpu/fa4_bwd_smoke.py", "fa4") == ".gpu/fa4_bwd_smoke.py"
    assert command_text("", "fa4") == "(not recorded)"


def test_every_committed_fa4_result_file_has_an_entry():
    """The real page of repro/fa4: one entry per committed result file."""
    from paperclub import ROOT

    page = results_log_page("fa4")
    for f in (ROOT / "repro" / "fa4" / "results").glob("nvidia-*.json"):
        assert f"`{f.name}`" in page, f.name


def test_the_site_has_a_results_log_per_reproduction_and_results_links_reach_it(tmp_path, monkeypatch):
    import shutil

    from paperclub import sitegen
    from paperclub.content import load
    from paperclub.sitegen import generate, rewrite_links
    from tests.conftest import FIXTURES, make_repo

    monkeypatch.setattr(sitegen, "load_bench_results", lambda name: [])  # (it reads the real repro/ folders)
    root = make_repo(tmp_path)
    shutil.copytree(FIXTURES / "gpu-claims" / "repro", root / "repro")  # a reproduction, "toy"
    paper = root / "papers" / "doe2026example.md"  # its paper, whose page links the log too
    paper.write_text(paper.read_text().replace("tags: [attention]\n", "tags: [attention]\nrepro: toy\n", 1))
    content, problems = load(root)
    assert not problems, problems
    site = generate(content)
    for name, repro in content.repros.items():
        if repro.planned:
            continue
        assert site.pages[f"repro/{name}/results-log.md"].startswith("# Results log")
        assert f"({name}/results-log.md)" in site.pages[f"repro/{name}.md"]
    assert "(../repro/toy/results-log.md)" in site.pages["papers/doe2026example.md"]
    name = next(n for n, r in content.repros.items() if not r.planned)
    known = set(site.pages)
    md = f"[the runs](../repro/{name}/results/) and [one file](../repro/{name}/results/dev.json)"
    out = rewrite_links(md, "papers/x.md", "papers/x.md", root, known)
    assert out.count(f"../repro/{name}/results-log.md") == 2, out


def test_result_tables_escape_text_cells():
    """A result row's text is HTML-escaped and table-safe in the site's tables: a profiler's kernel
    name with template brackets must not open an HTML tag that swallows the rest of the page."""
    from paperclub.sitegen import table_safe

    row = table_safe({"stage": "kernel: elementwise_kernel<128, 4, Op<float>>", "check": "a | b", "ms": 1.5})
    assert row == {
        "stage": "kernel: elementwise_kernel&lt;128, 4, Op&lt;float&gt;&gt;",
        "check": "a \\| b",
        "ms": 1.5,
    }
