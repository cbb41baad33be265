"""Collective algorithms, each a plain function over a Transport and a 1-D contiguous buffer.

``ALGORITHMS[collective]`` lists the names ``Communicator`` accepts for ``algorithm=``.
"""

from nanoparallel.algorithms.direct import (
    all_gather_direct,
    all_reduce_one_shot,
    all_reduce_two_shot,
    all_to_all_direct,
    broadcast_direct,
    reduce_scatter_direct,
)
from nanoparallel.algorithms.rhd import all_reduce_rhd
from nanoparallel.algorithms.ring import all_gather_ring, all_reduce_ring, broadcast_ring, reduce_scatter_ring
from nanoparallel.algorithms.tree import all_reduce_tree, broadcast_tree, reduce_tree

ALL_REDUCE = {
    "ring": all_reduce_ring,
    "tree": all_reduce_tree,
    "rhd": all_reduce_rhd,
    "one_shot": all_reduce_one_shot,
    "two_shot": all_reduce_two_shot,
}
REDUCE_SCATTER = {"ring": reduce_scatter_ring, "direct": reduce_scatter_direct}
ALL_GATHER = {"ring": all_gather_ring, "direct": all_gather_direct}
BROADCAST = {"ring": broadcast_ring, "tree": broadcast_tree, "direct": broadcast_direct}
REDUCE = {"tree": reduce_tree}
ALL_TO_ALL = {"direct": all_to_all_direct}

ALGORITHMS: dict[str, tuple[str, ...]] = {
    "all_reduce": tuple(ALL_REDUCE),
    "reduce_scatter": tuple(REDUCE_SCATTER),
    "all_gather": tuple(ALL_GATHER),
    "broadcast": tuple(BROADCAST),
    "reduce": tuple(REDUCE),
    "all_to_all": tuple(ALL_TO_ALL),
}
