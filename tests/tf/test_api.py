"""Multi-rank tests of Horovod's Python-level API: the small
API (topology ops, flags, util helpers, broadcast_global_variables, object
helpers in graphs, IndexedSlices, timeline control), SyncBatchNormalization
(Keras 3 and tf_keras), and the elastic state API with BestModelCheckpoint.
Each launch batches many checks (see the workers' docstrings)."""
import os

import pytest

from mpi_util import run_mpi

WORKERS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "workers")


def worker(name):
    return os.path.join(WORKERS, name)


@pytest.mark.parametrize("ranks", [2, 3])
def test_small_api(ranks, tmp_path):
    result = run_mpi(worker("api_small.py"), ranks, args=[tmp_path], timeout=420)
    assert result.output.count(" 0 failures") == ranks


@pytest.mark.parametrize("ranks", [2, 3])
def test_sync_batch_norm_keras3(ranks):
    result = run_mpi(worker("syncbn.py"), ranks, timeout=420)
    assert result.output.count(" 0 failures") == ranks


def test_sync_batch_norm_tf_keras():
    result = run_mpi(worker("syncbn.py"), 2, env={"TF_USE_LEGACY_KERAS": "1"}, timeout=420)
    assert result.output.count(" 0 failures") == 2


@pytest.mark.parametrize("ranks", [2, 3])
def test_elastic_and_best_checkpoint(ranks, tmp_path):
    result = run_mpi(worker("elastic_worker.py"), ranks, args=[tmp_path], timeout=420)
    assert result.output.count(" 0 failures") == ranks


def test_elastic_and_best_checkpoint_tf_keras(tmp_path):
    result = run_mpi(worker("elastic_worker.py"), 2, args=[tmp_path],
                     env={"TF_USE_LEGACY_KERAS": "1"}, timeout=420)
    assert result.output.count(" 0 failures") == 2
