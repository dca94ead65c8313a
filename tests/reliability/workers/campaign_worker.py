"""Worker of the fault campaign (tests/reliability/fault_campaign.py): one rank
of a small training job on one of the user's paths, with one fault injected.

    campaign_worker.py PATH PHASE FAULT VICTIM DELAY_S RECORD_DIR

PATH: keras_fit (Keras fit, hvd.DistributedOptimizer, ModelCheckpoint on rank
0), tape (hvd.DistributedGradientTape loop), xla (a tf.function(jit_compile=
True) step), collectives (grouped allreduce, allgather, reducescatter,
alltoall), process_sets (a set of ranks 0..n-2 next to the global set),
elastic (hvd.elastic.run with TensorFlowKerasState and commits), engine (the
collectives of `collectives` through the engine's own module nvgroup_tf._engine,
without TensorFlow: a trial costs the MPI start, not TensorFlow's import).
PHASE: init (the fault timer starts before hvd.init()), train (when the first
step is done), checkpoint (rank 0, when a checkpoint save starts), shutdown
(before hvd.shutdown()). FAULT: kill (SIGKILL) or stop (SIGSTOP). The victim
fires DELAY_S after its phase starts, from a thread.

Every rank writes lines to RECORD_DIR/<pid>.log (mpirun may drop output of a
job it aborts): "START rank pid", "PHASE name t", "FAULT kind t phase" (the
victim, just before the signal), "ERROR t Type: message" (the first error a
survivor saw; the exception then propagates as in a user's script, or
hvd.elastic.run retries), "DONE t"
(the program ended normally). The rank's stderr (the engine's log lines: what
init() says when it is ended, cc/engine/init_watchdog.h) goes to
RECORD_DIR/<pid>.stderr.
"""
import faulthandler
import os
import signal
import sys
import threading
import time

RANK = int(os.environ.get("OMPI_COMM_WORLD_RANK", "0"))
SIZE = int(os.environ.get("OMPI_COMM_WORLD_SIZE", "1"))
STEPS = 60
STEP_PAUSE_S = 0.05  # keeps every path training for a few seconds, the faults' window
_phase = ["start"]
_errors = []


def record(text):
    line = ("%s\n" % text).encode()
    fd = os.open(os.path.join(RECORD_DIR, "%d.log" % os.getpid()), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.write(fd, line)
    os.close(fd)


def enter(phase):
    _phase[0] = phase
    record("PHASE %s %.6f" % (phase, time.time()))
    if phase == PHASE and RANK == VICTIM:
        threading.Thread(target=fire, daemon=True).start()


def fire():
    time.sleep(DELAY_S)
    record("FAULT %s %.6f %s" % (FAULT, time.time(), _phase[0]))
    os.kill(os.getpid(), signal.SIGKILL if FAULT == "kill" else signal.SIGSTOP)


def note_error(e):
    """Records the first error this rank saw (the one that names the cause)."""
    if not _errors:
        _errors.append(e)
        message = getattr(e, "message", None) or str(e)
        record("ERROR %.6f %s: %s" % (time.time(), type(e).__name__, " ".join(message.split())))


def tiny_model(keras):
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="relu"), keras.layers.Dense(1)])
    return model


def data(np, n=64):
    rng = np.random.default_rng(7 + RANK)
    x = rng.standard_normal((n, 4)).astype("float32")
    return x, (x.sum(axis=1, keepdims=True) * 0.5).astype("float32")


def run_keras_fit(hvd, tf, keras, np):
    import nvgroup_tf.keras as hvd  # as Horovod's Keras examples: horovod.tensorflow.keras as hvd
    model = tiny_model(keras)
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.01)), loss="mse")
    path = os.path.join(CKPT_DIR, "model.keras")
    if RANK == 0:
        model.save(path)  # the "old" checkpoint every later save replaces

    class SaveFault(keras.callbacks.Callback):  # placed right before ModelCheckpoint
        def on_epoch_end(self, epoch, logs=None):
            if epoch == 1:
                enter("checkpoint")

    class FirstStep(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            time.sleep(STEP_PAUSE_S)
            if batch == 0 and _phase[0] != "train" and _phase[0] != "checkpoint":
                enter("train")

    callbacks = [hvd.callbacks.BroadcastGlobalVariablesCallback(0), FirstStep()]
    if RANK == 0:
        callbacks += [SaveFault(), keras.callbacks.ModelCheckpoint(path)]
    x, y = data(np)
    model.fit(x, y, batch_size=8, epochs=6, shuffle=False, verbose=0, callbacks=callbacks)


def run_tape(hvd, tf, keras, np):
    model = tiny_model(keras)
    opt = keras.optimizers.SGD(0.01)
    x, y = data(np)
    for step in range(STEPS):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean((model(x[:16]) - y[:16]) ** 2)
        tape = hvd.DistributedGradientTape(tape)
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        time.sleep(STEP_PAUSE_S)
        if step == 0:
            hvd.broadcast_variables(model.variables, root_rank=0)
            enter("train")


def run_xla(hvd, tf, keras, np):
    w = tf.Variable(tf.ones((4, 1)))
    x, y = data(np)

    @tf.function(jit_compile=True)
    def step(xb, yb):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean((tf.matmul(xb, w) - yb) ** 2)
        g = hvd.allreduce(tape.gradient(loss, w), op=hvd.Average, name="xla.grad")
        w.assign_sub(0.01 * g)
        return loss

    for i in range(STEPS):
        step(tf.constant(x[:16]), tf.constant(y[:16]))
        time.sleep(STEP_PAUSE_S)
        if i == 0:
            enter("train")


def run_collectives(hvd, tf, keras, np):
    rng = np.random.default_rng(11 + RANK)
    for i in range(STEPS):
        a = [tf.constant(rng.standard_normal(s)) for s in ((5,), (3, 2))]
        hvd.grouped_allreduce(a, op=hvd.Sum, name="fc.grouped")
        hvd.allgather(tf.constant(rng.standard_normal((RANK + 1, 2))), name="fc.allgather")
        hvd.reducescatter(tf.constant(rng.standard_normal((SIZE * 2, 3))), op=hvd.Sum, name="fc.reducescatter")
        hvd.alltoall(tf.constant(rng.standard_normal((SIZE * 2,))), name="fc.alltoall")
        time.sleep(STEP_PAUSE_S)
        if i == 0:
            enter("train")


def run_process_sets(hvd, tf, keras, np, subset):
    for i in range(STEPS):
        x = tf.constant(np.full((6,), float(RANK + i)))
        if RANK in subset.ranks:
            hvd.allreduce(x, op=hvd.Sum, name="fc.subset", process_set=subset)
        hvd.allreduce(x, op=hvd.Sum, name="fc.global")
        time.sleep(STEP_PAUSE_S)
        if i == 0:
            enter("train")


def run_elastic(hvd, tf, keras, np):
    model = tiny_model(keras)
    opt = keras.optimizers.SGD(0.01)
    model.build((None, 4))
    opt.build(model.trainable_variables)
    state = hvd.elastic.TensorFlowKerasState(model, opt, batch=0)
    x, y = data(np)

    @hvd.elastic.run
    def train(state):
        try:
            steps(state)
        except BaseException as e:  # seen here first: run() then restores, re-inits and retries
            note_error(e)
            raise

    def steps(state):
        for step in range(state.batch, STEPS):
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean((model(x[:16]) - y[:16]) ** 2)
            tape = hvd.DistributedGradientTape(tape)
            opt.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))
            state.batch = step + 1
            time.sleep(STEP_PAUSE_S)
            if step % 5 == 4:
                state.commit()
            if step == 0 and _phase[0] != "train":
                enter("train")

    train(state)


def run_engine(np):
    import nvgroup_tf._engine as engine
    rng = np.random.default_rng(11 + RANK)

    for i in range(STEPS):
        a = [rng.standard_normal(s) for s in ((5,), (3, 2))]
        outs = [np.empty_like(x) for x in a]
        handles = engine.grouped_allreduce_async(
            [("fc.grouped[%d]" % k, x.ctypes.data, y.ctypes.data, list(x.shape), "float64")
             for k, (x, y) in enumerate(zip(a, outs))], keepalive=(a, outs))
        for h in handles:
            engine.wait(h)
        g = rng.standard_normal((RANK + 1, 2))
        engine.wait(engine.allgather_async("fc.allgather", g.ctypes.data, list(g.shape), "float64", keepalive=g))
        r = rng.standard_normal((SIZE * 2, 3))
        engine.wait(engine.reducescatter_async("fc.reducescatter", r.ctypes.data, list(r.shape), "float64", keepalive=r))
        t = rng.standard_normal((SIZE * 2,))
        engine.wait(engine.alltoall_async("fc.alltoall", t.ctypes.data, list(t.shape), "float64", keepalive=t))
        time.sleep(STEP_PAUSE_S)
        if i == 0:
            enter("train")


def run_phases(init, train, shutdown):
    """init(), train(), shutdown() as a user's script does, with the phases
    recorded and the first error noted; DONE when all returned."""
    enter("init")
    try:
        init()
        train()
        enter("shutdown")
        shutdown()
    except BaseException as e:
        note_error(e)
        raise
    record("DONE %.6f" % time.time())


def main_engine():
    import numpy as np
    import nvgroup_tf._engine as engine
    run_phases(engine.init, lambda: run_engine(np), engine.shutdown)
    engine.finalize_mpi()


def main():
    record("START %d %d" % (RANK, os.getpid()))
    fd = os.open(os.path.join(RECORD_DIR, "%d.stderr" % os.getpid()), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 2)
    os.close(fd)
    # The campaign sends SIGUSR1 to a rank left behind: where it is stuck.
    faulthandler.register(signal.SIGUSR1, file=open(os.path.join(RECORD_DIR, "%d.stack" % os.getpid()), "w"),
                          all_threads=True)
    if PATH == "engine":
        return main_engine()
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import numpy as np
    import tensorflow as tf
    import keras
    import nvgroup_tf as hvd
    subset = hvd.ProcessSet(list(range(max(1, SIZE - 1)))) if PATH == "process_sets" else None
    run = {"keras_fit": run_keras_fit, "tape": run_tape, "xla": run_xla, "collectives": run_collectives,
           "elastic": run_elastic}

    def init():
        if subset is not None:
            hvd.init(process_sets=[subset])
        else:
            hvd.init()

    def train():
        if subset is not None:
            run_process_sets(hvd, tf, keras, np, subset)
        else:
            run[PATH](hvd, tf, keras, np)

    run_phases(init, train, hvd.shutdown)


if __name__ == "__main__":
    PATH, PHASE, FAULT = sys.argv[1], sys.argv[2], sys.argv[3]
    VICTIM, DELAY_S, RECORD_DIR = int(sys.argv[4]), float(sys.argv[5]), sys.argv[6]
    CKPT_DIR = os.path.join(RECORD_DIR, "ckpt")
    main()
