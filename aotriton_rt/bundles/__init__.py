"""Image bundles (NOIMAGE mode): the formats, unpacking, installing, fetching, verifying.

One module per concern, imported in this order (each only from the ones before it):

- :mod:`.format`: the index, manifest and install-record schemas, member-name rules, where
  installs live (:func:`~.format.images_root`) and which bundles serve an arch. The builder
  (``python -m builder pack``) imports this module only.
- :mod:`.unpack`: reading a bundle in one pass with every defence (``docs/security.md``).
- :mod:`.verify`: re-checking an installed folder (standard library only).
- :mod:`.install`: lock, staging, all-or-nothing swap; :func:`~.install.install_file`.
- :mod:`.fetch`: HTTPS with resume, retries and a deadline; :func:`~.fetch.download`.

The public API is :mod:`aotriton_rt.download`; the command line is ``python -m aotriton_rt``
(``aotriton_rt/__main__.py``). Importing this package imports none of its modules.
"""
