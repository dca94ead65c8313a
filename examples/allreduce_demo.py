"""A tiny data-parallel step on 2+ ranks: each rank computes a gradient on its
own data, nvgroup_tf averages the gradients, and every rank applies the same
update. Prints the per-rank gradients, the average, and a check that all ranks
hold identical weights afterwards.

    mpirun -np 2 python examples/allreduce_demo.py     (scripts/run_example.sh)
"""
import numpy as np
import tensorflow as tf

import nvgroup_tf as hvd


def main():
    hvd.init()
    rank, size = hvd.rank(), hvd.size()

    # Same initial weights everywhere: rank 0's, broadcast.
    w = tf.Variable(np.random.default_rng(rank).normal(size=(4, 1)).astype(np.float32))
    hvd.broadcast_variables([w], root_rank=0)

    # Each rank has its own shard of a linear-regression data set.
    rng = np.random.default_rng(100 + rank)
    x = rng.normal(size=(64, 4)).astype(np.float32)
    y = x @ np.array([[1.0], [-2.0], [3.0], [0.5]], np.float32)

    @tf.function
    def train_step(x, y):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(x @ w - y))
        grad = tape.gradient(loss, w)
        avg_grad = hvd.allreduce(grad, op=hvd.Average, name="grad/w")
        w.assign_sub(0.1 * avg_grad)
        return loss, grad, avg_grad

    for step in range(30):
        loss, grad, avg_grad = train_step(x, y)
        loss = hvd.allreduce(loss, op=hvd.Average, name="loss")
        if step in (0, 29):
            print("rank %d/%d step %2d  local grad %s  averaged grad %s  mean loss %.5f"
                  % (rank, size, step, np.round(grad.numpy().ravel(), 3),
                     np.round(avg_grad.numpy().ravel(), 3), float(loss)), flush=True)

    # Bitwise check: every rank's weights equal rank 0's.
    same = tf.reduce_all(tf.equal(hvd.broadcast(w, 0, name="check/w"), w))
    agree = int(hvd.allreduce(tf.cast(same, tf.int32), op=hvd.Min, name="check/agree"))
    if rank == 0:
        print("weights after 30 steps: %s" % np.round(w.numpy().ravel(), 4))
        print("all %d ranks hold identical weights: %s" % (size, "yes" if agree else "NO"))
    if not agree:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
