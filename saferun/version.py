"""saferun's version, in its own module so that modules recording it (checkpoints) need not import
the package root."""

__version__ = "0.1.0"
