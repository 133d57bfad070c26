#!/usr/bin/env python3
"""Every relative link in the repo's Markdown resolves, and BENCHMARKS.md's index lists every section.

A link [text](path) or [text](path#anchor) in README.md, DEVELOPERS.md, BENCHMARKS.md or docs/**/*.md must name a
file or folder of the repository, and its anchor a heading of that file (GitHub's slugs: lower case, punctuation
dropped, spaces to hyphens, repeats numbered). Web links are not fetched. BENCHMARKS.md keeps an index at its top
that others append to: a section ("## ...") without a line there is reported too. Standard library only.

Usage: check_doc_links.py REPO_ROOT
"""
import re
import sys
from pathlib import Path

LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^\s*```")


def prose_lines(text):
    """The lines outside fenced code blocks (a link inside ``` is code, not a link)."""
    inside = False
    for number, line in enumerate(text.split("\n"), start=1):
        if FENCE.match(line):
            inside = not inside
            continue
        if not inside:
            yield number, line


def slug(heading):
    s = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return s.replace(" ", "-")


def anchors(path):
    seen = {}
    result = set()
    for _, line in prose_lines(path.read_text(encoding="utf-8")):
        match = re.match(r"^(#{1,6})\s+(.*?)\s*#*\s*$", line)
        if not match:
            continue
        base = slug(match.group(2))
        count = seen.get(base, 0)
        seen[base] = count + 1
        result.add(base if count == 0 else f"{base}-{count}")
    return result


def check_file(root, md, problems):
    for number, line in prose_lines(md.read_text(encoding="utf-8")):
        # Code spans are code: `[x](y)` inside backticks is not a link.
        line = re.sub(r"`[^`]*`", "", line)
        for target in LINK.findall(line):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
                continue
            path_part, _, anchor = target.partition("#")
            dest = md if not path_part else (md.parent / path_part).resolve()
            where = f"{md.relative_to(root)}:{number}"
            if not dest.exists():
                problems.append(f"{where}: link to {target}: no such file")
            elif root not in dest.parents and dest != root:
                problems.append(f"{where}: link to {target}: outside the repository")
            elif anchor and (dest.is_dir() or anchor not in anchors(dest)):
                problems.append(f"{where}: link to {target}: no heading with that anchor")


def check_benchmark_index(root, problems):
    text = (root / "BENCHMARKS.md").read_text(encoding="utf-8")
    listed = set(re.findall(r"\]\(#([^)]+)\)", text))
    for number, line in prose_lines(text):
        if line.startswith("## ") and line.strip() != "## Index" and slug(line[3:]) not in listed:
            problems.append(f"BENCHMARKS.md:{number}: section '{line[3:].strip()}' has no line in the index at the "
                            "top of the file (add one under its area)")


def main():
    root = Path(sys.argv[1]).resolve()
    files = [root / "README.md", root / "DEVELOPERS.md", root / "BENCHMARKS.md"]
    files += sorted((root / "docs").rglob("*.md"))
    problems = []
    for md in files:
        check_file(root, md, problems)
    check_benchmark_index(root, problems)
    for problem in problems:
        print(problem)
    print(f"{len(files)} Markdown files checked, {len(problems)} problem(s)")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
