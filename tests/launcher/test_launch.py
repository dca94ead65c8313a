"""nvgrouprun: generated jsrun/srun/mpirun lines for fake LSF/Slurm allocations
(pure functions and `--dry-run` subprocesses), Horovod's flags, error exits, and
real 2-rank runs (knobs, per-rank logs).

The launcher is loaded from its file so these tests never import TensorFlow.
"""
import importlib.util
import os
import re
import shlex
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LAUNCH_PY = os.path.join(REPO, "nvgroup_tf", "runner", "launch.py")
_spec = importlib.util.spec_from_file_location("nvgrouprun_launch", LAUNCH_PY)
launch = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(launch)

BASE_ENV = {"PATH": "/usr/bin:/bin", "HOME": "/root"}
# Summit: a batch (launch) node, then 42-core compute nodes with 6 GPUs.
SUMMIT_LSF = dict(BASE_ENV, LSB_JOBID="4242", LSB_MCPU_HOSTS="batch3 1 h41n01 42 h41n02 42 h41n03 42")


def build(argv, env, flavor="openmpi", is_root=False):
    opts = launch.parse_args(argv)
    alloc = launch.detect_allocation(opts, env)
    return launch.build_command(opts, alloc, env, flavor, is_root, python="/py")


def nvgrouprun(argv, env):
    return subprocess.run([sys.executable, LAUNCH_PY] + argv, env=env, capture_output=True,
                          text=True, timeout=300)


def flag_values(cmd, flag):
    return [cmd[i + 1] for i, w in enumerate(cmd[:-1]) if w == flag]


def jsrun_placement(cmd, cores_per_node, gpus_per_node, sockets):
    """What jsrun makes of our line, by its documented semantics: -> per node, for
    each task (= local rank) the GPUs it sees, its cores and their sockets."""
    assert cmd[0] == "jsrun"
    rs_per_host = int(flag_values(cmd, "--rs_per_host")[0])
    tasks = int(flag_values(cmd, "--tasks_per_rs")[0])
    gpus = int(flag_values(cmd, "--gpu_per_rs")[0])
    cpus = int(flag_values(cmd, "--cpu_per_rs")[0])
    kind, per_task = flag_values(cmd, "--bind")[0].split(":")
    assert rs_per_host == 1 and kind == "packed"
    assert flag_values(cmd, "--launch_distribution") == ["packed"]
    assert cpus <= cores_per_node and gpus <= gpus_per_node
    per_task = int(per_task)
    assert per_task * tasks <= cpus
    cores_per_socket = cores_per_node // sockets
    out = []
    for t in range(tasks):
        cores = list(range(per_task * t, per_task * (t + 1)))  # packed, in order, in the RS
        out.append({"visible_gpus": list(range(gpus)), "cores": cores,
                    "sockets": {c // cores_per_socket for c in cores}})
    return out


# ----------------------------------------------------------------------- LSF


def test_jsrun_summit_one_resource_set_per_node_all_gpus_visible():
    cmd = build(["-np", "18", "python", "train.py", "--steps", "3"], SUMMIT_LSF)
    assert cmd == ["jsrun", "--nrs", "3", "--rs_per_host", "1", "--tasks_per_rs", "6",
                   "--gpu_per_rs", "6", "--cpu_per_rs", "42", "--bind", "packed:7",
                   "--launch_distribution", "packed", "python", "train.py", "--steps", "3"]
    tasks = jsrun_placement(cmd, 42, 6, 2)
    assert len(tasks) == 6
    for local_rank, t in enumerate(tasks):
        # Every rank sees all 6 GPUs (the NV-group needs them) and uses GPU local_rank.
        assert t["visible_gpus"] == [0, 1, 2, 3, 4, 5]
        gpu = t["visible_gpus"][local_rank]
        # 7 cores, all on the socket of its GPU (GPUs 0-2: socket 0, 3-5: socket 1).
        assert len(t["cores"]) == 7 and t["sockets"] == {gpu // 3}
    assert [c for t in tasks for c in t["cores"]] == list(range(42))  # disjoint, all used


def test_jsrun_partial_node_and_default_np_and_bad_np():
    cmd = build(["-np", "3", "python", "t.py"], SUMMIT_LSF)
    assert flag_values(cmd, "--nrs") == ["1"] and flag_values(cmd, "--tasks_per_rs") == ["3"]
    assert flag_values(cmd, "--gpu_per_rs") == ["6"]  # still all GPUs visible
    assert [t["sockets"] for t in jsrun_placement(cmd, 42, 6, 2)] == [{0}, {0}, {0}]
    assert flag_values(build(["python", "t.py"], SUMMIT_LSF), "--nrs") == ["3"]  # whole allocation
    with pytest.raises(launch.LaunchError, match=r"-np 8 does not fill whole nodes of 6 GPUs.*-np 6 or 12"):
        build(["-np", "8", "python", "t.py"], SUMMIT_LSF)
    with pytest.raises(launch.LaunchError, match=r"-np 19 is larger than the allocation.*18 GPUs"):
        build(["-np", "19", "python", "t.py"], SUMMIT_LSF)


def test_jsrun_custom_node_shape_keeps_cores_on_the_gpu_socket():
    env = dict(BASE_ENV, LSB_JOBID="1", LSB_MCPU_HOSTS="login1 1 n1 40 n2 40")
    cmd = build(["--gpus-per-node", "4", "--cores-per-node", "40", "python", "x.py"], env)
    assert flag_values(cmd, "--nrs") == ["2"] and flag_values(cmd, "--bind") == ["packed:10"]
    tasks = jsrun_placement(cmd, 40, 4, 2)
    assert [t["sockets"] for t in tasks] == [{0}, {0}, {1}, {1}]


def test_jsrun_hostfile_variable_and_env_passthrough(tmp_path):
    hostfile = tmp_path / "djob"
    hostfile.write_text("batch1\n" + "nodeA\n" * 42 + "nodeB\n" * 42)
    env = dict(BASE_ENV, LSB_JOBID="7", LSB_DJOB_HOSTFILE=str(hostfile), NVGROUP_CYCLE_TIME="0.5")
    cmd = build(["-np", "12", "-x", "OMP_NUM_THREADS=7", "--fusion-threshold-mb", "32",
                 "--mpi-args=--smpiargs=-gpu", "python", "t.py"], env)
    assert flag_values(cmd, "--nrs") == ["2"]
    assert flag_values(cmd, "-E") == ["NVGROUP_CYCLE_TIME=0.5", "NVGROUP_FUSION_THRESHOLD=33554432",
                                      "OMP_NUM_THREADS=7"]
    assert cmd[-3:] == ["--smpiargs=-gpu", "python", "t.py"]


def test_jsrun_dry_run_subprocess():
    res = nvgrouprun(["-np", "12", "--dry-run", "python", "train.py"], SUMMIT_LSF)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == ("jsrun --nrs 2 --rs_per_host 1 --tasks_per_rs 6 --gpu_per_rs 6 "
                                  "--cpu_per_rs 42 --bind packed:7 --launch_distribution packed "
                                  "python train.py")


# --------------------------------------------------------------------- Slurm


def test_slurm_nodelist_expansion():
    assert launch.expand_slurm_nodelist("gpu[01-03,07],login2,x[8-10]") == [
        "gpu01", "gpu02", "gpu03", "gpu07", "login2", "x8", "x9", "x10"]


@pytest.mark.parametrize("gpus_per_node", [4, 8])
def test_srun_whole_nodes_mpi_type_and_cpus_per_task(gpus_per_node):
    env = dict(BASE_ENV, SLURM_JOB_ID="99", SLURM_NTASKS=str(2 * gpus_per_node),
               SLURM_NTASKS_PER_NODE=str(gpus_per_node), SLURM_JOB_NODELIST="g[1-2]",
               SLURM_MPI_TYPE="pmi2", SRUN_CPUS_PER_TASK="8", SLURM_CPUS_PER_TASK="4")
    n = 2 * gpus_per_node
    cmd = build(["python", "t.py"], env)
    assert cmd == ["srun", "--mpi=pmi2", "--ntasks", str(n), "--nodes", "2", "--ntasks-per-node",
                   str(gpus_per_node), "--cpus-per-task", "8", "--export=ALL", "python", "t.py"]
    # No GPU restriction per task: every rank of a node sees all its GPUs.
    assert not any(w.startswith(("--gpus-per-task", "--gpu-bind", "--gpus")) for w in cmd)
    # The flags win over the environment; extra launcher arguments go before the command.
    cmd = build(["--slurm-mpi", "cray_shasta", "--cpus-per-task", "16", "-np", str(gpus_per_node),
                 "--mpi-args", "--exclusive --gres-flags=enforce-binding", "python", "t.py"], env)
    assert cmd == ["srun", "--mpi=cray_shasta", "--ntasks", str(gpus_per_node), "--nodes", "1",
                   "--ntasks-per-node", str(gpus_per_node), "--cpus-per-task", "16", "--export=ALL",
                   "--exclusive", "--gres-flags=enforce-binding", "python", "t.py"]
    with pytest.raises(launch.LaunchError, match="-np %d is larger.*%d tasks" % (n + 1, n)):
        build(["-np", str(n + 1), "python", "t.py"], env)


def test_srun_without_mpi_type_uses_srun_default_and_sbatch_cpus():
    env = dict(BASE_ENV, SLURM_JOB_ID="99", SLURM_NTASKS_PER_NODE="4", SLURM_JOB_NODELIST="g[1-3]",
               SLURM_CPUS_PER_TASK="6")
    cmd = build(["-np", "6", "python", "t.py"], env)  # not whole nodes: no --nodes
    assert cmd == ["srun", "--ntasks", "6", "--cpus-per-task", "6", "--export=ALL", "python", "t.py"]
    assert build(["python", "t.py"], env)[2] == "12"  # tasks per node x nodes


def test_srun_dry_run_subprocess():
    env = dict(BASE_ENV, SLURM_JOB_ID="5", SLURM_NTASKS="2", SLURM_JOB_NODELIST="c1")
    res = nvgrouprun(["--dry-run", "python", "a b.py"], env)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "srun --ntasks 2 --export=ALL python 'a b.py'"


# -------------------------------------------------------------------- mpirun


def test_openmpi_forwards_the_environment_like_horovodrun():
    env = dict(BASE_ENV, NVGROUP_TIMEOUT="10", LD_LIBRARY_PATH="/x", OLDPWD="/o",
               AWS_SECRET_KEY="s", BASH_FUNC_x="() {}", MY_VAR="1")
    cmd = build(["-np", "16", "-H", "a:8,b:8", "-x", "FOO=2", "--cycle-time-ms", "3.5",
                 "--log-level", "DEBUG", "--timeline-filename", "/t/tl.json", "python", "t.py"],
                env, is_root=True)
    assert cmd[:10] == ["mpirun", "-np", "16", "-H", "a:8,b:8", "-bind-to", "none", "-map-by", "slot",
                        "--allow-run-as-root"]
    assert flag_values(cmd, "-x") == ["FOO", "HOME", "LD_LIBRARY_PATH", "MY_VAR", "NVGROUP_CYCLE_TIME",
                                      "NVGROUP_LOG_LEVEL", "NVGROUP_TIMELINE", "NVGROUP_TIMEOUT", "PATH"]
    assert cmd[-2:] == ["python", "t.py"]
    child = launch.child_env(launch.parse_args(["--cycle-time-ms", "3.5", "--log-level", "FATAL",
                                                "--fusion-threshold-mb", "0", "-x", "FOO=2", "t"]), env)
    assert (child["NVGROUP_CYCLE_TIME"], child["NVGROUP_LOG_LEVEL"], child["NVGROUP_FUSION_THRESHOLD"],
            child["FOO"]) == ("3.5", "error", "0", "2")
    with pytest.raises(launch.LaunchError, match="-np 17 is larger.*16 slots"):
        build(["-np", "17", "-H", "a:8,b:8", "python", "t.py"], env)


def test_hostfile_formats_and_mpich_intel_flags(tmp_path):
    hf = tmp_path / "hosts"
    hf.write_text("# cluster\nnode1 slots=2\nnode2:3\nnode3   # one slot\n")
    assert launch.parse_hostfile(hf.read_text()) == [("node1", 2), ("node2", 3), ("node3", 1)]
    for flavor in ("mpich", "intel"):
        cmd = build(["--hostfile", str(hf), "--mpi-args=-ppn 2", "python", "t.py"], BASE_ENV, flavor=flavor)
        assert cmd == ["mpiexec", "-n", "6", "-hosts", "node1:2,node2:3,node3:1", "-bind-to", "none",
                       "-genvall", "-ppn", "2", "python", "t.py"]
    cmd = build(["-np", "2", "python", "t.py"], BASE_ENV, flavor="spectrum")
    assert cmd[:6] == ["mpirun", "-np", "2", "-bind-to", "none", "-map-by"]
    assert "--oversubscribe" not in cmd and "--allow-run-as-root" not in cmd


def test_output_filename_wraps_the_command():
    cmd = build(["-np", "12", "-H", "a:6,b:6", "--output-filename", "/logs", "python", "t.py"], BASE_ENV)
    wrapper = os.path.join(REPO, "nvgroup_tf", "runner", "rank_output.py")
    assert cmd[-7:] == ["/py", wrapper, "/logs", "2", "--", "python", "t.py"]


def test_mpi_flavor_detection():
    assert launch.detect_mpi_flavor("mpirun (Open MPI) 4.1.4\n") == "openmpi"
    assert launch.detect_mpi_flavor("mpirun (IBM Spectrum MPI) 10.4.0.3\n") == "spectrum"
    assert launch.detect_mpi_flavor("HYDRA build details:\n    Version: 4.1.2\n") == "mpich"
    assert launch.detect_mpi_flavor("Intel(R) MPI Library for Linux* OS, Version 2021.9\n") == "intel"
    with pytest.raises(launch.LaunchError, match="cannot tell which MPI"):
        launch.detect_mpi_flavor("something else")


@pytest.mark.parametrize("argv,message", [
    (["-np", "2", "--bogus", "python", "t.py"], "unknown flag '--bogus'"),
    (["-np", "2", "--start-timeout", "5", "python", "t.py"], "unknown flag '--start-timeout'"),
    (["-np", "2", "--gloo", "python", "t.py"], "no Gloo controller"),
    (["-np", "two", "python", "t.py"], "-np expects a positive integer, got 'two'"),
    (["-np", "2"], "no command given"),
    (["--launcher", "pbs", "python", "t.py"], "--launcher must be one of"),
    (["-np", "2", "-H", "a:0", "python", "t.py"], "bad host 'a:0'"),
    (["-np", "2", "--fusion-threshold-mb", "-1", "python", "t.py"], "whole number of MiB"),
    (["-np", "2", "--cycle-time-ms", "x", "python", "t.py"], "milliseconds >= 0"),
    (["-np", "2", "--log-level", "loud", "python", "t.py"], "--log-level must be one of"),
    (["-np", "2", "--mpi-args", "'unclosed", "python", "t.py"], "No closing quotation"),
    (["python", "t.py"], "-np is required"),
    (["--launcher", "jsrun", "-np", "2", "python", "t.py"], "needs an LSF allocation"),
    (["--launcher", "srun", "-np", "2", "python", "t.py"], "needs a Slurm allocation"),
])
def test_bad_input_exits_2_with_a_clear_message(argv, message):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "LSB_"))}
    res = nvgrouprun(argv, env)
    assert res.returncode == 2
    assert res.stderr.startswith("nvgrouprun: error: ") and message in res.stderr, res.stderr


def test_no_launcher_found(tmp_path):
    res = nvgrouprun(["-np", "2", "python", "t.py"], {"PATH": str(tmp_path)})
    assert res.returncode == 2 and "no launcher found" in res.stderr, res.stderr


def _local_env(**extra):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "LSB_"))}
    env.update(PYTHONUNBUFFERED="1", OMPI_MCA_btl="self,vader,tcp", OMPI_MCA_pml="ob1",
               OMPI_MCA_btl_tcp_if_include="lo", OMPI_MCA_oob_tcp_if_include="lo", **extra)
    return env


@pytest.mark.mpi
def test_real_two_rank_job_passes_knobs_and_writes_per_rank_logs(tmp_path):
    """`nvgrouprun -np 2 ...` really runs 2 ranks here: the environment and the knob
    flags reach every rank; --output-filename gives each rank its own files."""
    env = _local_env(NVGROUP_TEST_KNOB="42", UNRELATED_VAR="u")
    # One write() per rank, so the two ranks' lines cannot interleave.
    code = ("import os, sys; e = os.environ; os.write(1, ('rank %s of %s knob %s %s %s %s %s\\n' % ("
            "e['OMPI_COMM_WORLD_RANK'], e['OMPI_COMM_WORLD_SIZE'], e['NVGROUP_TEST_KNOB'], e['EXTRA'], "
            "e['UNRELATED_VAR'], e['NVGROUP_FUSION_THRESHOLD'], e['NVGROUP_LOG_LEVEL'])).encode()); "
            "sys.stderr.write('err %s\\n' % e['OMPI_COMM_WORLD_RANK'])")
    flags = ["-np", "2", "-x", "EXTRA=yes", "--fusion-threshold-mb", "2", "--log-level", "INFO"]
    res = nvgrouprun(flags + [sys.executable, "-c", code], env)
    assert res.returncode == 0, res.stdout + res.stderr
    lines = sorted(l for l in res.stdout.splitlines() if l.startswith("rank"))
    assert lines == ["rank %d of 2 knob 42 yes u 2097152 info" % r for r in range(2)], res.stdout
    logs = tmp_path / "logs"
    res = nvgrouprun(flags + ["--output-filename", str(logs), sys.executable, "-c", code], env)
    assert res.returncode == 0, res.stdout + res.stderr
    assert sorted(os.listdir(logs)) == ["rank.0", "rank.1"]
    for r in range(2):
        assert (logs / ("rank.%d" % r) / "stderr").read_text() == "err %d\n" % r
        assert (logs / ("rank.%d" % r) / "stdout").read_text().startswith("rank %d of 2 knob 42" % r)
    # A failing rank makes nvgrouprun fail.
    res = nvgrouprun(["-np", "2", sys.executable, "-c", "import sys; sys.exit(3)"], env)
    assert res.returncode != 0


def test_check_build_reports_this_build():
    res = nvgrouprun(["--check-build"], _local_env())
    lib = os.path.join(REPO, "nvgroup_tf", "lib", "libnvgroup_tf_ops.so")
    if os.path.exists(lib):
        assert res.returncode == 0, res.stdout + res.stderr
        assert "    [X] TensorFlow\n" in res.stdout and "    [X] MPI\n" in res.stdout
        assert "    [ ] NCCL\n" in res.stdout and "NV-group" in res.stdout
    else:
        assert res.returncode == 1 and "    [ ] TensorFlow\n" in res.stdout
        assert "the op library did not load" in res.stdout
