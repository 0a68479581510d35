"""The catalog format: the one definition of ``catalog.json``, its shards, and how they are read
and written. ``docs/catalog.md`` specifies every field.

- :mod:`.schema`: what one catalog entry may hold, as frozen dataclasses with
  ``from_json``/``to_json`` (``Variant``, ``Target``, ``Arg``, ``Config``, ``Image``), the limits
  on their fields and the one table of scalar types. (:mod:`.reader`: its typed JSON access,
  whose errors name file and JSON path.)
- :mod:`.index`: the two files that hold the entries, the index (``catalog.json``, its
  ``ShardRef`` entries) and a shard: their shapes, names and size limits, and where they and
  the images sit in an image folder.
- :mod:`.store`: :class:`Catalog`, a whole catalog: the index read at once, the shards on demand;
  :meth:`Catalog.new` (what the builder makes), :meth:`Catalog.write`.
- :mod:`.files`: safe reads and atomic writes, and :func:`check_image`, the one check of an image
  against its catalog entry.

Every name is importable from here: ``from aotriton_rt.catalog import Catalog, Variant``.
"""

from __future__ import annotations

from .files import (
    XZ_MEMLIMIT,
    canonical_bytes,
    check_file,
    check_image,
    check_image_bytes,
    open_regular,
    parse_json,
    read_bounded,
    write_atomic,
)
from .index import (
    CATALOG_FILE,
    MAX_CATALOG_BYTES,
    MAX_INDEX_BYTES,
    MAX_SHARD_BYTES,
    SCHEMA,
    SCHEMA_VERSION,
    SHARD_FILE,
    SHARD_SCHEMA,
    ShardRef,
    image_path,
    shard_path,
)
from .schema import (
    BACKENDS,
    IMAGE_FORMATS,
    MAX_PTX,
    POINTER_SIZE,
    SCALAR_TYPES,
    TRITON_SCALARS,
    Arg,
    Config,
    Image,
    Target,
    Variant,
    is_pointer_type,
)
from .store import Catalog, index_bytes

__all__ = [
    "BACKENDS", "CATALOG_FILE", "IMAGE_FORMATS", "MAX_CATALOG_BYTES", "MAX_INDEX_BYTES", "MAX_PTX", "MAX_SHARD_BYTES",
    "POINTER_SIZE",
    "SCALAR_TYPES", "SCHEMA", "SCHEMA_VERSION", "SHARD_FILE", "SHARD_SCHEMA", "TRITON_SCALARS", "XZ_MEMLIMIT",
    "Arg", "Catalog", "Config", "Image", "ShardRef", "Target", "Variant", "canonical_bytes", "check_file",
    "check_image", "check_image_bytes", "image_path", "index_bytes", "is_pointer_type", "open_regular", "parse_json",
    "read_bounded", "shard_path", "write_atomic",
]
