"""python -m builder: compile Triton kernels into image folders, and package them.

Commands: build (compile a set of variants into an image folder), list (what a build would
compile), merge (join shard outputs), verify (re-check digests and argument layouts), tune
(measure every config on a GPU into a tuning database), pack (bundles for download), wheel (the
runtime wheel and data-only image wheels). Run
`python -m builder COMMAND --help` for each command's options and defaults.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from collections import Counter
from pathlib import Path

_CHECKOUT = Path(__file__).resolve().parent.parent
# A source checkout builds into its images/ folder (the runtime finds it there); an installed
# builder into ./images.
DEFAULT_OUT = _CHECKOUT / "images" if (_CHECKOUT / "pyproject.toml").is_file() else Path("images")


def _jobs(args) -> list:
    from . import registry, targets
    from .build import check_triton_version

    version = check_triton_version()
    chosen = targets.parse_targets(args.targets)
    everything = registry.load_kernels()
    if args.set not in registry.known_sets(everything):
        raise ValueError(f"unknown build set {args.set!r}; sets: {', '.join(registry.known_sets(everything))}")
    kernels = registry.select(everything, args.kernels)
    jobs = [j for k in kernels for j in registry.expand(k, chosen, args.set, version)]
    return registry.shard(jobs, getattr(args, "shard", None)), version


def cmd_build(args) -> int:
    from . import registry
    from .build import build

    executor = _executor(args)
    jobs, version = _jobs(args)
    cache = _cache(args, version)
    tuning = _tuning_table(args, jobs, registry.tuning_of(registry.load_kernels(), jobs))
    out = Path(args.out)
    how = (f"as Ray tasks{' on ' + args.address if args.address else ''}" if executor is not None
           else f"with {args.jobs} workers")
    print(f"building {len(jobs)} variants ({args.set} set"
          f"{', shard ' + args.shard if args.shard else ''}) into {out} {how}"
          f"{f', compile cache {cache.root}' if cache is not None else ''}", file=sys.stderr)
    # Triton's own cache would make "compiled" counts lie; ours are the output folder and --cache.
    with tempfile.TemporaryDirectory(prefix="aotriton-build-") as triton_cache:
        os.environ["TRITON_CACHE_DIR"] = triton_cache
        summary = build(jobs, out, workers=args.jobs, timeout=args.timeout,
                        keep_going=args.keep_going, triton_version=version, quiet=args.quiet, tuning=tuning,
                        existing="keep" if args.add else "replace" if args.replace else "refuse",
                        timings=Path(args.timings) if args.timings else None, executor=executor, cache=cache)
    for line in summary.lines():
        print(line)
    return 0


def _executor(args):
    """None for the local pool (``-j``), else the Ray executor, Ray's presence checked now."""
    if args.executor != "ray":
        for option, given in (("--address", args.address), ("--retries", args.retries)):
            if given is not None:
                raise ValueError(f"{option} is for --executor ray")
        return None
    from .cluster import RayExecutor, import_ray

    import_ray()
    return RayExecutor(args.address, 3 if args.retries is None else args.retries)


def _cache(args, triton_version: str):
    """The compile cache of --cache, else of $AOTRITON_BUILDER_CACHE; None with --no-cache or neither."""
    from .cache import ENV, CompileCache

    folder = None if args.no_cache else args.cache or os.environ.get(ENV)
    return CompileCache(Path(folder), triton_version) if folder else None


def _tuning_table(args, jobs: list, declared: dict) -> dict:
    """The build's catalog tuning table: the tuning databases' rules (--tuning-db, else the
    checked-in builder/tuning_db/<arch>.json of the archs built), then the kernels' own rules."""
    from . import tuning

    if args.no_tuning_db:
        paths = []
    elif args.tuning_db:
        paths = [Path(p) for p in args.tuning_db]
    else:
        paths = tuning.checked_in({j.target.arch for j in jobs})
    databases = [(p.name, tuning.load(p)) for p in paths]
    table, notes = tuning.fold(databases, jobs, declared)
    for note in notes:
        print(f"tuning database {note}", file=sys.stderr)
    return table


def cmd_list(args) -> int:
    jobs, _ = _jobs(args)
    for job in jobs:
        print(f"{job.key[:16]}  {job.label}  warps={job.config.num_warps} stages={job.config.num_stages}")
    per = Counter((j.kernel, j.target.arch) for j in jobs)
    print(f"{len(jobs)} variants: " + ", ".join(f"{k}@{a}={n}" for (k, a), n in sorted(per.items())),
          file=sys.stderr)
    return 0


def cmd_merge(args) -> int:
    from .merge import merge

    merged = merge([Path(p) for p in args.inputs], Path(args.out))
    print(f"merged {len(args.inputs)} folders: {len(merged.variants)} variants into {args.out}")
    return 0


def cmd_verify(args) -> int:
    from .build import prove_folder

    n = prove_folder(Path(args.images))
    print(f"ABI proof passed for {n} images in {args.images}")
    return 0


def parser() -> argparse.ArgumentParser:
    from aotriton_rt import __version__

    from .wheels import CliHelp as fmt
    p = argparse.ArgumentParser(prog="python -m builder", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--version", action="version", version=f"aotriton-rt builder {__version__}")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def selection(sp):
        sp.add_argument("--set", default="default",
                        help="which variants: default (common models), full (everything), or a set "
                             "the kernels declare, e.g. gputest")
        sp.add_argument("--targets", default="default",
                        help="comma list of targets (gfx942,sm90) or the aliases hip, cuda, default")
        sp.add_argument("--kernels", help="comma list of kernel names (default: all kernels)")
        sp.add_argument("--shard", metavar="K/N", help="build only the K-th of N deterministic slices")

    b = sub.add_parser("build", help="compile images and write the catalog", formatter_class=fmt,
                       description="Compile the selected variants into an image folder, in parallel, "
                                   "reusing unchanged variants. A folder that already holds other "
                                   "variants is refused unless --add (keep them) or --replace (drop "
                                   "them) is given.")
    selection(b)
    b.add_argument("-j", "--jobs", type=int, default=os.cpu_count() or 1, help="worker processes")
    b.add_argument("--out", default=str(DEFAULT_OUT), help="image folder")
    b.add_argument("--timeout", type=float, default=600.0, help="seconds allowed per variant")
    b.add_argument("--keep-going", action="store_true", help="write what compiled despite failures")
    keep = b.add_mutually_exclusive_group()
    keep.add_argument("--add", action="store_true",
                      help="keep the folder's variants that this build does not rebuild")
    keep.add_argument("--replace", action="store_true",
                      help="drop the folder's variants that this build does not rebuild")
    b.add_argument("-q", "--quiet", action="store_true", help="no progress output")
    dbs = b.add_mutually_exclusive_group()
    dbs.add_argument("--tuning-db", action="append", metavar="FILE",
                     help="fold this tuning database (from `tune`) into the catalog's rules; repeatable, the "
                          "first wins (default: builder/tuning_db/<arch>.json of each arch built, if present)")
    dbs.add_argument("--no-tuning-db", action="store_true", help="fold no tuning database (untuned build)")
    b.add_argument("--timings", metavar="FILE",
                   help="append one JSON line per compiled variant to FILE: kernel, target, spec, config, "
                        "CPU seconds (worker and compiler subprocesses), wall seconds, image and PTX sizes")
    b.add_argument("--executor", choices=("local", "ray"), default="local",
                   help="what compiles: local worker processes (-j), or Ray tasks (needs the cluster extra)")
    b.add_argument("--address", metavar="ADDR",
                   help="with --executor ray: the Ray cluster (auto: the one `ray start` runs on this machine; "
                        "HOST:6379; ray://HOST:10001); default: RAY_ADDRESS, else a new Ray instance here")
    b.add_argument("--retries", type=int, metavar="N",
                   help="with --executor ray: how often a task whose worker died is run again (default 3)")
    caches = b.add_mutually_exclusive_group()
    caches.add_argument("--cache", metavar="DIR",
                        help="compile cache: read variants from DIR before compiling, store each one compiled "
                             "(default: $AOTRITON_BUILDER_CACHE, if set)")
    caches.add_argument("--no-cache", action="store_true",
                        help="use no compile cache, even if $AOTRITON_BUILDER_CACHE is set")
    b.set_defaults(func=cmd_build)

    sp = sub.add_parser("list", help="print what would be built, without building", formatter_class=fmt,
                        description="Print one line per variant a build with these options would compile, "
                                    "and counts per kernel and target.")
    selection(sp)
    sp.set_defaults(func=cmd_list)

    m = sub.add_parser("merge", help="merge shard outputs into one image folder", formatter_class=fmt,
                       description="Merge image folders built with --shard into one folder and catalog.")
    m.add_argument("inputs", nargs="+", help="image folders built with --shard")
    m.add_argument("--out", required=True, help="the merged image folder")
    m.set_defaults(func=cmd_merge)

    v = sub.add_parser("verify", help="re-check digests and the ABI proof of an image folder", formatter_class=fmt,
                       description="Re-check both digests of every image and prove its argument layout "
                                   "against the binary's own metadata.")
    v.add_argument("--images", default=str(DEFAULT_OUT), help="image folder")
    v.set_defaults(func=cmd_verify)

    from .tune import add_cli as add_tune_cli

    add_tune_cli(sub)
    try:
        from .bundle import add_cli
    except ImportError:
        pass
    else:
        add_cli(sub)
    from .wheels import add_cli as add_wheel_cli

    add_wheel_cli(sub, DEFAULT_OUT)
    return p


#: The modules of the ``[builder]`` extra (pyproject.toml) -> the distribution that provides each: a
#: command that needs one when it is missing says which extra to install instead of a traceback.
EXTRA_MODULES = {"triton": "triton", "elftools": "pyelftools", "msgpack": "msgpack", "tqdm": "tqdm",
                 "setuptools": "setuptools"}


def main(argv: list[str] | None = None) -> int:
    from aotriton_rt.errors import AotritonError

    from .abi import AbiError
    from .build import BuildError
    from .cache import CacheError
    from .targets import UnknownTarget
    from .tuning import TuningError
    from .wheels import WheelError

    args = parser().parse_args(argv)
    try:
        return args.func(args)
    except (BuildError, CacheError, UnknownTarget, ValueError, AbiError, AotritonError, WheelError,
            TuningError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except ImportError as e:
        missing = (e.name or "").partition(".")[0]
        if missing not in EXTRA_MODULES:
            raise
        script = Path(sys.argv[0]).name  # the console script's name, or __main__.py under -m
        prog = script if argv is None and script != "__main__.py" else "python -m builder"
        print(f"error: {prog} {args.command} needs "
              f"{EXTRA_MODULES[missing]}, which is not installed; install the builder's extra: "
              "pip install 'aotriton-rt[builder]'", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
