"""Foundations every layer uses: errors, paths, private folders, atomic writes, sizes, bits, digests."""
