"""Keras callbacks for data-parallel training (Horovod's names and semantics).

They subclass `tf.keras.callbacks.Callback`, which is Keras 3 normally and
tf_keras under TF_USE_LEGACY_KERAS=1, so one module serves both.

  * BroadcastGlobalVariablesCallback(root_rank): every rank starts from rank
    root_rank's weights and optimizer state.
  * MetricAverageCallback(): epoch-end metrics (logs) averaged over ranks.
  * LearningRateScheduleCallback(initial_lr, multiplier, ...): lr =
    initial_lr * multiplier(epoch) inside [start_epoch, end_epoch); a number
    m as multiplier means m ** (epoch - start_epoch).
  * LearningRateWarmupCallback(initial_lr, warmup_epochs, ...): lr ramps from
    initial_lr / size to initial_lr over warmup_epochs ("Accurate, Large
    Minibatch SGD", Goyal et al. 2017, as Horovod does).
"""
from __future__ import annotations

from typing import Callable, Optional, Sequence, Union

import numpy as np
import tensorflow as tf

import nvgroup_tf as core

_Callback = tf.keras.callbacks.Callback


def _optimizer_variables(optimizer):
    variables = optimizer.variables
    return list(variables() if callable(variables) else variables)


def _optimizer_built(optimizer):
    if hasattr(optimizer, "built"):          # Keras 3
        return bool(optimizer.built)
    return bool(_optimizer_variables(optimizer))  # tf_keras: slots exist after the first step


def _variables_to_broadcast(model):
    """The model's variables less Keras 3's random-seed states.

    Keras 3 keeps each SeedGenerator's state (dropout, random augmentation) in a
    variable among model.variables. Broadcasting it would give every rank the
    same dropout masks; each data-parallel replica should draw its own, as with
    Horovod on Keras 2 (which had no such variables). The list is the same on
    every rank, so the broadcast stays matched.
    """
    return [v for v in model.variables
            if not getattr(v, "path", "").endswith("seed_generator_state")]


class BroadcastGlobalVariablesCallback(_Callback):
    """Makes every rank start from root_rank's model and optimizer state.

    What exists at on_train_begin is broadcast then, so a model built before
    fit (an `Input`, or built by hand) takes identical first steps on all
    ranks. Keras 3 builds a subclassed model, a Sequential without `Input` and
    an optimizer lazily inside the first train step: whatever was not yet
    broadcast is broadcast at the end of the first batch (as Horovod does
    there for everything), so from the second step on all ranks hold
    root_rank's values. If no variable at all could be broadcast by then,
    training stops with an error instead of letting ranks diverge silently.

    local_variables: variables left per rank (Horovod's argument, e.g. the
    weights of a PartialDistributedOptimizer's local layers); the optimizer's
    slots of those variables stay local too.
    """

    def __init__(self, root_rank: int = 0, device: str = "",
                 local_variables: Optional[Sequence[tf.Variable]] = None) -> None:
        super().__init__()
        self.root_rank = root_rank
        self.device = device
        self.local_variables = list(local_variables or [])
        self.broadcast_done = False
        self._done_ids = set()   # id() of every variable broadcast so far
        self._rounds = 0

    def _local_ids(self):
        ids = {id(v) for v in self.local_variables}
        optimizer = getattr(self.model, "optimizer", None)
        ids |= {id(v) for v in getattr(optimizer, "_nvg_local_vars", ())}
        # The optimizer's slot variables of local variables are local as well.
        for v in self._optimizer_slots_of(optimizer, [v for v in self.local_variables] +
                                          list(getattr(optimizer, "_nvg_local_vars", ()))):
            ids.add(id(v))
        return ids

    @staticmethod
    def _optimizer_slots_of(optimizer, variables):
        if optimizer is None or not variables:
            return []
        inner = getattr(optimizer, "inner_optimizer", optimizer)
        index = getattr(inner, "_get_variable_index", None)
        slots = []
        if index is not None and getattr(inner, "built", False):  # Keras 3: slots are kept per variable index
            trainable = list(getattr(inner, "_trainable_variables", []))
            wanted = {id(v) for v in variables}
            positions = [i for i, v in enumerate(trainable) if id(v) in wanted]
            for attr in vars(inner).values():
                if isinstance(attr, list) and len(attr) == len(trainable) and attr is not trainable:
                    slots.extend(attr[i] for i in positions if hasattr(attr[i], "assign"))
        return slots

    def _pending(self):
        local = self._local_ids()
        candidates = list(_variables_to_broadcast(self.model))
        optimizer = getattr(self.model, "optimizer", None)
        if optimizer is not None and _optimizer_built(optimizer):
            candidates += _optimizer_variables(optimizer)
        seen, out = set(), []
        for v in candidates:
            if id(v) in seen or id(v) in self._done_ids or id(v) in local:
                continue
            seen.add(id(v))
            out.append(v)
        return out

    def _broadcast(self):
        pending = self._pending()
        if pending:
            with tf.device(self.device):
                core.broadcast_variables(pending, self.root_rank,
                                         name="nvg_bcast_variables.round%d" % self._rounds)
            self._rounds += 1
            self._done_ids.update(id(v) for v in pending)

    def on_train_begin(self, logs=None):
        if not self.broadcast_done:
            self._broadcast()

    def on_train_batch_end(self, batch, logs=None):
        if self.broadcast_done:
            return
        self._broadcast()
        if not self._done_ids:
            raise RuntimeError(
                "BroadcastGlobalVariablesCallback: nothing was broadcast (the model has no "
                "variables after its first batch, or all of them are local_variables); ranks "
                "would train different models")
        self.broadcast_done = True


class MetricAverageCallback(_Callback):
    """Replaces each numeric entry of the epoch-end logs by its average over
    ranks (one allreduce of all metrics, in sorted-name order, so every rank
    sends the same layout). Place it before callbacks that read the metrics."""

    def __init__(self, device: str = "") -> None:
        super().__init__()
        self.device = device

    def on_epoch_end(self, epoch, logs=None):
        if not logs:
            return
        names = sorted(k for k, v in logs.items() if np.ndim(v) == 0 and np.issubdtype(np.asarray(v).dtype, np.number))
        if not names:
            return
        values = tf.constant([float(logs[k]) for k in names], dtype=tf.float64)
        with tf.device(self.device):
            averaged = core.allreduce(values, op=core.Average, name="nvg_metric_average")
        for k, v in zip(names, averaged.numpy().tolist()):
            logs[k] = v


def _get_lr(optimizer):
    lr = optimizer.learning_rate
    return float(lr.numpy() if hasattr(lr, "numpy") else lr)


class LearningRateScheduleCallback(_Callback):
    """lr = initial_lr * multiplier(epoch) for start_epoch <= epoch < end_epoch.

    multiplier: a function of the epoch, or a number m, which means
    m ** (epoch - start_epoch) (exponential decay, as Horovod). staircase=True changes
    the lr at epoch starts (integer epochs); staircase=False every batch, with
    the fractional epoch epoch + batch / steps_per_epoch (steps_per_epoch is
    taken from fit's params when not given). momentum_correction scales the
    momentum by new_lr / old_lr for the batch in which the lr changed (Goyal et
    al.) when the optimizer's momentum is a variable (tf_keras); a Keras 3
    optimizer's momentum is a Python float baked into the compiled step, so
    there it is left alone.
    """

    def __init__(self, initial_lr: float, multiplier: Union[float, Callable[[float], float]],
                 start_epoch: int = 0, end_epoch: Optional[int] = None, staircase: bool = True,
                 momentum_correction: bool = True, steps_per_epoch: Optional[int] = None,
                 verbose: int = 0) -> None:
        super().__init__()
        self.initial_lr = float(initial_lr)
        if callable(multiplier):
            self.multiplier = multiplier
        else:  # a number: exponential decay from start_epoch, as Horovod's
            self.multiplier = lambda epoch: multiplier ** (epoch - start_epoch)
        self.start_epoch = start_epoch
        self.end_epoch = end_epoch
        self.staircase = staircase
        self.momentum_correction = momentum_correction
        self.steps_per_epoch = steps_per_epoch
        self.verbose = verbose
        self.current_epoch = None
        self._restore_momentum = None

    def _in_range(self, epoch):
        return epoch >= self.start_epoch and (self.end_epoch is None or epoch < self.end_epoch)

    def _adjust(self, epoch):
        optimizer = self.model.optimizer
        old_lr = _get_lr(optimizer)
        new_lr = self.initial_lr * float(self.multiplier(epoch))
        optimizer.learning_rate = new_lr
        momentum = getattr(optimizer, "momentum", None)
        if self.momentum_correction and old_lr > 0 and hasattr(momentum, "assign"):
            self._restore_momentum = float(momentum.numpy())
            momentum.assign(self._restore_momentum * new_lr / old_lr)

    def on_train_begin(self, logs=None):
        if self.steps_per_epoch is None:
            self.steps_per_epoch = (self.params or {}).get("steps")
        if not self.staircase and not self.steps_per_epoch:
            raise ValueError("%s: staircase=False needs steps_per_epoch (fit did not report it)"
                             % type(self).__name__)

    def on_epoch_begin(self, epoch, logs=None):
        self.current_epoch = epoch

    def on_train_batch_begin(self, batch, logs=None):
        epoch = self.current_epoch
        if epoch is None or not self._in_range(epoch):
            return
        if self.staircase:
            if batch == 0:
                self._adjust(epoch)
        else:
            self._adjust(epoch + float(batch) / self.steps_per_epoch)

    def on_train_batch_end(self, batch, logs=None):
        if self._restore_momentum is not None:
            self.model.optimizer.momentum.assign(self._restore_momentum)
            self._restore_momentum = None

    def on_epoch_end(self, epoch, logs=None):
        if logs is not None:
            logs["lr"] = _get_lr(self.model.optimizer)


class LearningRateWarmupCallback(LearningRateScheduleCallback):
    """Gradual warmup: lr goes from initial_lr / size to initial_lr over
    warmup_epochs, per batch. At fractional epoch e (counted so each epoch ends
    on a round number: e = epoch + (batch + 1) / steps_per_epoch), the
    multiplier is (e * (size - 1) / warmup_epochs + 1) / size."""

    def __init__(self, initial_lr: float, warmup_epochs: int = 5, momentum_correction: bool = True,
                 steps_per_epoch: Optional[int] = None, verbose: int = 0) -> None:
        def multiplier(epoch):
            epoch += 1.0 / self.steps_per_epoch
            n = core.size()
            return 1.0 / n * (epoch * (n - 1) / warmup_epochs + 1)

        super().__init__(initial_lr, multiplier, start_epoch=0, end_epoch=warmup_epochs, staircase=False,
                         momentum_correction=momentum_correction, steps_per_epoch=steps_per_epoch,
                         verbose=verbose)
        self.warmup_epochs = warmup_epochs

    def on_epoch_end(self, epoch, logs=None):
        super().on_epoch_end(epoch, logs)
        if epoch == self.end_epoch - 1 and self.verbose > 0 and core.rank() == 0:
            print("\nEpoch %d: finished gradual learning rate warmup to %g." % (epoch + 1, _get_lr(self.model.optimizer)))


# ---- BestModelCheckpoint ----------------------------------------------------

class BestModelCheckpoint(tf.keras.callbacks.ModelCheckpoint):
    """ModelCheckpoint that keeps only the best model (save_best_only=True),
    Horovod's hvd.callbacks.BestModelCheckpoint. Horovod leaves `filepath` unset
    for its Spark estimator to fill in; here it may also be given (a keyword
    Horovod lacks), or assigned to `.filepath` before fit. Every rank that
    runs it writes: pass it on rank 0 only unless the path differs per rank.
    """

    def __init__(self, monitor: str = "val_loss", verbose: int = 0, save_weights_only: bool = False,
                 mode: str = "auto", save_freq: Union[str, int] = "epoch",
                 filepath: Optional[str] = None) -> None:
        # Keras 3 checks the file suffix in the constructor; an unset path is
        # checked when training starts instead.
        placeholder = "best_model.weights.h5" if save_weights_only else "best_model.keras"
        super().__init__(filepath=filepath if filepath is not None else placeholder,
                         monitor=monitor, verbose=verbose, save_best_only=True,
                         save_weights_only=save_weights_only, mode=mode, save_freq=save_freq)
        if filepath is None:
            self.filepath = None

    def on_train_begin(self, logs=None):
        if self.filepath is None:
            raise ValueError("BestModelCheckpoint: set filepath (BestModelCheckpoint(filepath=...) "
                             "or callback.filepath = ...) before training")
        parent = getattr(super(), "on_train_begin", None)
        if parent is not None:
            parent(logs)
