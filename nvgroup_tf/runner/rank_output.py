"""Per-rank logs for `nvgrouprun --output-filename DIR` (horovodrun's layout):

    python rank_output.py DIR WIDTH -- command args...

finds this process's rank in the launcher's variables (RANK_VARIABLES below:
Open MPI, PMIx, PMI/Hydra, Slurm, jsrun), creates DIR/rank.<rank zero-padded to
WIDTH>/, points stdout and stderr at `stdout` and `stderr` files there and execs
the command (same process, same pid, exit code passes through). Imports nothing
from nvgroup_tf.
"""
import os
import sys

RANK_VARIABLES = ("OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK", "SLURM_PROCID",
                  "JSM_NAMESPACE_RANK")


def main(argv):
    if len(argv) < 4 or argv[2] != "--" or not argv[1].isdigit():
        sys.stderr.write("usage: rank_output.py DIR WIDTH -- command args...\n")
        return 2
    directory, width, command = argv[0], int(argv[1]), argv[3:]
    rank = next((os.environ[v] for v in RANK_VARIABLES if os.environ.get(v, "").isdigit()), None)
    if rank is None:
        sys.stderr.write("nvgrouprun --output-filename: no rank variable set (looked for %s)\n"
                         % ", ".join(RANK_VARIABLES))
        return 2
    rank_dir = os.path.join(directory, "rank.%s" % rank.zfill(width))
    os.makedirs(rank_dir, exist_ok=True)
    for fd, name in ((1, "stdout"), (2, "stderr")):
        f = os.open(os.path.join(rank_dir, name), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(f, fd)
        os.close(f)
    try:
        os.execvp(command[0], command)
    except OSError as e:
        sys.stderr.write("nvgrouprun --output-filename: cannot run %s: %s\n" % (command[0], e))
        return 127


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
