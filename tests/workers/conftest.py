"""The training fixtures (tests/support/training.py): var_dir, engine, data."""
from support.training import data, engine, var_dir  # noqa: F401 (fixtures pytest finds by name)
