"""Clean exits are not deaths: ranks 1.. call shutdown() and exit at once,
while rank 0 (whose engine loop stopped with theirs: shutdown is agreed) keeps
its liveness monitor open for 2 s before its own shutdown(). The others' BYE
must keep rank 0 from reporting them as dead."""
import time

import numpy as np

import nvgroup_tf._engine as engine
from rel_common import say, wait_bounded


def main():
    engine.init()
    rank = engine.rank()
    x = np.ones(8)
    wait_bounded(engine.allreduce_async("one", x.ctypes.data, x.ctypes.data, [8], "float64", "sum",
                                        keepalive=x), 60)
    assert np.all(x == engine.size()), x
    if rank == 0:
        time.sleep(2.0)
    engine.shutdown()
    engine.finalize_mpi()
    say("rank %d: EXITED_CLEANLY" % rank)


if __name__ == "__main__":
    main()
