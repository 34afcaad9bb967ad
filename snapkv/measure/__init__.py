"""Measurements through the front door (snapkv.session): bench, eval, fidelity, the decode floor."""
