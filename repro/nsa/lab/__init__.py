"""The NSA lab: sweeps, diagnosis and compile reports, on top of ``paperclub.bench`` and ``paperclub.lab``.
Nothing in the fast path imports it.

* ``breakdown``: the forward timed stage by stage at one length (GPU).
* ``slc_backward``: the selected branch's backwards and launch shapes against fla's (GPU).
* ``strided_sweep``: the strided forward's loops (one masked, or split) and tiles, both branches (GPU).
* ``sm90_check``: every kernel launch compiled offline for sm_90a, registers and spills (no GPU).
* ``fingerprints``: offline PTX / SASS fingerprints of every launch, to show a change of files left the
  kernels as they were (no GPU); ``launches`` records the launches both of these compile.
* ``fixed_costs``: the launches and PyTorch ops of one layer forward and backward, their bytes and any
  host wait, counted on CPU tensors (no GPU).
* ``decode_host``: the host time of one decode step with the kernels stubbed, this layout or the one
  before the stage split (no GPU).
"""
