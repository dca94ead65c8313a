"""Makes tests/mpi_util.py importable from every test directory."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def pytest_configure(config):
    # The fast tier skips these: python -m pytest tests/ -m "not slow".
    config.addinivalue_line("markers", "slow: a test that takes minutes on the 2-core CI machine "
                                       "(whole elastic jobs); python -m pytest -m 'not slow' skips it")
