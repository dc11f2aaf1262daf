#!/usr/bin/env python3
"""Every relative link and image in the README and docs/ resolves: the file
(or folder) exists, and a #fragment names a heading of the page it points
to (GitHub's anchors: lower case, punctuation dropped, spaces as hyphens).
Prints each broken link with its page and line; exit status 1 if any."""

import os
import re
import sys

ROOT = os.path.abspath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def pages():
    yield os.path.join(ROOT, "README.md")
    for folder, _, files in os.walk(os.path.join(ROOT, "docs")):
        for f in sorted(files):
            if f.endswith(".md"):
                yield os.path.join(folder, f)


def prose(path):
    """(line number, text) outside fenced code blocks."""
    fenced = False
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if line.lstrip().startswith("```"):
                fenced = not fenced
                continue
            if not fenced:
                yield n, line


def anchors(path):
    seen, out = {}, set()
    for _, line in prose(path):
        m = re.match(r"#+\s+(.*)", line)
        if not m:
            continue
        slug = re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-")
        k = seen.get(slug, 0)
        seen[slug] = k + 1
        out.add(slug if k == 0 else f"{slug}-{k}")
    return out


def main():
    broken = []
    for page in pages():
        for n, line in prose(page):
            for target in LINK.findall(line):
                if re.match(r"[a-z]+:", target):
                    continue
                path, _, fragment = target.partition("#")
                where = os.path.normpath(os.path.join(os.path.dirname(page), path)) if path else page
                rel = os.path.relpath(page, ROOT)
                if not os.path.exists(where):
                    broken.append(f"{rel}:{n}: {target}: no such file")
                elif fragment and where.endswith(".md") and fragment not in anchors(where):
                    broken.append(f"{rel}:{n}: {target}: no heading #{fragment} there")
    for b in broken:
        print(b)
    print(f"{len(broken)} broken link(s)" if broken else "every relative link resolves")
    return 1 if broken else 0


if __name__ == "__main__":
    sys.exit(main())
