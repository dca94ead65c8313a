"""Cross-algorithm worker: the same data through different allreduce paths.

Usage: comm_algorithms.py dyadic     (4 ranks, NVGROUP_GROUP_SIZE=2: 2 groups x 2)
       comm_algorithms.py same-fold  (one group of all ranks)
dyadic: hierarchical (auto) and flat (mpi) agree bit for bit on dyadic data,
whose sums are exact in any order. same-fold: with one group, the one-shot
group path (auto), the forced skeleton (hierarchical) and flat MPI compute the
same fold, so they agree bit for bit on general random data.
"""
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import comm_common as cc  # noqa: E402

COUNTS = [1, 7, 1000, 100003]


def create(algorithm):
    os.environ["NVGROUP_ALLREDUCE_ALGORITHM"] = algorithm  # read at creation (cc/common/env.h)
    # Small registered buffer and pipeline chunk: many pieces and chunks per call.
    return cc.make_communicator(registered_bytes=1 << 18, pipeline_chunk=1 << 14)


def main():
    mode = sys.argv[1]
    algorithms = ["auto", "mpi"] if mode == "dyadic" else ["auto", "hierarchical", "mpi"]
    comms = {a: create(a) for a in algorithms}
    check = cc.Checker()
    groups = comms["auto"].topology()["group_count"]
    check.expect(groups == (2 if mode == "dyadic" else 1), "unexpected group count %d" % groups)
    case_id = 0
    for dtype in cc.DTYPES:
        for op in cc.OPS:
            for count in COUNTS:
                rng = np.random.default_rng([3, case_id, cc.RANK])
                case_id += 1
                make = cc.dyadic_input if mode == "dyadic" else cc.random_input
                mine = make(rng, dtype, op, count)
                results = {}
                for a, comm in comms.items():
                    out = np.empty_like(mine)
                    comm.allreduce(mine.ctypes.data, out.ctypes.data, count, dtype, op)
                    results[a] = out
                label = "%s %s count=%d" % (dtype, op, count)
                check.compare(label + " auto", results["auto"], mine, dtype, op)
                for a in algorithms[1:]:
                    check.expect(np.array_equal(results[a].view(np.uint8), results["auto"].view(np.uint8)),
                                 "%s: %s differs bitwise from auto" % (label, a))
    check.finish()


if __name__ == "__main__":
    cc.run_main(main)
