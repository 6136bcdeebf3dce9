"""Accuracy of bundles: metrics (metrics.py), the float reference (reference.py, needs the export extra), the
built-in samples and calibration sets (samples.py), the comparison behind `vlmrt eval --reference` (accuracy.py)."""
