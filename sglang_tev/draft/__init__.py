"""Drafting: the DFlash drafter (the dflash/ package; DFlash2's pieces in dflash2.py), the DDTree
best-first tree builder (ddtree.py) and the DFlash2 lattice trees (lattice.py)."""
