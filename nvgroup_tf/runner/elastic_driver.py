"""nvgrouprun's elastic mode: run the job again, on the hosts there are now,
whenever a worker dies or hosts come or go.

MPI cannot take a new process into a running job, so where Horovod re-forms
its Gloo ring inside the running processes, this driver ends the job and
launches it again (a *relaunch*), keeping Horovod's API: `hvd.elastic.run`,
`State.commit()`, reset callbacks, `HostsUpdatedInterrupt`.

Protocol between the driver and the workers (nvgroup_tf/elastic.py is the
worker side):

* Every launch gets these variables (on top of the job's environment):
    NVGROUP_ELASTIC_JOB     the job's identity (random, one per nvgrouprun run);
    NVGROUP_ELASTIC_DIR     the host-local directory where each host's local
                            rank 0 keeps the newest commit (file `commit`,
                            written to a temporary name and renamed, so a kill
                            leaves the previous commit or the new one, never a
                            torn one);
    NVGROUP_ELASTIC_NOTIFY  a file on the driver's host that the driver
                            rewrites when the hosts change; rank 0 looks at it
                            (one stat) at every commit() / check_host_updates()
                            and broadcasts what it saw, so every rank raises
                            HostsUpdatedInterrupt at the same commit;
    NVGROUP_ELASTIC_LAUNCH  the launch's number (0, 1, ...).
  Each launch is a new MPI job, so the engine's liveness rendezvous draws a
  new random secret in every launch (cc/transport/liveness_setup.cc).
* A worker that gets HostsUpdatedInterrupt saves and writes its state and
  exits with EXIT_HOSTS_UPDATED; the driver then relaunches at once.
* Any other non-zero end of the launcher (a worker killed, an engine error
  naming a dead rank) is a failure: the driver relaunches on the hosts that
  discovery reports, the relaunched ranks load the newest commit.
* The job ends when a launch exits 0 (the training function returned on every
  rank), when --reset-limit relaunches have been made, or when fewer than
  --min-np slots have been available for --elastic-timeout seconds.

The driver reads one setting, NVGROUP_ELASTIC_BASE (the directory under which
it makes the job's directory), through the settings table (cc/common/env.h),
as the ranks read theirs; the four variables above it only sets.

Hosts: the discovery script prints one host per line, `host:slots` or `host`
(then --slots-per-host, default 1). It is run every DISCOVERY_INTERVAL_S with a
timeout of DISCOVERY_TIMEOUT_S; a script that fails or prints garbage is an
error naming the script. A host is blacklisted (not used again) after
--blacklist-after failed launches in a row that had ranks on it and during
which discovery kept listing it.

Relaunch time: a launch that stops is waited on; when it does not end by
itself within STOP_GRACE_S of a SIGTERM to its process group it gets SIGKILL.
The next launch starts after at most one discovery (DISCOVERY_TIMEOUT_S), so
a relaunch begins within STOP_GRACE_S + DISCOVERY_TIMEOUT_S of the failure
being seen, plus the program's own start-up (importing TensorFlow, building
the model).
"""
import glob
import importlib.util
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid

# Exit status of a worker that leaves because the hosts changed (EX_TEMPFAIL).
# nvgroup_tf/elastic.py uses the same number.
EXIT_HOSTS_UPDATED = 75
DISCOVERY_INTERVAL_S = 1.0
DISCOVERY_TIMEOUT_S = 30.0
STOP_GRACE_S = 10.0
POLL_S = 0.1


def parse_discovery_output(text, default_slots, script):
    """`host:slots` or `host` lines -> [(host, slots)] in the script's order."""
    hosts = []
    for line in text.splitlines():
        line = line.strip()
        if not line:
            continue
        name, _, slots = line.partition(":")
        if not name or (slots and not slots.isdigit()) or " " in name:
            raise DriverError("host discovery script %s printed %r (expected host:slots or host)"
                              % (script, line))
        n = int(slots) if slots else default_slots
        if n > 0:
            hosts.append((name, n))
    return hosts


class DriverError(Exception):
    pass


def setting_value(name):
    """`name` as the settings table (cc/common/env.h) parses it from this
    process's environment: the table nvgroup_tf.basics.setting_value reads,
    reached through the engine's pybind11 module (cc/python/) loaded from its
    file, since nvgrouprun imports neither TensorFlow nor the nvgroup_tf package
    (launch.py also runs as a script). A malformed value raises ValueError
    naming the variable."""
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    found = sorted(glob.glob(os.path.join(package, "_engine*.so")))
    if not found:
        raise DriverError("%s/_engine*.so is missing: nvgrouprun's elastic mode needs the built library "
                          "(python setup.py build_ext --inplace)" % package)
    spec = importlib.util.spec_from_file_location("_engine", found[0])
    engine = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(engine)
    return engine.setting_value(name)


def _log(text):
    # One write per line: the launch's ranks write to the same stderr meanwhile,
    # and print() would write the text and its newline separately.
    sys.stderr.write("nvgrouprun: elastic: %s\n" % text)
    sys.stderr.flush()


class ElasticDriver:
    def __init__(self, opts, alloc, env, flavor, launch):
        self.opts = opts
        self.alloc = alloc
        self.env = env
        self.flavor = flavor
        self.launch = launch  # nvgroup_tf/runner/launch.py (build_command, LaunchError)
        self.job_id = uuid.uuid4().hex
        try:
            base = setting_value("NVGROUP_ELASTIC_BASE") or tempfile.gettempdir()
        except (ValueError, DriverError) as e:
            raise launch.LaunchError(str(e))
        self.commit_dir = os.path.join(base, "nvgroup_elastic_%s" % self.job_id)
        self.notify_path = os.path.join(self.commit_dir, "hosts_updated")
        self.failures = {}      # host -> failed launches in a row
        self.blacklist = set()
        self.proc = None
        self.stopping = False

    # ------------------------------------------------------------ discovery
    def discover(self):
        """[(host, slots)] now usable: the script's hosts (or -H/--hostfile), minus the blacklist."""
        if not self.opts.host_discovery_script:
            hosts = list(self.alloc.hosts)
        else:
            script = self.opts.host_discovery_script
            try:
                res = subprocess.run([script], capture_output=True, text=True,
                                     timeout=DISCOVERY_TIMEOUT_S, env=self.env)
            except subprocess.TimeoutExpired:
                raise DriverError("host discovery script %s did not finish within %ds"
                                  % (script, DISCOVERY_TIMEOUT_S))
            except OSError as e:
                raise DriverError("cannot run host discovery script %s: %s" % (script, e.strerror))
            if res.returncode != 0:
                raise DriverError("host discovery script %s exited with status %d: %s"
                                  % (script, res.returncode, res.stderr.strip()[-500:]))
            hosts = parse_discovery_output(res.stdout, self.opts.slots_per_host or 1, script)
        return [(h, s) for h, s in hosts if h not in self.blacklist]

    def plan(self, hosts):
        """Ranks per host for the next launch: fill hosts in order up to --max-np."""
        limit = self.opts.max_np or sum(s for _, s in hosts)
        if self.alloc.kind != "local" and self.alloc.num_slots:
            limit = min(limit, self.alloc.num_slots)
        out, left = [], limit
        for host, slots in hosts:
            take = min(slots, left)
            if take > 0:
                out.append((host, take))
                left -= take
        return out

    def wait_for_hosts(self):
        """Discovery until at least --min-np slots are there, for at most --elastic-timeout."""
        start = time.monotonic()
        while True:
            plan = self.plan(self.discover())
            have = sum(n for _, n in plan)
            if have >= self.opts.min_np:
                return plan
            waited = time.monotonic() - start
            if waited >= self.opts.elastic_timeout:
                raise DriverError(
                    "only %d slot(s) available (hosts %s%s), fewer than --min-np %d, for %ds "
                    "(--elastic-timeout %d): giving up"
                    % (have, ",".join("%s:%d" % h for h in plan) or "none",
                       ", blacklisted: " + ",".join(sorted(self.blacklist)) if self.blacklist else "",
                       self.opts.min_np, waited, self.opts.elastic_timeout))
            time.sleep(DISCOVERY_INTERVAL_S)

    # ------------------------------------------------------------ launching
    def command(self, plan, index):
        np_ = sum(n for _, n in plan)
        opts = self.launch.dataclasses.replace(self.opts, num_proc=np_, hosts=None, hostfile=None)
        if self.alloc.kind == "local":
            alloc = self.launch.Allocation("local", plan, np_)
            if plan == [("localhost", np_)] or plan == [("127.0.0.1", np_)]:
                alloc = self.launch.Allocation("local", [], 0)  # this host: no -H (may oversubscribe)
        else:
            alloc = self.alloc
        env = dict(self.env)
        env.update({"NVGROUP_ELASTIC_JOB": self.job_id, "NVGROUP_ELASTIC_DIR": self.commit_dir,
                    "NVGROUP_ELASTIC_NOTIFY": self.notify_path, "NVGROUP_ELASTIC_LAUNCH": str(index)})
        cmd = self.launch.build_command(opts, alloc, env, self.flavor, is_root=os.geteuid() == 0)
        return cmd, self.launch.child_env(opts, env)

    def stop(self, proc):
        """SIGTERM to the launch's process group, SIGKILL after STOP_GRACE_S."""
        if proc.poll() is not None:
            return proc.returncode
        try:
            os.killpg(proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        try:
            return proc.wait(STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            return proc.wait()

    def run(self):
        os.makedirs(self.commit_dir, mode=0o700, exist_ok=True)
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._on_signal)
        try:
            return self._loop()
        except DriverError as e:
            sys.stderr.write("nvgrouprun: error: %s\n" % e)
            sys.stderr.flush()
            return 2
        finally:
            if self.proc is not None:
                self.stop(self.proc)
            shutil.rmtree(self.commit_dir, ignore_errors=True)

    def _on_signal(self, signum, _frame):
        self.stopping = True
        if self.proc is not None and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signum)
            except ProcessLookupError:
                pass

    def _loop(self):
        resets = 0
        notified = 0
        index = 0
        while True:
            plan = self.wait_for_hosts()
            cmd, env = self.command(plan, index)
            if shutil.which(cmd[0], path=env.get("PATH")) is None:
                raise DriverError("no launcher found: %s is not on PATH" % cmd[0])
            _log("launch %d: %d rank(s) on %s" % (index, sum(n for _, n in plan),
                                                  ",".join("%s:%d" % h for h in plan)))
            if self.opts.verbose:
                print(shlex.join(cmd), flush=True)
            try:
                os.unlink(self.notify_path)  # a new launch starts with the hosts it has
            except FileNotFoundError:
                pass
            started = time.monotonic()
            self.proc = subprocess.Popen(cmd, env=env, start_new_session=True)
            changed = False
            next_poll = started + DISCOVERY_INTERVAL_S
            while self.proc.poll() is None:
                time.sleep(POLL_S)
                if self.stopping or changed or time.monotonic() < next_poll:
                    continue
                next_poll = time.monotonic() + DISCOVERY_INTERVAL_S
                try:
                    now = self.plan(self.discover())
                except DriverError as e:
                    _log("%s (keeping the current hosts)" % e)
                    continue
                if now != plan and sum(n for _, n in now) >= self.opts.min_np:
                    notified += 1
                    self._notify(notified, now)
                    changed = True
                    _log("hosts changed to %s: workers are told at their next commit"
                         % ",".join("%s:%d" % h for h in now))
            rc = self.proc.returncode
            self.proc = None
            if self.stopping:
                return rc if rc else 1
            elapsed = time.monotonic() - started
            if rc == 0:
                _log("launch %d finished (%.1fs)" % (index, elapsed))
                return 0
            if rc == EXIT_HOSTS_UPDATED:
                _log("launch %d ended for the new hosts after %.1fs" % (index, elapsed))
                for host, _ in plan:
                    self.failures.pop(host, None)
            else:
                _log("launch %d failed with exit status %d after %.1fs (a worker died or "
                     "failed; its error is above)" % (index, rc, elapsed))
                self._count_failure(plan)
            resets += 1
            if self.opts.reset_limit is not None and resets > self.opts.reset_limit:
                raise DriverError("the job was reset %d times (--reset-limit %d); last launch "
                                  "exit status %d" % (resets, self.opts.reset_limit, rc))
            index += 1

    def _notify(self, count, hosts):
        tmp = self.notify_path + ".tmp"
        with open(tmp, "w") as f:
            f.write("%d %s\n" % (count, ",".join("%s:%d" % h for h in hosts)))
        os.replace(tmp, self.notify_path)

    def _count_failure(self, plan):
        """Hosts of a failed launch that discovery still lists count one more failure in a row;
        --blacklist-after of them blacklist the host."""
        try:
            listed = {h for h, _ in self.discover()}
        except DriverError:
            listed = set()
        for host, _ in plan:
            if host not in listed:
                self.failures.pop(host, None)
                continue
            self.failures[host] = self.failures.get(host, 0) + 1
            if self.failures[host] >= self.opts.blacklist_after:
                self.blacklist.add(host)
                _log("host %s blacklisted: %d failed launches in a row (--blacklist-after %d)"
                     % (host, self.failures[host], self.opts.blacklist_after))
