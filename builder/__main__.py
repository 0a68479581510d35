"""``python -m builder``: build, list, merge, verify and pack image folders."""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from collections import Counter
from pathlib import Path

DEFAULT_OUT = Path(__file__).resolve().parent.parent / "images"


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

    jobs, version = _jobs(args)
    tuning = registry.tuning_of(registry.load_kernels(), jobs)
    out = Path(args.out)
    print(f"building {len(jobs)} variants ({args.set} set"
          f"{', shard ' + args.shard if args.shard else ''}) into {out} with {args.jobs} workers",
          file=sys.stderr)
    # Triton's own cache would make "compiled" counts lie; ours is the output folder.
    with tempfile.TemporaryDirectory(prefix="aotriton-build-") as cache:
        os.environ["TRITON_CACHE_DIR"] = cache
        summary = build(jobs, out, workers=args.jobs, timeout=args.timeout,
                        keep_going=args.keep_going, triton_version=version, quiet=args.quiet, tuning=tuning)
    for line in summary.lines():
        print(line)
    return 0


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
    from .build import verify_folder

    n = verify_folder(Path(args.images))
    print(f"ABI proof passed for {n} images in {args.images}")
    return 0


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m builder", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)

    def selection(sp):
        sp.add_argument("--set", default="default",
                        help="which variants: default (small), full (everything), or a set the "
                             "kernels declare, e.g. gputest (default: default)")
        sp.add_argument("--targets", help="comma list of targets or aliases hip, cuda, default")
        sp.add_argument("--kernels", help="comma list of kernel names (default: all)")
        sp.add_argument("--shard", metavar="K/N", help="build the K-th of N deterministic slices")

    b = sub.add_parser("build", help="compile images and write the catalog")
    selection(b)
    b.add_argument("-j", "--jobs", type=int, default=os.cpu_count() or 1, help="worker processes")
    b.add_argument("--out", default=str(DEFAULT_OUT), help="image folder (default: images/)")
    b.add_argument("--timeout", type=float, default=600.0, help="seconds allowed per variant")
    b.add_argument("--keep-going", action="store_true", help="write what compiled despite failures")
    b.add_argument("-q", "--quiet", action="store_true")
    b.set_defaults(func=cmd_build)

    sp = sub.add_parser("list", help="print what would be built, without building")
    selection(sp)
    sp.set_defaults(func=cmd_list)

    m = sub.add_parser("merge", help="merge shard outputs into one image folder")
    m.add_argument("inputs", nargs="+", help="image folders built with --shard")
    m.add_argument("--out", required=True)
    m.set_defaults(func=cmd_merge)

    v = sub.add_parser("verify", help="re-check digests and the ABI proof of an image folder")
    v.add_argument("--images", default=str(DEFAULT_OUT))
    v.set_defaults(func=cmd_verify)

    try:
        from .bundle import add_cli
    except ImportError:
        pass
    else:
        add_cli(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    from aotriton_rt.errors import AotritonError

    from .abi import AbiError
    from .build import BuildError
    from .targets import UnknownTarget

    args = parser().parse_args(argv)
    try:
        return args.func(args)
    except (BuildError, UnknownTarget, ValueError, AbiError, AotritonError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
