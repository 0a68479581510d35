"""NOIMAGE mode end to end: real bundles, a real HTTP server on 127.0.0.1 injecting faults,
hostile archives, several processes installing at once. Every failure must end in a clear error
with the previous install intact and nothing partial left behind."""

from __future__ import annotations

import argparse
import functools
import hashlib
import io
import json
import lzma
import multiprocessing
import os
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import filelock
import pytest

from aotriton_rt import images
from aotriton_rt.__main__ import add_bundle_commands
from aotriton_rt.catalog import Catalog
from aotriton_rt.download import (
    ENV_URL,
    check_member_name,
    download,
    images_root,
    install_file,
    select_bundles,
    verify,
    verify_folder,
)
from aotriton_rt.errors import BundleError, CatalogError, DownloadError, ImageFolderNotFound, NoDevice
from builder.bundle import pack
from tests.helpers.httpfaults import FaultServer, make_image_folder, wait_at

ROOT = Path(__file__).resolve().parents[2]
NAME = "hip-gfx942"


@pytest.fixture(scope="module")
def releases(tmp_path_factory) -> dict[str, Path]:
    """Two published releases of the same bundles (different images): 'v1' and 'v2'."""
    base = tmp_path_factory.mktemp("releases")
    out = {}
    for seed, tag in ((0, "v1"), (1, "v2")):
        pack(make_image_folder(base / f"images-{tag}", seed=seed), base / tag)
        out[tag] = base / tag
    return out


def sha_of(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def tree(folder: Path) -> dict[str, str]:
    return {p.relative_to(folder).as_posix(): sha_of(p) for p in sorted(folder.rglob("*")) if p.is_file()}


def leftovers(root: Path) -> list[str]:
    """Everything under the images root that is neither an image folder nor a lock file."""
    return sorted(p.name for p in root.iterdir() if p.name.startswith(".") and not p.name.endswith(".lock"))


def fetch(server: FaultServer, fault: str, dest: Path, arch: str = "gfx942", **kw):
    opts = dict(url=server.url(fault), dest=dest, allow_http=True, timeout=2.0, retries=2, backoff=0.01,
                progress=False)
    opts.update(kw)
    return download(arch, **opts)


@pytest.fixture
def previous(releases, tmp_path) -> tuple[Path, dict[str, str]]:
    """An images root with release v1 of hip-gfx942 installed, and a snapshot of its files."""
    dest = tmp_path / "images"
    install_file(releases["v1"] / f"{NAME}.tar", dest=dest)
    return dest, tree(dest / NAME)


def assert_intact(dest: Path, before: dict[str, str], reinstalled: bool = False) -> None:
    # A reinstall rewrites install.json (it records the source, a file or a URL); nothing else differs.
    skip = "install.json" if reinstalled else None
    assert {k: v for k, v in tree(dest / NAME).items() if k != skip} == \
        {k: v for k, v in before.items() if k != skip}
    assert verify_folder(dest / NAME).ok
    assert leftovers(dest) == []


# --------------------------------------------------------------------------- happy paths


def test_download_installs_only_the_asked_target_and_it_verifies(releases, tmp_path):
    dest = tmp_path / "images"
    with FaultServer(releases["v1"]) as server:
        done = fetch(server, "ok", dest)
    assert [(b.name, b.action, b.targets) for b in done] == [(NAME, "installed", ("gfx942",))]
    catalog = Catalog.load(dest / NAME)
    assert {v.target.arch for v in catalog.variants} == {"gfx942"} and len(catalog.variants) == 2
    index = json.loads((releases["v1"] / "index.json").read_text())
    assert done[0].sha256 == next(b["sha256"] for b in index["bundles"] if b["name"] == NAME)
    assert [r.ok for r in verify(dest)] == [True]
    assert sorted(p.name for p in dest.iterdir()) == [f".{NAME}.lock", NAME]


def test_installed_images_load_offline_through_the_runtime(releases, tmp_path):
    dest = tmp_path / "images"
    with FaultServer(releases["v1"]) as server:
        folder = fetch(server, "ok", dest)[0].path
    # The server is gone: the runtime reads and checks images from the install alone.
    catalog = Catalog.load(folder)
    for v in catalog.variants:
        assert hashlib.sha256(images.read_image(folder, v)).hexdigest() == v.image.raw_sha256


def _bundle_catalog(bundle: Path) -> tuple[bytes, Catalog]:
    """The inline catalog a bundle carries, as bytes and parsed."""
    data = next(d for m, d in read_members(bundle) if m.name == "catalog.json")
    return data, Catalog.from_json(json.loads(data))


def test_an_installed_bundle_is_the_index_form_and_opens_without_reading_a_shard(releases, tmp_path,
                                                                                 monkeypatch):
    from aotriton_rt.catalog import store
    from aotriton_rt.library import Library

    with FaultServer(releases["v1"]) as server:
        folder = fetch(server, "ok", tmp_path / "images")[0].path
    index = json.loads((folder / "catalog.json").read_bytes())
    assert "variants" not in index
    assert sorted(s["path"] for s in index["shards"]) == ["hip/gfx942/add/variants.json",
                                                          "hip/gfx942/softmax/variants.json"]
    reads: list[str] = []
    real_read = store.read_bounded

    def spy(path, *args):
        reads.append(Path(path).relative_to(folder).as_posix())
        return real_read(path, *args)

    monkeypatch.setattr(store, "read_bounded", spy)
    lib = Library(folder)
    assert reads == ["catalog.json"] and lib.kernels == ["add", "softmax"]
    add = lib.variants_of("add")
    assert reads == ["catalog.json", "hip/gfx942/add/variants.json"]
    # The same variants the bundle carried inline, so every launch is the same.
    _, inline = _bundle_catalog(releases["v1"] / f"{NAME}.tar")
    assert add == inline.variants_of("add")
    assert sorted(lib.variants, key=lambda v: v.key) == sorted(inline.variants, key=lambda v: v.key)
    assert verify_folder(folder).ok and verify_folder(folder).files == 5  # 2 images, the index, 2 shards


def test_verify_notices_a_changed_index_or_shard_of_an_install(previous):
    dest, _ = previous
    folder = dest / NAME
    index = folder / "catalog.json"
    index.write_bytes(index.read_bytes() + b" ")
    assert "catalog.json was modified after installation" in verify_folder(folder).problems
    index.write_bytes(index.read_bytes()[:-1])
    shard = folder / "hip" / "gfx942" / "add" / "variants.json"
    shard.write_bytes(shard.read_bytes().replace(b'"num_warps":', b'"num_warps" :', 1))
    assert any("add/variants.json: does not match its entry in" in p for p in verify_folder(folder).problems)


def test_a_reinstall_over_an_older_inline_install_replaces_it_with_the_index_form(previous, releases):
    dest, before = previous
    folder = dest / NAME
    # What an older runtime left: the bundle's inline catalog.json, no shards, no index digest.
    inline, _ = _bundle_catalog(releases["v1"] / f"{NAME}.tar")
    (folder / "catalog.json").write_bytes(inline)
    for shard in folder.rglob("variants.json"):
        shard.unlink()
    record = json.loads((folder / "install.json").read_bytes())
    del record["catalog_sha256"]
    (folder / "install.json").write_text(json.dumps(record))
    assert verify_folder(folder).ok  # intact as that runtime installed it: only the form is old
    done = install_file(releases["v1"] / f"{NAME}.tar", dest=dest)
    assert done.action == "installed"
    assert_intact(dest, before, reinstalled=True)
    assert "shards" in json.loads((folder / "catalog.json").read_bytes())
    assert install_file(releases["v1"] / f"{NAME}.tar", dest=dest).action == "already installed"


def test_a_bundle_member_at_a_shard_path_is_refused(releases, tmp_path):
    members = read_members(releases["v1"] / f"{NAME}.tar")
    shard = b"{}"
    manifest = json.loads(members[0][1])
    manifest["files"].append({"path": "hip/gfx942/add/variants.json", "size": len(shard),
                              "sha256": hashlib.sha256(shard).hexdigest()})
    path = tmp_path / "bad.tar"
    with tarfile.open(path, "w") as tar:
        for info, data in [member("bundle.json", json.dumps(manifest).encode()), *members[1:],
                           member("hip/gfx942/add/variants.json", shard)]:
            tar.addfile(info, io.BytesIO(data))
    with pytest.raises(BundleError, match=r"member 'hip/gfx942/add/variants\.json' is where the installer writes "
                                          r"the catalog shard of add; refused"):
        install_file(path, dest=tmp_path / "images")
    assert not (tmp_path / "images" / NAME).exists()


def test_default_destination_is_the_cache_the_runtime_searches(releases, tmp_path, monkeypatch):
    monkeypatch.setenv(images.ENV_CACHE, str(tmp_path / "cache"))
    assert images_root() == images.cache_root().absolute()
    with FaultServer(releases["v1"]) as server:
        done = download("sm90", url=server.url("ok"), allow_http=True, progress=False)
    assert done[0].path == tmp_path / "cache" / "cuda-sm90"


def test_url_may_name_the_index_itself_and_several_targets_at_once(releases, tmp_path):
    with FaultServer(releases["v1"]) as server:
        done = download(["gfx942", "sm90", "gfx90a"], url=server.url("ok") + "index.json",
                        dest=tmp_path, allow_http=True, progress=False)
    assert sorted(b.name for b in done) == ["cuda-sm90", "hip-gfx90a", NAME]


def test_second_download_of_the_same_digest_does_nothing(releases, tmp_path):
    with FaultServer(releases["v1"]) as server:
        fetch(server, "ok", tmp_path)
        again = fetch(server, "ok", tmp_path)
        assert [b.action for b in again] == ["already installed"]
        assert len(server.hits()) == 1


def test_new_release_replaces_the_old_one(previous, releases):
    dest, before = previous
    with FaultServer(releases["v2"]) as server:
        done = fetch(server, "ok", dest)
    assert done[0].action == "installed"
    assert tree(dest / NAME) != before
    assert verify_folder(dest / NAME).ok and leftovers(dest) == []


def test_progress_bar_goes_to_stderr(releases, tmp_path, capsys):
    with FaultServer(releases["v1"]) as server:
        fetch(server, "ok", tmp_path, progress=True)
    err = capsys.readouterr().err
    assert NAME in err and "100%" in err


# --------------------------------------------------------------------------- network faults


def test_dropped_connection_resumes_with_a_range_request(releases, tmp_path):
    with FaultServer(releases["v1"], drop_fraction=0.4) as server:
        done = fetch(server, "drop", tmp_path)
        hits = server.hits()
    size = (releases["v1"] / f"{NAME}.tar").stat().st_size
    assert done[0].action == "installed" and verify_folder(done[0].path).ok
    assert [(h.range, h.status) for h in hits] == [(None, 200), (f"bytes={int(size * 0.4)}-", 206)]


def test_server_that_ignores_range_is_downloaded_from_the_top(releases, tmp_path):
    dest = tmp_path / "images"
    with FaultServer(releases["v1"]) as server:
        with pytest.raises(DownloadError):
            fetch(server, "truncate", dest, keep_partial=True, retries=0)
        done = fetch(server, "norange", dest)
        assert [h.status for h in server.hits()][-1] == 200
    assert done[0].action == "installed" and verify_folder(done[0].path).ok
    assert leftovers(dest) == []


def test_kept_partial_download_is_resumed_by_the_next_run(releases, tmp_path):
    dest = tmp_path / "images"
    size = (releases["v1"] / f"{NAME}.tar").stat().st_size
    with FaultServer(releases["v1"]) as server:
        with pytest.raises(DownloadError, match="gave up after 1 failed attempts"):
            fetch(server, "truncate", dest, keep_partial=True, retries=0)
        parts = list((dest / f".{NAME}.staging").glob("*.part"))
        assert [p.stat().st_size for p in parts] == [size // 2]
        done = fetch(server, "ok", dest)
        assert (server.hits()[-1].range, server.hits()[-1].status) == (f"bytes={size // 2}-", 206)
    assert done[0].action == "installed" and leftovers(dest) == []


def test_truncated_body_is_a_clear_error_and_keeps_the_previous_install(previous, releases):
    dest, before = previous
    with FaultServer(releases["v2"]) as server:
        with pytest.raises(DownloadError, match=r"gave up after 3 failed attempts in a row; last: the "
                                                r"connection broke mid-transfer.*raise --retries"):
            fetch(server, "truncate", dest)
    assert_intact(dest, before)


def test_missing_bundle_is_a_clear_404(previous, releases):
    dest, before = previous
    with FaultServer(releases["v2"]) as server:
        with pytest.raises(DownloadError, match=rf"{NAME}\.tar: HTTP 404 Not Found; check --url"):
            fetch(server, "missing", dest)
        assert len(server.hits()) == 1  # a 404 is not retried
    assert_intact(dest, before)


def test_missing_index_is_a_clear_404(releases, tmp_path):
    with FaultServer(releases["v1"]) as server:
        with pytest.raises(DownloadError, match=r"nowhere/index\.json: HTTP 404.*folder holding index\.json"):
            download("gfx942", url=server.url("ok") + "nowhere/", dest=tmp_path, allow_http=True)


def test_500_then_success_is_retried_to_an_install(releases, tmp_path):
    with FaultServer(releases["v1"], flaky_failures=2) as server:
        done = fetch(server, "flaky", tmp_path, retries=2)
        assert [h.status for h in server.hits()] == [500, 500, 200]
    assert done[0].action == "installed" and verify_folder(done[0].path).ok


def test_persistent_500_gives_up_and_keeps_the_previous_install(previous, releases):
    dest, before = previous
    with FaultServer(releases["v2"]) as server:
        with pytest.raises(DownloadError, match=r"gave up after 3 failed attempts.*HTTP 500"):
            fetch(server, "broken", dest, retries=2)
        assert len(server.hits()) == 3
    assert_intact(dest, before)


def test_wrong_digest_is_refused_before_anything_is_installed(previous, releases):
    dest, before = previous
    with FaultServer(releases["v2"]) as server:
        with pytest.raises(DownloadError, match=r"sha256 [0-9a-f]{16}\.\.\., the index says [0-9a-f]{16}\.\.\.; "
                                                r"it is corrupt or was replaced"):
            fetch(server, "corrupt", dest)
    assert_intact(dest, before)


def test_body_longer_than_the_index_says_is_refused(previous, releases):
    dest, before = previous
    with FaultServer(releases["v2"]) as server:
        with pytest.raises(DownloadError, match=r"sent more than the \d+ bytes the index lists"):
            fetch(server, "oversize", dest)
    assert_intact(dest, before)


def test_too_slow_server_times_out(previous, releases):
    dest, before = previous
    start = time.monotonic()
    with FaultServer(releases["v2"], delay=5.0) as server:
        with pytest.raises(DownloadError, match=r"gave up after 2 failed attempts.*timed out \(no answer for 0\.3 s\)"):
            fetch(server, "slow", dest, timeout=0.3, retries=1)
    assert time.monotonic() - start < 3.0
    assert_intact(dest, before)


# --------------------------------------------------------------------------- arguments


def test_plain_http_needs_explicit_permission(tmp_path):
    with pytest.raises(DownloadError, match=r"refusing plain HTTP for 'http://127\.0\.0\.1:9/'.*--allow-http"):
        download("gfx942", url="http://127.0.0.1:9/", dest=tmp_path)
    with pytest.raises(DownloadError, match=r"unsupported URL 'ftp://example\.org/'.*--from-file"):
        download("gfx942", url="ftp://example.org/", dest=tmp_path)


def test_no_url_is_an_error_that_names_the_fix(tmp_path, monkeypatch):
    monkeypatch.delenv(ENV_URL, raising=False)
    with pytest.raises(DownloadError, match=rf"no download URL: pass --url BASE .* or set {ENV_URL}"):
        download("gfx942", dest=tmp_path)


def test_auto_arch_without_a_gpu_asks_for_arch(tmp_path):
    with pytest.raises(DownloadError, match=r"--arch auto found no GPU on this machine; .* --arch gfx942"):
        download("auto", url="https://example.invalid/", dest=tmp_path, detect=lambda: [])

    def no_driver() -> list[str]:
        raise NoDevice("libcuda.so.1 not found")

    with pytest.raises(DownloadError, match=r"found no GPU on this machine \(libcuda\.so\.1 not found\)"):
        download("auto", url="https://example.invalid/", dest=tmp_path, detect=no_driver)


def test_auto_arch_downloads_the_detected_targets(releases, tmp_path):
    with FaultServer(releases["v1"]) as server:
        done = download("auto", url=server.url("ok"), dest=tmp_path, allow_http=True, progress=False,
                        detect=lambda: ["gfx942", "sm90"])
    assert sorted(b.name for b in done) == ["cuda-sm90", NAME]


def test_target_without_a_bundle_lists_what_the_index_offers(releases, tmp_path):
    with FaultServer(releases["v1"]) as server:
        with pytest.raises(DownloadError, match=r"no bundle for gfx1201 in .*index\.json; it offers gfx1100, gfx90a, "
                                                r"gfx942, sm90\. .*--targets gfx1201"):
            fetch(server, "ok", tmp_path, arch="gfx942,gfx1201")
        assert server.hits() == []  # refused before downloading anything


def test_select_bundles_understands_device_arch_spellings():
    index = {"bundles": [
        {"name": "cuda-sm8x", "backend": "cuda", "targets": ["sm80"]},
        {"name": "cuda-sm90", "backend": "cuda", "targets": ["sm90"]},
        {"name": "hip-gfx9x", "backend": "hip", "targets": ["gfx90a", "gfx942"]},
    ]}
    pick = lambda *archs: [b["name"] for b in select_bundles(index, archs)]
    assert pick("gfx942:sramecc+:xnack-", "hip/gfx90a") == ["hip-gfx9x"]
    assert pick("sm86") == ["cuda-sm8x"]  # sm80 code runs on sm86
    assert pick("sm_90", "cuda-sm90") == ["cuda-sm90"]
    with pytest.raises(DownloadError, match="no bundle for sm89a-nonsense"):
        pick("sm89a-nonsense")


def test_missing_download_extra_names_the_pip_command(releases, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "filelock", None)
    with pytest.raises(DownloadError, match=r"optional package 'filelock': pip install 'aotriton-rt\[download\]'"):
        install_file(releases["v1"] / f"{NAME}.tar", dest=tmp_path)


# --------------------------------------------------------------------------- hostile input


def read_members(bundle: Path) -> list[tuple[tarfile.TarInfo, bytes]]:
    with tarfile.open(bundle) as tar:
        return [(m, tar.extractfile(m).read()) for m in tar.getmembers()]


def member(name: str, data: bytes = b"", kind: bytes = tarfile.REGTYPE, link: str = "") -> tuple:
    info = tarfile.TarInfo(name)
    info.type, info.size, info.linkname = kind, len(data), link
    return info, data


def forge(src: Path, dst: Path, *, edit=None, replace: dict[str, bytes] | None = None, relist: bool = True,
          extra: tuple = (), drop: tuple = ()) -> Path:
    """Rewrite bundle ``src``: replace member bytes (updating bundle.json when ``relist``), edit
    bundle.json, insert ``extra`` members after catalog.json, drop members."""
    members = read_members(src)
    manifest = json.loads(members[0][1])
    replace = replace or {}
    if relist:
        for f in manifest["files"]:
            if f["path"] in replace:
                f["size"], f["sha256"] = len(replace[f["path"]]), hashlib.sha256(replace[f["path"]]).hexdigest()
    if edit:
        edit(manifest)
    out = [member("bundle.json", json.dumps(manifest).encode())]
    for info, data in members[1:]:
        if info.name not in drop:
            out.append(member(info.name, replace.get(info.name, data)))
        if info.name == "catalog.json":
            out.extend(extra)
    with tarfile.open(dst, "w", format=tarfile.GNU_FORMAT) as tar:
        for info, data in out:
            tar.addfile(info, io.BytesIO(data) if info.isreg() and data else None)
    return dst


def fifo(name: str) -> tuple:
    return member(name, kind=tarfile.FIFOTYPE)


HOSTILE_MEMBERS = {
    "traversal": (member("../evil", b"x"), r"'\.\./evil' refused: '\.\.' would escape the install folder"),
    "deep traversal": (member("hip/../../evil", b"x"), r"'\.\.' would escape"),
    "absolute": (member("/tmp/aotriton-evil", b"x"), r"'/tmp/aotriton-evil' refused: absolute path"),
    "drive letter": (member("C:/evil", b"x"), r"refused: absolute path"),
    "backslash": (member("hip\\..\\evil", b"x"), r"character '\\\\' is not allowed"),
    "windows device": (member("hip/aux.hsaco.xz", b"x"), r"'aux\.hsaco\.xz' is a reserved device name on Windows"),
    "symlink": (member("hip/link", kind=tarfile.SYMTYPE, link="/etc/passwd"), r"'hip/link' is a symbolic link"),
    "hard link": (member("hip/hard", kind=tarfile.LNKTYPE, link="catalog.json"), r"'hip/hard' is a hard link"),
    "fifo": (fifo("hip/fifo"), r"'hip/fifo' is a FIFO; bundles hold regular files only"),
    "device": (member("hip/tty", kind=tarfile.CHRTYPE), r"'hip/tty' is a character device"),
    "sparse": (member("hip/sparse", kind=tarfile.GNUTYPE_SPARSE), r"'hip/sparse' is a sparse file"),
    "unlisted": (member("hip/extra.bin", b"x"), r"member 'hip/extra\.bin' is not listed in bundle\.json"),
}


@pytest.fixture
def v2_installed(releases, tmp_path) -> tuple[Path, dict[str, str]]:
    """Release v2 installed: forged bundles (from v1) must leave it exactly as it is."""
    dest = tmp_path / "images"
    install_file(releases["v2"] / f"{NAME}.tar", dest=dest)
    return dest, tree(dest / NAME)


@pytest.mark.parametrize("case", sorted(HOSTILE_MEMBERS))
def test_hostile_member_is_refused_and_nothing_is_written(case, releases, v2_installed, tmp_path):
    dest, before = v2_installed
    extra, message = HOSTILE_MEMBERS[case]
    bad = forge(releases["v1"] / f"{NAME}.tar", tmp_path / "bad.tar", extra=(extra,))
    with pytest.raises(BundleError, match=message):
        install_file(bad, dest=dest)
    assert_intact(dest, before)
    assert not (tmp_path / "evil").exists() and not Path("/tmp/aotriton-evil").exists()


def test_hostile_path_in_the_manifest_is_refused(releases, v2_installed, tmp_path):
    dest, before = v2_installed
    bad = forge(releases["v1"] / f"{NAME}.tar", tmp_path / "bad.tar",
                edit=lambda m: m["files"].append({"path": "../evil", "size": 1, "sha256": "0" * 64}))
    with pytest.raises(BundleError, match=r"'\.\./evil' refused"):
        install_file(bad, dest=dest)
    assert_intact(dest, before)


def test_bundle_declaring_more_than_the_cap_is_refused_before_unpacking(releases, v2_installed, tmp_path):
    dest, before = v2_installed
    bomb = forge(releases["v1"] / f"{NAME}.tar", tmp_path / "bomb.tar",
                 edit=lambda m: m["files"].append({"path": "hip/big", "size": 100 << 30, "sha256": "0" * 64}))
    with pytest.raises(BundleError, match=r"unpacks to 107374\d+ bytes, over the limit of 8589934592; refused"):
        install_file(bomb, dest=dest)
    with pytest.raises(BundleError, match=r"over the limit of 5000"):
        install_file(releases["v1"] / f"{NAME}.tar", dest=dest, max_unpacked_bytes=5000)
    assert_intact(dest, before)


def test_member_larger_than_declared_is_refused_before_it_is_written(releases, v2_installed, tmp_path):
    dest, before = v2_installed
    big = bytes(2 << 20)
    bomb = forge(releases["v1"] / f"{NAME}.tar", tmp_path / "bomb.tar", extra=(member("hip/big", big),),
                 edit=lambda m: m["files"].append({"path": "hip/big", "size": 10, "sha256": "0" * 64}))
    with pytest.raises(BundleError, match=r"member 'hip/big' is 2097152 bytes, bundle\.json says 10"):
        install_file(bomb, dest=dest, max_unpacked_bytes=1 << 20)
    assert_intact(dest, before)


def test_huge_catalog_is_refused_before_it_is_read(releases, tmp_path):
    members = read_members(releases["v1"] / f"{NAME}.tar")
    manifest = json.loads(members[0][1])
    manifest["files"][0]["size"] = 300 << 20
    path = tmp_path / "bad.tar"
    with tarfile.open(path, "w") as tar:
        info, data = member("bundle.json", json.dumps(manifest).encode())
        tar.addfile(info, io.BytesIO(data))
        huge, _ = member("catalog.json")
        huge.size = 300 << 20
        tar.addfile(huge)  # the header alone: the refusal must come before any byte is read
    with pytest.raises(BundleError, match=r"catalog\.json is 314572800 bytes, over the 67108864 a "
                                          r"bundle's catalog may have"):
        install_file(path, dest=tmp_path / "images")


def test_tampered_image_fails_its_digest_and_nothing_is_installed(releases, v2_installed, tmp_path):
    dest, before = v2_installed
    members = read_members(releases["v1"] / f"{NAME}.tar")
    image, data = members[-1][0].name, members[-1][1]
    bad = forge(releases["v1"] / f"{NAME}.tar", tmp_path / "bad.tar", relist=False,
                replace={image: data[:-1] + bytes([data[-1] ^ 1])})
    with pytest.raises(BundleError, match=rf"member '{image}' has sha256 [0-9a-f]{{16}}\.\.\., bundle\.json says"):
        install_file(bad, dest=dest)
    assert_intact(dest, before)


def test_catalog_disagreeing_with_the_manifest_is_refused(releases, v2_installed, tmp_path):
    dest, before = v2_installed
    members = read_members(releases["v1"] / f"{NAME}.tar")
    catalog = json.loads(members[1][1])
    catalog["variants"][0]["image"]["sha256"] = "f" * 64
    bad = forge(releases["v1"] / f"{NAME}.tar", tmp_path / "bad.tar",
                replace={"catalog.json": json.dumps(catalog).encode()})
    with pytest.raises(BundleError, match=r"the catalog and bundle\.json disagree on the digest of hip/gfx942/"):
        install_file(bad, dest=dest)
    assert_intact(dest, before)


def test_member_missing_from_the_bundle_is_refused(releases, v2_installed, tmp_path):
    dest, before = v2_installed
    last = read_members(releases["v1"] / f"{NAME}.tar")[-1][0].name
    bad = forge(releases["v1"] / f"{NAME}.tar", tmp_path / "bad.tar", drop=(last,))
    with pytest.raises(BundleError, match=rf"1 file\(s\) listed in bundle\.json are missing .*'{last}'"):
        install_file(bad, dest=dest)
    assert_intact(dest, before)


def test_archive_without_the_manifest_first_is_refused(releases, tmp_path):
    members = read_members(releases["v1"] / f"{NAME}.tar")
    path = tmp_path / "bad.tar"
    with tarfile.open(path, "w") as tar:
        for info, data in members[1:] + members[:1]:
            tar.addfile(info, io.BytesIO(data))
    with pytest.raises(BundleError, match=r"the first member must be bundle\.json, found 'catalog\.json'"):
        install_file(path, dest=tmp_path / "images")


def test_file_that_is_not_an_uncompressed_tar_is_refused(tmp_path):
    for name, data in (("noise.tar", os.urandom(3000)), ("empty.tar", b""),
                       ("bundle.tar.xz", __import__("lzma").compress(b"x" * 10000))):
        (tmp_path / name).write_bytes(data)
        with pytest.raises(BundleError, match=r"not a readable bundle \(an uncompressed tar\)"):
            install_file(tmp_path / name, dest=tmp_path / "images")
    with pytest.raises(BundleError, match="no such bundle file"):
        install_file(tmp_path / "absent.tar", dest=tmp_path / "images")


def test_from_file_checks_an_expected_digest(releases, tmp_path):
    with pytest.raises(BundleError, match=r"sha256 is [0-9a-f]{64}, expected 0{64}; the file is corrupt"):
        install_file(releases["v1"] / f"{NAME}.tar", dest=tmp_path, sha256="0" * 64)


def test_hostile_bundle_over_http_is_refused_and_cleaned_up(releases, previous, tmp_path):
    dest, before = previous
    pub = tmp_path / "pub"
    shutil.copytree(releases["v2"], pub)
    forge(releases["v2"] / f"{NAME}.tar", pub / f"{NAME}.tar", extra=(member("../../evil", b"x"),))
    index = json.loads((pub / "index.json").read_text())
    for b in index["bundles"]:
        if b["name"] == NAME:  # a correct digest: the index vouches for a hostile bundle
            b["size"], b["sha256"] = (pub / b["file"]).stat().st_size, sha_of(pub / b["file"])
    (pub / "index.json").write_text(json.dumps(index))
    with FaultServer(pub) as server:
        with pytest.raises(BundleError, match=r"'\.\./\.\./evil' refused"):
            fetch(server, "ok", dest)
    assert_intact(dest, before)
    assert not (tmp_path / "evil").exists()


def test_index_pointing_outside_its_folder_is_refused(releases, tmp_path):
    pub = tmp_path / "pub"
    shutil.copytree(releases["v1"], pub)
    index = json.loads((pub / "index.json").read_text())
    index["bundles"][0]["file"] = "../secret.tar"
    (pub / "index.json").write_text(json.dumps(index))
    with FaultServer(pub) as server:
        with pytest.raises(BundleError, match=r"bundles\[0\]\.file must be a plain file name .*'\.\./secret\.tar'"):
            fetch(server, "ok", tmp_path / "images")


def test_check_member_name_accepts_catalog_paths():
    assert check_member_name("hip/gfx942/add/add-0123456789abcdef.hsaco.xz")
    with pytest.raises(BundleError, match="ends with a dot or space"):
        check_member_name("hip/trailing.")


# --------------------------------------------------------------------------- compatibility


def republish(src: Path, dst: Path, **changes) -> Path:
    shutil.copytree(src, dst)
    index = json.loads((dst / "index.json").read_text())
    index.update(changes)
    (dst / "index.json").write_text(json.dumps(index))
    return dst


def test_index_of_a_newer_schema_is_refused_with_the_fix(releases, tmp_path):
    with FaultServer(republish(releases["v1"], tmp_path / "pub", schema_version=2)) as server:
        with pytest.raises(BundleError, match=r"bundle index schema_version 2 is newer than this aotriton-rt .* "
                                              r"\(it reads 1\); upgrade it: pip install -U aotriton-rt"):
            fetch(server, "ok", tmp_path / "images")


def test_index_of_unknown_catalogs_is_refused_before_downloading(releases, tmp_path):
    with FaultServer(republish(releases["v1"], tmp_path / "pub", catalog_schema_version=3)) as server:
        with pytest.raises(CatalogError, match=r"its catalogs are schema_version 3, this aotriton-rt .* reads "
                                               r"version 2; upgrade it: pip install -U aotriton-rt"):
            fetch(server, "ok", tmp_path / "images")
        assert server.hits() == []


def test_index_of_another_kind_is_refused(releases, tmp_path):
    with FaultServer(republish(releases["v1"], tmp_path / "pub", schema="something.else")) as server:
        with pytest.raises(BundleError, match=r"not an aotriton-rt bundle index: schema is 'something\.else'"):
            fetch(server, "ok", tmp_path / "images")


def test_bundle_of_a_newer_format_is_refused_with_the_fix(releases, v2_installed, tmp_path):
    dest, before = v2_installed
    bad = forge(releases["v1"] / f"{NAME}.tar", tmp_path / "bad.tar", edit=lambda m: m.update(schema_version=2))
    with pytest.raises(BundleError, match=r"bundle schema_version 2 is newer .*pip install -U aotriton-rt"):
        install_file(bad, dest=dest)
    assert_intact(dest, before)


def test_bundle_whose_catalog_schema_is_unknown_is_refused_with_the_fix(releases, v2_installed, tmp_path):
    dest, before = v2_installed
    catalog = json.loads(read_members(releases["v1"] / f"{NAME}.tar")[1][1])
    catalog["schema_version"] = 3
    bad = forge(releases["v1"] / f"{NAME}.tar", tmp_path / "bad.tar",
                replace={"catalog.json": json.dumps(catalog).encode()})
    with pytest.raises(CatalogError, match=r"catalog schema_version 3 is not understood .*pip install -U aotriton-rt"):
        install_file(bad, dest=dest)
    assert_intact(dest, before)


# --------------------------------------------------------------------------- atomicity, concurrency


def test_failed_swap_restores_the_previous_install(releases, previous, monkeypatch):
    dest, before = previous
    real = os.replace

    def full_disk(src, dst):
        if Path(src).name.startswith("unpack-"):
            raise OSError(28, "No space left on device")
        return real(src, dst)

    monkeypatch.setattr(os, "replace", full_disk)
    with pytest.raises(DownloadError, match=rf"installing {NAME} into .* failed: .*No space left on device.*"
                                            r"previous install, if any, is unchanged"):
        install_file(releases["v2"] / f"{NAME}.tar", dest=dest)
    monkeypatch.setattr(os, "replace", real)
    assert_intact(dest, before)


def test_installer_waiting_too_long_for_the_lock_says_why(releases, previous):
    dest, before = previous
    with filelock.FileLock(str(dest / f".{NAME}.lock")):
        with pytest.raises(DownloadError, match=rf"another installer of {NAME} has held .*\.{NAME}\.lock for "
                                                r"over 0\.2 s; wait for it to finish"):
            install_file(releases["v2"] / f"{NAME}.tar", dest=dest, lock_timeout=0.2)
    assert_intact(dest, before)


def test_staging_left_by_a_crashed_installer_is_cleaned(releases, tmp_path):
    dest = tmp_path / "images"
    stale = dest / f".{NAME}.staging" / "unpack-dead"
    stale.mkdir(parents=True)
    (stale / "catalog.json").write_text("{}")
    install_file(releases["v1"] / f"{NAME}.tar", dest=dest)
    assert leftovers(dest) == []


def test_concurrent_downloads_of_one_bundle_install_it_once(releases, tmp_path):
    dest = tmp_path / "images"
    ctx = multiprocessing.get_context("spawn")
    # "slow" holds the first installer inside the lock for a while, so the others queue on it.
    with FaultServer(releases["v1"], delay=0.5) as server:
        job = functools.partial(download, url=server.url("slow"), dest=str(dest), allow_http=True, timeout=10.0,
                                retries=1, backoff=0.01, progress=False)
        with ctx.Pool(4, initializer=wait_at, initargs=(ctx.Barrier(4),)) as pool:
            results = pool.map(job, ["gfx942"] * 4, chunksize=1)
        assert len(server.hits()) == 1
    actions = sorted(r[0].action for r in results)
    assert actions == ["already installed"] * 3 + ["installed"]
    assert verify_folder(dest / NAME).ok and leftovers(dest) == []


def test_concurrent_installs_of_two_releases_end_with_one_intact(releases, tmp_path):
    dest = tmp_path / "images"
    ctx = multiprocessing.get_context("spawn")
    files = [str(releases[tag] / f"{NAME}.tar") for tag in ("v1", "v2", "v1", "v2")]
    with ctx.Pool(4, initializer=wait_at, initargs=(ctx.Barrier(4),)) as pool:
        results = pool.map(functools.partial(install_file, dest=str(dest)), files, chunksize=1)
    assert {r.sha256 for r in results} == {sha_of(Path(f)) for f in files}
    installed = json.loads((dest / NAME / "install.json").read_text())["sha256"]
    assert installed in {r.sha256 for r in results}
    assert verify_folder(dest / NAME).ok and leftovers(dest) == []


# --------------------------------------------------------------------------- portable paths


@pytest.mark.parametrize("how", ["http", "file"])
def test_non_ascii_and_long_destinations_work(how, releases, tmp_path):
    dest = tmp_path / "ünïcødé-路径" / ("長" * 40) / ("x" * 150)
    assert len(str(dest)) > 260  # past Windows' MAX_PATH
    if how == "http":
        with FaultServer(releases["v1"]) as server:
            fetch(server, "drop", dest)
    else:
        copy = tmp_path / "ünïcødé-路径" / f"{NAME}.tar"
        copy.parent.mkdir()
        shutil.copy(releases["v1"] / f"{NAME}.tar", copy)
        install_file(copy, dest=dest)
    assert [r.ok for r in verify(dest)] == [True]
    assert leftovers(dest) == []


# --------------------------------------------------------------------------- verify


def test_verify_reports_corrupt_missing_and_unexpected_files(releases, tmp_path):
    dest = tmp_path / "images"
    folder = install_file(releases["v1"] / f"{NAME}.tar", dest=dest).path
    first, second = sorted(p for p in folder.rglob("*.xz"))
    first.write_bytes(first.read_bytes()[:-1] + b"\0")
    second.unlink()
    (folder / "hip" / "note.txt").write_text("hello")
    problems = verify(dest)[0].problems
    rel = lambda p: p.relative_to(folder).as_posix()
    assert f"{rel(first)}: sha256 differs from the catalog (corrupt or modified)" in problems
    assert f"missing {rel(second)}" in problems
    assert "unexpected file hip/note.txt" in problems


def test_verify_notices_an_edited_manifest(releases, tmp_path):
    folder = install_file(releases["v1"] / f"{NAME}.tar", dest=tmp_path).path
    manifest = json.loads((folder / "bundle.json").read_text())
    manifest["triton_version"] = "9.9.9"
    (folder / "bundle.json").write_text(json.dumps(manifest))
    assert "bundle.json was modified after installation" in verify_folder(folder).problems


def test_verify_of_an_empty_root_says_how_to_install(tmp_path):
    with pytest.raises(ImageFolderNotFound, match=r"nothing is installed in .*python -m aotriton_rt download"):
        verify(tmp_path)


def test_verify_checks_a_plain_image_folder_against_its_catalog(tmp_path):
    folder = make_image_folder(tmp_path / "built")
    assert verify_folder(folder).ok and verify_folder(folder).files == 8
    victim = next(folder.rglob("*.xz"))
    victim.write_bytes(victim.read_bytes()[::-1])
    assert any("sha256 differs" in p for p in verify_folder(folder).problems)


# --------------------------------------------------------------------------- command line


def cli(*argv: str) -> int:
    p = argparse.ArgumentParser()
    add_bundle_commands(p.add_subparsers(dest="command", required=True))
    args = p.parse_args(argv)
    return args.func(args)


def test_cli_downloads_installs_from_file_and_verifies(releases, tmp_path, capsys):
    dest = str(tmp_path / "images")
    with FaultServer(releases["v1"]) as server:
        assert cli("download", "--arch", "sm90", "--url", server.url("ok"), "--dest", dest) == 1
        assert "refusing plain HTTP" in capsys.readouterr().err
        assert cli("download", "--arch", "sm90", "--url", server.url("ok"), "--dest", dest, "--allow-http",
                   "--no-progress") == 0
    assert cli("download", "--from-file", str(releases["v1"] / f"{NAME}.tar"), "--dest", dest) == 0
    out = capsys.readouterr().out
    assert "installed: cuda-sm90 (sm90) in" in out and f"installed: {NAME} (gfx942) in" in out
    assert cli("verify", "--dest", dest) == 0
    # 2 images, the index, 2 shards
    assert capsys.readouterr().out.splitlines()[0].startswith("ok: cuda-sm90 (5 files)")
    next((tmp_path / "images" / NAME).rglob("*.xz")).unlink()
    assert cli("verify", "--dest", dest, NAME) == 1
    captured = capsys.readouterr()
    assert f"FAILED: {NAME}" in captured.out and "reinstall with" in captured.err


def test_python_dash_m_aotriton_rt_download_from_file(releases, tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "AOTRITON_RT_CACHE": str(tmp_path / "cache")}
    run = lambda *a: subprocess.run([sys.executable, "-m", "aotriton_rt", *a], capture_output=True, text=True,
                                    env=env, cwd=tmp_path, timeout=60)
    done = run("download", "--from-file", str(releases["v1"] / f"{NAME}.tar"))
    assert done.returncode == 0, done.stderr
    assert f"installed: {NAME}" in done.stdout
    checked = run("verify")
    assert checked.returncode == 0 and f"ok: {NAME}" in checked.stdout


# --------------------------------------------------------------------------- issue 9: bounds and repair


@pytest.mark.parametrize("fault", ["resume416", "wrongrange"])
def test_server_refusing_every_resume_gives_up_after_the_retries(fault, previous, releases):
    # Each restart from 0 regains the same bytes: that is not progress, so --retries bounds it.
    dest, before = previous
    with FaultServer(releases["v2"]) as server:
        with pytest.raises(DownloadError, match=r"gave up after 2 failed attempts in a row"):
            fetch(server, fault, dest, retries=1)
        assert len(server.hits()) == 3
    assert_intact(dest, before)


def test_trickling_server_is_given_up_at_the_deadline(previous, releases):
    dest, before = previous
    start = time.monotonic()
    with FaultServer(releases["v2"], trickle=0.02) as server:
        with pytest.raises(DownloadError, match=r"not finished within the deadline of 1 s; .*raise --deadline"):
            fetch(server, "trickle", dest, timeout=0.5, deadline=1.0)
    assert time.monotonic() - start < 4.0
    assert_intact(dest, before)


def test_bundle_listed_larger_than_the_unpack_cap_is_never_downloaded(previous, releases, tmp_path):
    # The .part file can never outgrow the cap: a bundle listed larger is refused before a byte.
    dest, before = previous
    shutil.copytree(releases["v2"], tmp_path / "v2")
    index = json.loads((tmp_path / "v2" / "index.json").read_text())
    for b in index["bundles"]:
        b["size"] = 1 << 40
    (tmp_path / "v2" / "index.json").write_text(json.dumps(index))
    with FaultServer(tmp_path / "v2") as server:
        with pytest.raises(BundleError, match=r"the index lists 1099511627776 bytes for bundle hip-gfx942, over the "
                                              r"limit of \d+ for max_unpacked_bytes=1048576; refused before "
                                              r"downloading"):
            fetch(server, "ok", dest, max_unpacked_bytes=1 << 20)
        assert server.hits() == []
    assert_intact(dest, before)


def test_bad_network_settings_are_refused_up_front(tmp_path):
    with pytest.raises(DownloadError, match=r"need 0 < timeout <= deadline <= 604800 \(seconds\), retries >= 0"):
        download("gfx942", url="http://127.0.0.1:9/", allow_http=True, dest=tmp_path, retries=-1)


def test_corrupt_install_is_repaired_by_the_next_download(previous, releases):
    dest, before = previous
    image = next((dest / NAME).rglob("*.xz"))
    image.write_bytes(b"corrupt")
    assert not verify_folder(dest / NAME).ok
    with FaultServer(releases["v1"]) as server:
        assert [b.action for b in fetch(server, "ok", dest)] == ["installed"]
    assert_intact(dest, before, reinstalled=True)


def test_corrupt_install_is_repaired_by_install_file_and_force_reinstalls_an_intact_one(previous, releases):
    dest, before = previous
    bundle = releases["v1"] / f"{NAME}.tar"
    assert install_file(bundle, dest=dest).action == "already installed"
    assert install_file(bundle, dest=dest, force=True).action == "installed"
    (dest / NAME / "catalog.json").unlink()
    assert install_file(bundle, dest=dest).action == "installed"
    assert_intact(dest, before)


@pytest.mark.skipif(os.name != "posix", reason="POSIX modes")
def test_installed_folders_and_files_get_their_modes_from_the_umask(releases, tmp_path):
    old = os.umask(0o022)
    try:
        install_file(releases["v1"] / f"{NAME}.tar", dest=tmp_path / "images")
    finally:
        os.umask(old)
    folder = tmp_path / "images" / NAME
    for p in [folder, *folder.rglob("*")]:
        assert p.stat().st_mode & 0o777 == (0o755 if p.is_dir() else 0o644), p


@pytest.mark.skipif(os.name != "posix", reason="symlinks")
def test_planted_staging_link_is_removed_never_followed(releases, tmp_path):
    dest = tmp_path / "images"
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "precious").write_text("keep me")
    dest.mkdir()
    (dest / f".{NAME}.staging").symlink_to(victim)
    install_file(releases["v1"] / f"{NAME}.tar", dest=dest)
    assert (victim / "precious").read_text() == "keep me"
    assert verify_folder(dest / NAME).ok and leftovers(dest) == []


def test_verify_refuses_a_name_that_leaves_the_destination(previous):
    dest, _ = previous
    with pytest.raises(ImageFolderNotFound, match=r"'\.\./\.\.' is not a bundle name"):
        verify(dest, ["../.."])


def test_paths_equal_under_unicode_normalization_are_refused(releases, v2_installed, tmp_path):
    dest, before = v2_installed

    def edit(m):
        m["files"] += [{"path": "hip/\u00e9.bin", "size": 1, "sha256": "0" * 64},
                       {"path": "hip/e\u0301.bin", "size": 1, "sha256": "0" * 64}]
    bad = forge(releases["v1"] / f"{NAME}.tar", tmp_path / "bad.tar", edit=edit)
    with pytest.raises(BundleError, match=r"repeats another path \(ignoring case and Unicode normalization\)"):
        install_file(bad, dest=dest)
    assert_intact(dest, before)


def test_manifest_whose_targets_disagree_with_its_catalog_is_refused(releases, v2_installed, tmp_path):
    dest, before = v2_installed
    bad = forge(releases["v1"] / f"{NAME}.tar", tmp_path / "bad.tar",
                edit=lambda m: m.update(backend="cuda", targets=["sm90"]))
    with pytest.raises(BundleError, match=r"bundle\.json says cuda sm90 but the catalog holds hip gfx942; refused"):
        install_file(bad, dest=dest)
    assert_intact(dest, before)


def test_pax_sparse_member_is_a_bundle_error(tmp_path):
    bad = tmp_path / "sparse.tar"
    with tarfile.open(bad, "w", format=tarfile.PAX_FORMAT) as tar:
        info = tarfile.TarInfo("bundle.json")
        info.size = 3
        info.pax_headers = {"GNU.sparse.major": "1", "GNU.sparse.minor": "0", "GNU.sparse.name": "bundle.json",
                            "GNU.sparse.realsize": "10"}
        tar.addfile(info, io.BytesIO(b"abc"))
    with pytest.raises(BundleError, match="not a readable bundle"):
        install_file(bad, dest=tmp_path / "images")


def test_deeply_nested_manifest_and_index_are_bundle_errors(tmp_path):
    from aotriton_rt.download import parse_index

    with pytest.raises(BundleError, match="JSON nested too deeply"):
        parse_index(b"[" * 100_000 + b"]" * 100_000, "index.json")


def test_images_root_that_is_a_file_is_a_download_error(releases, tmp_path):
    root = tmp_path / "a-file"
    root.write_text("x")
    with pytest.raises(DownloadError, match=r"cannot install into .*a-file: .*pass a writable folder with --dest"):
        install_file(releases["v1"] / f"{NAME}.tar", dest=root)


def test_verify_reports_an_unreadable_image_instead_of_crashing(previous):
    dest, _ = previous
    image = next((dest / NAME).rglob("*.xz"))
    image.unlink()
    image.mkdir()  # stat works, reading does not: as an unreadable file would be
    report = verify_folder(dest / NAME)
    assert not report.ok
    assert any("not a regular file" in p for p in report.problems), report.problems


# --------------------------------------------------------------------------- review of issue 25


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="symlinks and FIFOs")
@pytest.mark.parametrize("plant", ["symlink", "fifo", "folder"])
def test_planted_partial_download_is_replaced_never_followed(plant, releases, tmp_path):
    from tests.runtime.test_security import guarded, unblock

    dest = tmp_path / "images"
    staging = dest / f".{NAME}.staging"
    staging.mkdir(parents=True)
    index = json.loads((releases["v1"] / "index.json").read_text())
    sha = next(b["sha256"] for b in index["bundles"] if b["name"] == NAME)
    part = staging / f"{sha[:16]}.part"
    victim = tmp_path / "victim"
    victim.write_text("keep me")
    if plant == "symlink":
        part.symlink_to(victim)
    elif plant == "fifo":
        os.mkfifo(part)
    else:
        part.mkdir()
        (part / "x").write_text("x")
    with FaultServer(releases["v1"]) as server:
        try:
            done, box = guarded(lambda: fetch(server, "ok", dest), 60)
        finally:
            unblock(part)
    assert done, "the installer blocked on the planted .part"
    assert victim.read_text() == "keep me"
    assert "error" not in box, box["error"]
    assert box["value"][0].action == "installed" and verify_folder(dest / NAME).ok
    assert leftovers(dest) == []


@pytest.fixture(scope="module")
def ptx_bundle(tmp_path_factory) -> Path:
    """A bundle whose CUDA variants carry PTX beside their images, as the builder packs them."""
    base = tmp_path_factory.mktemp("ptx")
    pack(make_image_folder(base / "images", targets=(("cuda", "sm90", 32),), ptx=True), base / "rel")
    return base / "rel" / "cuda-sm90.tar"


def test_bundle_installs_its_ptx_and_verify_checks_it(ptx_bundle, tmp_path):
    done = install_file(ptx_bundle, dest=tmp_path / "images")
    assert verify_folder(done.path).ok
    ptx = next(done.path.rglob("*.ptx.xz"))
    ptx.write_bytes(b"\0" * ptx.stat().st_size)
    assert not verify_folder(done.path).ok


def test_bundle_whose_ptx_disagrees_with_its_catalog_is_refused(ptx_bundle, tmp_path):
    dest = tmp_path / "images"
    name = next(m.name for m, _ in read_members(ptx_bundle) if m.name.endswith(".ptx.xz"))
    # Listed and shipped consistently, but not the PTX the catalog vouches for.
    other = forge(ptx_bundle, tmp_path / "other.tar",
                  replace={name: lzma.compress(b"// another PTX\n", format=lzma.FORMAT_XZ)})
    with pytest.raises(BundleError, match=rf"the catalog and bundle\.json disagree on the digest of {name}"):
        install_file(other, dest=dest)
    # Absent from the bundle and its manifest, though the catalog names it.
    dropped = forge(ptx_bundle, tmp_path / "dropped.tar", drop=(name,),
                    edit=lambda m: m.update(files=[f for f in m["files"] if f["path"] != name]))
    with pytest.raises(BundleError, match=rf"variant add [0-9a-f]{{16}} needs {name}, which the bundle does not hold"):
        install_file(dropped, dest=dest)
    assert not (dest / "cuda-sm90").exists()
