"""Worker: rank VICTIM freezes (SIGSTOP) or dies (SIGKILL) in phase PHASE of
init() (the engine's test hook _engine.testing.fault_in_init; the phases are
listed in cc/engine/init_watchdog.h). PHASE before_init: the victim stops or
kills itself from Python right before calling init(), without the hook.
PHASE process_set: init() succeeds, then every rank calls add_process_set of
all ranks, where the hook stops or kills the victim.

    init_fault.py VICTIM PHASE stop|kill

Every rank sends its stderr (the engine's log lines) to
REL_RECORD_DIR/<pid>.log, since mpirun may drop the output of a job it ends.
A rank whose init() fails says "rank R: INIT_ERROR <seconds> <message>" and
exits 3 (add_process_set: "rank R: ADD_ERROR <seconds> <message>", exit 4); one whose init() returns says "rank R: INIT_OK", shuts down and
finalizes MPI.
Engine only (no TensorFlow), so a trial costs the MPI start and the bound.
"""
import os
import signal
import sys
import time

import nvgroup_tf._engine as engine
from rel_common import say


def main():
    victim, phase, kind = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    rank = int(os.environ["OMPI_COMM_WORLD_RANK"])
    record = os.environ["REL_RECORD_DIR"]
    fd = os.open(os.path.join(record, "%d.log" % os.getpid()), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 2)
    if rank == victim and phase == "before_init":
        os.kill(os.getpid(), signal.SIGSTOP if kind == "stop" else signal.SIGKILL)
    elif rank == victim:
        engine.testing.fault_in_init(phase, kind)
    start = time.monotonic()
    try:
        engine.init()
    except Exception as e:  # noqa: BLE001 -- the error is the test's observation
        say("rank %d: INIT_ERROR %.1f %s" % (rank, time.monotonic() - start, " ".join(str(e).split())))
        sys.exit(3)
    say("rank %d: INIT_OK" % rank)
    if phase == "process_set":
        start = time.monotonic()
        try:
            engine.add_process_set(list(range(int(os.environ["OMPI_COMM_WORLD_SIZE"]))))
        except Exception as e:  # noqa: BLE001 -- the error is the test's observation
            say("rank %d: ADD_ERROR %.1f %s" % (rank, time.monotonic() - start, " ".join(str(e).split())))
            sys.exit(4)
        say("rank %d: ADD_OK" % rank)
    engine.shutdown()
    engine.finalize_mpi()


if __name__ == "__main__":
    main()
