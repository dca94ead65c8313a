"""init/shutdown life cycle: collectives before init raise naming the fix,
init(comm) validation, re-init after shutdown, an mpi4py sub-communicator, and a
shutdown that fails a collective still waiting for its peers."""
import threading
import time

from common import Checker, hvd, run, tf

FIX = "call nvgroup_tf.init() first"


def main():
    c = Checker("lifecycle")
    c.check(not hvd.is_initialized(), "not initialized at start")
    c.raises(ValueError, lambda: hvd.allreduce(tf.ones([2]), name="early"),
             "allreduce before init", contains=FIX)
    c.raises(ValueError, lambda: hvd.allgather(tf.ones([2]), name="early"),
             "allgather before init", contains=FIX)
    c.raises(ValueError, lambda: hvd.broadcast(tf.ones([2]), 0, name="early"),
             "broadcast before init", contains=FIX)
    c.raises(ValueError, lambda: hvd.grouped_allreduce([tf.ones([2])], name="early"),
             "grouped_allreduce before init", contains=FIX)
    c.raises(ValueError, hvd.rank, "rank() before init", contains=FIX)
    c.raises(ValueError, hvd.size, "size() before init", contains=FIX)
    c.raises(ValueError, lambda: hvd.init([0, 1]), "init(list of ranks)", contains="mpi4py")
    c.raises(TypeError, lambda: hvd.init("world"), "init(str)")

    hvd.init()
    n, me = hvd.size(), hvd.rank()
    got = hvd.allreduce(tf.constant([me + 1.0]), op=hvd.Sum, name="first")
    c.equal(got.numpy(), [n * (n + 1) / 2.0], "allreduce after init")
    hvd.shutdown()
    c.check(not hvd.is_initialized(), "not initialized after shutdown")
    c.raises(ValueError, lambda: hvd.allreduce(tf.ones([2]), name="late"),
             "allreduce after shutdown", contains=FIX)

    # Re-init over a sub-communicator: even and odd world ranks.
    from mpi4py import MPI
    sub = MPI.COMM_WORLD.Split(me % 2, me)
    hvd.init(sub)
    c.equal(hvd.size(), sub.size, "size over a sub-communicator")
    c.equal(hvd.rank(), sub.rank, "rank over a sub-communicator")
    got = hvd.allreduce(tf.constant([float(me)]), op=hvd.Sum, name="sub")
    c.equal(got.numpy(), [float(sum(r for r in range(n) if r % 2 == me % 2))],
            "allreduce over a sub-communicator")
    hvd.shutdown()

    hvd.init()
    c.equal(hvd.size(), n, "size after re-init over COMM_WORLD")
    # Rank 0 submits a tensor nobody else does; shutdown must fail it (no hang).
    errors = []
    if me == 0:
        def lonely():
            try:
                hvd.allreduce(tf.ones([3]), op=hvd.Sum, name="lonely")
                errors.append(None)
            except Exception as e:  # noqa: BLE001
                errors.append(e)
        t = threading.Thread(target=lonely)
        t.start()
        time.sleep(2.0)  # let the thread get its request into the engine
    sub.Barrier()
    MPI.COMM_WORLD.Barrier()
    hvd.shutdown()
    if me == 0:
        t.join(timeout=60)
        c.check(not t.is_alive(), "collective in flight returns after shutdown")
        c.check(len(errors) == 1 and isinstance(errors[0], tf.errors.AbortedError),
                "collective in flight at shutdown fails with AbortedError, got %r" % errors)
    c.finish()


if __name__ == "__main__":
    run(main)
