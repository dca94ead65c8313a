"""A model save that dies part-way (a crash, a kill during ModelCheckpoint)
leaves the previous file whole: nvgroup_tf.keras saves `.keras` and `.h5`
model files under a temporary name and renames them into place
(nvgroup_tf/keras/compat.py, atomic_model_saves). Keras 3 alone writes in
place, and the old checkpoint is lost."""
import os

import numpy as np
import pytest

keras = pytest.importorskip("keras")


def _model(seed):
    rng = np.random.default_rng(seed)
    model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(3)])
    model.set_weights([rng.normal(size=w.shape).astype("float32") for w in model.get_weights()])
    model.compile(optimizer="sgd", loss=keras.losses.MeanSquaredError())
    return model


@pytest.mark.parametrize("ext,failing", [
    (".keras", "keras.src.saving.saving_lib._save_model_to_fileobj"),
    (".h5", "keras.src.legacy.saving.legacy_h5_format.save_weights_to_hdf5_group"),
])
def test_a_save_that_dies_leaves_the_previous_file(tmp_path, monkeypatch, ext, failing):
    import nvgroup_tf.keras  # noqa: F401  (installs the shims)
    path = str(tmp_path / ("checkpoint" + ext))
    first = _model(1)
    first.save(path)

    module_name, attr = failing.rsplit(".", 1)
    module = __import__(module_name, fromlist=[attr])
    real = getattr(module, attr)

    def dies_part_way(*args, **kwargs):
        target = args[1] if ext == ".keras" else None
        if target is not None:
            target.write(b"PK\x03\x04 part of a model")  # bytes reach the file, then the process dies
        raise RuntimeError("killed during the save")

    monkeypatch.setattr(module, attr, dies_part_way)
    with pytest.raises(RuntimeError, match="killed during the save"):
        _model(2).save(path)
    monkeypatch.setattr(module, attr, real)

    loaded = keras.models.load_model(path, compile=False)
    for got, want in zip(loaded.get_weights(), first.get_weights()):
        np.testing.assert_array_equal(got, want)
    assert sorted(os.listdir(tmp_path)) == ["checkpoint" + ext]  # no partial file left

    second = _model(3)
    second.save(path)  # a save that completes replaces the file
    for got, want in zip(keras.models.load_model(path, compile=False).get_weights(), second.get_weights()):
        np.testing.assert_array_equal(got, want)


def test_the_next_save_removes_a_killed_writers_partial_file(tmp_path):
    """SIGKILL runs no cleanup: a writer killed part-way leaves its temporary
    file. The next save of that file on the host removes it; the temporary
    file of a live writer, or of another host, stays."""
    import socket
    import subprocess
    import sys

    import nvgroup_tf.keras  # noqa: F401  (installs the shims)
    from nvgroup_tf.keras.compat import _partial_name
    host = socket.gethostname()
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True)
    dead_pid = int(dead.stdout)  # exited: its pid names no process now
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        for ext in (".keras", ".h5"):
            killed = _partial_name("checkpoint", host, dead_pid, ext)
            kept = [_partial_name("checkpoint", host, live.pid, ext),
                    _partial_name("checkpoint", "another-host", dead_pid, ext),
                    _partial_name("other", host, dead_pid, ext)]
            for name in [killed] + kept:
                (tmp_path / name).write_bytes(b"PK\x03\x04 part of a model")
            model = _model(4)
            model.save(str(tmp_path / ("checkpoint" + ext)))
            left = set(os.listdir(tmp_path))
            assert killed not in left
            assert set(kept) <= left
            for got, want in zip(keras.models.load_model(str(tmp_path / ("checkpoint" + ext)),
                                                         compile=False).get_weights(), model.get_weights()):
                np.testing.assert_array_equal(got, want)
    finally:
        live.kill()
        live.wait()
