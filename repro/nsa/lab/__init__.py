"""The NSA lab: sweeps, diagnosis and compile reports, on top of ``paperclub.bench`` and ``paperclub.lab``.
Nothing in the fast path imports it.

* ``breakdown``: the forward timed stage by stage at one length (GPU).
* ``slc_backward``: the selected branch's backwards and launch shapes against fla's (GPU).
* ``strided_sweep``: the strided forward's loops (one masked, or split) and tiles, both branches (GPU).
* ``sm90_check``: every kernel launch compiled offline for sm_90a, registers and spills (no GPU).
* ``fingerprints``: offline PTX / SASS fingerprints of every launch, to show a change of files left the
  kernels as they were (no GPU); ``launches`` records the launches both of these compile.
"""
