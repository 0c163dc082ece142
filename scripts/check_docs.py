#!/usr/bin/env python3
"""Every relative link of the README and of docs/ resolves (run by scripts/test.sh): the file or
directory it names exists, and an anchor (`page.md#section`, `#section`) names a heading of that
page, as GitHub makes anchors of headings. The README also stays short: at most 300 lines. And
no page has one heading twice (a section pasted twice by an edit: seen once, semantics.md's
global section doubled with its old text).

Exits 1 listing every broken link.
"""

import pathlib
import re
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
README_MAX_LINES = 300
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")


def prose(text: str) -> str:
    """The text outside fenced code blocks and inline code."""
    out, fence = [], False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fence = not fence
            continue
        if not fence:
            out.append(re.sub(r"`[^`]*`", "", line))
    return "\n".join(out)


def anchors(page: pathlib.Path) -> set[str]:
    """GitHub's anchors of the headings of `page` (lower case, punctuation dropped, spaces to
    dashes, repeats numbered)."""
    seen: dict[str, int] = {}
    out = set()
    fence = False
    for line in page.read_text().splitlines():
        if line.lstrip().startswith("```"):
            fence = not fence
        if fence or not line.startswith("#"):
            continue
        title = line.lstrip("#").strip()
        slug = re.sub(r"[^\w\- ]", "", title.lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def main() -> int:
    pages = [ROOT / "README.md"] + sorted((ROOT / "docs").glob("*.md"))
    problems = []
    readme_lines = (ROOT / "README.md").read_text().count("\n")
    if readme_lines > README_MAX_LINES:
        problems.append(f"README.md: {readme_lines} lines (at most {README_MAX_LINES})")
    for page in pages:
        heads: dict[str, int] = {}
        fence = False
        for line in page.read_text().splitlines():
            if line.lstrip().startswith("```"):
                fence = not fence
            if not fence and line.startswith("#"):
                heads[line.strip()] = heads.get(line.strip(), 0) + 1
        for head, n in heads.items():
            if n > 1:
                problems.append(f"{page.relative_to(ROOT)}: heading {head!r} {n} times")
    links = 0
    for page in pages:
        for target in LINK.findall(prose(page.read_text())):
            if re.match(r"^[a-z]+:", target):
                continue  # http(s), mailto: not checked here (no network)
            links += 1
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            name = page.relative_to(ROOT)
            if not dest.exists():
                problems.append(f"{name}: link to {target}: {path} does not exist")
                continue
            if anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                problems.append(f"{name}: link to {target}: no heading #{anchor} there")
    for p in problems:
        print(p)
    if problems:
        return 1
    print(f"docs: {links} relative links resolve across {len(pages)} pages; "
          f"README {readme_lines} lines")
    return 0


if __name__ == "__main__":
    sys.exit(main())
