"""fa4's lab: tuning sweeps, offline compile reports, GPU diagnosis and profiling (see README.md here).

Nothing in ``repro.fa4``'s kernels or entry points imports this package; it imports them. Each tool
is a module with its own ``python -m repro.fa4.lab.<tool>`` command line.
"""
