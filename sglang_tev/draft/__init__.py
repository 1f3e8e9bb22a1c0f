"""Drafting: the DFlash drafter (dflash.py) and the DDTree best-first tree builder (ddtree.py)."""
