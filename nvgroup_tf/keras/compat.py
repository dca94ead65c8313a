"""Keras 3 shims for what Horovod programs do with Keras (the README's
migration section lists them), each described where it is defined:

* `Model.compile(..., experimental_run_tf_function=False)`, which Horovod's
  Keras examples and docs tell every user to pass (so that TF 2.0's Keras
  computed gradients through the optimizer, and so through
  DistributedOptimizer). tf.keras accepted it, obsolete and ignored, from
  TF 2.2 on; Keras 3 (tf.keras in TF >= 2.16) rejects it with a TypeError, so
  a Horovod script stops before it trains. In Keras 3 the train step always
  hands the gradients to the optimizer's apply, where DistributedOptimizer
  reduces them, so the argument has nothing left to choose: the shim accepts
  it and drops it, as tf.keras did. Every other argument reaches Keras
  unchanged (an unknown one still fails as Keras says). A Keras whose compile
  takes the argument is left alone.
* Resuming from a legacy .h5 checkpoint (restore_hdf5_optimizer, which
  nvgroup_tf.keras.load_model calls).
* `opt.variables()` and `opt.lr` (keras2_optimizer_attributes), and tf.keras
  2's `lr=` constructor argument (keras2_lr_argument).
* `v.ref()` on Keras 3 variables (variable_ref).
* Whole-file saves (atomic_model_saves): Keras 3 writes a `.keras` or `.h5`
  model file in place, so a process killed during `model.save` (or
  `ModelCheckpoint`) leaves a torn file and the last good checkpoint is gone.

install() puts in every other shim that applies, once per process; it runs when
nvgroup_tf.keras is imported and when a DistributedOptimizer or
DistributedGradientTape is made.
"""
import functools
import inspect

import numpy as np

OBSOLETE_COMPILE_ARGUMENTS = ("experimental_run_tf_function",)


_compile_shim_installed = False


def accept_obsolete_compile_arguments():
    # On Trainer.compile, where nvgroup_tf's other compile hook lives
    # (optimizer.py, _install_keras_hooks): each wraps what it finds there, so
    # both run whichever is installed first.
    from keras.src.trainers import trainer as keras_trainer
    global _compile_shim_installed
    if _compile_shim_installed:
        return
    _compile_shim_installed = True
    compile_fn = keras_trainer.Trainer.compile
    try:
        parameters = inspect.signature(inspect.unwrap(compile_fn)).parameters
    except (TypeError, ValueError):
        return
    dropped = tuple(name for name in OBSOLETE_COMPILE_ARGUMENTS if name not in parameters)
    if not dropped:
        return

    @functools.wraps(compile_fn)
    def compile(self, *args, **kwargs):
        for name in dropped:
            kwargs.pop(name, None)
        return compile_fn(self, *args, **kwargs)

    keras_trainer.Trainer.compile = compile


# Legacy HDF5 checkpoints (`ModelCheckpoint('checkpoint-{epoch}.h5')`, as
# Horovod's Keras examples write them). Keras 3's .h5 loader builds the
# restored optimizer on `model._trainable_variables`, which for a Sequential or
# functional model is the model's *own* variables (none), not its layers'; the
# saved moments then do not fit, Keras logs "starting with a freshly
# initialized optimizer", and the first train step fails with "Unknown
# variable ... This optimizer can only be called for the variables it was
# originally built with" (plain keras.models.load_model alike). load_model
# (nvgroup_tf.keras) rebuilds the optimizer on model.trainable_variables -- the
# order the saving optimizer was built in -- and sets the saved values.


def is_hdf5_path(filepath):
    path = str(filepath)
    if path.endswith((".h5", ".hdf5")):
        return True
    try:
        import h5py
        return bool(h5py.is_hdf5(path))
    except (ImportError, OSError, TypeError):
        return False


def _saved_optimizer_values(filepath):
    import h5py
    from keras.src.legacy.saving import legacy_h5_format
    with h5py.File(str(filepath), "r") as f:
        if "optimizer_weights" not in f:
            return None
        # h5py datasets: read them before the file closes.
        return [np.asarray(v) for v in legacy_h5_format.load_optimizer_weights_from_hdf5_group(f)]


def restore_hdf5_optimizer(model, filepath):
    """Returns the model with its optimizer rebuilt on the model's trainable
    variables and its saved state set, when Keras' .h5 loader left it built on
    other variables; a model whose optimizer already covers them is returned
    as is. Raises ValueError when the saved state does not fit the rebuilt
    optimizer (the file's model and optimizer disagree)."""
    optimizer = getattr(model, "optimizer", None)
    if optimizer is None or not getattr(optimizer, "built", False):
        return model
    known = {id(v) for v in getattr(optimizer, "_trainable_variables", [])}
    if all(id(v) in known for v in model.trainable_variables):
        return model
    values = _saved_optimizer_values(filepath)
    fresh = type(optimizer).from_config(optimizer.get_config())
    for attr in ("_nvg_sync",):  # a DistributedOptimizer's reduction settings
        if hasattr(optimizer, attr):
            setattr(fresh, attr, getattr(optimizer, attr))
    fresh.build(model.trainable_variables)
    if values is not None:
        slots = fresh.variables
        if len(values) != len(slots) or any(tuple(v.shape) != tuple(s.shape) for v, s in zip(values, slots)):
            raise ValueError(
                "load_model(%r): the saved optimizer state (%d arrays) does not fit %s built on the "
                "model's %d trainable variables (%d arrays)" % (
                    str(filepath), len(values), type(fresh).__name__, len(model.trainable_variables),
                    len(slots)))
        fresh.set_weights(values)
    model.optimizer = fresh
    model.train_function = None
    return model


# tf.keras 2 spellings on Keras 3 optimizers, as Horovod's TF2 and elastic
# examples use them:
#  * `opt.variables()`: tf.keras 2's optimizers had a variables() method; Keras
#    3's have a `variables` property returning a list, so the call fails with
#    "'list' object is not callable". The property is made to return a list
#    that can also be called (returning a plain copy): both spellings work.
#  * `opt.lr` (`opt.lr.assign(x)`, `tf.keras.backend.set_value(opt.lr, x)` in
#    the elastic examples' reset callbacks): Keras 3 has only `learning_rate`.
#    `lr` reads the learning rate's TF variable (what tf.keras 2 returned, and
#    what tf.keras.backend.set_value can assign; the Keras variable wrapping it
#    sees the change) or the schedule; setting it sets `learning_rate`.
# An optimizer class that has `lr` itself keeps it.


class CallableVariableList(list):
    """A Keras 3 optimizer's `variables` (a list) that `variables()` also reads."""

    def __call__(self):
        return list(self)


_optimizer_shims_installed = False


def keras2_optimizer_attributes():
    global _optimizer_shims_installed
    if _optimizer_shims_installed:
        return
    _optimizer_shims_installed = True
    try:
        from keras.src.optimizers import base_optimizer, loss_scale_optimizer
    except ImportError:  # no Keras 3
        return
    classes = [base_optimizer.BaseOptimizer, loss_scale_optimizer.LossScaleOptimizer]
    try:
        from keras.src.optimizers import multi_optimizer
        classes.append(multi_optimizer.MultiOptimizer)
    except ImportError:
        pass
    for cls in classes:
        prop = cls.__dict__.get("variables")
        if isinstance(prop, property) and prop.fget is not None:
            cls.variables = _callable_property(prop)
    base = base_optimizer.BaseOptimizer
    if not hasattr(base, "lr"):
        base.lr = property(_get_lr, _set_lr, doc="tf.keras 2's alias of learning_rate (nvgroup_tf)")


def _callable_property(prop):
    fget = prop.fget

    @functools.wraps(fget)
    def variables(self):
        return CallableVariableList(fget(self))

    return property(variables, prop.fset, prop.fdel, prop.__doc__)


def _get_lr(self):
    from keras.src import backend
    rate = self._learning_rate
    if isinstance(rate, backend.Variable):
        return rate.value  # the TF variable itself
    return rate


def _set_lr(self, value):
    self.learning_rate = value


# `lr=` in optimizer constructors (`keras.optimizers.SGD(lr=0.1)`, as older
# Horovod Keras examples write it): tf.keras 2 took it as learning_rate, with a
# deprecation warning, and `lr` won over `learning_rate`; Keras 3 raises
# "Argument(s) not recognized: {'lr': ...}". Every Keras 3 optimizer hands its
# unknown keyword arguments to BaseOptimizer.__init__, so one wrapper there
# does what tf.keras 2 did, warning the same way. Passing both is an error.

_lr_shim_installed = False


def keras2_lr_argument():
    global _lr_shim_installed
    if _lr_shim_installed:
        return
    _lr_shim_installed = True
    try:
        from keras.src.optimizers import base_optimizer
    except ImportError:  # no Keras 3
        return
    base = base_optimizer.BaseOptimizer
    init = base.__init__
    try:
        if "lr" in inspect.signature(inspect.unwrap(init)).parameters:
            return  # a Keras that takes lr itself
    except (TypeError, ValueError):
        return

    @functools.wraps(init)
    def __init__(self, learning_rate, *args, **kwargs):
        if "lr" in kwargs:
            import warnings
            warnings.warn("The `lr` argument is deprecated, use `learning_rate` instead.", UserWarning,
                          stacklevel=3)
            learning_rate = kwargs.pop("lr")
        return init(self, learning_rate, *args, **kwargs)

    base.__init__ = __init__


# `v.ref()` on Keras 3 variables. Horovod's API works with variable references
# (`hvd.vars_to_refs`, the `v.ref()` sets of local variables that
# PartialDistributedOptimizer / PartialDistributedGradientTape keep, code
# testing `v.ref() in opt._local_vars`); a tf.keras 2 variable was a
# tf.Variable and had `ref()`, a Keras 3 variable holds one and has not. The
# shim returns the reference of the tf.Variable it holds -- what that
# variable's own `ref()` returns, so both spellings name the same variable
# and `.deref()` gives the tf.Variable. A Keras whose Variable has `ref` is left alone.

_ref_shim_installed = False


def variable_ref():
    global _ref_shim_installed
    if _ref_shim_installed:
        return
    _ref_shim_installed = True
    try:
        from keras.src.backend.common import variables
    except ImportError:  # no Keras 3
        return
    cls = variables.Variable
    if hasattr(cls, "ref"):
        return

    def ref(self):
        """The reference of the tf.Variable this Keras variable holds (tf.Variable.ref())."""
        held = getattr(self, "_value", None)
        if held is None or not hasattr(held, "ref"):
            raise ValueError("%s.ref(): the variable %r holds no TensorFlow variable yet (not "
                             "initialized, or not the TensorFlow backend)" % (type(self).__name__,
                                                                              getattr(self, "path", self)))
        return held.ref()

    cls.ref = ref


_atomic_saves_installed = False


def _partial_name(stem, host, pid, ext):
    """The temporary name a save of `<stem><ext>` writes first (host and pid
    say whose it is, so a sweep on another host sharing the directory leaves
    it alone)."""
    return ".%s.%s.%d.partial%s" % (stem, host, pid, ext)


def _remove_dead_writers_partials(head, stem, ext):
    """Removes the temporary files beside `<stem><ext>` whose writer, a process
    of this host, is gone (killed while saving: SIGKILL runs no cleanup). A
    partial file of a live process, or of another host, is left alone."""
    import os
    import re
    import socket
    host = socket.gethostname()
    pattern = re.compile(r"^\.%s\.%s\.(\d+)\.partial%s$" % (re.escape(stem), re.escape(host), re.escape(ext)))
    try:
        names = os.listdir(head or ".")
    except OSError:
        return
    for name in names:
        m = pattern.match(name)
        if not m:
            continue
        pid = int(m.group(1))
        try:
            os.kill(pid, 0)
            continue  # alive (or a pid now reused): not ours to remove
        except ProcessLookupError:
            pass
        except OSError:  # alive under another user
            continue
        try:
            os.remove(os.path.join(head, name))
        except FileNotFoundError:
            pass


def _saved_then_renamed(save):
    """`save(model, filepath, *args)` written to a temporary file beside
    filepath, then renamed over it (os.replace is atomic on POSIX within one
    file system): a reader, or a resume after a crash, sees the old file or the
    new one, never a part of one. A writer killed part-way leaves its
    temporary file; the next save of that file on the host removes it
    (_remove_dead_writers_partials). Paths Keras handles otherwise (file
    objects, remote or hub paths, directories) are left to it."""
    import os
    import socket

    @functools.wraps(save)
    def wrapper(model, filepath, *args, **kwargs):
        if not isinstance(filepath, (str, os.PathLike)) or "://" in str(filepath):
            return save(model, filepath, *args, **kwargs)
        path = os.fspath(filepath)
        head, tail = os.path.split(path)
        stem, ext = os.path.splitext(tail)
        _remove_dead_writers_partials(head, stem, ext)
        temp = os.path.join(head, _partial_name(stem, socket.gethostname(), os.getpid(), ext))
        try:
            result = save(model, temp, *args, **kwargs)
            os.replace(temp, path)
        except BaseException:
            if os.path.exists(temp):
                os.remove(temp)
            raise
        return result

    wrapper._nvgroup_atomic = True
    return wrapper


def atomic_model_saves():
    """`.keras` (saving_lib.save_model, zipped) and `.h5`
    (legacy_h5_format.save_model_to_hdf5) model files are written under a
    temporary name and renamed into place (_saved_then_renamed)."""
    global _atomic_saves_installed
    if _atomic_saves_installed:
        return
    _atomic_saves_installed = True
    try:
        from keras.src.legacy.saving import legacy_h5_format
        from keras.src.saving import saving_lib
    except ImportError:  # not Keras 3
        return
    original = saving_lib.save_model

    @functools.wraps(original)
    def save_model(model, filepath, weights_format="h5", zipped=True):
        if not zipped:  # a directory: left to Keras
            return original(model, filepath, weights_format, zipped)
        return atomic(model, filepath, weights_format, zipped)

    atomic = _saved_then_renamed(original)
    if not getattr(saving_lib.save_model, "_nvgroup_atomic", False):
        save_model._nvgroup_atomic = True
        saving_lib.save_model = save_model
    h5 = legacy_h5_format.save_model_to_hdf5
    if not getattr(h5, "_nvgroup_atomic", False):
        legacy_h5_format.save_model_to_hdf5 = _saved_then_renamed(h5)


def install():
    """Every shim of this module that applies to the Keras in use (once each)."""
    accept_obsolete_compile_arguments()
    atomic_model_saves()
    keras2_optimizer_attributes()
    keras2_lr_argument()
    variable_ref()
