"""Makes tests/mpi_util.py importable from every test directory."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
