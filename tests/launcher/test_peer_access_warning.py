"""The CUDA communicator's warning when a node's GPUs form no NV-group
(cc/device/peer_access_advice.cc, printed once per node by device_topology_cuda.cc):
ranks restricted to their own GPU by the launcher get the cause and the fix,
not the generic "lack peer access" line. Pure function, tested through the
pybind module (no GPU needed)."""
import pytest

engine = pytest.importorskip("nvgroup_tf._engine")

BUS = ["0004:04:00.0", "0004:05:00.0", "0004:06:00.0", "0035:03:00.0", "0035:04:00.0", "0035:05:00.0"]


def test_each_rank_sees_only_its_gpu_names_the_cause_and_the_fix():
    # jsrun with one GPU per resource set: every rank sees 1 device, all different.
    msg = engine.no_peer_access_warning(3, [1] * 6, BUS, "0")
    assert msg.startswith("nvgroup WARNING: node 3: each of the 6 local ranks sees only its own GPU")
    assert "CUDA_VISIBLE_DEVICES=0 here" in msg
    for fix in ("one resource set per node", "jsrun -r1 -a6 -g6", "--gpus-per-task/--gpu-bind",
                "do not set CUDA_VISIBLE_DEVICES per rank", "nvgrouprun"):
        assert fix in msg, fix
    assert "lack mutual peer access" not in msg
    assert "<unset>" in engine.no_peer_access_warning(0, [1, 1], BUS[:2], None)


@pytest.mark.parametrize("visible,bus", [
    ([6] * 6, BUS),            # all GPUs visible, no NVLink between them: really no peer access
    ([1, 6], BUS[:2]),         # mixed visibility: not the launcher pattern
])
def test_other_cases_keep_the_generic_warning(visible, bus):
    msg = engine.no_peer_access_warning(0, visible, bus, None)
    assert msg == ("nvgroup WARNING: node 0: the %d local GPUs lack mutual peer access (NVLink); "
                   "using host-staged MPI between single-GPU groups (slow)" % len(visible))


@pytest.mark.parametrize("visible", [[1, 1], [1, 1, 1]])
def test_ranks_sharing_one_gpu_are_told_so_not_lack_of_peer_access(visible):
    # Two or three ranks on one GPU (each sees that one): not a launcher
    # restriction and not missing NVLink; the message says they share it.
    msg = engine.no_peer_access_warning(0, visible, [BUS[0]] * len(visible), None)
    assert msg.startswith("nvgroup WARNING: node 0: the %d local ranks share one GPU (%s)"
                          % (len(visible), BUS[0]))
    assert "NVGROUP_ONE_GPU_GROUP=1" in msg and "one rank per GPU" in msg
    assert "lack mutual peer access" not in msg
