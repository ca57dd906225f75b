"""The per-node collector: sources -> bounded rings -> one node-local HDF5 trace (docs/trace-format.md).

Also the suite's base layer, which the other packages import and which imports none of them: the
config file (config.py), the environment variables read anywhere (environment.py), the exception
classes (errors.py) and the version.
"""

__version__ = "0.1.0"
