"""nvgrouprun: start a data-parallel job the way horovodrun does.

How it works
------------
1. Parse our own flags up to the first word that is not one of them: that word
   and everything after it is the command every rank runs (`python train.py ...`).
   Horovod's common horovodrun flags are accepted with horovodrun's meaning
   (-np, -H/--hosts, --hostfile, --check-build, --mpi-args, --fusion-threshold-mb,
   --cycle-time-ms, --timeline-filename, --log-level, --output-filename,
   --verbose); the knob flags become NVGROUP_* variables of every rank. Any other
   flag is an error naming it.
2. Find out what the machine has (`detect_allocation`):
     * an LSF allocation (LSB_JOBID with LSB_MCPU_HOSTS or LSB_DJOB_HOSTFILE):
       jsrun with ONE resource set per node holding all its GPUs and one task per
       GPU (`jsrun_command`), so every rank of a node sees all of that node's
       GPUs -- the NV-group needs peer access between them -- and picks its GPU
       by local rank; each task is bound to its GPU's share of cores (7 on
       Summit) on its GPU's socket;
     * a Slurm allocation (SLURM_JOB_ID): srun (`srun_command`) with --mpi from
       --slurm-mpi or SLURM_MPI_TYPE (else srun's configured default), and
       --cpus-per-task from the flag, SRUN_CPUS_PER_TASK or SLURM_CPUS_PER_TASK
       (srun stopped inheriting it from sbatch in Slurm 22.05);
     * otherwise the hosts of -H / --hostfile (or this host) and `mpirun`, whose
       flags depend on the MPI it belongs to (`detect_mpi_flavor`).
   --launcher forces one of the three.
3. Build the exact command (`build_command`, a pure function of the parsed flags,
   the allocation and the MPI flavor) and either print it (--dry-run) or run it,
   forwarding SIGINT/SIGTERM, and exit with its code.

Environment, like horovodrun: every exportable variable of our environment
reaches every rank (Open MPI/Spectrum: one `-x NAME` each; MPICH/Intel:
`-genvall`; srun: `--export=ALL`; jsrun propagates the environment itself, and
NVGROUP_* and -x variables are also listed with -E so a site's env filtering
cannot drop them). Not exported: BASH_FUNC_*, OLDPWD, *_SECRET_KEY (Horovod's
list). `-x VAR=value` sets a variable for the ranks.

Errors (unknown flag, -np larger than the allocation, no launcher) print one
line starting with "nvgrouprun: error:" and exit with status 2.

This file imports nothing from nvgroup_tf (so it starts without TensorFlow) and
can also be run as a script: `python nvgroup_tf/runner/launch.py -np 2 ...`.
"""
import dataclasses
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
from typing import Dict, List, Optional, Sequence, Tuple

USAGE = """usage: nvgrouprun [-np N] [-H host1:4,host2:4 | --hostfile FILE]
                  [--launcher auto|mpirun|jsrun|srun] [--dry-run] [--verbose]
                  [-x VAR[=VALUE]]... [--mpi-args ARGS]
                  [--fusion-threshold-mb MB] [--cycle-time-ms MS]
                  [--timeline-filename FILE] [--log-level LEVEL]
                  [--output-filename DIR] [--check-build]
                  [--gpus-per-node G] [--cores-per-node C] [--sockets-per-node S]
                  [--slurm-mpi TYPE] [--cpus-per-task C]
                  command [args...]

  -np, -n, --num-proc N   number of ranks (default: the whole allocation or all
                          slots of -H/--hostfile)
  -H, --hosts LIST        host1:slots,host2:slots (mpirun only)
  --hostfile FILE         one host per line: "host slots=4", "host:4" or "host"
  --launcher L            auto (default), mpirun, jsrun or srun
  --dry-run               print the command and exit
  --verbose               print the command before running it
  -x VAR[=VALUE]          pass VAR (with VALUE) to every rank
  --mpi-args ARGS         extra arguments for the launcher (mpirun, jsrun or
                          srun), one shell-quoted string: --mpi-args="--mca btl ^openib"
  --launcher-args ARGS    the same as --mpi-args
  Horovod knobs (set the NVGROUP_* variable of every rank):
  --fusion-threshold-mb MB   NVGROUP_FUSION_THRESHOLD = MB * 1048576 (0: no fusion)
  --cycle-time-ms MS         NVGROUP_CYCLE_TIME
  --timeline-filename FILE   NVGROUP_TIMELINE (written by rank 0)
  --log-level LEVEL          NVGROUP_LOG_LEVEL: TRACE, DEBUG, INFO, WARNING, ERROR
                             (FATAL means ERROR), any case
  --output-filename DIR   rank r writes DIR/rank.<r>/stdout and .../stderr (r
                          zero-padded so the names sort by rank)
  --check-build           print what this build supports and exit
  LSF/jsrun (defaults: a Summit node):
  --gpus-per-node G       GPUs (= ranks) per node (6)
  --cores-per-node C      usable cores per node, split evenly across GPUs (42)
  --sockets-per-node S    sockets; GPUs and cores split evenly across them (2)
  Slurm/srun:
  --slurm-mpi TYPE        srun --mpi=TYPE (default: SLURM_MPI_TYPE, else srun's own)
  --cpus-per-task C       srun --cpus-per-task (default: SRUN_CPUS_PER_TASK, else
                          SLURM_CPUS_PER_TASK)
"""

# Summit AC922 node: 2 POWER9 sockets x 21 usable cores (the 22nd core of each
# socket is reserved for system services), 6 V100 (3 per socket, GPUs 0-2 on
# socket 0). Source: OLCF Summit user guide.
SUMMIT_GPUS_PER_NODE = 6
SUMMIT_CORES_PER_NODE = 42
SUMMIT_SOCKETS_PER_NODE = 2

# Not exported to the ranks (horovodrun's IGNORE_REGEXES).
NOT_EXPORTED = (r"BASH_FUNC_.*", r"OLDPWD", r".*_SECRET_KEY")
# horovodrun --log-level values -> NVGROUP_LOG_LEVEL (we have no FATAL level).
LOG_LEVELS = {"trace": "trace", "debug": "debug", "info": "info", "warning": "warning",
              "error": "error", "fatal": "error"}


class LaunchError(Exception):
    """A user-facing problem: printed as one line, exit status 2."""


@dataclasses.dataclass
class Options:
    num_proc: Optional[int] = None
    hosts: Optional[str] = None
    hostfile: Optional[str] = None
    launcher: str = "auto"
    dry_run: bool = False
    verbose: bool = False
    check_build: bool = False
    env_vars: List[str] = dataclasses.field(default_factory=list)
    launcher_args: List[str] = dataclasses.field(default_factory=list)
    fusion_threshold_mb: Optional[int] = None
    cycle_time_ms: Optional[float] = None
    timeline_filename: Optional[str] = None
    log_level: Optional[str] = None
    output_filename: Optional[str] = None
    gpus_per_node: int = SUMMIT_GPUS_PER_NODE
    cores_per_node: int = SUMMIT_CORES_PER_NODE
    sockets_per_node: int = SUMMIT_SOCKETS_PER_NODE
    slurm_mpi: Optional[str] = None
    cpus_per_task: Optional[int] = None
    # Elastic mode (nvgroup_tf/runner/elastic_driver.py): set by any of the flags below.
    elastic: bool = False
    min_np: Optional[int] = None
    max_np: Optional[int] = None
    host_discovery_script: Optional[str] = None
    slots_per_host: Optional[int] = None
    elastic_timeout: int = 600
    reset_limit: Optional[int] = None
    blacklist_after: int = 3
    command: List[str] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class Allocation:
    kind: str                        # "lsf", "slurm" or "local"
    hosts: List[Tuple[str, int]]     # (host, slots); for Slurm the expanded node list
    num_slots: int                   # ranks the allocation can hold
    tasks_per_node: int = 0          # Slurm: SLURM_NTASKS_PER_NODE when uniform


# --------------------------------------------------------------------- parsing

_VALUE_FLAGS = {
    "-np": "num_proc", "-n": "num_proc", "--num-proc": "num_proc",
    "-H": "hosts", "--hosts": "hosts", "--hostfile": "hostfile",
    "--launcher": "launcher", "-x": "env_vars",
    "--mpi-args": "launcher_args", "--launcher-args": "launcher_args",
    "--fusion-threshold-mb": "fusion_threshold_mb", "--cycle-time-ms": "cycle_time_ms",
    "--timeline-filename": "timeline_filename", "--log-level": "log_level",
    "--output-filename": "output_filename",
    "--gpus-per-node": "gpus_per_node", "--cores-per-node": "cores_per_node",
    "--sockets-per-node": "sockets_per_node",
    "--slurm-mpi": "slurm_mpi", "--cpus-per-task": "cpus_per_task",
    "--min-np": "min_np", "--max-np": "max_np", "--host-discovery-script": "host_discovery_script",
    "--slots-per-host": "slots_per_host", "--slots": "slots_per_host",
    "--elastic-timeout": "elastic_timeout", "--reset-limit": "reset_limit",
    "--blacklist-after": "blacklist_after",
}
_BOOL_FLAGS = {"--dry-run": "dry_run", "--verbose": "verbose", "-v": "verbose",
               "--check-build": "check_build", "-cb": "check_build", "--elastic": "elastic"}
_POSITIVE_INT_FIELDS = ("num_proc", "gpus_per_node", "cores_per_node", "sockets_per_node",
                        "cpus_per_task", "min_np", "max_np", "slots_per_host", "elastic_timeout",
                        "blacklist_after")
# horovodrun flags that have no meaning here: a clear error instead of "unknown".
_UNSUPPORTED = {
    "--gloo": "nvgroup_tf has no Gloo controller (MPI only); drop --gloo",
    "--autotune": "autotuning is not provided; set --fusion-threshold-mb/--cycle-time-ms",
}
LAUNCHERS = ("auto", "mpirun", "jsrun", "srun")


def parse_args(argv: Sequence[str]) -> Options:
    """Parses our flags; the first word that is not a flag starts the command."""
    opts = Options()
    i = 0
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("-"):
            opts.command = list(argv[i:])
            break
        if arg == "--":
            opts.command = list(argv[i + 1:])
            break
        if arg in ("-h", "--help"):
            print(USAGE)
            raise SystemExit(0)
        name, inline = (arg.split("=", 1) + [None])[:2] if arg.startswith("--") else (arg, None)
        if name in _BOOL_FLAGS and inline is None:
            setattr(opts, _BOOL_FLAGS[name], True)
            i += 1
            continue
        if name == "--mpi" and inline is None:  # horovodrun's "use the MPI controller": always
            i += 1
            continue
        if name in _UNSUPPORTED:
            raise LaunchError("%s: %s" % (name, _UNSUPPORTED[name]))
        if name not in _VALUE_FLAGS:
            raise LaunchError("unknown flag %r (see nvgrouprun --help; the command to run "
                              "comes after nvgrouprun's own flags)" % arg)
        if inline is None:
            if i + 1 >= len(argv):
                raise LaunchError("flag %s needs a value" % name)
            inline = argv[i + 1]
            i += 2
        else:
            i += 1
        _set_value(opts, name, _VALUE_FLAGS[name], inline)
    if not opts.command and not opts.check_build:
        raise LaunchError("no command given (e.g. nvgrouprun -np 2 python train.py)")
    if opts.launcher not in LAUNCHERS:
        raise LaunchError("--launcher must be one of %s, got %r" % ("|".join(LAUNCHERS), opts.launcher))
    if opts.hosts and opts.hostfile:
        raise LaunchError("give -H or --hostfile, not both")
    if opts.sockets_per_node > opts.gpus_per_node or opts.gpus_per_node % opts.sockets_per_node:
        raise LaunchError("--gpus-per-node (%d) must be a multiple of --sockets-per-node (%d)"
                          % (opts.gpus_per_node, opts.sockets_per_node))
    if opts.min_np or opts.max_np or opts.host_discovery_script or opts.reset_limit is not None:
        opts.elastic = True
    if opts.elastic:
        _check_elastic(opts)
    if opts.cores_per_node % opts.gpus_per_node:
        raise LaunchError("--cores-per-node (%d) must split evenly across --gpus-per-node (%d)"
                          % (opts.cores_per_node, opts.gpus_per_node))
    return opts


def _check_elastic(opts: Options) -> None:
    """horovodrun's rules for the elastic flags."""
    if not opts.host_discovery_script and not (opts.hosts or opts.hostfile):
        raise LaunchError("elastic mode (--min-np/--max-np/--elastic) needs --host-discovery-script "
                          "(or fixed hosts with -H/--hostfile)")
    if opts.num_proc is None:
        opts.num_proc = opts.min_np or opts.max_np
    if opts.num_proc is None:
        raise LaunchError("elastic mode needs -np or --min-np")
    opts.min_np = opts.min_np or opts.num_proc
    if opts.max_np is not None and opts.max_np < opts.min_np:
        raise LaunchError("--max-np (%d) is smaller than --min-np (%d)" % (opts.max_np, opts.min_np))
    if opts.num_proc < opts.min_np or (opts.max_np is not None and opts.num_proc > opts.max_np):
        raise LaunchError("-np %d is outside --min-np %d .. --max-np %s"
                          % (opts.num_proc, opts.min_np, opts.max_np))
    if opts.dry_run:
        raise LaunchError("--dry-run does not apply to elastic mode (the command changes with the hosts)")


def _set_value(opts: Options, name: str, field: str, text: str) -> None:
    if field == "reset_limit":
        if not text.isdigit():
            raise LaunchError("%s expects a whole number >= 0, got %r" % (name, text))
        opts.reset_limit = int(text)
        return
    if field in _POSITIVE_INT_FIELDS:
        try:
            value = int(text)
        except ValueError:
            value = 0
        if value < 1:
            raise LaunchError("%s expects a positive integer, got %r" % (name, text))
        setattr(opts, field, value)
    elif field == "fusion_threshold_mb":
        if not text.isdigit():
            raise LaunchError("%s expects a whole number of MiB >= 0, got %r" % (name, text))
        opts.fusion_threshold_mb = int(text)
    elif field == "cycle_time_ms":
        try:
            value = float(text)
        except ValueError:
            value = -1.0
        if not value >= 0 or value == float("inf"):
            raise LaunchError("%s expects milliseconds >= 0, got %r" % (name, text))
        opts.cycle_time_ms = value
    elif field == "log_level":
        if text.lower() not in LOG_LEVELS:
            raise LaunchError("%s must be one of TRACE, DEBUG, INFO, WARNING, ERROR, FATAL, got %r"
                              % (name, text))
        opts.log_level = LOG_LEVELS[text.lower()]
    elif field == "env_vars":
        if not re.match(r"^[A-Za-z_][A-Za-z0-9_]*(=.*)?$", text):
            raise LaunchError("-x expects VAR or VAR=VALUE, got %r" % text)
        opts.env_vars.append(text)
    elif field == "launcher_args":
        try:
            opts.launcher_args += shlex.split(text)
        except ValueError as e:
            raise LaunchError("%s %r: %s" % (name, text, e))
    else:
        setattr(opts, field, text)


def parse_host_list(spec: str) -> List[Tuple[str, int]]:
    """"h1:4,h2:4,h3" -> [("h1", 4), ("h2", 4), ("h3", 1)]."""
    hosts = []
    for item in spec.split(","):
        item = item.strip()
        if not item:
            continue
        name, _, slots = item.partition(":")
        if not name or (slots and not slots.isdigit()) or slots == "0":
            raise LaunchError("bad host %r in -H (expected host or host:slots)" % item)
        hosts.append((name, int(slots) if slots else 1))
    if not hosts:
        raise LaunchError("-H lists no hosts")
    return hosts


def parse_hostfile(text: str, path: str = "hostfile") -> List[Tuple[str, int]]:
    """Open MPI ("host slots=4") or MPICH ("host:4") hostfile lines; '#' comments."""
    hosts = []
    for lineno, line in enumerate(text.splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        m = (re.match(r"^(\S+?)(?::(\d+))?$", line) or
             re.match(r"^(\S+)\s+(?:slots|max_slots|max-slots)\s*=\s*(\d+)\b.*$", line))
        if not m or m.group(2) == "0":
            raise LaunchError("%s:%d: cannot parse %r (expected 'host slots=N' or 'host:N')"
                              % (path, lineno, line))
        hosts.append((m.group(1), int(m.group(2) or 1)))
    if not hosts:
        raise LaunchError("%s lists no hosts" % path)
    return hosts


def expand_slurm_nodelist(nodelist: str) -> List[str]:
    """Slurm's compressed list: "gpu[01-03,07],login2" -> [gpu01, gpu02, gpu03, gpu07, login2]."""
    names = []
    for m in re.finditer(r"([^,\[]+)(?:\[([^\]]+)\])?(?:,|$)", nodelist):
        prefix, ranges = m.group(1), m.group(2)
        if ranges is None:
            names.append(prefix)
            continue
        for part in ranges.split(","):
            lo, _, hi = part.partition("-")
            if not hi:
                names.append(prefix + lo)
                continue
            width = len(lo)
            names.extend(prefix + str(k).zfill(width) for k in range(int(lo), int(hi) + 1))
    return names


def _lsf_hosts(env: Dict[str, str]) -> List[Tuple[str, int]]:
    """Compute hosts of an LSF job. The first host LSF lists is the launch (batch)
    node that runs the job script; jsrun never places ranks there (Summit), so it
    is dropped when more than one host is listed."""
    if env.get("LSB_MCPU_HOSTS"):
        words = env["LSB_MCPU_HOSTS"].split()
        if len(words) % 2:
            raise LaunchError("LSB_MCPU_HOSTS is not 'host count host count ...': %r"
                              % env["LSB_MCPU_HOSTS"])
        hosts = [(words[k], int(words[k + 1])) for k in range(0, len(words), 2)]
    else:
        path = env["LSB_DJOB_HOSTFILE"]
        try:
            with open(path) as f:
                lines = [l.strip() for l in f if l.strip()]
        except OSError as e:
            raise LaunchError("cannot read LSB_DJOB_HOSTFILE %s: %s" % (path, e.strerror))
        hosts = []
        for name in lines:  # one line per slot, hosts in order
            if hosts and hosts[-1][0] == name:
                hosts[-1] = (name, hosts[-1][1] + 1)
            else:
                hosts.append((name, 1))
    return hosts[1:] if len(hosts) > 1 else hosts


def detect_allocation(opts: Options, env: Dict[str, str]) -> Allocation:
    """What the job may use: a scheduler allocation or the given/local hosts."""
    in_lsf = bool(env.get("LSB_JOBID")) and bool(env.get("LSB_MCPU_HOSTS") or env.get("LSB_DJOB_HOSTFILE"))
    in_slurm = bool(env.get("SLURM_JOB_ID") or env.get("SLURM_JOBID"))
    launcher = opts.launcher
    if launcher == "auto":
        launcher = "jsrun" if in_lsf else "srun" if in_slurm else "mpirun"
    if launcher == "jsrun":
        if not in_lsf:
            raise LaunchError("--launcher jsrun needs an LSF allocation (LSB_JOBID and "
                              "LSB_MCPU_HOSTS or LSB_DJOB_HOSTFILE are not set)")
        if opts.hosts or opts.hostfile:
            raise LaunchError("-H/--hostfile do not apply under jsrun: ranks go to the LSF allocation")
        hosts = [(h, opts.gpus_per_node) for h, _ in _lsf_hosts(env)]
        return Allocation("lsf", hosts, len(hosts) * opts.gpus_per_node)
    if launcher == "srun":
        if not in_slurm:
            raise LaunchError("--launcher srun needs a Slurm allocation (SLURM_JOB_ID is not set)")
        if opts.hosts or opts.hostfile:
            raise LaunchError("-H/--hostfile do not apply under srun: ranks go to the Slurm allocation")
        nodes = expand_slurm_nodelist(env.get("SLURM_JOB_NODELIST", env.get("SLURM_NODELIST", "")))
        ntasks = env.get("SLURM_NTASKS") or env.get("SLURM_NPROCS")
        # SLURM_NTASKS_PER_NODE is "4" when uniform ("2(x3),1" otherwise: not used).
        per_node = env.get("SLURM_NTASKS_PER_NODE", "")
        per_node = int(per_node) if per_node.isdigit() else 0
        if ntasks:
            slots = int(ntasks)
        elif per_node and nodes:
            slots = per_node * len(nodes)
        else:
            slots = len(nodes)
        return Allocation("slurm", [(n, 0) for n in nodes], slots, per_node)
    if opts.hostfile:
        try:
            with open(opts.hostfile) as f:
                hosts = parse_hostfile(f.read(), opts.hostfile)
        except OSError as e:
            raise LaunchError("cannot read --hostfile %s: %s" % (opts.hostfile, e.strerror))
    elif opts.hosts:
        hosts = parse_host_list(opts.hosts)
    else:
        return Allocation("local", [], 0)  # this host; any -np (mpirun may oversubscribe)
    return Allocation("local", hosts, sum(s for _, s in hosts))


def detect_mpi_flavor(version_text: str) -> str:
    """Which MPI an `mpirun --version` text belongs to: openmpi, spectrum, intel or mpich."""
    if "Spectrum MPI" in version_text:
        return "spectrum"
    if "Open MPI" in version_text or "OpenRTE" in version_text:
        return "openmpi"
    if "Intel(R) MPI" in version_text or "Intel MPI" in version_text:
        return "intel"
    if "HYDRA" in version_text or "MPICH" in version_text:
        return "mpich"
    raise LaunchError("cannot tell which MPI `mpirun --version` belongs to (looked for Open MPI, "
                      "Spectrum MPI, Intel MPI, MPICH/Hydra); use --launcher or fix PATH")


# ------------------------------------------------------------------ the command

def exported_names(env: Dict[str, str]) -> List[str]:
    """The variables of `env` every rank gets, like horovodrun (sorted)."""
    return [k for k in sorted(env) if not any(re.fullmatch(p, k) for p in NOT_EXPORTED)]


def knob_values(opts: Options) -> Dict[str, str]:
    """NVGROUP_* variables set by the Horovod-style flags."""
    out = {}
    if opts.fusion_threshold_mb is not None:
        out["NVGROUP_FUSION_THRESHOLD"] = str(opts.fusion_threshold_mb * 1024 * 1024)
    if opts.cycle_time_ms is not None:
        out["NVGROUP_CYCLE_TIME"] = repr(opts.cycle_time_ms)
    if opts.timeline_filename is not None:
        out["NVGROUP_TIMELINE"] = opts.timeline_filename
    if opts.log_level is not None:
        out["NVGROUP_LOG_LEVEL"] = opts.log_level
    return out


def child_env(opts: Options, env: Dict[str, str]) -> Dict[str, str]:
    """The launcher's environment: ours, the knob flags, then -x VAR=value."""
    out = dict(env)
    out.update(knob_values(opts))
    for spec in opts.env_vars:
        if "=" in spec:
            k, v = spec.split("=", 1)
            out[k] = v
    return out


def rank_command(opts: Options, num_proc: int, python: str) -> List[str]:
    """What every rank runs: the command, behind the per-rank log wrapper with
    --output-filename (the wrapper's path is used on every node: shared file system)."""
    if opts.output_filename is None:
        return list(opts.command)
    wrapper = os.path.join(os.path.dirname(os.path.abspath(__file__)), "rank_output.py")
    width = len(str(max(0, num_proc - 1)))
    return [python, wrapper, opts.output_filename, str(width), "--"] + list(opts.command)


def jsrun_command(opts: Options, num_nodes_hosts: int, num_proc: int) -> List[str]:
    """jsrun, one resource set per node: all the node's GPUs and cores, one task per GPU.

    Every task of a resource set sees all of its GPUs, so a node's ranks can open
    each other's memory over NVLink (an ERF or `-g1` resource set per rank would
    hide the other GPUs and turn the NV-group off). Tasks are placed in order
    (--launch_distribution packed) so local rank k runs task k and uses GPU k
    (the engine's default device is local_rank); `--bind packed:K` gives task k
    the cores K*k .. K*k+K-1 of the node, K = cores per GPU, which lie on the
    socket of GPU k because GPUs and cores are both numbered socket by socket.
    """
    g = opts.gpus_per_node
    if num_proc > g and num_proc % g:
        raise LaunchError("-np %d does not fill whole nodes of %d GPUs: jsrun needs the same "
                          "number of ranks on every node (use -np %d or %d)"
                          % (num_proc, g, num_proc // g * g, (num_proc // g + 1) * g))
    nodes = num_proc // g if num_proc >= g else 1
    tasks = min(num_proc, g)
    if nodes > num_nodes_hosts:
        raise LaunchError("-np %d needs %d nodes, the LSF allocation has %d" % (num_proc, nodes, num_nodes_hosts))
    cores_per_gpu = opts.cores_per_node // g
    return ["jsrun", "--nrs", str(nodes), "--rs_per_host", "1", "--tasks_per_rs", str(tasks),
            "--gpu_per_rs", str(g), "--cpu_per_rs", str(opts.cores_per_node),
            "--bind", "packed:%d" % cores_per_gpu, "--launch_distribution", "packed"]


def srun_command(opts: Options, alloc: Allocation, env: Dict[str, str], num_proc: int) -> List[str]:
    """srun inside the allocation; every task sees all GPUs of its node (no --gpus-per-task
    or --gpu-bind is added)."""
    cmd = ["srun"]
    mpi = opts.slurm_mpi or env.get("SLURM_MPI_TYPE")
    if mpi:
        cmd.append("--mpi=%s" % mpi)
    cmd += ["--ntasks", str(num_proc)]
    per_node = alloc.tasks_per_node
    if per_node and num_proc % per_node == 0:  # whole nodes: local ranks fill each node
        cmd += ["--nodes", str(num_proc // per_node), "--ntasks-per-node", str(per_node)]
    cpus = opts.cpus_per_task
    if cpus is None:
        for var in ("SRUN_CPUS_PER_TASK", "SLURM_CPUS_PER_TASK"):
            if env.get(var, "").isdigit() and int(env[var]) > 0:
                cpus = int(env[var])
                break
    if cpus is not None:
        cmd += ["--cpus-per-task", str(cpus)]
    return cmd + ["--export=ALL"]


def build_command(opts: Options, alloc: Allocation, env: Dict[str, str], mpi_flavor: str = "openmpi",
                  is_root: bool = False, python: str = sys.executable) -> List[str]:
    """The launcher command line (a pure function of its arguments)."""
    num_proc = opts.num_proc if opts.num_proc is not None else alloc.num_slots
    if num_proc < 1:
        raise LaunchError("-np is required when nvgrouprun runs outside a scheduler "
                          "allocation without -H/--hostfile")
    if alloc.num_slots and num_proc > alloc.num_slots:
        where = {"lsf": "the LSF allocation has %d GPUs (%d hosts x %d --gpus-per-node)"
                        % (alloc.num_slots, len(alloc.hosts), opts.gpus_per_node),
                 "slurm": "the Slurm allocation has %d tasks (SLURM_NTASKS)" % alloc.num_slots,
                 "local": "the hosts given have %d slots" % alloc.num_slots}[alloc.kind]
        raise LaunchError("-np %d is larger than the allocation: %s" % (num_proc, where))
    command = rank_command(opts, num_proc, python)
    values = child_env(opts, env)
    if alloc.kind == "lsf":
        cmd = jsrun_command(opts, len(alloc.hosts), num_proc)
        listed = sorted(set(k for k in values if k.startswith("NVGROUP_")) |
                        set(spec.split("=", 1)[0] for spec in opts.env_vars))
        for name in listed:
            cmd += ["-E", "%s=%s" % (name, values.get(name, ""))]
        return cmd + opts.launcher_args + command
    if alloc.kind == "slurm":
        return srun_command(opts, alloc, env, num_proc) + opts.launcher_args + command
    host_spec = ",".join("%s:%d" % h for h in alloc.hosts)
    names = exported_names(values)
    if mpi_flavor in ("openmpi", "spectrum"):
        cmd = ["mpirun", "-np", str(num_proc)]
        if host_spec:
            cmd += ["-H", host_spec]
        cmd += ["-bind-to", "none", "-map-by", "slot"]
        if not host_spec and mpi_flavor == "openmpi":
            cmd += ["--oversubscribe"]  # one host, ranks may exceed its cores (CPU tests)
        if is_root and mpi_flavor == "openmpi":
            cmd += ["--allow-run-as-root"]
        for name in names:
            cmd += ["-x", name]
        return cmd + opts.launcher_args + command
    # MPICH and Intel MPI: Hydra's mpiexec.
    cmd = ["mpiexec", "-n", str(num_proc)]
    if host_spec:
        cmd += ["-hosts", host_spec]
    cmd += ["-bind-to", "none", "-genvall"]
    return cmd + opts.launcher_args + command


# --------------------------------------------------------------------- running

def check_build(python: str = sys.executable) -> Tuple[int, str]:
    """horovodrun --check-build: what this build supports, found by loading the
    library in a child process (TensorFlow is imported there, not here)."""
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    code = ("import nvgroup_tf.basics as b; b._load(); "
            "print('CUDA', int(b.cuda_built()))")
    env = dict(os.environ)
    env["PYTHONPATH"] = repo + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    try:
        res = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=300, env=env)
        out, ok = res.stdout, res.returncode == 0
        why = (res.stderr.strip().splitlines() or ["exit %d" % res.returncode])[-1]
    except (OSError, subprocess.TimeoutExpired) as e:
        out, ok, why = "", False, str(e)
    cuda = ok and "CUDA 1" in out
    mark = lambda b: "[X]" if b else "[ ]"
    text = ["nvgroup_tf:", "", "Available Frameworks:", "    %s TensorFlow" % mark(ok),
            "    [ ] PyTorch", "    [ ] MXNet", "", "Available Controllers:", "    %s MPI" % mark(ok),
            "    [ ] Gloo", "", "Available Tensor Operations:", "    [ ] NCCL", "    [ ] DDL",
            "    [ ] CCL", "    %s MPI" % mark(ok), "    [ ] Gloo",
            "    %s NV-group (CUDA IPC + NVLink kernels)" % mark(cuda)]
    if not ok:
        text += ["", "the op library did not load: %s" % why]
    return (0 if ok else 1), "\n".join(text) + "\n"


def _mpi_flavor(env: Dict[str, str]) -> str:
    exe = shutil.which("mpirun", path=env.get("PATH")) or shutil.which("mpiexec", path=env.get("PATH"))
    if not exe:
        raise LaunchError("no launcher found: not inside an LSF (jsrun) or Slurm (srun) allocation "
                          "and no mpirun/mpiexec on PATH; install Open MPI or MPICH")
    try:
        out = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise LaunchError("%s --version failed: %s" % (exe, e))
    return detect_mpi_flavor(out.stdout + out.stderr)


def _elastic_driver():
    """elastic_driver.py, loaded by path: importing the nvgroup_tf package would load TensorFlow."""
    import importlib.util
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "elastic_driver.py")
    spec = importlib.util.spec_from_file_location("nvgroup_tf_elastic_driver", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run(argv: Sequence[str], env: Optional[Dict[str, str]] = None) -> int:
    env = dict(os.environ if env is None else env)
    opts = parse_args(argv)
    if opts.check_build:
        rc, text = check_build()
        print(text, end="")
        return rc
    alloc = detect_allocation(opts, env)
    flavor = _mpi_flavor(env) if alloc.kind == "local" else "openmpi"
    if opts.elastic:
        return _elastic_driver().ElasticDriver(opts, alloc, env, flavor, sys.modules[__name__]).run()
    cmd = build_command(opts, alloc, env, flavor, is_root=os.geteuid() == 0)
    if not opts.dry_run and shutil.which(cmd[0], path=env.get("PATH")) is None:
        raise LaunchError("no launcher found: %s is not on PATH" % cmd[0])
    if opts.dry_run or opts.verbose:
        print(shlex.join(cmd), flush=True)
    if opts.dry_run:
        return 0
    proc = subprocess.Popen(cmd, env=child_env(opts, env))

    def forward(signum, _frame):
        proc.send_signal(signum)

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, forward)
    return proc.wait()


def main(argv: Optional[Sequence[str]] = None) -> int:
    try:
        rc = run(sys.argv[1:] if argv is None else argv)
    except LaunchError as e:
        print("nvgrouprun: error: %s" % e, file=sys.stderr)
        rc = 2
    if argv is None:
        sys.exit(rc)
    return rc


if __name__ == "__main__":
    main()
