"""Gradient compression applied around allreduce (Horovod's Compression API).

`Compression.fp16` casts floating-point tensors to float16 before the allreduce
and back to their type after it, halving the bytes on the wire; other tensors
pass through unchanged.
"""
from __future__ import annotations

from typing import Any, Optional

import tensorflow as tf


class Compressor:
    """Interface: compress(tensor) -> (tensor, context); decompress(tensor, context)."""

    @staticmethod
    def compress(tensor: tf.Tensor) -> tuple[tf.Tensor, Any]:
        raise NotImplementedError

    @staticmethod
    def decompress(tensor: tf.Tensor, ctx: Any) -> tf.Tensor:
        raise NotImplementedError


class NoneCompressor(Compressor):
    @staticmethod
    def compress(tensor: tf.Tensor) -> tuple[tf.Tensor, None]:
        return tensor, None

    @staticmethod
    def decompress(tensor: tf.Tensor, ctx: None) -> tf.Tensor:
        return tensor


class FP16Compressor(Compressor):
    @staticmethod
    def compress(tensor: tf.Tensor) -> tuple[tf.Tensor, Optional[tf.DType]]:
        tensor = tf.convert_to_tensor(tensor)
        if tensor.dtype.is_floating and tensor.dtype != tf.float16:
            return tf.cast(tensor, tf.float16), tensor.dtype
        return tensor, None

    @staticmethod
    def decompress(tensor: tf.Tensor, ctx: Optional[tf.DType]) -> tf.Tensor:
        return tensor if ctx is None else tf.cast(tensor, ctx)


class Compression:
    none = NoneCompressor
    fp16 = FP16Compressor
