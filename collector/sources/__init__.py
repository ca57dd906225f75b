"""Collector sources. Each samples on its own clock into its own bounded ring (collector/ring.py)."""
