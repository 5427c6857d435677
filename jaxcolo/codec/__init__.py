"""Per-type codecs.  Importing this package registers every table and leaf."""

from jaxcolo.codec import core  # noqa: F401
from jaxcolo.codec import dtypes, pytree, mesh, sharding, aval, effects  # noqa: F401
from jaxcolo.codec import spec_tree  # noqa: F401
