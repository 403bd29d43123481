"""The embedded default model: a small Ling-3.0-architecture target and its DSpark draft trained on
the Python standard library's source (`train.py`), shipped in `weights/`, loaded by `load.py`."""
