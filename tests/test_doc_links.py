"""Links in README.md and docs/*.md resolve: relative links to files that exist, anchors to
headings that exist, and the repository paths the docs quote in backticks (result files, scripts)
to files that exist. Offline and cheap: no network, no imports of the packages."""

import glob
import re
import unicodedata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

LINK = re.compile(r"(?<!\!)\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)|!\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^(```|~~~)")
# a backticked path that starts at the repository root: `lab/results/...`, `packages/oscar-x/...`
QUOTED = re.compile(r"`((?:packages|lab|docs|tests)/[^`\s]+)`")


def _prose(text: str) -> str:
    """The text outside fenced code blocks (commands there may name files a run creates)."""
    out, fenced = [], False
    for line in text.splitlines():
        if FENCE.match(line.strip()):
            fenced = not fenced
            continue
        if not fenced:
            out.append(line)
    return "\n".join(out)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"`|\*\*|__", "", heading.strip()).lower()
    kept = "".join(c for c in text if c in " -_" or unicodedata.category(c)[0] in "LN")
    return kept.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for line in _prose(path.read_text()).splitlines():
        m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        s = slug(m.group(1))
        n = seen.get(s, 0)
        seen[s] = n + 1
        out.add(s if n == 0 else f"{s}-{n}")
    return out


def _expand(pattern: str) -> list[str]:
    """`a_{b,c}.json` → [`a_b.json`, `a_c.json`] (shell brace expansion, one level at a time)."""
    m = re.search(r"\{([^{}]*)\}", pattern)
    if not m:
        return [pattern]
    head, tail = pattern[: m.start()], pattern[m.end() :]
    return [q for alt in m.group(1).split(",") for q in _expand(head + alt + tail)]


def _links(doc: Path) -> list[str]:
    text = re.sub(r"`[^`\n]*`", "", _prose(doc.read_text()))  # `kernel[grid](...)` is code, not a link
    return [a or b for a, b in LINK.findall(text)]


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(doc: Path):
    broken = []
    for target in _links(doc):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        dest = (doc.parent / path).resolve() if path else doc
        if not dest.exists():
            shown = dest.relative_to(ROOT) if dest.is_relative_to(ROOT) else dest
            broken.append(f"{target}: no file {shown}")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target}: no heading with anchor #{anchor} in {dest.relative_to(ROOT)}")
    assert not broken, f"{doc.relative_to(ROOT)}: broken links:\n" + "\n".join(broken)


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_quoted_repository_paths_exist(doc: Path):
    missing = []
    for quoted in QUOTED.findall(_prose(doc.read_text())):
        quoted = quoted.rstrip(".,;:")
        path = re.split(r"::|:\d", quoted)[0]  # test ids, file:line
        if any(c in path for c in "<>$"):  # placeholders such as <machine>
            continue
        # `tests/...` may also be a package's own tests folder (packages/oscar-x/tests/...)
        bases = [ROOT, *sorted((ROOT / "packages").glob("*"))] if path.startswith("tests/") else [ROOT]
        if not any(glob.glob(str(b / p)) for b in bases for p in _expand(path)):
            missing.append(quoted)
    assert not missing, f"{doc.relative_to(ROOT)} quotes paths that do not exist: {missing}"


def test_slug_follows_github():
    assert slug("Layers kept in BF16 (`exclude_layers`)") == "layers-kept-in-bf16-exclude_layers"
    assert slug("H200, 2026-12-03 evening: 64-token blocks") == "h200-2026-12-03-evening-64-token-blocks"
    audit = "vllm-033-audit-of-the-names-the-plugin-uses"
    assert slug("vLLM 0.33: audit of the names the plugin uses") == audit
