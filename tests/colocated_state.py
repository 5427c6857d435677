"""A module whose attributes colocated functions use as host state (as
JAX's tests use the colocated_python module).  Tests reset what they set."""
