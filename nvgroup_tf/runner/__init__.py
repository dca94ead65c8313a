"""nvgrouprun, the job launcher (see launch.py). Imports nothing heavy."""
