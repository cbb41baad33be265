"""Generate the website's pages from the content: pure functions from :class:`Content` to text.

``site/hooks.py`` calls :func:`generate` during ``mkdocs build`` and adds every returned file
to the build. Markdown pages go through mkdocs (search index, theme); slide decks, plots and
vendored assets are written as they are.
"""

from __future__ import annotations

import ast
import datetime as _dt
import hashlib
import html
import io
import json
import posixpath
import re
from dataclasses import dataclass, field
from pathlib import Path

from paperclub.bench import load_results as load_bench_results
from paperclub.bench import markdown_table
from paperclub.claims import GPU_CHECKS_NAME, NOT_RUN, FunctionGroup, summary
from paperclub.codelinks import SOURCE_LANGUAGES, line_for_fragment
from paperclub.content import Content, Paper, Repro, Session, split_slides
from paperclub.lab_page import lab_page
from paperclub.results_log import results_log_page
from paperclub.slides import render_deck

SOURCE_SUFFIXES = set(SOURCE_LANGUAGES)
STATUS_ICON = {
    "passed": "passed",
    "failed": "failed",
    "skipped": "skipped",
    "no test": "no test yet",
    "not reproducible": "not reproducible here",
}


@dataclass
class Site:
    """Everything generated: markdown pages, other files, and where each page came from."""

    pages: dict[str, str] = field(default_factory=dict)  # src_uri -> markdown
    files: dict[str, bytes | str] = field(default_factory=dict)  # src_uri -> content
    origin: dict[str, str] = field(default_factory=dict)  # src_uri -> repo path it was written from
    # (result file, digest of its rows and the plot spec) -> rendered figures: a result's plots appear on
    # the benchmarks page, its reproduction's page and its paper's page, and are drawn once per build
    plots: dict[tuple[str, str], list[tuple[str, bytes]]] = field(default_factory=dict, repr=False)


def cell(text: object) -> str:
    """Table-safe text."""
    return str(text).replace("|", "\\|").replace("\n", " ")


def code_html(text: object) -> str:
    """``text`` as a table-safe <code> element that markdown leaves alone: HTML-escaped, backticks as
    entities (markdown would open a code span at one, even inside inline HTML)."""
    return f"<code>{cell(html.escape(str(text)).replace('`', '&#96;'))}</code>"


def short_title(text: str, limit: int = 48) -> str:
    """``text`` cut at a word boundary to at most ``limit`` characters, with an ellipsis when cut."""
    if len(text) <= limit:
        return text
    cut = text[: limit - 1].rsplit(" ", 1)[0].rstrip(" :,;-(")
    return cut + "…"


def upcoming(s: Session, today: _dt.date | None = None) -> bool:
    """A session that has not been held yet: planned, or dated after today."""
    if s.meta.date_known == "planned":
        return True
    if not s.meta.date or len(s.meta.date) != 10:
        return False
    return _dt.date.fromisoformat(s.meta.date) > (today or _dt.date.today())


def front_matter(**meta) -> str:
    """A generated page's front matter (search boost, tags, exclusion from search)."""
    return "---\n" + json.dumps(meta) + "\n---\n\n"  # JSON is YAML


def rel_link(from_uri: str, to_uri: str) -> str:
    return posixpath.relpath(to_uri, posixpath.dirname(from_uri) or ".")


def status_html(status: str) -> str:
    """A coloured status; a summary such as 'failed (1 failed, 17 passed)' takes its first word's colour."""
    word = next((k for k in sorted(STATUS_ICON, key=len, reverse=True) if status.startswith(k)), status)
    word = NOT_RUN if status.startswith(NOT_RUN) else word
    cls = "status-" + word.replace(" ", "-")
    return f'<span class="{cls}">{STATUS_ICON.get(status, status)}</span>'


def generate(content: Content, *, render_notebook=None) -> Site:
    site = Site()
    root = content.root
    site.pages["index.md"] = home(content)
    site.pages["sessions/index.md"] = sessions_index(content)
    for s in content.sessions:
        uri = f"sessions/{s.folder}.md"
        site.pages[uri] = session_page(content, s)
        site.origin[uri] = f"sessions/{s.folder}/notes.md"
        if s.deck is not None:
            site.files[f"slides/{s.folder}/index.html"] = render_deck(
                s.meta.title,
                s.deck.read_text(encoding="utf-8"),
                assets="../../assets/vendor",
                back_link=f"../../sessions/{s.folder}/",
            )
    site.pages["papers/index.md"] = papers_index(content)
    for key, paper in content.papers.items():
        uri = f"papers/{key}.md"
        site.pages[uri] = paper_page(content, paper, site)
        site.origin[uri] = f"papers/{key}.md"
    site.pages["repro/index.md"] = repro_index(content)
    for name, repro in content.repros.items():
        if repro.planned:
            continue
        site.pages[f"repro/{name}.md"] = repro_page(content, repro, site)
        site.pages[f"repro/{name}/results-log.md"] = results_log_page(name, repro.path / "results")
        extra = sorted((root / "tests" / "nanoparallel").rglob("*")) if name == "nanoparallel" else []
        for path in sorted(repro.path.rglob("*")) + extra:
            if path.is_file() and path.suffix in SOURCE_SUFFIXES and "__pycache__" not in path.parts:
                repo_rel = path.relative_to(root).as_posix()
                site.pages[f"source/{repo_rel}.md"] = source_page(repo_rel, path)
                site.origin[f"source/{repo_rel}.md"] = repo_rel
        if repro.walkthrough is not None and render_notebook is not None:
            md, resources = render_notebook(repro.walkthrough)
            uri = f"repro/{name}/walkthrough.md"
            site.pages[uri] = md
            for fname, data in resources.items():
                site.files[f"repro/{name}/{fname}"] = data
    site.pages["claims.md"] = claims_dashboard(content)
    site.pages["benchmarks.md"] = benchmarks_page(content, site)
    built = [(name, r.path) for name, r in content.repros.items() if not r.planned]
    site.pages["lab.md"] = lab_page(built, root, repro_pages={name for name, _ in built})
    site.pages["bibliography.md"] = bibliography(content)
    site.pages["tags.md"] = tags_page(content)
    return site


# ---------------------------------------------------------------- home and sessions


def home(content: Content) -> str:
    sessions = content.sessions_newest_first()
    landed = [r for r in content.repros.values() if not r.planned]
    records = [content.record(c) for c in content.claims.values()]
    statuses = [r.status for r in records]
    testable = len(statuses) - statuses.count("not reproducible")
    on_gpu = sum(r.status == "passed" and r.gpu == "passed" for r in records)
    lines = [
        "# ML-performance reading group",
        "",
        "We meet weekly; one member presents a paper on making machine learning fast: sequence parallelism,",
        "MoE kernels, linear and sparse attention, RL systems, speculative decoding, attention kernels and",
        "collective communication. This site keeps what we learned and proves it: every paper has a summary in",
        "our own words, and the papers we reproduce have a reference implementation, a fast path, property tests",
        "for each claim, and benchmarks against the library people actually use.",
        "",
        f"**{len(sessions)} sessions · {len(content.papers)} papers · {len(landed)} reproductions · "
        f"{statuses.count('passed')} of {testable} testable claims pass their tests ({on_gpu} of them on a GPU) · "
        f"{statuses.count('not reproducible')} claims we cannot reproduce here, with the reason** "
        "([claims dashboard](claims.md)).",
        "",
        "## Latest sessions",
        "",
    ]
    for s in [s for s in sessions if not upcoming(s)][:6]:
        lines.append(
            f"- **{s.display_date()}** [{s.meta.title}](sessions/{s.folder}.md){repro_badge(content, s, 'index.md')}"
        )
    ahead = sorted((s for s in sessions if upcoming(s)), key=lambda s: s.sort_key)
    if ahead:
        lines += ["", "## Upcoming", ""]
        lines += [
            f"- **{s.display_date()}** [{s.meta.title}](sessions/{s.folder}.md)"
            if s.meta.date_known != "planned"
            else f"- [{s.meta.title}](sessions/{s.folder}.md) (planned, no date yet)"
            for s in ahead
        ]
    lines += [
        "",
        "## Run it yourself",
        "",
        "```bash",
        "bash .ci/serve   # set up, build this site and serve it on http://127.0.0.1:8000",
        "bash .ci/test    # set up and run every test (what CI runs)",
        "pytest repro/kda # one reproduction's property tests, on a laptop CPU",
        "```",
        "",
        "Presenting soon? `paperclub new-session` scaffolds your session and `paperclub check` tells you what",
        "is missing; see [Contributing](contributing.md).",
    ]
    return "\n".join(lines) + "\n"


def repro_badge(content: Content, s: Session, from_uri: str) -> str:
    name = s.meta.repro
    if not name:
        return ""
    repro = content.repros.get(name)
    if repro is None or repro.planned:
        return (
            f' <span class="repro-badge planned" title="reproduction planned">repro: {name} (planned)</span>'
        )
    return f' <a class="repro-badge" href="{rel_link(from_uri, f"repro/{name}/")}">repro: {name}</a>'


def paper_links(content: Content, keys: list[str], from_uri: str) -> str:
    out = []
    for k in keys:
        entry = content.bib.get(k)
        title = entry.title if entry else k
        if k in content.papers:
            out.append(f"[{cell(title)}]({rel_link(from_uri, f'papers/{k}.md')})")
        else:
            out.append(cell(title))
    return "<br>".join(out) or "—"


ARCHIVE_URL = "https://github.com/danielvegamyhre/ml-perf-reading-group"  # the group's public slide archive


def sessions_index(content: Content) -> str:
    uri = "sessions/index.md"
    lines = [
        "# Sessions",
        "",
        "Every meeting of the group, newest first. A *repro* badge marks the sessions whose paper we reproduce.",
        f"*#* is the group's session number, *Archive* the number the group's [public archive]({ARCHIVE_URL})",
        "gives the session (it numbers sessions 1-18).",
        "",
        '<div class="sessions-table" markdown="1">',
        "",
        "| Date | Archive | Session | Presenters | Papers | Recording | Slides |",
        "|---|---|---|---|---|---|---|",
    ]
    for s in content.sessions_newest_first():
        m = s.meta
        num = f"#{m.number} " if m.number else ""
        archive = f"{m.archive_number}" if m.archive_number else "—"
        rec = f"[video]({m.recording})" if m.recording else "—"
        slides = []
        if s.deck is not None:
            slides.append(f"[deck](../slides/{s.folder}/index.html)")
        if s.slides_url:
            slides.append(f"[presenter's]({s.slides_url})")
        date = s.display_date()
        if upcoming(s) and m.date_known != "planned":
            date += " (upcoming)"
        lines.append(
            f"| {date} | {archive} | {num}[{cell(m.title)}]({s.folder}.md){repro_badge(content, s, uri)} | "
            f"{cell(', '.join(m.presenters) or '—')} | {paper_links(content, m.papers, uri)} | {rec} | {' · '.join(slides) or '—'} |"
        )
    lines += ["", "</div>"]
    return "\n".join(lines) + "\n"


def session_page(content: Content, s: Session) -> str:
    uri = f"sessions/{s.folder}.md"
    m = s.meta
    date_note = {"exact": "", "approximate": " (approximate)", "unknown": "", "planned": ""}[m.date_known]
    rows = [
        ("Date", s.display_date() + date_note),
        ("Presenters", ", ".join(m.presenters) or "not recorded"),
        ("Papers", paper_links(content, m.papers, uri)),
    ]
    if m.number or m.archive_number:
        ours = f"#{m.number}" if m.number else "not numbered"
        archive = (
            f" (#{m.archive_number} in the group's [public archive]({ARCHIVE_URL}))"
            if m.archive_number
            else ""
        )
        rows.insert(0, ("Session", ours + archive))
    if m.recording:
        rows.append(("Recording", f"[{m.recording}]({m.recording})"))
    slides = []
    if s.deck is not None:
        slides.append(f"[our slide deck](../slides/{s.folder}/index.html)")
    if s.slides_url:
        slides.append(f"[the presenter's slides]({s.slides_url})")
    elif s.slides_file is not None:
        slides.append(f"`{m.slides}` (in the session folder)")
    if slides:
        rows.append(("Slides", " · ".join(slides)))
    if m.repro:
        repro = content.repros.get(m.repro)
        if repro and not repro.planned:
            rows.append(("Reproduction", f"[`repro/{m.repro}`](../repro/{m.repro}.md)"))
        else:
            rows.append(("Reproduction", f"`{m.repro}`: planned, not started yet"))
    claimed = [c for c in content.claims.values() if c.paper in m.papers]
    packages = sorted({c.package for c in claimed} - {m.repro})
    if packages:  # claims of this session's papers that a package other than the session's repro checks
        statuses = [content.status(c)[0] for c in claimed if c.package in packages]
        testable = len(statuses) - statuses.count("not reproducible")
        where = ", ".join(f"[`{p}`](../repro/{p}.md)" for p in packages)
        tested = (
            f"{statuses.count('passed')} of {testable} testable pass" if testable else "none testable here"
        )
        rows.append(
            (
                "Claims",
                f"{len(statuses)} claims of these papers, registered in {where}: {tested}; "
                f"{statuses.count('not reproducible')} not reproducible here (see each paper's page)",
            )
        )
    if m.tags:
        rows.append(("Tags", ", ".join(f"[{t}](../tags.md#{t})" for t in m.tags)))
    lines = [front_matter(search={"boost": 2}, tags=m.tags) + f"# {m.title}", ""]
    if upcoming(s) and m.date_known != "planned":
        lines += [f'!!! note "Upcoming"\n    This session is on {m.date}; it has not been held yet.', ""]
    if m.summary:
        lines += [m.summary, ""]
    lines += [f"- **{k}:** {v}" for k, v in rows] + [""]
    if s.notes is not None:
        notes = re.sub(r"\A\s*#\s+Notes?\s*\n", "", s.notes.read_text(encoding="utf-8"), flags=re.I)
        lines += ["## Notes", "", demote(notes, 2), ""]
    if s.deck is not None:
        lines += [
            "## Slides",
            "",
            f"[Open the slide deck](../slides/{s.folder}/index.html) (arrow keys to move, `s` for speaker notes). Its text:",
            "",
        ]
        for slide in split_slides(s.deck.read_text(encoding="utf-8")):
            body = re.split(r"^(?:Note|Notes):\s*$", slide, maxsplit=1, flags=re.M)[0]
            lines += [demote(body, 2), ""]
    return "\n".join(lines) + "\n"


def demote(md: str, levels: int) -> str:
    """Push headings down so an embedded document nests under the page's own headings."""
    out = []
    in_fence = False
    for line in md.splitlines():
        if line.startswith("```"):
            in_fence = not in_fence
        if not in_fence and re.match(r"^#{1,5} ", line):
            line = "#" * levels + line
        out.append(line)
    return "\n".join(out)


# ---------------------------------------------------------------- papers


def papers_index(content: Content) -> str:
    lines = [
        "# Papers",
        "",
        "Our summary of every paper a session covered, with the claims we check where we reproduce it.",
        "",
        "| Paper | Authors | Year | Sessions | Reproduction | Claims |",
        "|---|---|---|---|---|---|",
    ]
    for key, paper in sorted(
        content.papers.items(),
        key=lambda kv: (content.bib[kv[0]].year if kv[0] in content.bib else "", kv[0]),
        reverse=True,
    ):
        entry = content.bib.get(key)
        sessions = ", ".join(
            f"[{cell(short_title(s.meta.title))}](../sessions/{s.folder}.md)"
            for s in content.sessions_for_paper(key)
        )
        claims = [c for c in content.claims.values() if c.paper == key]
        claims_txt = claims_summary(content, claims) if claims else "—"
        repro = paper.meta.repro
        repro_txt = "—"
        if repro:
            r = content.repros.get(repro)
            repro_txt = f"[{repro}](../repro/{repro}.md)" if r and not r.planned else f"{repro} (planned)"
        lines.append(
            f"| [{cell(paper.meta.title)}]({key}.md) | {cell(entry.short_authors if entry else '')} | {entry.year if entry else ''} | "
            f"{sessions or '—'} | {repro_txt} | {claims_txt} |"
        )
    return "\n".join(lines) + "\n"


def claims_summary(content: Content, claims: list) -> str:
    """'9 of 9 pass; 6 not reproducible here': claims we cannot check are not counted as testable."""
    statuses = [content.status(c)[0] for c in claims]
    unreproducible = statuses.count("not reproducible")
    text = f"{statuses.count('passed')} of {len(claims) - unreproducible} pass"
    return text + (f"; {unreproducible} not reproducible here" if unreproducible else "")


def paper_page(content: Content, paper: Paper, site: Site) -> str:
    uri = f"papers/{paper.key}.md"
    entry = content.bib.get(paper.key)
    m = paper.meta
    lines = [front_matter(search={"boost": 2}, tags=m.tags) + f"# {m.title}", ""]
    if entry:
        link = f"[arXiv:{entry.eprint}]({entry.url})" if entry.eprint else f"[link]({entry.url})"
        lines += [f"*{cell(', '.join(entry.authors))}* · {entry.year} · {link}", ""]
    meta_bits = []
    sessions = content.sessions_for_paper(paper.key)
    if sessions:
        meta_bits.append(
            "**Sessions:** " + ", ".join(f"[{s.meta.title}](../sessions/{s.folder}.md)" for s in sessions)
        )
    if m.repro:
        r = content.repros.get(m.repro)
        meta_bits.append(
            f"**Reproduction:** [`repro/{m.repro}`](../repro/{m.repro}.md)"
            if r and not r.planned
            else f"**Reproduction:** `{m.repro}` (planned)"
        )
    if m.tags:
        meta_bits.append("**Tags:** " + ", ".join(f"[{t}](../tags.md#{t})" for t in m.tags))
    if meta_bits:
        lines += [" · ".join(meta_bits), ""]
    body = re.sub(r"\A\s*# [^\n]*\n", "", paper.body)  # the page already has the title as its heading
    lines += [body.strip(), ""]
    claims = [c for c in content.claims.values() if c.paper == paper.key]
    if claims:
        lines += ["## Claims and their status", "", claims_table(content, claims, uri), ""]
    if m.repro and m.repro in content.repros and not content.repros[m.repro].planned:
        repro = content.repros[m.repro]
        docs = load_bench_results(repro.name)
        if docs:
            lines += ["## Benchmark results", "", *bench_overview(site, repro.name, docs, uri), ""]
        log = rel_link(uri, f"repro/{repro.name}/results-log.md")
        lines += [f"The history of the runs, newest first: [results log]({log}).", ""]
        if repro.walkthrough is not None:
            lines += [
                "## Walkthrough",
                "",
                f"[The walkthrough notebook](../repro/{m.repro}/walkthrough.md) runs on a laptop CPU in seconds.",
                "",
            ]
    if entry and entry.raw:
        lines += ["## Cite", "", "```bibtex", entry.raw, "```", ""]
    return "\n".join(lines) + "\n"


def claims_table(content: Content, claims: list, from_uri: str) -> str:
    """One row per claim: the claim (id, section, statement), its status on CPUs and on a GPU, and its
    tests grouped by test function (count and worst status per machine; the cases in a <details>)."""
    rows = [
        '<div class="claims-table" markdown="1">',
        "",
        "| Claim | CPU | GPU | Checked by |",
        "|---|---|---|---|",
    ]
    for c in sorted(claims, key=lambda c: c.id):
        rec = content.record(c)
        claim = f'`{c.id}` <span class="claim-section">{cell(c.section)}</span><br>{cell(c.statement)}'
        if not c.reproducible:
            # a soft hyphen lets the narrow column break "reproducible" where a reader expects it
            cpu = '<span class="status-not-reproducible">not repro&shy;ducible here</span>'
            gpu, checked = "—", cell(c.reason)
        else:
            cpu = status_html(rec.cpu) if rec.groups else "—"
            gpu = gpu_html(rec.gpu, rec.gpu_devices, rec.gpu_pending) if rec.groups else "—"
            checked = "".join(group_html(content, g, from_uri) for g in rec.groups) or "no recorded run yet"
        rows.append(f"| {claim} | {cpu} | {gpu} | {checked} |")
    return "\n".join([*rows, "", "</div>"])


def gpu_html(status: str, devices: list[str], pending: int = 0) -> str:
    """A GPU outcome with the device it ran on; 'not run on a GPU' reads apart from a CPU-only pass;
    ``pending`` cases (skipped on CPUs, no GPU outcome yet) are counted beside an outcome."""
    if status == NOT_RUN:
        return '<span class="status-not-run">not run on a GPU</span>'
    on = f'<br><span class="claim-device">on {cell(", ".join(devices))}</span>' if devices else ""
    later = (
        f'<br><span class="status-not-run">{pending} case{"s" if pending > 1 else ""} not yet run on a GPU</span>'
        if pending
        else ""
    )
    return status_html(status) + on + later


def _case_html(outcome: dict | None, where: str) -> str:
    """'CPU passed' / 'GPU not run'; the date and platform of the outcome in the hover title."""
    if outcome is None:
        return f'{where} <span class="status-not-run">{NOT_RUN}</span>'
    title = f"{outcome['outcome']} since {outcome.get('since', '?')} on {outcome.get('platform') or '?'}"
    return f'<span title="{cell(html.escape(title))}">{where} {status_html(outcome["outcome"])}</span>'


def group_html(content: Content, group: FunctionGroup, from_uri: str) -> str:
    """A test function: its name (linked to its source), number of cases, its CPU and GPU outcomes
    (the worst case's); with several parametrised cases, a <details> that lists each case."""
    link = f"[`{cell(group.name)}`]({rel_link(from_uri, 'source/' + group.file + '.md')})"
    if len(group.cases) == 1:
        case = group.cases[0]
        params = f" {code_html(f'[{case.params}]')}" if case.params else ""
        detail = f"{_case_html(case.cpu, 'CPU')} · {_case_html(case.gpu, 'GPU')}"
        return f'<span class="claim-test">{link}{params}<br>{detail}</span>'
    statuses = f"CPU {status_html(summary(group, 'cpu'))} · GPU {status_html(summary(group, 'gpu'))}"
    on_gpu = bool(group.records("gpu"))  # GPU per case only where some case ran on one
    # the case's id as HTML, not a markdown code span: an empty or backtick-holding id would open a
    # span that the next cell's backticks close, and the rest of the table would render as code
    cases = "<br>".join(
        f"{code_html(c.params or '(no parameters)')} {_case_html(c.cpu, 'CPU')}"
        + (f" · {_case_html(c.gpu, 'GPU')}" if on_gpu else "")
        for c in group.cases
    )
    return (
        f'<details class="claim-test"><summary>{link} ×{len(group.cases)}<br>{statuses}</summary>'
        f'<span class="claim-cases">{cases}</span></details>'
    )


# ---------------------------------------------------------------- reproductions and claims


def module_doc(path: Path) -> str:
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"))
    except (SyntaxError, UnicodeDecodeError):
        return ""
    doc = ast.get_docstring(tree) or ""
    # Sphinx roles read as noise in markdown: :func:`f` -> `f`
    return re.sub(r":(?:func|class|meth|mod|attr|data|obj):`([^`]+)`", r"`\1`", doc).strip()


def repro_index(content: Content) -> str:
    lines = [
        "# Reproductions",
        "",
        "Each reproduction is a small package: a reference written from the paper's equations, the fast path,",
        "property tests for the paper's claims, a GPU benchmark against the library people use, and a walkthrough.",
        "Run one with `pytest repro/<name>` (or `pytest tests/nanoparallel` for the collective library).",
        "",
        "| Reproduction | Paper | Claims | Benchmarks | Walkthrough |",
        "|---|---|---|---|---|",
    ]
    for name, repro in sorted(content.repros.items()):
        if repro.planned:
            continue
        claims = [c for c in content.claims.values() if c.package == name]
        papers = sorted({c.paper for c in claims})
        paper_txt = paper_links(content, papers, "repro/index.md")
        devices = sorted({d.get("device", "?") for d in load_bench_results(name)})
        wt = f"[notebook]({name}/walkthrough.md)" if repro.walkthrough else "—"
        lines.append(
            f"| [`{name}`]({name}.md) | {paper_txt} | {claims_summary(content, claims) if claims else '—'} | "
            f"{cell(', '.join(devices)) or 'not yet run'} | {wt} |"
        )
    planned = [r for r in content.repros.values() if r.planned]
    if planned:
        lines += ["", "## Planned", "", "Sessions pair with these; they have not landed yet.", ""]
        for r in sorted(planned, key=lambda r: r.name):
            lines.append(f"- `{r.name}`: {r.description}")
    return "\n".join(lines) + "\n"


def repro_page(content: Content, repro: Repro, site: Site) -> str:
    uri = f"repro/{repro.name}.md"
    root = content.root
    init = repro.path / "__init__.py"
    doc = module_doc(init) if init.exists() else ""
    lines = [f"# `{repro.path.relative_to(root).as_posix()}`", ""]
    if doc:
        lines += [doc, ""]
    claims = [c for c in content.claims.values() if c.package == repro.name]
    papers = sorted({c.paper for c in claims})
    if papers:
        lines += ["**Paper(s):** " + paper_links(content, papers, uri).replace("<br>", " · "), ""]
    test_cmd = "pytest tests/nanoparallel" if repro.name == "nanoparallel" else f"pytest repro/{repro.name}"
    bench_cmd = (
        "python -m nanoparallel.bench"
        if repro.name == "nanoparallel"
        else f"python -m repro.{repro.name}.bench"
    )
    lines += [
        "```bash",
        f"{test_cmd}      # property tests, CPU",
        f"{bench_cmd}   # GPU benchmark, writes results/<device>.json",
        "```",
        "",
    ]
    if claims:
        lines += ["## Claims", "", claims_table(content, claims, uri), ""]
    bench = bench_sections(content, repro, site, uri, level=3)
    lines += ["## Benchmarks", "", bench or "No benchmark results have been committed yet.", ""]
    lines += [f"The history of the runs, newest first: [results log]({repro.name}/results-log.md).", ""]
    checks = gpu_checks_table({repro.name: repro})
    if checks:
        lines += ["## GPU checks", "", GPU_CHECKS_INTRO, "", checks, ""]
    if repro.walkthrough is not None:
        lines += ["## Walkthrough", "", f"[Open the walkthrough]({repro.name}/walkthrough.md).", ""]
    lines += ["## Files", "", "| File | What it is |", "|---|---|"]
    for path in sorted(repro.path.rglob("*.py")):
        if "__pycache__" in path.parts:
            continue
        rp = path.relative_to(root).as_posix()
        first = module_doc(path).split("\n\n")[0].replace("\n", " ")
        lines.append(
            f"| [`{path.relative_to(repro.path).as_posix()}`]({rel_link(uri, f'source/{rp}.md')}) | {cell(first)} |"
        )
    lines.append("")
    return "\n".join(lines) + "\n"


def claims_dashboard(content: Content) -> str:
    lines = [
        "# Claims",
        "",
        "Every claim of every reproduced paper, the section that states it, the property tests that check it and",
        "their last recorded outcomes. Where a test ran matters, so each claim has two statements: **CPU** is what",
        "the runs on CPU machines saw (`results/claims.json`; Triton kernels run there through Triton's",
        "interpreter, and GPU-only tests are skipped), **GPU** is what a run on a GPU saw",
        "(`results/claims-gpu.json`, with the device). A claim checked only on CPUs reads *not run on a GPU*.",
        "Tests parametrised over many cases are grouped under their test function with the number of cases and the",
        "worst outcome (failed, then skipped, then passed); open a group to see each case. Claims we cannot check",
        "here are listed with the reason: they count as **not reproduced**.",
        "",
    ]
    records = {c.id: content.record(c) for c in content.claims.values()}
    statuses = [r.status for r in records.values()]
    totals = {k: statuses.count(k) for k in STATUS_ICON}
    on_gpu = {k: sum(r.status == k and r.gpu != NOT_RUN for r in records.values()) for k in STATUS_ICON}
    lines += (
        ["| Status | Claims | of which checked on a GPU |", "|---|---|---|"]
        + [
            f"| {status_html(k)} | {v} | {on_gpu[k] if k not in ('no test', 'not reproducible') else '—'} |"
            for k, v in totals.items()
        ]
        + [""]
    )
    devices = sorted({d for r in records.values() for d in r.gpu_devices})
    gpu_claims = sum(r.gpu != NOT_RUN for r in records.values())
    lines += [
        f"{gpu_claims} claim(s) have tests that ran on a GPU"
        + (f" ({cell(', '.join(devices))})" if devices else "")
        + f"; {sum(r.gpu == NOT_RUN and r.cpu != NOT_RUN for r in records.values())} were checked on CPUs only.",
        "",
    ]
    checks = gpu_checks_table({n: r for n, r in sorted(content.repros.items()) if not r.planned})
    if checks:
        lines += ["## GPU test runs and compute-sanitizer passes", "", GPU_CHECKS_INTRO, "", checks, ""]
    by_paper: dict[str, list] = {}
    for c in content.claims.values():
        by_paper.setdefault(c.paper, []).append(c)
    if not by_paper:
        lines.append("No claims are registered yet: they appear here as reproductions land.")
    for key in sorted(by_paper):
        entry = content.bib.get(key)
        title = entry.title if entry else key
        link = f"[{title}](papers/{key}.md)" if key in content.papers else title
        lines += [f"## {key}", "", link, "", claims_table(content, by_paper[key], "claims.md"), ""]
    return "\n".join(lines) + "\n"


GPU_CHECKS_INTRO = (
    "The latest run of each package's GPU-marked tests and of the same tests under "
    "`compute-sanitizer --tool memcheck` (memory errors only), as the GPU job recorded them "
    "(`results/gpu-checks.json`; a step that did not finish reads *timeout*)."
)


def gpu_checks_table(repros: dict[str, Repro]) -> str:
    """One row per package and GPU check (tests, sanitizer) from ``results/gpu-checks.json``;
    "" when no package has one. A file that does not parse is shown as such, not skipped."""
    import json

    rows = []
    for name, repro in repros.items():
        path = repro.path / "results" / GPU_CHECKS_NAME
        if not path.exists():
            continue
        try:
            checks = json.loads(path.read_text())["checks"]
        except (ValueError, KeyError, TypeError) as exc:
            rows.append(f"| {cell(name)} | — | unreadable | {cell(f'{path.name}: {exc}')} | | |")
            continue
        # the whole package's record of each step, then the parts run with --select ("tests -k EXPR")
        steps = [k for k in ("tests", "sanitizer") if k in checks]
        steps += sorted(k for k in checks if k.split(" -k ")[0] in ("tests", "sanitizer") and k not in steps)
        for step in steps:
            c = checks[step]
            rows.append(
                f"| {cell(name)} | {step} | {cell(c.get('status', '?'))} | {cell(c.get('detail', ''))} "
                f"| {cell(c.get('device') or '')} | {cell((c.get('date') or '')[:10])} |"
            )
    if not rows:
        return ""
    return "\n".join(
        [
            '<div class="gpu-checks-table" markdown="1">',
            "",
            "| Package | Check | Status | Summary | Device | Date |",
            "|---|---|---|---|---|---|",
            *rows,
            "",
            "</div>",
        ]
    )


# ---------------------------------------------------------------- benchmarks


def result_label(doc: dict) -> str:
    """What tells a result file from its package's others: the tag of its file name after the device
    (``nvidia-h100-80gb-hbm3-seqlens-16384-repeat.json`` -> ``seqlens-16384-repeat``), or ''."""
    stem = Path(doc["_file"]).stem
    device = re.sub(r"[^a-z0-9]+", "-", str(doc.get("device", "")).lower()).strip("-")
    return stem[len(device) :].strip("-") if device and stem.startswith(device) else ("" if device else stem)


def result_anchor(doc: dict) -> str:
    return "result-" + re.sub(r"[^a-z0-9]+", "-", Path(doc["_file"]).stem.lower()).strip("-")


def result_heading(doc: dict, repro_name: str) -> str:
    count = doc.get("device_count", 1)
    label = result_label(doc)
    return (
        f"{doc.get('title', repro_name)}: {doc.get('device')}{f' ×{count}' if count and count > 1 else ''}"
        + (f" ({label}, {doc.get('date', '?')[:10]})" if label else f" ({doc.get('date', '?')[:10]})")
    )


def bench_sections(content: Content, repro: Repro, site: Site, from_uri: str, level: int = 2) -> str:
    docs = load_bench_results(repro.name)
    out = []
    for doc in docs:
        slug = Path(doc["_file"]).stem
        h = "#" * level
        env = doc.get("environment", {})
        versions = ", ".join(
            f"{k} {v}"
            for k, v in [
                ("torch", env.get("torch")),
                ("triton", env.get("triton")),
                ("CUDA", env.get("cuda")),
            ]
            if v
        )
        pk = env.get("packages") or {}
        if pk:
            versions += ", " + ", ".join(f"{k} {v}" for k, v in pk.items())
        out += [
            f"{h} {result_heading(doc, repro.name)} {{ #{result_anchor(doc)} }}",
            "",
            f"Measured {doc.get('date', '?')[:10]} · {versions}"
            + (f" · peer: {doc['peer']}" if doc.get("peer") else "")
            + f" · `{doc['_file']}`",
            "",
        ]
        if doc.get("ceilings"):
            out += [
                "Machine ceilings measured in the same run: "
                + ", ".join(f"{k} = {v}" for k, v in doc["ceilings"].items()),
                "",
            ]
        if doc.get("notes"):
            out += [doc["notes"], ""]
        out += result_plots(site, doc, repro.name, slug, from_uri)
        out += [
            '<div class="bench-table" data-search-exclude="" markdown="1">',
            "",
            '??? note "Full table"',
            "",
            indent(markdown_table(doc["columns"], [table_safe(r) for r in doc["rows"]]), 4),
            "",
            "</div>",
            "",
        ]
    return "\n".join(out)


def table_safe(row: dict) -> dict:
    """A result row with its text cells HTML-escaped and table-safe: a profiler's kernel name
    (``elementwise_kernel<128, 4, ...>``) would otherwise open an HTML tag that swallows the rest of
    the page."""
    return {k: cell(html.escape(v, quote=False)) if isinstance(v, str) else v for k, v in row.items()}


def result_plots(
    site: Site, doc: dict, repro_name: str, slug: str, from_uri: str, limit: int | None = None
) -> list[str]:
    """The markdown of a result's plots (its declared ones, or a summary bar chart when it declares
    none), each drawn once per site; plots that would be empty are left out."""
    out = []
    plots = doc.get("plots") or [p for p in [summary_plot(doc)] if p]
    for i, plot in enumerate(plots):
        for j, (label, png) in enumerate(cached_plots(site, doc, plot)):
            if limit is not None and len(out) // 2 >= limit:
                return out
            name = f"benchmarks/{repro_name}/{slug}-{i}-{j}.png"
            site.files[name] = png
            out += [f"![{cell(label)}]({rel_link(from_uri, name)}){{ .bench-plot }}", ""]
    return out


def summary_plot(doc: dict) -> dict | None:
    """For a result that declares no plot: ms by implementation as bars, one chart per combination of
    the few other settings its rows vary over (pass, causal, ...), so that our time and the peer's sit
    side by side; None when the rows have no 'impl' and 'ms' or vary over too many settings."""
    rows = doc.get("rows") or []
    if not rows or "impl" not in doc.get("columns", []) or not any(_num(r.get("ms")) for r in rows):
        return None
    timed = [r for r in rows if _num(r.get("ms"))]
    facets = []
    for col in doc["columns"]:
        if col in ("impl", "note", "check") or col.startswith("ms"):
            continue
        values = {str(r.get(col)) for r in timed}
        if len(values) < 2 or any(isinstance(r.get(col), float) for r in timed):
            continue  # the same everywhere, or a measurement (ms_per_rank, tokens_per_s, ...)
        by_impl: dict[str, set] = {}
        for r in timed:
            by_impl.setdefault(str(r.get("impl")), set()).add(str(r.get(col)))
        if all(len(v) == 1 for v in by_impl.values()):
            continue  # the implementation's name already says it (ring n=4 -> ring = 4)
        if len(values) > 4 or not all(isinstance(r.get(col), (str, bool, int)) for r in timed):
            return None  # a sweep or a measurement: a line plot would be the right picture
        facets.append(col)
    if len({tuple(str(r.get(c)) for c in facets) for r in timed}) > 6:
        return None
    return {
        "kind": "bars",
        "x": "impl",
        "y": "ms",
        "facets": facets,
        "title": "time per call (ms), lower is better",
    }


def indent(text: str, n: int) -> str:
    return "\n".join((" " * n + line) if line else line for line in text.splitlines())


def cached_plots(site: Site, doc: dict, plot: dict) -> list[tuple[str, bytes]]:
    """:func:`render_plots` of ``doc`` and ``plot``, drawn once per site however many pages show it.

    Keyed by the result file and a digest of what the figures are drawn from (its rows and the plot
    spec), so two results or two plots never share figures, and changed numbers are drawn afresh."""
    spec = json.dumps({"rows": doc["rows"], "plot": plot}, sort_keys=True, default=str)
    key = (doc.get("_file", ""), hashlib.sha256(spec.encode()).hexdigest())
    if key not in site.plots:
        site.plots[key] = render_plots(doc, plot)
    return site.plots[key]


def render_plots(doc: dict, plot: dict) -> list[tuple[str, bytes]]:
    """The figures of one plot spec: one per facet; a facet (or a whole plot) with no numeric point is
    not drawn (an empty chart says nothing, e.g. a plot filtering on a value the file does not hold)."""
    if plot.get("kind") == "bars":
        return _render_bars(doc, plot)
    rows = [r for r in doc["rows"] if all(r.get(k) == v for k, v in (plot.get("where") or {}).items())]
    facets = [None]
    if plot.get("facet"):
        facets = sorted({r.get(plot["facet"]) for r in rows}, key=str)
    out = []
    for facet in facets:
        sub = [r for r in rows if facet is None or r.get(plot["facet"]) == facet]
        series = sorted({str(r.get(plot["series"])) for r in sub})
        lines = []
        for name in series:
            pts = sorted(
                (
                    (r[plot["x"]], r[plot["y"]])
                    for r in sub
                    if str(r.get(plot["series"])) == name
                    and _num(r.get(plot["y"]))
                    and _num(r.get(plot["x"]))
                ),
                key=lambda p: p[0],
            )
            if pts:
                lines.append((name, pts))
        if not lines:
            continue
        fig, ax = _figure(6.4, 3.6)
        for name, pts in lines:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name)
        if plot.get("logx"):
            ax.set_xscale("log", base=2)
        if plot.get("logy"):
            ax.set_yscale("log")
        title = plot.get("title", "") + (f" ({plot['facet']} = {facet})" if facet is not None else "")
        ax.set_title(title, fontsize=10)
        ax.set_xlabel(plot["x"])
        ax.set_ylabel(plot["y"])
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
        out.append((title, _png(fig)))
    return out


# one mathtext parser for every figure of the build: each figure's renderer would otherwise start with an
# empty cache and parse the log axes' tick labels (2^10, 10^-1, ...) afresh, a third of a line plot's cost
_MATHTEXT: list = []


def _figure(width: float, height: float):
    """A figure and its axes at 100 dpi, drawn by Agg (without pyplot, which keeps every figure in its
    registry until closed), whose renderer shares the build's mathtext parser."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.mathtext import MathTextParser

    fig = Figure(figsize=(width, height), dpi=100)
    renderer = FigureCanvasAgg(fig).get_renderer()
    if isinstance(getattr(renderer, "mathtext_parser", None), MathTextParser):
        if not _MATHTEXT:
            _MATHTEXT.append(renderer.mathtext_parser)
        renderer.mathtext_parser = _MATHTEXT[0]
    return fig, fig.subplots()


def _png(fig) -> bytes:
    """The figure as PNG, laid out tight (no label clipped). The layout is computed once: tight_layout
    leaves a placeholder layout engine behind, for which savefig would lay the figure out again."""
    fig.tight_layout()
    fig.set_layout_engine(None)
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return buf.getvalue()


def _render_bars(doc: dict, plot: dict) -> list[tuple[str, bytes]]:
    rows = [r for r in doc["rows"] if _num(r.get(plot["y"]))]
    keys = sorted({tuple(str(r.get(c)) for c in plot["facets"]) for r in rows})
    out = []
    for key in keys:
        sub = [r for r in rows if tuple(str(r.get(c)) for c in plot["facets"]) == key]
        if not sub:
            continue
        sub.sort(key=lambda r: r[plot["y"]])
        fig, ax = _figure(6.4, 0.9 + 0.32 * len(sub))
        labels = [str(r.get(plot["x"])) for r in sub]
        values = [r[plot["y"]] for r in sub]
        ax.barh(range(len(sub)), values, color="#5c6bc0")
        ax.set_yticks(range(len(sub)), labels, fontsize=8)
        ax.invert_yaxis()
        for y, v in enumerate(values):
            ax.text(v, y, f" {v:.3g}", va="center", fontsize=7)
        ax.set_xlabel(plot["y"])
        ax.margins(x=0.15)
        ax.grid(True, axis="x", alpha=0.3)
        where = ", ".join(f"{c} = {v}" for c, v in zip(plot["facets"], key, strict=True))
        title = plot["title"] + (f" ({where})" if where else "")
        ax.set_title(title, fontsize=10)
        out.append((title, _png(fig)))
    return out


def _num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and v == v


def bench_overview(site: Site, name: str, docs: list[dict], from_uri: str) -> list[str]:
    """A reproduction's results in brief: each result file linked to its section of the reproduction's
    page (plots, notes, full table), and the first plots of the newest one."""
    page = rel_link(from_uri, f"repro/{name}.md")
    lines = [
        f"[All {len(docs)} result(s) on the `{name}` page]({page}#benchmarks)"
        + (f" · peer: {cell(docs[0]['peer'])}" if docs[0].get("peer") else ""),
        "",
        "| Result | Device | Date | Rows |",
        "|---|---|---|---|",
    ]
    for doc in docs:
        label = result_label(doc)
        title = cell(doc.get("title", name)) + (f" ({cell(label)})" if label else "")
        count = doc.get("device_count", 1)
        device = f"{doc.get('device')}{f' ×{count}' if count and count > 1 else ''}"
        lines.append(
            f"| [{title}]({page}#{result_anchor(doc)}) | {cell(device)} | {doc.get('date', '?')[:10]} "
            f"| {len(doc.get('rows', []))} |"
        )
    lines.append("")
    return lines + result_plots(site, docs[0], name, Path(docs[0]["_file"]).stem, from_uri, limit=2)


def benchmarks_page(content: Content, site: Site) -> str:
    """An overview: each reproduction's result files (linked to their section of the reproduction's
    page, where the plots, notes and full tables are) and the headline plot of its newest result."""
    lines = [
        "# Benchmarks",
        "",
        "Results committed by `python -m repro.<name>.bench` (and `python -m nanoparallel.bench`) on the GPU",
        "machine, each with its device, library versions and date, beside the peer library's numbers.",
        "Timings are medians of CUDA-event-timed runs after warm-up (see `paperclub.bench.time_ms`).",
        "Each reproduction's page shows every result in full: its plots, notes and table.",
        "",
    ]
    any_results = False
    for name, repro in sorted(content.repros.items()):
        if repro.planned:
            continue
        docs = load_bench_results(name)
        lines += [f"## {name}", ""]
        if not docs:
            lines += ["No results committed yet.", ""]
            continue
        any_results = True
        lines += bench_overview(site, name, docs, "benchmarks.md")
    if not any_results:
        lines += ["No benchmark has been run yet: results appear here when a reproduction commits them."]
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------- bibliography, tags, source


def bibliography(content: Content) -> str:
    lines = [
        "# Bibliography",
        "",
        f"{len(content.bib)} papers cited by our sessions. Copy an entry with the button on its block.",
        "",
    ]
    for key, e in sorted(
        content.bib.items(),
        key=lambda kv: (kv[1].authors[0].split()[-1].lower() if kv[1].authors else "", kv[1].year),
    ):
        link = f"[{e.title}](papers/{key}.md)" if key in content.papers else e.title
        lines += [
            f"### {key}",
            "",
            f"{link}. {cell(', '.join(e.authors))}. {e.year}. [{e.venue or e.url}]({e.url})",
            "",
            "```bibtex",
            e.raw,
            "```",
            "",
        ]
    return "\n".join(lines) + "\n"


def tags_page(content: Content) -> str:
    tags: dict[str, list[str]] = {}
    for s in content.sessions_newest_first():
        for t in s.meta.tags:
            tags.setdefault(t, []).append(f"session: [{s.meta.title}](sessions/{s.folder}.md)")
    for key, p in sorted(content.papers.items()):
        for t in p.meta.tags:
            tags.setdefault(t, []).append(f"paper: [{p.meta.title}](papers/{key}.md)")
    lines = ["# Tags", ""]
    lines += [" · ".join(f"[{t}](#{t}) ({len(v)})" for t, v in sorted(tags.items())), ""]
    for t, items in sorted(tags.items()):
        lines += [f"## {t}", ""] + [f"- {i}" for i in items] + [""]
    return "\n".join(lines) + "\n"


def source_page(repo_rel: str, path: Path) -> str:
    lang = SOURCE_LANGUAGES[path.suffix]
    text = path.read_text(encoding="utf-8")
    fence = "````" if "```" in text else "```"
    # kept out of the search index: it was most of the index (4.3 MB) and drowned the pages in code
    return (
        front_matter(search={"exclude": True})
        + f'# `{repo_rel}`\n\n{fence}{lang} linenums="1"\n{text}\n{fence}\n'
    )


# ---------------------------------------------------------------- links from content to the repository

LINK = re.compile(r"(?<!!)\[([^\]]*)\]\(([^)\s]+)\)")


def rewrite_links(
    markdown_text: str, page_uri: str, origin: str | None, root: Path, known_uris: set[str]
) -> str:
    """Point links that content writes relative to its file in the repository at the site's pages.

    A paper page links ``../repro/kda/chunk.py#chunk_kda`` (a symbol: function, class, ``Class.method``);
    on the site that is the source page of chunk.py at the line that defines it (``#L10`` links still
    resolve to line 10). Links to sessions, papers and repro folders map to their pages.
    """
    if origin is None:
        return markdown_text
    origin_dir = posixpath.dirname(origin)

    def fix(m: re.Match) -> str:
        text, target = m.group(1), m.group(2)
        if re.match(r"^[a-z]+:", target) or target.startswith("#"):
            return m.group(0)
        path, _, anchor = target.partition("#")
        repo_path = posixpath.normpath(posixpath.join(origin_dir, path)) if path else origin
        dest = _site_uri_for(repo_path, root, known_uris)
        if dest is None:
            return m.group(0)
        if anchor and dest.startswith("source/"):
            # a symbol (chunk.py#chunk_kda, #Class.method) or a line (#L40) -> that line of the source page
            line = line_for_fragment(root, repo_path, anchor)
            anchor = f"__codelineno-0-{line}" if line else anchor
        return f"[{text}]({rel_link(page_uri, dest)}{'#' + anchor if anchor else ''})"

    return LINK.sub(fix, markdown_text)


def _site_uri_for(repo_path: str, root: Path, known: set[str]) -> str | None:
    if repo_path.startswith(".."):
        return None
    parts = repo_path.split("/")
    candidates = []
    if parts[0] == "sessions" and len(parts) >= 2:
        candidates.append(f"sessions/{parts[1]}.md")
    if parts[0] == "papers" and len(parts) == 2:
        candidates.append(repo_path if repo_path.endswith(".md") else repo_path + ".md")
    if parts[0] == "bib":
        candidates.append("bibliography.md")
    if parts[0] in ("repro", "nanoparallel"):
        candidates.append(f"source/{repo_path}.md")
        if repo_path.endswith(".ipynb"):
            candidates.append(f"repro/{parts[-2]}/walkthrough.md")
        name = "nanoparallel" if parts[0] == "nanoparallel" else (parts[1] if len(parts) > 1 else "")
        if "results" in parts:  # the folder or a file in it: the results log names every file
            candidates.append(f"repro/{name}/results-log.md")
        if (root / repo_path).is_dir() or len(parts) <= 2:
            candidates.append(f"repro/{name}.md")
        if parts[-1] == "results" or "results" in parts:
            candidates.append(f"repro/{name}.md")
    if parts[0] == "site" and len(parts) > 2 and parts[1] == "pages":
        candidates.append("/".join(parts[2:]))
    for c in candidates:
        if c in known:
            return c
    return None
