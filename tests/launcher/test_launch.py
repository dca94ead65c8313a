"""nvgrouprun: generated commands and ERF files for fake LSF/Slurm environments
(pure functions and `--dry-run` subprocesses), error exits, and one real 2-rank run.

The launcher is loaded from its file so these tests never import TensorFlow.
"""
import importlib.util
import os
import re
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LAUNCH_PY = os.path.join(REPO, "nvgroup_tf", "runner", "launch.py")
_spec = importlib.util.spec_from_file_location("nvgrouprun_launch", LAUNCH_PY)
launch = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(launch)

BASE_ENV = {"PATH": "/usr/bin:/bin", "HOME": "/root"}
SUMMIT_LSF = dict(BASE_ENV, LSB_JOBID="4242", LSB_MCPU_HOSTS="batch3 1 h41n01 42 h41n02 42 h41n03 42")


def build(argv, env, flavor="openmpi", is_root=False):
    opts = launch.parse_args(argv)
    alloc = launch.detect_allocation(opts, env)
    return launch.build_command(opts, alloc, env, flavor, "/tmp/job.erf", is_root)


def nvgrouprun(argv, env):
    return subprocess.run([sys.executable, LAUNCH_PY] + argv, env=env, capture_output=True,
                          text=True, timeout=120)


def parse_erf(text):
    """-> {rank: (host, first_thread, last_thread, gpu)}"""
    out = {}
    for m in re.finditer(r"rank: (\d+): \{ hostname: (\S+); cpu: \{(\d+)-(\d+)\}; gpu: \{(\d+)\}; mem: \* \}",
                         text):
        out[int(m.group(1))] = (m.group(2), int(m.group(3)), int(m.group(4)), int(m.group(5)))
    return out


# ----------------------------------------------------------------------- LSF


def test_lsf_summit_erf_one_rank_per_gpu_cores_split_per_socket():
    cmd, erf = build(["-np", "18", "python", "train.py", "--steps", "3"], SUMMIT_LSF)
    assert cmd == ["jsrun", "--erf_input", "/tmp/job.erf", "python", "train.py", "--steps", "3"]
    assert erf.startswith("cpu_index_using: logical\n")
    ranks = parse_erf(erf)
    assert sorted(ranks) == list(range(18))
    # The batch (launch) node never gets ranks; 6 per compute node, in rank order.
    for r, (host, first, last, gpu) in ranks.items():
        assert host == ["h41n01", "h41n02", "h41n03"][r // 6]
        assert gpu == r % 6
        # 42 cores / 6 GPUs = 7 cores x SMT4 = 28 hardware threads each, disjoint, in
        # order: socket 0 (threads 0-83) holds GPUs 0-2, socket 1 (84-167) GPUs 3-5.
        assert (first, last) == (28 * gpu, 28 * gpu + 27)
        assert (first < 84) == (gpu < 3) and (last < 84) == (gpu < 3)


def test_lsf_custom_node_shape_and_smt1():
    env = dict(BASE_ENV, LSB_JOBID="1", LSB_MCPU_HOSTS="login1 1 n1 40 n2 40")
    cmd, erf = build(["--gpus-per-node", "4", "--cores-per-node", "40", "--smt", "1", "python", "x.py"], env)
    ranks = parse_erf(erf)
    assert len(ranks) == 8  # -np defaults to the whole allocation
    assert ranks[0] == ("n1", 0, 9, 0) and ranks[2] == ("n1", 20, 29, 2) and ranks[7] == ("n2", 30, 39, 3)


def test_lsf_hostfile_variable_and_env_passthrough(tmp_path):
    hostfile = tmp_path / "djob"
    hostfile.write_text("batch1\n" + "nodeA\n" * 42 + "nodeB\n" * 42)
    env = dict(BASE_ENV, LSB_JOBID="7", LSB_DJOB_HOSTFILE=str(hostfile), NVGROUP_CYCLE_TIME="0.5")
    cmd, erf = build(["-np", "12", "-x", "OMP_NUM_THREADS=7", "python", "t.py"], env)
    assert cmd[:3] == ["jsrun", "--erf_input", "/tmp/job.erf"]
    assert cmd[3:7] == ["-E", "NVGROUP_CYCLE_TIME=0.5", "-E", "OMP_NUM_THREADS=7"]
    assert {h for h, *_ in parse_erf(erf).values()} == {"nodeA", "nodeB"}


def test_lsf_np_larger_than_allocation_is_an_error():
    with pytest.raises(launch.LaunchError, match=r"-np 19 is larger than the allocation.*18 GPUs"):
        build(["-np", "19", "python", "t.py"], SUMMIT_LSF)


def test_lsf_dry_run_subprocess_prints_erf_and_command():
    res = nvgrouprun(["-np", "7", "--dry-run", "python", "train.py"], SUMMIT_LSF)
    assert res.returncode == 0, res.stderr
    assert "rank: 6: { hostname: h41n02; cpu: {0-27}; gpu: {0}; mem: * }" in res.stdout
    assert re.search(r"^jsrun --erf_input \S+\.erf python train\.py$", res.stdout, re.M)


# --------------------------------------------------------------------- Slurm


def test_slurm_nodelist_expansion():
    assert launch.expand_slurm_nodelist("gpu[01-03,07],login2,x[8-10]") == [
        "gpu01", "gpu02", "gpu03", "gpu07", "login2", "x8", "x9", "x10"]


def test_slurm_srun_command_and_limits():
    env = dict(BASE_ENV, SLURM_JOB_ID="99", SLURM_NTASKS="8", SLURM_JOB_NODELIST="g[1-2]",
               NVGROUP_FUSION_THRESHOLD="1048576")
    cmd, erf = build(["python", "t.py"], env)
    assert erf is None
    assert cmd == ["srun", "--mpi=pmix", "--ntasks", "8", "--export=ALL", "python", "t.py"]
    cmd, _ = build(["-np", "4", "python", "t.py"], env)
    assert cmd[3] == "4"
    with pytest.raises(launch.LaunchError, match="-np 9 is larger.*8 tasks"):
        build(["-np", "9", "python", "t.py"], env)
    # Without SLURM_NTASKS: tasks per node x nodes.
    env2 = dict(BASE_ENV, SLURM_JOB_ID="99", SLURM_NTASKS_PER_NODE="4", SLURM_JOB_NODELIST="g[1-3]")
    assert build(["python", "t.py"], env2)[0][3] == "12"


def test_slurm_dry_run_subprocess():
    env = dict(BASE_ENV, SLURM_JOB_ID="5", SLURM_NTASKS="2", SLURM_JOB_NODELIST="c1")
    res = nvgrouprun(["--dry-run", "python", "a b.py"], env)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "srun --mpi=pmix --ntasks 2 --export=ALL python 'a b.py'"


# -------------------------------------------------------------------- mpirun


def test_openmpi_command_with_hosts_and_knobs():
    env = dict(BASE_ENV, NVGROUP_TIMEOUT="10", LD_LIBRARY_PATH="/x")
    cmd, _ = build(["-np", "8", "-H", "a:4,b:4", "-x", "FOO", "python", "t.py"], env, is_root=True)
    assert cmd == ["mpirun", "-np", "8", "-H", "a:4,b:4", "-bind-to", "none", "-map-by", "slot",
                   "--allow-run-as-root", "-x", "NVGROUP_TIMEOUT", "-x", "PATH", "-x", "LD_LIBRARY_PATH",
                   "-x", "FOO", "python", "t.py"]
    with pytest.raises(launch.LaunchError, match="-np 9 is larger.*8 slots"):
        build(["-np", "9", "-H", "a:4,b:4", "python", "t.py"], env)


def test_hostfile_formats_and_mpich_intel_flags(tmp_path):
    hf = tmp_path / "hosts"
    hf.write_text("# cluster\nnode1 slots=2\nnode2:3\nnode3   # one slot\n")
    assert launch.parse_hostfile(hf.read_text()) == [("node1", 2), ("node2", 3), ("node3", 1)]
    env = dict(BASE_ENV, NVGROUP_LOG_LEVEL="info")
    for flavor in ("mpich", "intel"):
        cmd, _ = build(["--hostfile", str(hf), "python", "t.py"], env, flavor=flavor)
        assert cmd == ["mpiexec", "-n", "6", "-hosts", "node1:2,node2:3,node3:1", "-bind-to", "none",
                       "-genvlist", "NVGROUP_LOG_LEVEL,PATH", "python", "t.py"]
    cmd, _ = build(["-np", "2", "python", "t.py"], env, flavor="spectrum")
    assert cmd[:6] == ["mpirun", "-np", "2", "-bind-to", "none", "-map-by"]
    assert "--oversubscribe" not in cmd and "--allow-run-as-root" not in cmd


def test_mpi_flavor_detection():
    assert launch.detect_mpi_flavor("mpirun (Open MPI) 4.1.4\n") == "openmpi"
    assert launch.detect_mpi_flavor("mpirun (IBM Spectrum MPI) 10.4.0.3\n") == "spectrum"
    assert launch.detect_mpi_flavor("HYDRA build details:\n    Version: 4.1.2\n") == "mpich"
    assert launch.detect_mpi_flavor("Intel(R) MPI Library for Linux* OS, Version 2021.9\n") == "intel"
    with pytest.raises(launch.LaunchError, match="cannot tell which MPI"):
        launch.detect_mpi_flavor("something else")


@pytest.mark.parametrize("argv,message", [
    (["-np", "2", "--bogus", "python", "t.py"], "unknown flag '--bogus'"),
    (["-np", "two", "python", "t.py"], "-np expects a positive integer, got 'two'"),
    (["-np", "2"], "no command given"),
    (["--launcher", "pbs", "python", "t.py"], "--launcher must be one of"),
    (["-np", "2", "-H", "a:0", "python", "t.py"], "bad host 'a:0'"),
    (["python", "t.py"], "-np is required"),
    (["--launcher", "jsrun", "-np", "2", "python", "t.py"], "needs an LSF allocation"),
    (["--launcher", "srun", "-np", "2", "python", "t.py"], "needs a Slurm allocation"),
])
def test_bad_input_exits_2_with_a_clear_message(argv, message):
    res = nvgrouprun(argv + [], dict(os.environ))
    assert res.returncode == 2
    assert res.stderr.startswith("nvgrouprun: error: ") and message in res.stderr, res.stderr


def test_no_launcher_found(tmp_path):
    res = nvgrouprun(["-np", "2", "python", "t.py"], {"PATH": str(tmp_path)})
    assert res.returncode == 2 and "no launcher found" in res.stderr, res.stderr


def test_real_two_rank_job_passes_knobs():
    """`nvgrouprun -np 2 python -c ...` really runs 2 ranks here, each seeing the knobs."""
    env = dict(os.environ, NVGROUP_TEST_KNOB="42", PYTHONUNBUFFERED="1",
               OMPI_MCA_btl="self,vader,tcp", OMPI_MCA_pml="ob1",
               OMPI_MCA_btl_tcp_if_include="lo", OMPI_MCA_oob_tcp_if_include="lo")
    # One write() per rank, so the two ranks' lines cannot interleave.
    code = ("import os; e = os.environ; os.write(1, ('rank %s of %s knob %s %s\\n' % (e['OMPI_COMM_WORLD_RANK'], "
            "e['OMPI_COMM_WORLD_SIZE'], e['NVGROUP_TEST_KNOB'], e['EXTRA'])).encode())")
    res = nvgrouprun(["-np", "2", "-x", "EXTRA=yes", sys.executable, "-c", code], env)
    assert res.returncode == 0, res.stdout + res.stderr
    lines = sorted(l for l in res.stdout.splitlines() if l.startswith("rank"))
    assert lines == ["rank 0 of 2 knob 42 yes", "rank 1 of 2 knob 42 yes"], res.stdout
    # A failing rank makes nvgrouprun fail.
    res = nvgrouprun(["-np", "2", sys.executable, "-c", "import sys; sys.exit(3)"], env)
    assert res.returncode != 0
