"""NOIMAGE mode, the public API: fetch, install and verify image bundles.

A runtime package can ship without images; these functions install them per GPU target from a
published folder (``index.json`` plus one ``.tar`` bundle per target or family, made by
``python -m builder pack``) or from a local bundle file. ``docs/noimage.md`` specifies the
formats and the security model; the implementation is the :mod:`aotriton_rt.bundles` package
(one module per concern) and the command line is ``python -m aotriton_rt download|verify``.

Installation is all-or-nothing. Under a per-bundle file lock: download into a staging folder
(resuming a partial download with an HTTP Range request), check the bundle's sha256 against the
index while it streams, unpack into a staging folder checking every member (name, type, size,
digest, a cap on the total), check the catalog against the unpacked images, and only then swap
the folder into place. Anything that fails leaves the previous install as it was. Nothing from a
bundle is ever executed: members are written as plain, non-executable files.

Example::

    from aotriton_rt.download import download, install_file, verify
    download("gfx942", url="https://example.org/aotriton-rt/0.1.0/")
    install_file("hip-gfx942.tar")            # air-gapped
    assert all(r.ok for r in verify())

The network part needs the optional extra ``pip install aotriton-rt[download]`` (requests,
platformdirs, filelock, tqdm); ``verify`` needs only the standard library.
"""

from __future__ import annotations

from .bundles.fetch import DEFAULT_DEADLINE, DEFAULT_URL, ENV_URL, download
from .bundles.format import DEFAULT_MAX_UNPACKED, check_member_name, images_root, parse_index, select_bundles
from .bundles.install import InstalledBundle, install_file
from .bundles.verify import VerifyReport, verify, verify_folder

__all__ = [
    "DEFAULT_DEADLINE", "DEFAULT_MAX_UNPACKED", "DEFAULT_URL", "ENV_URL", "InstalledBundle", "VerifyReport",
    "check_member_name", "download", "images_root", "install_file", "parse_index", "select_bundles", "verify",
    "verify_folder",
]
