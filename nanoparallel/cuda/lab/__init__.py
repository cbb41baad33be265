"""nanoparallel.cuda's lab: diagnosis, tuning and compile reports for the GPU collectives (README.md here).

The collectives (``nanoparallel/cuda/`` outside this folder) never import this package; it imports
them. Each tool is a module with its own command line, ``python -m nanoparallel.cuda.lab.<tool>``:
``diagnose`` (where a collective's time goes: NVLink by traffic pattern, each algorithm over steps
and programs), ``nccl_info`` (what NCCL itself chose, and its algorithms and protocols pinned),
``tuning`` (turns a GPU run's result files into ``auto_tables.py``) and ``registers`` (offline
sm_90a compiles: registers per thread, programs per SM, PTX fingerprints). The benchmark
(``nanoparallel.cuda.sweep``) and the correctness check (``nanoparallel.cuda.check``) stay beside
the collectives.
"""
