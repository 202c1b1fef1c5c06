"""The papers' tasks: their data, read or generated from local files only (nothing is downloaded).

- ``text``: byte-level language modelling on any file (bits per byte).
- ``listops``: Long Range Arena's ListOps, generated from its specification (accuracy).
- ``pixels``: sequential image classification from MNIST-style IDX files (accuracy).
"""
