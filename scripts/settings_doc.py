"""Writes docs/SETTINGS.md from the settings table of the built library
(cc/common/env.h, read through nvgroup_tf._engine.settings_table()).

    python scripts/settings_doc.py          # rewrite docs/SETTINGS.md
    python scripts/settings_doc.py --check  # exit 1 when docs/SETTINGS.md is not current

tests/settings/test_settings.py runs the check. The module is loaded from its
file there, so `render(rows)` is the one place the page's text is made.
"""
import glob
import importlib.util
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOC = os.path.join(ROOT, "docs", "SETTINGS.md")

SECTIONS = [
    ("agreed", "Agreed across ranks",
     "The same on every rank: `init()` compares the parsed values (so `65536` and `0065536` agree) and "
     "fails on every rank, naming the variable and each rank's value, when they differ."),
    ("per process", "Per process",
     "Each process uses its own value."),
    ("tests", "Tests",
     "For checks on test machines; not needed to run jobs."),
    ("build", "Build",
     "Read when the library is built (`python setup.py build_ext --inplace`, `scripts/bazel_build.sh`)."),
]

HEADER = """# Settings

Every `NVGROUP_*` environment variable of nvgroup_tf. Unset or empty means the
default. A malformed value is an error naming the variable, the value and what
was expected: `nvgroup_tf.init()` parses every variable the library reads (the
rows whose "read by" is the engine, the TF ops or the Python front end) and
raises `InvalidArgumentError` on every rank when one rank has a malformed
value; `DistributedOptimizer` and `DistributedGradientTape` read
`NVGROUP_BUCKET_CAP_MB` again when they are made and raise `ValueError`.

`nvgrouprun` reads only `NVGROUP_ELASTIC_BASE` (in elastic mode, through this
table); its Horovod-style flags set the variable named in the table for every
rank (`--fusion-threshold-mb MB` sets `NVGROUP_FUSION_THRESHOLD` to MB *
1048576), its elastic mode sets `NVGROUP_ELASTIC_JOB`, `NVGROUP_ELASTIC_DIR`,
`NVGROUP_ELASTIC_NOTIFY` and `NVGROUP_ELASTIC_LAUNCH` for the ranks it
launches, and it passes the rest of its environment on to the ranks.

This page is generated from the settings table in `cc/common/env.h` by
`python scripts/settings_doc.py`; `tests/settings/test_settings.py` fails when
they differ.
"""


def load_engine():
    """nvgroup_tf._engine from the built extension file, without importing TensorFlow."""
    found = sorted(glob.glob(os.path.join(ROOT, "nvgroup_tf", "_engine*.so")))
    if not found:
        raise SystemExit("settings_doc: nvgroup_tf/_engine*.so is missing: build first "
                         "(python setup.py build_ext --inplace)")
    spec = importlib.util.spec_from_file_location("_engine", found[0])
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _cell(text):
    return text.replace("|", "\\|").replace("\n", " ")


def render(rows):
    out = [HEADER]
    scopes = [s for s, _, _ in SECTIONS]
    unknown = sorted(set(r["scope"] for r in rows) - set(scopes))
    if unknown:
        raise ValueError("settings_doc: scopes without a section: %s" % unknown)
    for scope, title, text in SECTIONS:
        mine = [r for r in rows if r["scope"] == scope]
        if not mine:
            continue
        out.append("## %s\n\n%s\n" % (title, text))
        out.append("| Variable | Default | Value | Read by | Meaning |")
        out.append("|---|---|---|---|---|")
        for r in mine:
            meaning = r["help"]
            if r["launcher_flag"]:
                meaning += " Set by `nvgrouprun %s`." % r["launcher_flag"]
            out.append("| `%s` | %s | %s | %s | %s |" % (r["name"], _cell(r["default"]), _cell(r["type"]),
                                                        _cell(r["read_by"]), _cell(meaning)))
        out.append("")
    return "\n".join(out)


def main(argv):
    text = render(load_engine().settings_table())
    if "--check" in argv:
        with open(DOC) as f:
            current = f.read()
        if current != text:
            print("docs/SETTINGS.md differs from the settings table (cc/common/env.h): "
                  "run python scripts/settings_doc.py", file=sys.stderr)
            return 1
        return 0
    with open(DOC, "w") as f:
        f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
