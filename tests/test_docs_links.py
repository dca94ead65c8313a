"""Every relative link in the user docs (README.md, docs/*.md, benchmarks/results/README.md)
points at a file that exists, and every #anchor at a heading of its target page (GitHub's
anchor rule: lower case, punctuation dropped, spaces to '-'). Links inside code blocks are
not links; http(s) and mailto links are not checked."""
import glob
import os
import re
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Pages linked from the docs that are being written as their own change. A link to one is
# accepted only while it does not exist; once it exists, take it out of this set.
NOT_YET_WRITTEN = set()

LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def doc_files():
    files = [os.path.join(REPO, "README.md"), os.path.join(REPO, "benchmarks", "results", "README.md")]
    files += sorted(glob.glob(os.path.join(REPO, "docs", "*.md")))
    return [f for f in files if os.path.exists(f)]


def strip_code(text):
    text = re.sub(r"```.*?```", "", text, flags=re.S)
    return re.sub(r"`[^`\n]*`", "", text)


def anchors(path):
    with open(path) as f:
        text = re.sub(r"```.*?```", "", f.read(), flags=re.S)
    seen, out = {}, set()
    for line in text.splitlines():
        m = re.match(r"#{1,6}\s+(.*)", line)
        if not m:
            continue
        slug = re.sub(r"[^\w\- ]", "", m.group(1).strip().lower().replace("`", "")).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else "%s-%d" % (slug, n))
    return out


def dangling_links():
    problems = []
    for doc in doc_files():
        with open(doc) as f:
            text = strip_code(f.read())
        for target in LINK.findall(text):
            if re.match(r"[a-z]+:", target):
                continue
            path, _, anchor = target.partition("#")
            full = os.path.normpath(os.path.join(os.path.dirname(doc), path)) if path else doc
            rel = os.path.relpath(full, REPO)
            where = "%s -> %s" % (os.path.relpath(doc, REPO), target)
            if rel in NOT_YET_WRITTEN and not os.path.exists(full):
                continue
            if not os.path.exists(full):
                problems.append("%s: no such file" % where)
            elif anchor and full.endswith(".md") and anchor not in anchors(full):
                problems.append("%s: no heading with that anchor" % where)
    return problems


def test_every_relative_link_resolves():
    problems = dangling_links()
    assert not problems, "\n".join(problems)


def test_not_yet_written_pages_are_still_missing():
    written = sorted(p for p in NOT_YET_WRITTEN if os.path.exists(os.path.join(REPO, p)))
    assert not written, "%s exist now: remove them from NOT_YET_WRITTEN" % written


def test_the_check_finds_a_dangling_link(tmp_path, monkeypatch):
    (tmp_path / "docs").mkdir()
    (tmp_path / "README.md").write_text("[ok](docs/A.md) [gone](docs/B.md) [bad anchor](docs/A.md#nowhere)\n"
                                        "```\n[in code](docs/C.md)\n```\n")
    (tmp_path / "docs" / "A.md").write_text("# A\n\n## Some `code` heading\n[back](../README.md#top)"
                                            " [fine](#some-code-heading)\n")
    monkeypatch.setattr(sys.modules[__name__], "REPO", str(tmp_path))
    problems = dangling_links()
    assert sorted(problems) == sorted([
        "README.md -> docs/B.md: no such file",
        "README.md -> docs/A.md#nowhere: no heading with that anchor",
        "docs/A.md -> ../README.md#top: no heading with that anchor",
    ]), problems
