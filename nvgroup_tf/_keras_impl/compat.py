"""Keras 3 shims for what Horovod programs pass to Keras.

`Model.compile(..., experimental_run_tf_function=False)`: Horovod's Keras
examples and docs tell every user to pass it (so that TF 2.0's Keras computed
gradients through the optimizer, and so through DistributedOptimizer). tf.keras
accepted it, obsolete and ignored, from TF 2.2 on; Keras 3 (tf.keras in
TF >= 2.16) rejects it with a TypeError, so a Horovod script stops before it
trains. In Keras 3 the train step always hands the gradients to the
optimizer's apply, where DistributedOptimizer reduces them, so the argument
has nothing left to choose: the shim accepts it and drops it, as tf.keras did.
Every other argument reaches Keras unchanged (an unknown one still fails as
Keras says).

Installed once per process, when nvgroup_tf.keras is imported or a
DistributedOptimizer wraps a Keras 3 optimizer; a Keras whose compile takes
the argument itself is left alone.
"""
import functools
import inspect

OBSOLETE_COMPILE_ARGUMENTS = ("experimental_run_tf_function",)


def accept_obsolete_compile_arguments():
    import keras
    compile_fn = keras.Model.compile
    if getattr(compile_fn, "_nvg_accepts_obsolete", False):
        return
    try:
        parameters = inspect.signature(compile_fn).parameters
    except (TypeError, ValueError):
        return
    if all(name in parameters for name in OBSOLETE_COMPILE_ARGUMENTS):
        return

    @functools.wraps(compile_fn)
    def compile(self, *args, **kwargs):
        for name in OBSOLETE_COMPILE_ARGUMENTS:
            if name not in parameters:
                kwargs.pop(name, None)
        return compile_fn(self, *args, **kwargs)

    compile._nvg_accepts_obsolete = True
    keras.Model.compile = compile
