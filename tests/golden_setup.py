"""Makes tools/jax_golden importable and registers its pytree types and
testing effects once per process (the golden payloads use them)."""

import os
import sys

TOOLS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(
    __file__))), "tools", "jax_golden")
if TOOLS not in sys.path:
    sys.path.insert(0, TOOLS)

import golden_types  # noqa: E402
import verify_golden  # noqa: E402

golden_types.register_serialization()
golden_types.setup_testing_effects()
