"""nanoparallel: a from-scratch collective-communication library, small enough to read in an evening.

    import nanoparallel as npl
    comm = npl.init(rank, world_size)          # store from MASTER_ADDR/MASTER_PORT, shm transport
    comm.all_reduce(x)                         # in place, algorithm chosen by the cost model
    comm.all_reduce(x, op="max", algorithm="tree")

Layout: comm.py (bootstrap, API, header check), transport/ (shared memory with NCCL's Simple and
LL protocols; torch.distributed fallback), algorithms/ (ring, double binary tree, recursive
halving/doubling, one-shot/two-shot, direct), cost_model.py (alpha-beta model and calibration),
faults.py + FAULTS.md (timeouts, liveness, mismatch), bench.py (nccl-tests style sweep).
"""

from nanoparallel.algorithms import ALGORITHMS
from nanoparallel.comm import Communicator, init
from nanoparallel.errors import CommAbortedError, CommError, CommTimeoutError, MismatchError, PeerFailureError

__all__ = [
    "ALGORITHMS",
    "CommAbortedError",
    "CommError",
    "CommTimeoutError",
    "Communicator",
    "MismatchError",
    "PeerFailureError",
    "init",
]
