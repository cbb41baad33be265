"""dflash's lab: the toy-scale experiments behind the orderings that claims.yaml registers (DFlash's KV
injection against input fusion, drafter depth, the EAGLE-3-style drafter with and without training-time
test), rerun seed by seed on a CPU. Nothing in ``repro.dflash`` imports this package; it imports them.
"""
