"""The megablocks lab: tile and launch settings timed against one another, on top of ``paperclub.bench``.
Nothing in the fast path imports it.

* ``tuning``: our two dMoE paths under other ``kernels.GPU_CONFIG`` settings, beside torch._grouped_mm
  (GPU; the rows the bench adds after its main table, or before it with ``--tune-first``).
"""
