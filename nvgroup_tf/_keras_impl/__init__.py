"""Keras-side internals: gradient reduction (reduce.py) and the tf_keras optimizer (legacy.py)."""
