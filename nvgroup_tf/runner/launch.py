"""nvgrouprun: start a data-parallel job the way horovodrun does.

How it works
------------
1. Parse our own flags up to the first word that is not one of them: that word
   and everything after it is the command every rank runs (`python train.py ...`).
2. Find out what the machine has (`detect_allocation`):
     * an LSF allocation (LSB_JOBID with LSB_MCPU_HOSTS or LSB_DJOB_HOSTFILE):
       jsrun, one rank per GPU, each node's cores split across its GPUs through an
       explicit resource file (ERF) -- Summit's recipe, see `make_erf`;
     * a Slurm allocation (SLURM_JOB_ID): `srun --mpi=pmix`, which places ranks
       within the allocation itself;
     * otherwise the hosts of -H / --hostfile (or this host) and `mpirun`, whose
       flags depend on the MPI it belongs to (`detect_mpi_flavor`).
   --launcher forces one of the three.
3. Build the exact command (`build_command`, a pure function of the parsed flags,
   the allocation and the MPI flavor) and either print it (--dry-run, with the
   ERF's content) or run it, forwarding SIGINT/SIGTERM, and exit with its code.

Every NVGROUP_* variable of our environment reaches every rank (mpirun: `-x`,
MPICH/Intel: `-genvlist`; jsrun and srun forward the environment, and we list
them explicitly to jsrun with -E so a site's env filtering cannot drop them),
as does each `-x VAR` / `-x VAR=value` given here.

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
import tempfile
from typing import Dict, List, Optional, Sequence, Tuple

USAGE = """usage: nvgrouprun -np N [-H host1:4,host2:4 | --hostfile FILE]
                  [--launcher auto|mpirun|jsrun|srun] [--dry-run] [--verbose]
                  [-x VAR[=VALUE]]... [--gpus-per-node G] [--cores-per-node C]
                  [--sockets-per-node S] [--smt T] [--erf-file PATH]
                  command [args...]

  -np, -n, --num-proc N   number of ranks (default: the whole allocation or all
                          slots of -H/--hostfile)
  -H, --hosts LIST        host1:slots,host2:slots (mpirun only)
  --hostfile FILE         one host per line: "host slots=4", "host:4" or "host"
  --launcher L            auto (default), mpirun, jsrun or srun
  --dry-run               print the command (and the ERF file) and exit
  --verbose               print the command before running it
  -x VAR[=VALUE]          pass VAR to every rank (NVGROUP_* always are)
  LSF/jsrun only (defaults: a Summit node):
  --gpus-per-node G       GPUs (= ranks) per node (6)
  --cores-per-node C      usable cores per node (42)
  --sockets-per-node S    sockets per node; GPUs and cores split evenly (2)
  --smt T                 hardware threads per core of the job (4)
  --erf-file PATH         where to write the ERF (default: a temporary file)
"""

# Summit AC922 node: 2 POWER9 sockets x 21 usable cores (the 22nd core of each
# socket is reserved for system services), SMT4 by default, 6 V100 (3 per
# socket). Source: OLCF Summit user guide / "ERF CPU Indexing" tutorial.
SUMMIT_GPUS_PER_NODE = 6
SUMMIT_CORES_PER_NODE = 42
SUMMIT_SOCKETS_PER_NODE = 2
SUMMIT_SMT = 4

# Variables every rank needs besides NVGROUP_* (Horovod's horovodrun passes the same).
ALWAYS_PASSED = ("PATH", "LD_LIBRARY_PATH", "PYTHONPATH")


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
    env_vars: List[str] = dataclasses.field(default_factory=list)
    gpus_per_node: int = SUMMIT_GPUS_PER_NODE
    cores_per_node: int = SUMMIT_CORES_PER_NODE
    sockets_per_node: int = SUMMIT_SOCKETS_PER_NODE
    smt: int = SUMMIT_SMT
    erf_file: Optional[str] = None
    command: List[str] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class Allocation:
    kind: str                        # "lsf", "slurm" or "local"
    hosts: List[Tuple[str, int]]     # (host, slots); for Slurm the expanded node list
    num_slots: int                   # ranks the allocation can hold


# --------------------------------------------------------------------- parsing

_VALUE_FLAGS = {
    "-np": "num_proc", "-n": "num_proc", "--num-proc": "num_proc",
    "-H": "hosts", "--hosts": "hosts", "--hostfile": "hostfile",
    "--launcher": "launcher", "-x": "env_vars",
    "--gpus-per-node": "gpus_per_node", "--cores-per-node": "cores_per_node",
    "--sockets-per-node": "sockets_per_node", "--smt": "smt", "--erf-file": "erf_file",
}
_BOOL_FLAGS = {"--dry-run": "dry_run", "--verbose": "verbose", "-v": "verbose"}
_INT_FIELDS = ("num_proc", "gpus_per_node", "cores_per_node", "sockets_per_node", "smt")
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
        field = _VALUE_FLAGS[name]
        if field in _INT_FIELDS:
            try:
                value = int(inline)
            except ValueError:
                raise LaunchError("%s expects a positive integer, got %r" % (name, inline))
            if value < 1:
                raise LaunchError("%s expects a positive integer, got %r" % (name, inline))
            setattr(opts, field, value)
        elif field == "env_vars":
            if not re.match(r"^[A-Za-z_][A-Za-z0-9_]*(=.*)?$", inline):
                raise LaunchError("-x expects VAR or VAR=VALUE, got %r" % inline)
            opts.env_vars.append(inline)
        else:
            setattr(opts, field, inline)
    if not opts.command:
        raise LaunchError("no command given (e.g. nvgrouprun -np 2 python train.py)")
    if opts.launcher not in LAUNCHERS:
        raise LaunchError("--launcher must be one of %s, got %r" % ("|".join(LAUNCHERS), opts.launcher))
    if opts.hosts and opts.hostfile:
        raise LaunchError("give -H or --hostfile, not both")
    if opts.sockets_per_node > opts.gpus_per_node or opts.gpus_per_node % opts.sockets_per_node:
        raise LaunchError("--gpus-per-node (%d) must be a multiple of --sockets-per-node (%d)"
                          % (opts.gpus_per_node, opts.sockets_per_node))
    if opts.cores_per_node % opts.gpus_per_node:
        raise LaunchError("--cores-per-node (%d) must split evenly across --gpus-per-node (%d)"
                          % (opts.cores_per_node, opts.gpus_per_node))
    return opts


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
        if ntasks:
            slots = int(ntasks)
        elif env.get("SLURM_NTASKS_PER_NODE", "").isdigit() and nodes:
            slots = int(env["SLURM_NTASKS_PER_NODE"]) * len(nodes)
        else:
            slots = len(nodes)
        return Allocation("slurm", [(n, 0) for n in nodes], slots)
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

def make_erf(hosts: Sequence[str], num_proc: int, gpus_per_node: int, cores_per_node: int,
             sockets_per_node: int, smt: int) -> str:
    """jsrun explicit resource file: one rank per GPU, ranks filled node by node.

    GPU g of a node sits on socket g // (gpus_per_node / sockets_per_node) and gets
    an equal, disjoint share of that socket's cores. CPUs use logical indexing, in
    which the usable hardware threads of a node are numbered 0..cores*smt-1 without
    gaps (the reserved service cores are skipped), so core c owns threads
    c*smt .. c*smt+smt-1 at any SMT level (OLCF "ERF CPU Indexing").
    Summit (42 cores, 6 GPUs, SMT4): rank g gets threads 28g..28g+27.
    """
    gpus_per_socket = gpus_per_node // sockets_per_node
    cores_per_socket = cores_per_node // sockets_per_node
    cores_per_gpu = cores_per_node // gpus_per_node
    lines = ["cpu_index_using: logical", "overlapping_rs: error", "oversubscribe_gpu: error", ""]
    for rank in range(num_proc):
        host = hosts[rank // gpus_per_node]
        gpu = rank % gpus_per_node
        first_core = (gpu // gpus_per_socket) * cores_per_socket + (gpu % gpus_per_socket) * cores_per_gpu
        first, last = first_core * smt, (first_core + cores_per_gpu) * smt - 1
        lines.append("rank: %d: { hostname: %s; cpu: {%d-%d}; gpu: {%d}; mem: * }"
                     % (rank, host, first, last, gpu))
    return "\n".join(lines) + "\n"


def passed_env_names(opts: Options, env: Dict[str, str]) -> List[str]:
    """Names of the variables every rank gets, in a stable order."""
    names = [k for k in sorted(env) if k.startswith("NVGROUP_")]
    names += [k for k in ALWAYS_PASSED if k in env]
    for spec in opts.env_vars:
        name = spec.split("=", 1)[0]
        if name not in names:
            names.append(name)
    return names


def child_env(opts: Options, env: Dict[str, str]) -> Dict[str, str]:
    out = dict(env)
    for spec in opts.env_vars:
        if "=" in spec:
            k, v = spec.split("=", 1)
            out[k] = v
    return out


def build_command(opts: Options, alloc: Allocation, env: Dict[str, str], mpi_flavor: str = "openmpi",
                  erf_path: str = "nvgroup.erf", is_root: bool = False) -> Tuple[List[str], Optional[str]]:
    """The launcher command line and, for jsrun, the ERF text to write at erf_path."""
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
    names = passed_env_names(opts, env)
    if alloc.kind == "lsf":
        erf = make_erf([h for h, _ in alloc.hosts], num_proc, opts.gpus_per_node, opts.cores_per_node,
                       opts.sockets_per_node, opts.smt)
        cmd = ["jsrun", "--erf_input", erf_path]
        values = child_env(opts, env)
        for name in names:
            if name not in ALWAYS_PASSED:  # jsrun forwards those itself
                cmd += ["-E", "%s=%s" % (name, values.get(name, ""))]
        return cmd + opts.command, erf
    if alloc.kind == "slurm":
        # srun forwards the whole environment (--export=ALL) to every task.
        return ["srun", "--mpi=pmix", "--ntasks", str(num_proc), "--export=ALL"] + opts.command, None
    host_spec = ",".join("%s:%d" % h for h in alloc.hosts)
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
        return cmd + opts.command, None
    # MPICH and Intel MPI: Hydra's mpiexec.
    cmd = ["mpiexec", "-n", str(num_proc)]
    if host_spec:
        cmd += ["-hosts", host_spec]
    cmd += ["-bind-to", "none"]
    if names:
        cmd += ["-genvlist", ",".join(names)]
    return cmd + opts.command, None


# --------------------------------------------------------------------- running

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


def run(argv: Sequence[str], env: Optional[Dict[str, str]] = None) -> int:
    env = dict(os.environ if env is None else env)
    opts = parse_args(argv)
    alloc = detect_allocation(opts, env)
    flavor = _mpi_flavor(env) if alloc.kind == "local" else "openmpi"
    erf_path = opts.erf_file
    if alloc.kind == "lsf" and erf_path is None:
        if opts.dry_run:
            erf_path = os.path.join(tempfile.gettempdir(), "nvgrouprun.XXXXXX.erf")
        else:
            fd, erf_path = tempfile.mkstemp(prefix="nvgrouprun.", suffix=".erf")
            os.close(fd)
    cmd, erf = build_command(opts, alloc, env, flavor, erf_path or "", is_root=os.geteuid() == 0)
    if not opts.dry_run and shutil.which(cmd[0], path=env.get("PATH")) is None:
        raise LaunchError("no launcher found: %s is not on PATH" % cmd[0])
    if opts.dry_run or opts.verbose:
        if erf is not None:
            print("# ERF %s:\n%s" % (erf_path, erf), end="")
        print(shlex.join(cmd), flush=True)
    if opts.dry_run:
        return 0
    if erf is not None:
        with open(erf_path, "w") as f:
            f.write(erf)
    proc = subprocess.Popen(cmd, env=child_env(opts, env))

    def forward(signum, _frame):
        proc.send_signal(signum)

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, forward)
    try:
        return proc.wait()
    finally:
        if erf is not None and opts.erf_file is None:
            os.unlink(erf_path)


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
