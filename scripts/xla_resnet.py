"""examples/resnet50/train.py in four variants, for the XLA comparison of
docs/XLA.md (the target: nvgroup_tf with XLA >= 95% of plain Keras with
XLA, same batch and precision):

    python scripts/xla_resnet.py MODE [train.py arguments...]

MODE  nvgroup        train.py as is (DistributedOptimizer; jit_compile="auto",
                     on where a GPU is visible)
      nvgroup-nojit  the same with every Model.compile forced to jit_compile=False
      plain          train.py with DistributedOptimizer and the nvgroup callbacks
                     replaced by the bare Keras optimizer / no-op callbacks: plain
                     Keras, same model, data, timer and batch (one rank)
      plain-nojit    plain with jit_compile=False

train.py prints its NVG_RESULT line; this script adds "NVG_MODE <mode> NVGROUP_XLA_CUDA_WAIT=<value>" first.
"""
import os
import runpy
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODES = ("nvgroup", "nvgroup-nojit", "plain", "plain-nojit")


def main():
    if len(sys.argv) < 2 or sys.argv[1] not in MODES:
        sys.exit("usage: xla_resnet.py {%s} [train.py arguments]" % ",".join(MODES))
    mode = sys.argv[1]
    print("NVG_MODE %s NVGROUP_XLA_CUDA_WAIT=%s" % (mode, os.environ.get("NVGROUP_XLA_CUDA_WAIT", "")), flush=True)
    import keras
    if mode.endswith("-nojit"):
        original = keras.Model.compile

        def compile_without_jit(self, *args, **kwargs):
            kwargs["jit_compile"] = False
            return original(self, *args, **kwargs)
        keras.Model.compile = compile_without_jit
    if mode.startswith("plain"):
        import nvgroup_tf.keras as hvd

        class NoOp(keras.callbacks.Callback):
            def __init__(self, *args, **kwargs):
                super().__init__()

        hvd.DistributedOptimizer = lambda optimizer, **kwargs: optimizer
        hvd.callbacks.BroadcastGlobalVariablesCallback = NoOp
        hvd.callbacks.MetricAverageCallback = NoOp
    sys.argv = [os.path.join(ROOT, "examples", "resnet50", "train.py")] + sys.argv[2:]
    runpy.run_path(sys.argv[0], run_name="__main__")


if __name__ == "__main__":
    main()
