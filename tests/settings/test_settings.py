"""The settings table (cc/common/env.h): docs/SETTINGS.md is generated from it,
no file outside it reads an NVGROUP_* variable, every NVGROUP_* name the
repository uses is a row, nvgrouprun's flags set the variables the table says,
and the rows parse and normalize as documented (single process, no MPI)."""
import importlib.util
import os
import re
import subprocess

import pytest

engine = pytest.importorskip("nvgroup_tf._engine")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _load(name, path):
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, path))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


settings_doc = _load("settings_doc", "scripts/settings_doc.py")
launch = _load("nvgrouprun_launch_for_settings", "nvgroup_tf/runner/launch.py")

ROWS = engine.settings_table()
NAMES = [r["name"] for r in ROWS]

# The table's owner and the launcher (which writes the engine's variables for
# the ranks from its flags, checked below, and whose elastic driver writes the
# elastic variables for the ranks it launches) are the only files naming them
# next to an environment access; the launcher's files may write them, not read
# them (LAUNCHER_READ).
TABLE_FILES = {"cc/common/env.cc"}
LAUNCHER_FILES = {"nvgroup_tf/runner/launch.py", "nvgroup_tf/runner/elastic_driver.py"}
# (file, variable) pairs allowed to call getenv themselves: none, the tools of
# cc/tools too start from ParseKnobsFromEnvironment().
TOOL_READS = set()
# NVGROUP_* tokens that are not environment variables: a compile-time macro of
# the CUDA kernels, a placeholder name in a launcher test, and one in a comment.
NOT_VARIABLES = {"NVGROUP_TWOSHOT_MIN_BLOCKS_PER_SM", "NVGROUP_TEST_KNOB", "NVGROUP_X"}


def _tracked(*prefixes):
    out = subprocess.run(["git", "ls-files", "--"] + list(prefixes), cwd=ROOT, capture_output=True,
                         text=True, check=True).stdout.split()
    return [p for p in out if os.path.isfile(os.path.join(ROOT, p))]


def _text(path):
    with open(os.path.join(ROOT, path), errors="replace") as f:
        return f.read()


def test_docs_settings_md_is_generated_from_the_table():
    with open(settings_doc.DOC) as f:
        current = f.read()
    assert current == settings_doc.render(ROWS), (
        "docs/SETTINGS.md differs from the settings table (cc/common/env.h): run "
        "python scripts/settings_doc.py")
    for name in NAMES:
        assert "| `%s` |" % name in current, name


def test_rows_are_complete_and_unique():
    assert len(NAMES) == len(set(NAMES)), NAMES
    for r in ROWS:
        assert re.fullmatch(r"NVGROUP_[A-Z0-9_]+", r["name"]), r
        assert r["scope"] in ("agreed", "per process", "tests", "build"), r
        for key in ("type", "default", "read_by", "help"):
            assert r[key].strip(), (r["name"], key)
        # The library parses exactly the rows it reads; build rows are read by the build.
        assert r["parsed"] == (r["scope"] != "build" and not r["read_by"].startswith("tests/")), r


C_READ = re.compile(r"getenv\s*\(\s*\"NVGROUP_")
C_READ_NAME = re.compile(r"getenv\s*\(\s*\"(NVGROUP_[A-Z0-9_]+)\"")
PY_READ = re.compile(r"(environ\s*(\.get\s*\(|\[)|getenv\s*\()\s*[\"']NVGROUP_")
PY_NAME = re.compile(r"[\"']NVGROUP_[A-Z0-9_]+[\"']")
# A read of a literal NVGROUP_ name from any mapping (the launcher passes the
# environment around as a dict): get/pop/setdefault, a subscript that is not
# assigned to, a membership test.
LAUNCHER_READ = re.compile(r"(\.get|\.pop|setdefault|getenv)\s*\(\s*[\"']NVGROUP_"
                           r"|\[\s*[\"']NVGROUP_[A-Z0-9_]+[\"']\s*\](?!\s*=[^=])"
                           r"|[\"']NVGROUP_[A-Z0-9_]+[\"']\s+(not\s+)?in\b")


def test_no_nvgroup_variable_is_read_outside_the_table():
    offenders = []
    for path in _tracked("cc", "ops", "nvgroup_tf"):
        if path in TABLE_FILES:
            continue
        text = _text(path)
        if path in LAUNCHER_FILES:
            if PY_READ.search(text) or LAUNCHER_READ.search(text):
                offenders.append(path + ": the launcher reads an NVGROUP_ name")
            continue
        if path.endswith((".cc", ".h", ".cu", ".cuh")):
            for name in C_READ_NAME.findall(text):
                if (path, name) not in TOOL_READS:
                    offenders.append("%s: getenv(\"%s\")" % (path, name))
        if path.endswith(".py"):
            if PY_READ.search(text):
                offenders.append(path + ": os.environ read of an NVGROUP_ name")
            elif "environ" in text and PY_NAME.search(text):
                offenders.append(path + ": an NVGROUP_ name next to an environment access")
    assert not offenders, ("read these through the settings table (cc/common/env.h; Python: "
                           "nvgroup_tf.basics.setting_value): %s" % offenders)


def test_the_grep_finds_reads():
    assert C_READ.search('const char* v = std::getenv("NVGROUP_XLA_ASYNC");')
    assert C_READ_NAME.findall('std::getenv("NVGROUP_XLA_ASYNC")') == ["NVGROUP_XLA_ASYNC"]
    assert PY_READ.search('raw = os.environ.get("NVGROUP_BUCKET_CAP_MB")')
    assert PY_READ.search("os.environ['NVGROUP_TIMEOUT']")
    assert PY_READ.search('os.getenv("NVGROUP_X")')
    assert not PY_READ.search('env = dict(os.environ)')
    assert LAUNCHER_READ.search('base = env.get("NVGROUP_ELASTIC_BASE") or tempfile.gettempdir()')
    assert LAUNCHER_READ.search("if env['NVGROUP_X'] == '1':")
    assert LAUNCHER_READ.search('if "NVGROUP_X" in env:')
    assert not LAUNCHER_READ.search('out["NVGROUP_TIMELINE"] = opts.timeline_filename')
    assert not LAUNCHER_READ.search('env.update({"NVGROUP_ELASTIC_JOB": self.job_id})')


def test_every_nvgroup_name_of_the_repository_is_a_row():
    used = {}
    for path in _tracked("cc", "ops", "nvgroup_tf", "tests", "scripts", "examples", "benchmarks", "bazel",
                         "docs", "setup.py", "BUILD", "README.md"):
        if path.startswith("benchmarks/results/") or path == "docs/SETTINGS.md":
            continue
        for name in set(re.findall(r"NVGROUP_[A-Z0-9_]*[A-Z0-9]", _text(path))):
            used.setdefault(name, path)
    missing = {n: p for n, p in used.items() if n not in NAMES and n not in NOT_VARIABLES}
    assert not missing, "NVGROUP_* names without a row in cc/common/env.h (name: first file): %s" % missing


def test_launcher_flags_set_the_variables_of_their_rows():
    flagged = [r for r in ROWS if r["launcher_flag"]]
    assert sorted(r["name"] for r in flagged) == ["NVGROUP_CYCLE_TIME", "NVGROUP_FUSION_THRESHOLD",
                                                   "NVGROUP_LOG_LEVEL", "NVGROUP_TIMELINE"]
    values = {"--fusion-threshold-mb": "2", "--cycle-time-ms": "3.5", "--timeline-filename": "t.json",
              "--log-level": "info"}
    for r in flagged:
        opts = launch.parse_args([r["launcher_flag"], values[r["launcher_flag"]], "python", "x.py"])
        assert list(launch.knob_values(opts)) == [r["name"]], r


def _python_bucket_cap(raw):
    """NVGROUP_BUCKET_CAP_MB as the Python front end parsed it: float() syntax,
    non-negative and finite; whitespace only = unset (25)."""
    if raw.strip() == "":
        return 25.0
    try:
        mb = float(raw)
    except ValueError:
        return None
    return mb if mb >= 0.0 and mb != float("inf") else None


BUCKET_CAP_TEXTS = ["0", "25", "2.5", "0.1", "1e3", "1E-3", ".5", "5.", "+4", "-0", "-0.0", " 7 ", "\t8\n",
                    "1_000", "1_0.2_5", "1e-400", "-1e-400", "1e-310", "1e308", "1e309", "-1", "-0.5", "nan",
                    "NaN", "inf", "-inf", "Infinity", "x", "lots", "0x10", "1__0", "_1", "1_", "1_.5", "1e",
                    "e5", "--1", "1.2.3", "1e5.5", "12abc", "4 4", ".", "+", "0.0000001", "123456789.123456789",
                    "99999999999999999999999"]


@pytest.mark.parametrize("raw", BUCKET_CAP_TEXTS)
def test_bucket_cap_parses_as_python_float(monkeypatch, raw):
    monkeypatch.setenv("NVGROUP_BUCKET_CAP_MB", raw)
    want = _python_bucket_cap(raw)
    if want is None:
        with pytest.raises(ValueError) as e:
            engine.setting_value("NVGROUP_BUCKET_CAP_MB")
        assert str(e.value) == ("environment variable NVGROUP_BUCKET_CAP_MB='%s' is not valid: expected a "
                                "non-negative number of MiB (0 disables fusion)" % raw)
    else:
        got = float(engine.setting_value("NVGROUP_BUCKET_CAP_MB"))
        assert got == want and repr(got) == repr(want), (raw, got, want)


def test_bucket_cap_default_when_unset_or_empty(monkeypatch):
    monkeypatch.delenv("NVGROUP_BUCKET_CAP_MB", raising=False)
    assert engine.setting_value("NVGROUP_BUCKET_CAP_MB") == "25"
    monkeypatch.setenv("NVGROUP_BUCKET_CAP_MB", "")
    assert engine.setting_value("NVGROUP_BUCKET_CAP_MB") == "25"


def test_agreed_knobs_are_the_agreed_rows_normalized(monkeypatch):
    for r in ROWS:
        if r["parsed"]:
            monkeypatch.delenv(r["name"], raising=False)
    agreed = [r["name"] for r in ROWS if r["scope"] == "agreed"]
    assert [n for n, _ in engine.agreed_knobs()] == agreed
    assert dict(engine.agreed_knobs())["NVGROUP_BUCKET_CAP_MB"] == "25"
    monkeypatch.setenv("NVGROUP_PIPELINE_CHUNK", "0065536")
    monkeypatch.setenv("NVGROUP_BUCKET_CAP_MB", "4.0")
    monkeypatch.setenv("NVGROUP_ALLREDUCE_ALGORITHM", "mpi")
    knobs = dict(engine.agreed_knobs())
    assert knobs["NVGROUP_PIPELINE_CHUNK"] == "65536"
    assert knobs["NVGROUP_BUCKET_CAP_MB"] == "4"
    assert knobs["NVGROUP_ALLREDUCE_ALGORITHM"] == "mpi"
    # Per-process rows are not compared across ranks.
    monkeypatch.setenv("NVGROUP_TIMEOUT", "5")
    assert "NVGROUP_TIMEOUT" not in dict(engine.agreed_knobs())


@pytest.mark.parametrize("name,raw,expected", [
    ("NVGROUP_XLA_ASYNC", "2", "0 or 1"),
    ("NVGROUP_TF_REGISTERED_GROUPS", "yes", "0 or 1"),
    ("NVGROUP_XLA_CUDA_WAIT", "device", "stream or host"),
    ("NVGROUP_TF_CUDA_WAIT", "event", "stream or host"),
    ("NVGROUP_LIVENESS_ADDR", "ib0", "an IPv4 address (a.b.c.d)"),
    ("NVGROUP_FUSION_THRESHOLD", "abc", "an integer"),
    ("NVGROUP_CACHE_CAPACITY", "4294967296", "an integer <= 2147483647"),
    # The table's range "seconds (> 0)", whatever the refused value.
    ("NVGROUP_TIMEOUT", "0", "a number of seconds > 0"),
    ("NVGROUP_TIMEOUT", "-1", "a number of seconds > 0"),
    ("NVGROUP_TIMEOUT", "abc", "a number of seconds > 0"),
    ("NVGROUP_INIT_TIMEOUT", "-0.5", "a number of seconds > 0"),
    ("NVGROUP_ONE_GPU_GROUP", "yes", "0 or 1"),
    ("NVGROUP_XLA_START_DONE", "yes", "auto, 0 or 1"),
    ("NVGROUP_TEST_BUCKET_DELAY_US", "-5", "a number of microseconds >= 0"),
    ("NVGROUP_ELASTIC_BASE", "commits", "an absolute path (starting with /)"),
    ("NVGROUP_ELASTIC_DIR", "./job", "an absolute path (starting with /)"),
    ("NVGROUP_ELASTIC_NOTIFY", "hosts_updated", "an absolute path (starting with /)"),
    ("NVGROUP_ELASTIC_JOB", "job-1", "32 lowercase hexadecimal digits (the job identity nvgrouprun sets)"),
    ("NVGROUP_ELASTIC_JOB", "0123456789ABCDEF0123456789abcdef",
     "32 lowercase hexadecimal digits (the job identity nvgrouprun sets)"),
    ("NVGROUP_ELASTIC_LAUNCH", "-1", "an integer >= 0"),
    ("NVGROUP_ELASTIC_LAUNCH", "one", "an integer"),
    ("NVGROUP_PIPELINE_MIN_CHUNK", "0", "a positive byte count"),
    ("NVGROUP_CROSS_ALLGATHER_MAX_BYTES", "16k", "an integer"),
])
def test_malformed_values_name_the_variable(monkeypatch, name, raw, expected):
    monkeypatch.setenv(name, raw)
    message = "environment variable %s='%s' is not valid: expected %s" % (name, raw, expected)
    with pytest.raises(ValueError) as e:
        engine.setting_value(name)
    assert str(e.value) == message
    with pytest.raises(ValueError) as e:  # the whole walk (what init() runs) stops at it too
        engine.agreed_knobs()
    assert str(e.value) == message


@pytest.mark.parametrize("name,raw,value", [
    ("NVGROUP_XLA_ASYNC", None, "0"), ("NVGROUP_XLA_ASYNC", "1", "1"),
    ("NVGROUP_TF_REGISTERED_GROUPS", None, "1"), ("NVGROUP_TF_REGISTERED_GROUPS", "0", "0"),
    ("NVGROUP_XLA_CUDA_WAIT", None, "stream"), ("NVGROUP_XLA_CUDA_WAIT", "host", "host"),
    ("NVGROUP_TF_CUDA_WAIT", None, "host"), ("NVGROUP_TF_CUDA_WAIT", "stream", "stream"),
    ("NVGROUP_LIVENESS_ADDR", "10.1.2.3", "10.1.2.3"), ("NVGROUP_LIVENESS_IFACE", "ib0", "ib0"),
    ("NVGROUP_CYCLE_TIME", "0.5", "0.5"), ("NVGROUP_LOG_LEVEL", "info", "info"),
    ("NVGROUP_XLA_START_DONE", None, "auto"), ("NVGROUP_XLA_START_DONE", "auto", "auto"),
    ("NVGROUP_XLA_START_DONE", "0", "0"),
    ("NVGROUP_XLA_START_DONE", "1", "1"),
    ("NVGROUP_TEST_BUCKET_DELAY_US", "2000", "2000"),
    ("NVGROUP_ELASTIC_BASE", None, ""), ("NVGROUP_ELASTIC_BASE", "/scratch/c", "/scratch/c"),
    ("NVGROUP_ELASTIC_JOB", None, ""),
    ("NVGROUP_ELASTIC_JOB", "0123456789abcdef0123456789abcdef", "0123456789abcdef0123456789abcdef"),
    ("NVGROUP_ELASTIC_DIR", "/tmp/nvgroup_elastic_x", "/tmp/nvgroup_elastic_x"),
    ("NVGROUP_ELASTIC_NOTIFY", "/tmp/x/hosts_updated", "/tmp/x/hosts_updated"),
    ("NVGROUP_ELASTIC_LAUNCH", None, ""), ("NVGROUP_ELASTIC_LAUNCH", "02", "2"),
    ("NVGROUP_PIPELINE_MIN_CHUNK", None, "1048576"), ("NVGROUP_PIPELINE_MIN_CHUNK", "0001024", "1024"),
    ("NVGROUP_CROSS_ALLGATHER_MAX_BYTES", None, "32768"), ("NVGROUP_CROSS_ALLGATHER_MAX_BYTES", "0", "0"),
])
def test_values_parse_into_their_fields(monkeypatch, name, raw, value):
    if raw is None:
        monkeypatch.delenv(name, raising=False)
    else:
        monkeypatch.setenv(name, raw)
    assert engine.setting_value(name) == value


def test_rows_without_a_parse_are_not_values():
    with pytest.raises(ValueError, match="not a setting the library parses"):
        engine.setting_value("NVGROUP_WITH_CUDA")
    with pytest.raises(ValueError, match="not a setting the library parses"):
        engine.setting_value("NVGROUP_" + "NO_SUCH_VARIABLE")  # split: not a name of the repository


def test_liveness_address_settings_come_from_the_table(monkeypatch):
    monkeypatch.setenv("NVGROUP_LIVENESS_ADDR", "10.9.9.9")
    monkeypatch.setenv("NVGROUP_LIVENESS_IFACE", "ib0")
    monkeypatch.setenv("OMPI_MCA_btl_tcp_if_include", "ib0,10.41.0.0/16")
    for var in ("OMPI_MCA_oob_tcp_if_include", "MPIR_CVAR_NEMESIS_TCP_NETWORK_IFACE", "I_MPI_HYDRA_IFACE"):
        monkeypatch.delenv(var, raising=False)
    assert engine.liveness_address_settings() == ("10.9.9.9", "ib0", ["ib0", "10.41.0.0/16"])
    monkeypatch.setenv("NVGROUP_LIVENESS_ADDR", "ib0")
    with pytest.raises(ValueError, match=r"NVGROUP_LIVENESS_ADDR='ib0' is not valid: expected an IPv4 address"):
        engine.liveness_address_settings()
