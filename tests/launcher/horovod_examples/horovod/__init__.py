"""`horovod` for Horovod's example programs run unchanged by the elastic tests:
horovod.tensorflow is nvgroup_tf and horovod.tensorflow.keras is
nvgroup_tf.keras (what `import nvgroup_tf as hvd` promises, under Horovod's
module names).

Two test-side helpers, both outside the programs' text:
  * tf.keras.datasets.mnist.load_data reads a stand-in file
    $KERAS_HOME/datasets/<path> written by the test. Keras's own load_data
    checks the file's SHA-256 against the real MNIST and downloads it on a
    mismatch; this machine has no network and no MNIST.
  * at exit each process prints "ELASTIC_WEIGHTS launch=<L> rank=<r>
    digest=<sha256>" over the trainable variables of its elastic states'
    models and their optimizers' variables, so the test can check that every
    rank ends with one model. Non-trainable variables are left out: batch
    normalization's moving statistics follow each rank's own batches, as in
    Horovod (the synthetic benchmark's MobileNet has them).
"""
import atexit
import gc
import hashlib
import os
import sys

import numpy as np
import tensorflow as tf

import nvgroup_tf
import nvgroup_tf.keras

tensorflow = nvgroup_tf
sys.modules[__name__ + ".tensorflow"] = nvgroup_tf
sys.modules[__name__ + ".tensorflow.keras"] = nvgroup_tf.keras


def _standin_load_data(path="mnist.npz"):
    with np.load(os.path.join(os.environ["KERAS_HOME"], "datasets", path)) as f:
        return (f["x_train"], f["y_train"]), (f["x_test"], f["y_test"])


tf.keras.datasets.mnist.load_data = _standin_load_data


def _print_weights_digest():
    from nvgroup_tf.elastic import TensorFlowKerasState, _optimizer_variables
    states = [o for o in gc.get_objects() if isinstance(o, TensorFlowKerasState)]
    if not states:
        return
    digest = hashlib.sha256()
    for state in states:
        for v in list(state.model.trainable_variables) + _optimizer_variables(state.optimizer):
            digest.update(np.asarray(v.numpy()).tobytes())
    # One write (text and newline together): mpirun joins the ranks' output as it comes.
    sys.stdout.write("ELASTIC_WEIGHTS launch=%s rank=%d digest=%s\n" % (
        nvgroup_tf.basics.setting_value("NVGROUP_ELASTIC_LAUNCH") or "-",
        int(os.environ.get("OMPI_COMM_WORLD_RANK", os.environ.get("PMI_RANK", "-1"))), digest.hexdigest()))
    sys.stdout.flush()


atexit.register(_print_weights_digest)
