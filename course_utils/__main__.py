"""Command line: ``python -m course_utils {doctor,data,bench,course}``.

python -m course_utils doctor [--json]
python -m course_utils data download --root DIR [--datasets cifar10 fashionmnist]
python -m course_utils bench launch --world-size 4 [--rounds 5]
python -m course_utils bench tp [--world-sizes 1 2 4] [--rounds 5] [--json]
python -m course_utils bench zero [--world-sizes 2 4] [--rounds 3] [--json]
python -m course_utils bench modelled [--json]
python -m course_utils bench cp [--world-sizes 2 4] [--rounds 3] [--json]
python -m course_utils bench moe [--world-sizes 2 4] [--rounds 3] [--json]
python -m course_utils course --out build [--size ci|cpu|gpu] [--only 01]
python -m course_utils preflight --out DIR [--size gpu] [--only 01 03]
python -m course_utils copies --kind student|answers --out build/student
python -m course_utils workspace --dir work [--kind student|answers]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m course_utils", description=__doc__.splitlines()[0]
    )
    sub = parser.add_subparsers(dest="cmd", required=True)

    p = sub.add_parser("doctor", help="check this node: GPUs, interconnect, backends, data, size")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--no-checks", action="store_true", help="skip the all_reduce runs")

    p = sub.add_parser("data", help="stage datasets")
    dsub = p.add_subparsers(dest="data_cmd", required=True)
    d = dsub.add_parser(
        "download", help="download datasets into a folder (run on a node with internet)"
    )
    d.add_argument("--root", required=True, help="target folder; point COURSE_DATA_DIR at it")
    d.add_argument(
        "--datasets", nargs="*", default=None, help="cifar10 cifar100 fashionmnist (default: all)"
    )

    p = sub.add_parser("bench", help="benchmarks")
    bsub = p.add_subparsers(dest="bench_cmd", required=True)
    b = bsub.add_parser("launch", help="launch overhead: launch vs raw spawn vs torchrun")
    b.add_argument("--world-size", type=int, default=4)
    b.add_argument("--rounds", type=int, default=5)
    b.add_argument("--later", type=int, default=5, help="later launches timed per fresh process")
    b.add_argument("--json", action="store_true")
    c = bsub.add_parser(
        "collectives", help="all_reduce, all_gather, ... : time, algbw, busbw per size"
    )
    c.add_argument("--world-size", type=int, default=2)
    c.add_argument(
        "--max-bytes", type=int, default=None, help="largest message (default: size preset's)"
    )
    c.add_argument("--iters", type=int, default=10)
    c.add_argument("--backend", default="auto", choices=["auto", "gloo", "nccl"])
    c.add_argument("--json", action="store_true")
    dd = bsub.add_parser(
        "ddp", help="from-scratch overlapped DDP vs torch DDP: step time and ratio"
    )
    dd.add_argument("--world-size", type=int, default=2)
    dd.add_argument("--rounds", type=int, default=5)
    dd.add_argument("--json", action="store_true")
    pp = bsub.add_parser(
        "pipeline", help="pipeline bubble vs theory, throughput vs m, 1F1B vs torch's"
    )
    pp.add_argument("--stages", type=int, default=2)
    pp.add_argument("--global-batch", type=int, default=1024)
    pp.add_argument("--rounds", type=int, default=5)
    pp.add_argument("--json", action="store_true")
    tp = bsub.add_parser(
        "tp", help="from-scratch TP layer vs torch DTensor TP: step time, ratio, activation memory"
    )
    tp.add_argument("--world-sizes", type=int, nargs="+", default=[1, 2, 4], metavar="T")
    tp.add_argument("--rounds", type=int, default=5)
    tp.add_argument("--json", action="store_true")
    zb = bsub.add_parser(
        "zero",
        help="DDP, ZeRO-1/2/3 from scratch, ZeroRedundancyOptimizer, FSDP2: time, memory, bytes",
    )
    zb.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4], metavar="N")
    zb.add_argument("--rounds", type=int, default=3)
    zb.add_argument("--json", action="store_true")
    b3 = bsub.add_parser(
        "3d",
        help="every dp x pp x tp layout of 8 ranks: measured step time and memory vs the planner",
    )
    b3.add_argument("--rounds", type=int, default=1)
    b3.add_argument(
        "--tflops", type=float, default=None,
        help="time under modelled compute at this many TFLOP/s per rank (communication real)",
    )  # fmt: skip
    b3.add_argument("--json", action="store_true")
    bm = bsub.add_parser(
        "modelled", help="bubble, overlap and straggler under modelled compute, against theory"
    )
    bm.add_argument("--json", action="store_true")
    cpb = bsub.add_parser(
        "cp", help="ring attention (contiguous, zig-zag) and Ulysses: step time, values sent"
    )
    cpb.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4], metavar="P")
    cpb.add_argument("--rounds", type=int, default=3)
    cpb.add_argument("--json", action="store_true")
    mb = bsub.add_parser(
        "moe", help="expert parallelism vs one process vs replicated experts: time, values, load"
    )
    mb.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4], metavar="N")
    mb.add_argument("--rounds", type=int, default=3)
    mb.add_argument("--json", action="store_true")
    t = bsub.add_parser("traces", help="parse + analyse speed on 8 generated ~50 MB rank traces")
    t.add_argument("--ranks", type=int, default=8)
    t.add_argument("--mb", type=float, default=50.0, help="size of each trace")
    t.add_argument("--keep", default=None, help="folder to keep the generated traces in")
    t.add_argument("--json", action="store_true")

    p = sub.add_parser(
        "preflight", help="instructor's check of a node: doctor, all_reduce, bench, notebooks"
    )
    p.add_argument(
        "--out", required=True, help="folder for preflight.md, preflight.json, notebooks"
    )
    p.add_argument("--size", default=None, choices=["ci", "cpu", "gpu"], help="the students' size")
    p.add_argument("--only", nargs="*", default=None, help="notebook name prefixes, e.g. 01 03")
    p.add_argument("--timeout", type=int, default=1800, help="seconds per notebook cell")

    p = sub.add_parser("course", help="execute every notebook into build/ with a timing table")
    p.add_argument("--out", default="build")
    p.add_argument("--size", choices=["ci", "cpu", "gpu"], default=None)
    p.add_argument("--only", nargs="*", default=None, help="notebook prefixes, e.g. 01 03")
    p.add_argument("--timeout", type=int, default=1800, help="seconds per cell")

    p = sub.add_parser(
        "copies", help="notebook copies without solutions (student) or with (answers)"
    )
    p.add_argument("--kind", choices=["student", "answers"], required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--src", default=None, help="folder of source notebooks (default: notebooks/)")

    p = sub.add_parser("workspace", help="create or refresh the working copies students open")
    p.add_argument("--dir", default="work")
    p.add_argument("--kind", choices=["student", "answers"], default="student")

    args = parser.parse_args(argv)
    if args.cmd == "doctor":
        from . import doctor

        return doctor.main(as_json=args.json, run_checks=not args.no_checks)
    if args.cmd == "data":
        from .data import data_root, download

        status = download(args.root, args.datasets)
        for name, st in status.items():
            print(f"{name}: {st}")
        print(f"Point the course at it: export COURSE_DATA_DIR={data_root(args.root)}")
        return 0 if all(s == "ok" for s in status.values()) else 1
    if args.cmd == "bench":
        if args.bench_cmd == "launch":
            from .bench import launch as bench_launch

            result = bench_launch.run(args.world_size, args.rounds, args.later)
            print(json.dumps(result, indent=2) if args.json else bench_launch.table(result))
        elif args.bench_cmd == "collectives":
            from .profiling import collectives

            # with --json, stdout carries only the JSON: launch's notices go to stderr
            with contextlib.redirect_stdout(sys.stderr if args.json else sys.stdout):
                report = collectives.run(
                    args.world_size,
                    args.max_bytes,
                    iters=args.iters,
                    backend=args.backend,
                    echo=False,
                )
            print(json.dumps(report, indent=2) if args.json else collectives.table(report))
        elif args.bench_cmd == "ddp":
            from .bench import ddp as bench_ddp

            with contextlib.redirect_stdout(sys.stderr if args.json else sys.stdout):
                result = bench_ddp.run(args.world_size, args.rounds)
            print(json.dumps(result, indent=2) if args.json else bench_ddp.table(result))
        elif args.bench_cmd == "pipeline":
            from .bench import pipeline as bench_pipeline

            with contextlib.redirect_stdout(sys.stderr if args.json else sys.stdout):
                result = bench_pipeline.run(args.stages, args.global_batch, rounds=args.rounds)
            print(json.dumps(result, indent=2) if args.json else bench_pipeline.table(result))
        elif args.bench_cmd == "tp":
            from .bench import tp as bench_tp

            with contextlib.redirect_stdout(sys.stderr if args.json else sys.stdout):
                result = bench_tp.run(args.world_sizes, args.rounds)
            print(json.dumps(result, indent=2) if args.json else bench_tp.table(result))
        elif args.bench_cmd == "zero":
            from .bench import zero as bench_zero

            with contextlib.redirect_stdout(sys.stderr if args.json else sys.stdout):
                result = bench_zero.run(args.world_sizes, args.rounds)
            print(json.dumps(result, indent=2) if args.json else bench_zero.table(result))
        elif args.bench_cmd == "3d":
            from .bench import threed as bench_3d

            with contextlib.redirect_stdout(sys.stderr if args.json else sys.stdout):
                result = bench_3d.run(args.rounds, tflops=args.tflops)
            print(json.dumps(result, indent=2) if args.json else bench_3d.table(result))
        elif args.bench_cmd == "modelled":
            from .bench import modelled as bench_modelled

            with contextlib.redirect_stdout(sys.stderr if args.json else sys.stdout):
                result = bench_modelled.run()
            print(json.dumps(result, indent=2) if args.json else bench_modelled.table(result))
        elif args.bench_cmd in ("cp", "moe"):
            from .bench import cp as bench_cp
            from .bench import moe as bench_moe

            mod = bench_cp if args.bench_cmd == "cp" else bench_moe
            with contextlib.redirect_stdout(sys.stderr if args.json else sys.stdout):
                result = mod.run(args.world_sizes, args.rounds)
            print(json.dumps(result, indent=2) if args.json else mod.table(result))
        else:
            from .bench import traces as bench_traces

            result = bench_traces.run(args.ranks, args.mb, args.keep)
            print(json.dumps(result, indent=2) if args.json else bench_traces.table(result))
        return 0
    if args.cmd == "preflight":
        from . import preflight

        return preflight.main(args.out, args.size, args.only, args.timeout)
    if args.cmd == "course":
        from . import course

        return course.main(args.out, args.size, args.only, args.timeout)
    if args.cmd == "workspace":
        from .workspace import prepare, report

        print(report(prepare(args.dir, args.kind)))
        print(
            f"Your notebooks are in {args.dir}/ (git ignores them; `make update` refreshes them)."
        )
        return 0
    if args.cmd == "copies":
        from .exercises import write_copies

        for path in write_copies(args.kind, args.out, args.src):
            print(path)
        return 0
    return 2


if __name__ == "__main__":
    sys.exit(main())
