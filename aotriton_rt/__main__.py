"""python -m aotriton_rt: info about GPUs and images; download and verify image bundles.

Commands: info (GPUs seen, image folders chosen and why, where each came from, digests checked),
explain (which variant and tuning config an attention call runs, and why), download (install
per-target image bundles), verify (re-check installed bundles). Run
`python -m aotriton_rt COMMAND --help` for each command's options.
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from typing import Any

from .bundles.fetch import DEFAULT_DEADLINE, ENV_URL, MAX_SECONDS
from .bundles.format import INDEX_FILE
from .errors import shown

#: Exit statuses: 0 done; 1 an input was refused (an ``error:`` line names it and the fix);
#: 2 a bad command line (argparse's convention); 3 an internal error, a bug to report.
EXIT_ERROR, EXIT_USAGE, EXIT_BUG = 1, 2, 3
#: The longest error line the CLI prints.
MAX_LINE = 600


def _printable(text: str) -> str:
    """``text`` on one line: control characters escaped, cut to :data:`MAX_LINE` characters."""
    text = "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in text)
    return text if len(text) <= MAX_LINE else text[:MAX_LINE] + "..."


class _Parser(argparse.ArgumentParser):
    """argparse, but a bad command line is one escaped line and :data:`EXIT_USAGE`."""

    def error(self, message: str):  # type: ignore[override]
        self.exit(EXIT_USAGE, f"{self.prog}: error: {_printable(message)}; `{self.prog} --help` lists the options\n")


def _url(text: str) -> str:
    """argparse type of --url: a one-line URL that urllib can parse and that names a host."""
    from .bundles.fetch import check_url
    from .errors import DownloadError

    try:
        return check_url(text)
    except DownloadError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _seconds(text: str) -> float:
    """argparse type of --timeout/--deadline: a number of seconds in (0, MAX_SECONDS]."""
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0 < value <= MAX_SECONDS:
        raise argparse.ArgumentTypeError(f"must be a number of seconds in (0, {MAX_SECONDS}], got {shown(text)}")
    return value


def _gpus() -> tuple[list[tuple[str, int, str, str]], list[str]]:
    """(backend, index, name, arch) of every visible GPU, and why each backend has none."""
    from .drivers import get_driver

    gpus, notes = [], []
    for backend in ("cuda", "hip"):
        try:
            driver = get_driver(backend)
            count = driver.device_count()
        except Exception as e:  # noqa: BLE001 - info reports every failure, it never raises
            notes.append(f"{backend}: {_one_line(e)}")
            continue
        if count == 0:
            notes.append(f"{backend}: driver loaded, no devices")
        for d in range(count):
            gpus.append((backend, d, driver.device_name(d), driver.device_arch(d)))
    return gpus, notes


def _one_line(e: BaseException) -> str:
    """A multi-line error as one line: its first line, how many places it lists, and its fix."""
    lines = [line for line in str(e).splitlines() if line.strip()]
    if not lines:
        return type(e).__name__
    head = lines[0]
    if head.endswith(":") and len(lines) > 1:  # "...; tried, in order:" then a list, then the fix
        listed = sum(1 for line in lines[1:] if line.lstrip().startswith("- "))
        head = head.rsplit(";", 1)[0].rstrip(":") + f" ({listed} places tried)"
        if not lines[-1].lstrip().startswith("- "):
            head += f"; {lines[-1].strip()}"
    return head


def cmd_info(args: argparse.Namespace) -> int:
    from . import __version__
    from .arch import compatible, normalize
    from .errors import AotritonError
    from .library import Library

    print(f"aotriton-rt {__version__}")
    gpus, notes = _gpus()
    if gpus:
        for backend, d, name, raw in gpus:
            print(f"GPU {backend}:{d}: {name} ({raw} -> {normalize(backend, raw)})")
    else:
        print("no GPU found: kernels can be inspected but not launched on this machine")
    for note in notes:
        print(f"  {note}")
    try:
        lib = Library(args.images)
    except AotritonError as e:
        print(f"images: {e}")
        return 0
    print(f"images: {', '.join(str(f) for f in lib.found.folders)} ({lib.found.reason})")
    for where, why in lib.found.tried:
        print(f"  skipped {where}: {why}")
    from .sources import summary_lines  # where each folder came from, digests checked

    print("\n".join(summary_lines(lib)))
    versions = sorted({c.triton_version for c in lib.catalogs})
    per_target = Counter(f"{v.target.backend}/{v.target.arch}" for v in lib.variants)
    print(f"catalog: {len(lib.variants)} variants of {len(lib.kernels)} kernels, "
          f"built with triton {', '.join(versions)}")
    print("  " + ", ".join(f"{t}: {n}" for t, n in sorted(per_target.items())))
    print(_tuning_line(lib))
    for backend, d, _, raw in gpus:
        archs = compatible(backend, normalize(backend, raw))
        usable = [v for v in lib.variants if v.target.backend == backend and v.target.arch in archs]
        kernels = sorted({v.kernel for v in usable})
        if usable:
            print(f"GPU {backend}:{d} can run {len(usable)} variants: {', '.join(kernels)}")
        else:
            built = sorted({v.target.arch for v in lib.variants if v.target.backend == backend})
            print(f"GPU {backend}:{d}: no image for {normalize(backend, raw)} (built: "
                  f"{', '.join(built) or 'none'}); run `python -m aotriton_rt download --arch "
                  f"{normalize(backend, raw)}`")
    return 0


def cmd_explain(args: argparse.Namespace) -> int:
    from .errors import NoDevice
    from .library import Library, default_library
    from .ops.attention import explain

    lib = Library(args.images) if args.images else default_library()
    if args.op == "decode":
        return _explain_decode(args, lib)
    for backward in (False, True) if args.backward else (False,):
        try:
            print(explain(dtype=args.dtype, head_dim=args.head_dim, head_dim_v=args.head_dim_v,
                          seqlen_q=args.seqlen, seqlen_k=args.seqlen_k, causal=args.causal, align=args.align,
                          bias=args.bias, dropout=args.dropout, varlen=args.varlen, alibi=args.alibi,
                          softcap=args.softcap, sinks=args.sinks, backward=backward,
                          deterministic=args.deterministic, arch=args.arch, out_dtype=args.out_dtype,
                          library=lib))
        except NoDevice:
            if args.arch:
                raise
            return _pass_arch(lib)
    return 0


def _explain_decode(args: argparse.Namespace, lib: Any) -> int:
    from .errors import NoDevice
    from .ops.decode.explain import explain

    try:
        print(explain(dtype=args.dtype, head_dim=args.head_dim, seqlen_q=args.seqlen,
                      seqlen_k=args.seqlen_k or args.seqlen, batch=args.batch, heads_q=args.heads_q,
                      heads_k=args.heads_k, kv_dtype=args.kv_dtype, paged=args.paged, append=args.append,
                      softcap=args.softcap, alibi=args.alibi, sinks=args.sinks, arch=args.arch, library=lib))
    except NoDevice:
        if args.arch:
            raise
        return _pass_arch(lib)
    return 0


def _pass_arch(lib: Any) -> int:
    """Say that explain needs ``--arch`` on a machine without a GPU, naming the images' archs."""
    built = sorted({a for _, a in lib.targets()})
    print(f"error: no GPU found on this machine to take the arch from; pass --arch {built[0]} (the "
          f"images hold: {', '.join(built)})", file=sys.stderr)
    return EXIT_ERROR


def _tuning_line(lib) -> str:
    """Which kernels have tuning rules and where they came from (the rest run config 0, untuned)."""
    table: dict = {}
    for cat in lib.catalogs:
        for name, rules in (cat.tuning or {}).items():
            table.setdefault(name, rules)  # the first folder's table wins, as at run time
    if not table:
        return "tuning: no rules (every kernel untuned: config 0, docs/tuning.md)"
    parts = []
    for name, rules in sorted(table.items()):
        sources = sorted({str(r.get("source", "declared by the kernel")).split(" measured at")[0].removesuffix(",")
                          for r in rules})
        parts.append(f"{name} {len(rules)} rules ({'; '.join(sources)})")
    return "tuning: " + ", ".join(parts) + "; other kernels untuned (`explain attention` says per call)"


def add_bundle_commands(subparsers: Any) -> None:
    """Add the ``download`` and ``verify`` subcommands (see ``docs/noimage.md``).

    Each sets ``func``: call ``args.func(args)``, which returns the exit status.
    """
    d = subparsers.add_parser(
        "download", help="fetch and install image bundles for your GPUs",
        description="Fetch, verify and install image bundles, or install one from a file.")
    d.add_argument("--arch", default="auto",
                   help="auto (the GPUs of this machine, the default) or a comma list of archs "
                        "or bundle names: gfx942,sm90")
    d.add_argument("--url", type=_url, help=f"the published folder holding {INDEX_FILE} "
                                 f"(default: ${ENV_URL})")
    d.add_argument("--dest", help="images folder to install into (default: the per-user cache, "
                                  "or $AOTRITON_RT_CACHE)")
    d.add_argument("--from-file", metavar="BUNDLE", action="append",
                   help="install a local bundle file instead of downloading (repeatable)")
    d.add_argument("--sha256", help="with --from-file: the digest the bundle must have")
    d.add_argument("--allow-http", action="store_true", help="accept a plain http:// URL")
    d.add_argument("--timeout", type=_seconds, default=30.0, help="seconds (default: 30)")
    d.add_argument("--retries", type=int, default=4, help="attempts in a row (default: 4)")
    d.add_argument("--deadline", type=_seconds, default=DEFAULT_DEADLINE,
                   help=f"seconds the whole download may take (default: {DEFAULT_DEADLINE:g})")
    d.add_argument("--force", action="store_true",
                   help="reinstall even if the same bundle is installed (an install that fails verify "
                        "is repaired without it too)")
    d.add_argument("--keep-partial", action="store_true",
                   help="keep a failed download's partial file so a later run resumes it")
    d.add_argument("--no-progress", action="store_true", help="no progress bar")
    d.set_defaults(func=cmd_download)

    v = subparsers.add_parser("verify", help="re-check installed image folders",
                              description="Re-check the digests of installed image folders.")
    v.add_argument("names", nargs="*", help="bundle names (default: all installed)")
    v.add_argument("--dest", help="images folder (default: the per-user cache)")
    v.add_argument("--folder", help="check this image folder instead")
    v.set_defaults(func=cmd_verify)


def cmd_download(args: argparse.Namespace) -> int:
    from .download import download, install_file
    from .errors import AotritonError

    try:
        if args.from_file:
            done = [install_file(f, dest=args.dest, sha256=args.sha256, force=args.force)
                    for f in args.from_file]
        else:
            done = download(args.arch, url=args.url, dest=args.dest, allow_http=args.allow_http,
                            timeout=args.timeout, retries=args.retries, deadline=args.deadline,
                            keep_partial=args.keep_partial, force=args.force,
                            progress=False if args.no_progress else None)
    except AotritonError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    for b in done:
        print(f"{b.action}: {b.name} ({', '.join(b.targets)}) in {b.path}")
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    from .download import verify, verify_folder
    from .errors import AotritonError

    try:
        reports = [verify_folder(args.folder)] if args.folder else verify(args.dest, args.names)
    except AotritonError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    for r in reports:
        print(f"{'ok' if r.ok else 'FAILED'}: {r.name} ({r.files} files) in {r.path}")
        for p in r.problems:
            print(f"  {p}")
    if not all(r.ok for r in reports):
        print("reinstall with `python -m aotriton_rt download` (or --from-file)", file=sys.stderr)
        return 1
    return 0


def parser() -> argparse.ArgumentParser:
    from . import __version__

    p = _Parser(prog="python -m aotriton_rt", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--version", action="version", version=f"aotriton-rt {__version__}")
    sub = p.add_subparsers(dest="command", required=True)
    info = sub.add_parser("info", help="GPUs seen, image folder chosen and why, catalog statistics")
    info.add_argument("--images", help="an image folder (default: the documented search)")
    info.set_defaults(func=cmd_info)
    ex = sub.add_parser("explain", help="which variant and tuning config an operator call runs, and why",
                        description="Print, for each kernel an attention call launches, its spec, the config "
                                    "index and parameters, and why: 'tuned' (the catalog rule, the tuning "
                                    "database it came from, the length bin) or 'untuned' (the heuristic). "
                                    "`explain decode`: the decode kernels of a call against a KV cache "
                                    "(--seqlen query rows, --seqlen-k keys; fp8 caches with --kv-dtype), their "
                                    "configs and split count. Launches nothing; with --arch no GPU is needed.")
    ex.add_argument("op", choices=["attention", "decode"], help="the operator")
    ex.add_argument("--dtype", default="fp16", help="fp16, bf16 or fp32 (default fp16); for attention also "
                                                    "fp8e4nv or fp8e4b8: the FP8 inference forward")
    ex.add_argument("--out-dtype", default="bf16", help="the FP8 forward's output dtype, bf16 or fp16 (default bf16)")
    ex.add_argument("--head-dim", type=int, default=128, help="q·k head dim (default 128)")
    ex.add_argument("--head-dim-v", type=int, default=None, help="v head dim (default: --head-dim)")
    ex.add_argument("--seqlen", type=int, required=True, help="query length")
    ex.add_argument("--seqlen-k", type=int, default=None, help="key length (default: --seqlen)")
    ex.add_argument("--causal", action="store_true")
    ex.add_argument("--align", default="top_left", help="top_left or bottom_right")
    ex.add_argument("--bias", action="store_true")
    ex.add_argument("--dropout", action="store_true")
    ex.add_argument("--varlen", action="store_true")
    ex.add_argument("--alibi", action="store_true", help="the call passes alibi_slopes (ALiBi)")
    ex.add_argument("--softcap", action="store_true", help="the call passes a logit softcap (softcap=)")
    ex.add_argument("--sinks", action="store_true", help="the call passes attention sinks (sinks=)")
    ex.add_argument("--backward", action="store_true", help="also explain the backward's kernels and scheme")
    ex.add_argument("--deterministic", action="store_true", help="backward: the bit-reproducible scheme only")
    ex.add_argument("--batch", type=int, default=1, help="decode: sequences (default 1)")
    ex.add_argument("--heads-q", type=int, default=32, help="decode: query heads (default 32)")
    ex.add_argument("--heads-k", type=int, default=8, help="decode: KV heads (default 8)")
    ex.add_argument("--kv-dtype", default=None,
                    help="decode: the caches' type, fp8e4nv (float8_e4m3fn) or fp8e4b8 (float8_e4m3fnuz); "
                         "default: --dtype")
    ex.add_argument("--paged", action="store_true", help="decode: a paged cache")
    ex.add_argument("--append", type=int, default=0, help="decode: rows appended per sequence (default 0)")
    ex.add_argument("--arch", help="catalog arch, e.g. sm90 (default: the one GPU 0 runs)")
    ex.add_argument("--images", help="an image folder (default: the documented search)")
    ex.set_defaults(func=cmd_explain)
    add_bundle_commands(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    from .errors import AotritonError

    args = parser().parse_args(argv)
    try:
        return args.func(args)
    except AotritonError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_ERROR
    except OSError as e:  # the file system said no (read-only, permissions, a name too long)
        where = f" ({_printable(str(e.filename)[:200])})" if e.filename else ""
        print(f"error: {_printable(str(e.strerror or e))}{where}; check that the path exists and is writable by "
              "you, or pick another with --dest / $AOTRITON_RT_CACHE", file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt:
        print("interrupted; nothing partial was installed", file=sys.stderr)
        return 130
    except Exception as e:  # noqa: BLE001 - the CLI never shows a traceback; this is a bug of ours
        print(f"error: unexpected {type(e).__name__}: {_printable(str(e)[:300])}; this is a bug in aotriton-rt, "
              "please report it with the command you ran (docs/security.md says how)", file=sys.stderr)
        return EXIT_BUG


if __name__ == "__main__":
    sys.exit(main())
