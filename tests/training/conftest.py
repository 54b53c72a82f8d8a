"""The training fixtures (tests/support/training.py): var_dir, engine, data, teacher_dir."""
from support.training import data, engine, teacher_dir, var_dir  # noqa: F401 (fixtures pytest finds by name)
