"""A tensor-parallel rank > 0 as its own process: ``python -m pdserve.engine.tensor_parallel.rank
FD RANK``, started by TPGroup with one end of a socket pair as FD (group.py worker_main)."""

import logging
import sys
from multiprocessing.connection import Connection

from pdserve.engine.tensor_parallel.group import worker_main

if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s tp-rank{sys.argv[2]} %(levelname)s %(message)s")
    worker_main(Connection(int(sys.argv[1])), int(sys.argv[2]))
