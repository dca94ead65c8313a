"""hvd.elastic for Keras (Horovod's horovod.tensorflow.keras.elastic): KerasState,
run, and the callbacks that keep the state current during fit.

    state = hvd.elastic.KerasState(model, batch=0, epoch=0)

    @hvd.elastic.run
    def train(state):
        model.fit(data, epochs=epochs - state.epoch, callbacks=[  # not initial_epoch: see below
            hvd.elastic.CommitStateCallback(state),
            hvd.elastic.UpdateBatchStateCallback(state),
            hvd.elastic.UpdateEpochStateCallback(state)])

See nvgroup_tf.elastic for what run retries and what is out of scope (elastic
membership). The batch hooks are on_train_batch_end (Keras 3 skips callbacks
whose train-batch hooks are not overridden).
"""
import tensorflow as tf

from nvgroup_tf.elastic import (HostsUpdatedInterrupt, ObjectState, State,  # noqa: F401
                                TensorFlowKerasState, TensorFlowState, run)

_Callback = tf.keras.callbacks.Callback


class KerasState(TensorFlowKerasState):
    """TensorFlowKerasState of a Keras model (and its compiled optimizer by default)."""

    def __init__(self, model, optimizer=None, **kwargs):
        super().__init__(model, optimizer=optimizer, backend=tf.keras.backend, **kwargs)


class CommitStateCallback(_Callback):
    """Commits `state` every `batches_per_commit` batches and at every epoch end."""

    def __init__(self, state, batches_per_commit=1):
        super().__init__()
        self.state = state
        self.batches_per_commit = batches_per_commit
        self.batches_remaining = batches_per_commit

    def on_train_begin(self, logs=None):
        # Restarted after every reset, the same way on every rank.
        self.batches_remaining = self.batches_per_commit

    def on_train_batch_end(self, batch, logs=None):
        self.batches_remaining -= 1
        if self.batches_remaining == 0:
            self.state.commit()
            self.batches_remaining = self.batches_per_commit

    def on_epoch_end(self, epoch, logs=None):
        self.state.commit()


class UpdateBatchStateCallback(_Callback):
    """Keeps state.batch at the last finished batch of the epoch (0 at epoch end).
    After a reset, the first epoch's step count (fit's params['steps']) is
    reduced by state.batch, as Horovod does; Keras 3's fit iterates its own
    step count, so there it only informs other callbacks."""

    def __init__(self, state):
        super().__init__()
        self.state = state
        self.steps_per_epoch = None

    def on_train_begin(self, logs=None):
        self.steps_per_epoch = None

    def on_epoch_begin(self, epoch, logs=None):
        params = self.params or {}
        if params.get("steps"):
            if self.steps_per_epoch is None:
                self.steps_per_epoch = params["steps"]
            params["steps"] = self.steps_per_epoch - self.state.batch

    def on_train_batch_end(self, batch, logs=None):
        self.state.batch = batch

    def on_epoch_end(self, epoch, logs=None):
        self.state.batch = 0


class UpdateEpochStateCallback(_Callback):
    """Keeps state.epoch at the number of finished epochs, counted across
    resets (fit's epoch restarts at its initial_epoch after each)."""

    def __init__(self, state):
        super().__init__()
        self.state = state
        self.initial_epoch = self.state.epoch

    def on_train_begin(self, logs=None):
        self.initial_epoch = self.state.epoch

    def on_epoch_end(self, epoch, logs=None):
        self.state.epoch = self.initial_epoch + epoch + 1
