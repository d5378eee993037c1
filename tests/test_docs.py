"""The README and docs/ as a reader meets them: links that resolve, a README read in minutes
whose commands and quick-start output are true today, and no citation a reader cannot
follow (a lab-notebook run id, a work-tracking issue number) anywhere in the tree."""

import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOCS = ["README.md"] + sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md"))
README_MAX_LINES = 200

# Run ids as the retired lab notebook named its GPU runs: a letter or two and a number ("run
# Q3", "runs Y2-Y3", "AF7", "(M1)"), and the logs named after them ("_run_B2.log",
# "quantize_run7.log"). Single letters that also name tensors or shapes in this project (C, D,
# F, H, S, W: C, D, F1, H16, S1-S4, W1) count only after "run"; two-letter ids only as AA-AF.
CITATION_PATTERNS = {
    "run id": re.compile(r"\b[Rr]uns? [A-Z]{1,2}\d{1,2}[a-z]?\b"),
    "run id in parentheses": re.compile(r"\((?:runs? )?[ABEGIJKLMNOPQRTUVXYZ]\d{1,2}[a-z]?[,;:)]"),
    "bare run id": re.compile(r"(?<![\w.\-])[BEGIJKLMNOPQRTUVXYZ]\d{1,2}[a-z]?(?=[,:/])"),
    "two-letter run id": re.compile(r"\bA[A-F]\d{1,2}[a-z]?\b"),
    "log named by run id": re.compile(r"_run_?[A-Z]{0,2}\d+[a-z]?\b"),
    "the retired notebook": re.compile(r"(?<!8b7b9de:benchmarks/)\bNOTES\b"),
    "issue number": re.compile(r"\b[Ii]ssue \d+\b"),
}
TEXT_SUFFIXES = {".py", ".md", ".toml", ".txt", ".cfg", ".ini", ".yml", ".yaml", ".sh", ""}
SKIPPED = ("benchmarks/results/",)  # recorded outputs: what a run printed, not what we cite


def tracked_text_files():
    names = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    for name in names:
        path = ROOT / name
        if name.startswith(SKIPPED) or path.suffix not in TEXT_SUFFIXES or not path.is_file():
            continue
        try:
            yield name, path.read_text()
        except UnicodeDecodeError:
            continue


def citations(text):
    """(line number, kind, line) for each line citing what a reader cannot follow."""
    for number, line in enumerate(text.splitlines(), 1):
        for kind, pattern in CITATION_PATTERNS.items():
            if pattern.search(line):
                yield number, kind, line.strip()
                break


@pytest.mark.parametrize("line, expected", [
    ("measured in run Q3 on the H200", True),
    ("(runs Y2-Y3, AC1-AC4)", True),
    ("the AF7 figures", True),
    ("# O1: TMA over 4 stages", True),
    ("Runs X1/X2 timed", True),
    ("1.35-2x slower (M1)", True),
    ("(P1, both operands)", True),
    ("benchmarks/results/grouped_mlp_run_B2.log", True),
    ("quantize_run7.log", True),
    ("see benchmarks/NOTES.md", True),
    ("the fix for issue 15", True),
    ("fc1 weight W1 (G, F1, H) and W2; shapes S1-S4; H16 = (-1)^popcount", False),
    ("w0, w1 = hi(M1*w2) ^ w1 ^ k0, lo(M1*w2)", False),
    ("REGION_NOTES[hop]", False),
    ("Qwen3-MoE, DeepSeek-V3, Mixtral", False),
    ("`git show 8b7b9de:benchmarks/NOTES.md`", False),
    ("docs/numerics.md section 6", False),
])
def test_citation_patterns(line, expected):
    assert bool(list(citations(line))) is expected


def test_no_file_cites_a_run_id():
    found = [f"{name}:{number}: [{kind}] {line}"
             for name, text in tracked_text_files() if name != "tests/test_docs.py"  # its own examples
             for number, kind, line in citations(text)]
    assert not found, ("cite a docs section (docs/decisions.md, docs/performance.md) instead of a run id:\n"
                       + "\n".join(found))


def github_slug(heading):
    """GitHub's anchor for a heading: lower case, punctuation but '-' and '_' dropped, spaces to '-'."""
    text = re.sub(r"[`*]", "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path):
    slugs, seen, fenced = set(), {}, False
    for line in path.read_text().splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and line.startswith("#"):
            slug = github_slug(line.lstrip("#"))
            count = seen.get(slug, 0)
            seen[slug] = count + 1
            slugs.add(slug if count == 0 else f"{slug}-{count}")
    return slugs


def links(text):
    fenced = False
    for line in text.splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced:
            yield from re.findall(r"!?\[[^\]]*\]\(([^)\s]+)\)", line)


@pytest.mark.parametrize("doc", DOCS)
def test_relative_links_resolve(doc):
    source = ROOT / doc
    broken = []
    for target in links(source.read_text()):
        if re.match(r"[a-z]+:", target):
            continue  # http(s), mailto: not checked offline
        path, _, anchor = target.partition("#")
        resolved = (source.parent / path).resolve() if path else source
        if not resolved.exists():
            broken.append(f"{target} (no file {resolved.relative_to(ROOT) if resolved.is_relative_to(ROOT) else resolved})")
        elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
            broken.append(f"{target} (no heading with anchor #{anchor})")
    assert not broken, f"{doc}: broken links: {broken}"


def test_readme_is_read_in_minutes():
    lines = len((ROOT / "README.md").read_text().splitlines())
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines; move detail to docs/ (at most {README_MAX_LINES})"


def test_readme_test_command_is_what_ci_runs():
    ci = (ROOT / ".ci" / "run").read_text()
    command = next(line for line in ci.splitlines() if "pytest" in line)
    assert command in (ROOT / "README.md").read_text(), f"README.md must give .ci/run's test command:\n{command}"


def fenced_blocks_after(text, heading):
    """The fenced blocks of the section headed `heading`, as (info string, body) pairs."""
    section = text.split(heading, 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```(\w*)\n(.*?)```", section, flags=re.S)


def test_readme_quick_start_prints_what_it_shows():
    """Runs the quick start's code as a user would and finds the excerpt's lines in its
    output, in order ('...' marks lines left out)."""
    blocks = fenced_blocks_after((ROOT / "README.md").read_text(), "## Quick start")
    code = next(body for info, body in blocks if info == "python")
    excerpt = next(body for info, body in blocks if info == "")
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    printed = [line.rstrip() for line in run.stdout.splitlines()]
    at = 0
    for line in (line.rstrip() for line in excerpt.splitlines()):
        if line == "...":
            continue
        assert line in printed[at:], f"README's quick-start excerpt line not printed (in order):\n{line}\n\noutput:\n{run.stdout}"
        at = printed.index(line, at) + 1


def test_each_kept_result_is_cited_and_each_cited_result_is_kept():
    """benchmarks/results/ holds the evidence the docs cite, nothing more: each file there is
    named in README.md or docs/, and each file a tracked text names there exists."""
    docs_text = "".join((ROOT / doc).read_text() for doc in DOCS)
    kept = subprocess.run(["git", "ls-files", "benchmarks/results"], cwd=ROOT, capture_output=True, text=True,
                          check=True).stdout.split()
    uncited = [name for name in kept if pathlib.Path(name).name not in docs_text]
    assert not uncited, f"result files no doc cites (cite them from docs/performance.md or docs/decisions.md, or remove them): {uncited}"
    missing = sorted({f"{name}: {cited}" for name, text in tracked_text_files() if name != "tests/test_docs.py"
                      for cited in re.findall(r"benchmarks/results/[\w.-]+\.\w+", text) if not (ROOT / cited).exists()})
    assert not missing, f"cited result files that are not in the tree: {missing}"
