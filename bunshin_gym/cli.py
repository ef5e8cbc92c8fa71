"""The ``bunshin`` command: a thin front on the library's layers.

    bunshin doctor                      check prerequisites, say how to fix them
    bunshin image build NAME | ls       build or list workspace images
    bunshin ws start|exec|ls|fork|stop  manage workspaces by hand
    bunshin snap ls|rm|flatten          snapshots
    bunshin gc [--all]                  reclaim what crashed processes left
    bunshin bench workspace --json P    benchmarks (also: fork, rollout, epoch, env --env ID, containment,
                                        soak, serve, cluster, density, scaling, train)
    bunshin demo                        start, run, fork: what a workspace can do
    bunshin train [options]             GRPO (TRL) over the envs: the main job
    bunshin serve [--host H] [--port N] [--token-file F]   E2B-compatible sandboxes and envs as a service
"""

from __future__ import annotations

import argparse
import sys
import time


def _cmd_doctor(args) -> int:
    from bunshin_gym import doctor

    return doctor.main()


def _cmd_image(args) -> int:
    from bunshin_gym.workspace import ImageStore, pool

    store = ImageStore(log=print)
    if args.action == "build":
        pool.ensure_pool(say=print)
        for name in args.names:
            store.ensure(name)
        return 0
    if args.action == "prune":
        removed = store.prune()
        print(f"removed {len(removed)} stale images: {', '.join(removed)}" if removed else "no stale images")
        return 0
    rows = store.list()
    for info in rows:
        mark = "" if info["current"] else "  (stale: recipe changed)"
        print(f"{info['name']:<12} {info['name']}-{info['key']}  built {time.ctime(info['built'])}{mark}")
    if not rows:
        print("no images; build one with: bunshin image build base")
    return 0


def _cmd_ws(args) -> int:
    from bunshin_gym.workspace import Workspace, records

    if args.action == "start":
        ws = Workspace.create(args.image, detached=True)
        print(ws.id)
        return 0
    if args.action == "ls":
        recs = records.all_records()
        print(f"{'ID':<14} {'IMAGE':<10} {'PID':>8}  {'STATE':<8} OWNER")
        for r in recs:
            state = "running" if r.running() else "dead"
            owner = "detached" if r.owner is None else f"pid {r.owner}" + ("" if r.owner_alive() else " (gone)")
            print(f"{r.id:<14} {r.image:<10} {r.pid1 or '-':>8}  {state:<8} {owner}")
        return 0
    if args.action == "exec":
        if not args.command:
            print("bunshin ws exec: give a command after the workspace id", file=sys.stderr)
            return 2
        ws = Workspace.attach(args.id)
        cmd = args.command[0] if len(args.command) == 1 else args.command
        res = ws.exec(cmd, timeout=args.timeout, user=args.user)
        sys.stdout.buffer.write(res.stdout)
        sys.stderr.buffer.write(res.stderr)
        if res.timed_out:
            print(f"bunshin: command timed out after {args.timeout} s", file=sys.stderr)
            return 124
        return res.exit_code
    if args.action == "fork":
        src = Workspace.attach(args.id)
        snap = src.snapshot(tags={"cli": "ws fork"})
        clones = snap.fork(args.n, mode=args.mode, detached=True)
        print(f"snapshot {snap.id} (source frozen {snap.meta['timings']['frozen_ms']:.0f} ms)")
        for c in clones:
            print(c.id)
        return 0
    if args.action == "stop":
        ids = [r.id for r in records.all_records()] if args.all else args.ids
        for ws_id in ids:
            rec = records.load(ws_id)
            if rec is None:
                print(f"bunshin: no workspace {ws_id!r}", file=sys.stderr)
                return 1
            from bunshin_gym.workspace.workspace import reclaim

            reclaim(rec)
            print(f"stopped {ws_id}")
        return 0
    raise AssertionError(args.action)


def _cmd_snap(args) -> int:
    from bunshin_gym.workspace.snapshot import SnapshotStore

    store = SnapshotStore()
    if args.action == "ls":
        snaps = store.list()
        print(f"{'ID':<14} {'PARENT':<14} {'WORKSPACE':<12} {'MODE':<8} {'MB':>7} {'FROZEN ms':>9}  "
              f"{'HELD BY':<16}  USERS")
        for s in snaps:
            u = s.users()
            users = ", ".join(u["clones"] + [f"child {c}" for c in u["children"]]) or "-"
            # held: the process that releases it, or the directory of the owner that keeps it
            # (a prefix cache's); a gone one's snapshots are `bunshin gc`'s
            holder, kept_by = s.metadata.holder, s.metadata.kept_by
            held = f"pid {holder[0]}" if holder is not None else kept_by or "-"
            held += " (gone)" if s.abandoned() else ""
            print(f"{s.id:<14} {s.parent or '-':<14} {s.meta['workspace']:<12} {s.mode.value:<8} "
                  f"{s.meta['criu_bytes'] / 2**20:>7.1f} {s.meta['timings']['frozen_ms']:>9.0f}  {held:<16}  {users}")
        if not snaps:
            print("no snapshots")
        return 0
    if args.action == "flatten":
        for snap_id in args.ids:
            info = store.get(snap_id).flatten()
            took = ", ".join(sorted({f["from"].split("/")[2] for f in info["files"]})) or "nothing"
            print(f"flattened {snap_id}: {len(info['files'])} file(s), {info['bytes'] / 2**20:.1f} MiB "
                  f"taken over from {took}; it needs no other snapshot")
        return 0
    for snap_id in args.ids:
        store.get(snap_id).delete()
        print(f"deleted {snap_id}")
    return 0


def _cmd_gc(args) -> int:
    from bunshin_gym.workspace import gc

    rep = gc.collect(all_workspaces=args.all)
    for kind in ("workspaces", "subvolumes", "cgroups", "partial_images", "snapshots", "caches"):
        items = getattr(rep, kind)
        if items:
            print(f"reclaimed {len(items)} {kind.replace('_', ' ')}: {', '.join(items)}")
    if rep.thawed:  # sources an interrupted snapshot had left frozen
        print(f"thawed {len(rep.thawed)} workspaces: {', '.join(rep.thawed)}")
    if not rep.total():
        print("nothing to reclaim")
    return 0


def _cmd_bench(args) -> int:
    if args.name == "workspace":
        from bunshin_gym.bench import workspace

        workspace.run(args.json)
        return 0
    if args.name == "rollout":
        from bunshin_gym.bench import rollout

        rollout.run(args.json, epochs=args.epochs or 3, group=args.group or 4,
                    plot=args.plot or (args.json.rsplit(".", 1)[0] + ".png" if args.json else None))
        return 0
    if args.name == "epoch":
        from bunshin_gym.bench import epoch

        size = epoch.QUICK if args.quick else epoch.PAPER if args.paper else epoch.DEFAULT
        size = epoch.Size(args.tasks or size.tasks, args.group or size.group, args.epochs or size.epochs)
        epoch.run(args.json, env_id=args.env or epoch.OSWORLD, size=size, seed=args.seed,
                  modes=tuple((args.modes or ",".join(epoch.MODES)).split(",")), parallel=args.parallel,
                  think=epoch.ThinkTime(scale=args.think_scale), replay=args.replay,
                  cache_budget_mb=args.cache_budget_mb)
        return 0
    if args.name == "fork":
        from bunshin_gym.bench import fork

        fork.run(args.json, image=args.image or "base",
                 counts=tuple(int(x) for x in (args.counts or "1,2,4,8,16").split(",")),
                 modes=tuple((args.modes or "copy,ksm,share,share+ksm,map-anon").split(",")), heap_mb=args.heap_mb,
                 plot=args.plot or (args.json.rsplit(".", 1)[0] + ".png" if args.json else None))
        return 0
    if args.name == "env":
        from bunshin_gym.bench import env

        if not args.env:
            print(f"bunshin bench env needs --env ID (one of: {', '.join(sorted(env.BENCHES))})")
            return 2
        env.run(args.json, env_id=args.env, counts=tuple(int(x) for x in (args.counts or "1,8,16").split(",")),
                modes=tuple((args.modes or "share,copy").split(",")))
        return 0
    if args.name == "containment":
        from bunshin_gym.bench import containment

        containment.run(args.json, before=args.before or containment.DEFAULT_BEFORE, rounds=args.rounds)
        return 0
    if args.name == "soak":
        from bunshin_gym.bench import soak

        doc = soak.run(args.json, cycles=args.cycles, minutes=args.minutes, threads=args.threads,
                       envs=tuple((args.envs or ",".join(soak.ENV_KINDS)).split(",")))
        return 0 if doc["errors"] == 0 and doc["leaks_total"] == 0 else 1
    if args.name == "serve":
        from bunshin_gym.bench import serve

        doc = serve.run(args.json, desktop="desktop" in (args.envs or "shell,desktop"))
        return 0 if doc["throughput"]["errors"] == 0 else 1
    if args.name == "density":
        from bunshin_gym.bench import density

        cfg = density.DensityConfig(modes=tuple((args.modes or ",".join(density.MODES)).split(",")),
                                    group=args.group or 16, max_desktops=args.max_desktops,
                                    period_s=args.period)
        doc = density.run(args.json, cfg)
        if args.json:
            density.plot(doc, args.plot or args.json.rsplit(".", 1)[0] + ".png")
        return 0
    if args.name == "scaling":
        from bunshin_gym.bench import epoch, scaling

        scaling.run(args.json, counts=tuple(int(x) for x in (args.counts or "8,16,32,64").split(",")),
                    group=args.group or 8, modes=tuple((args.modes or ",".join(scaling.MODES)).split(",")),
                    seed=args.seed, think=epoch.ThinkTime(scale=args.think_scale))
        return 0
    if args.name == "bgdump":
        from bunshin_gym.bench import bgdump

        bgdump.run(args.image or "base", args.heap_mb, args.rounds, args.json,
                   log_levels=bgdump.parse_levels(args.log_levels), fork_wait=args.fork_wait,
                   scans_as_before=args.scans_as_before, settle=args.settle,
                   background_only=args.background_only, ns_after_tasks=args.ns_after_tasks)
        return 0
    if args.name == "fanout":
        from bunshin_gym.bench import fanout

        fanout.run(args.json, image=args.image or "osworld",
                   counts=tuple(int(x) for x in (args.counts or "1,8,16").split(",")),
                   modes=tuple((args.modes or "share,copy").split(",")))
        return 0
    if args.name == "train":
        from bunshin_gym.train import compare
        from bunshin_gym.train.args import Args

        compare.run(args.json, base=Args(seed=args.seed), runs=tuple((args.modes or "base,full,base").split(",")))
        return 0
    if args.name == "cluster":
        from bunshin_gym.bench import cluster

        cluster.run(args.json, nodes=tuple(int(x) for x in (args.nodes or "1,2,3").split(",")),
                    epochs=args.epochs or 2, group=args.group or 2)
        return 0
    raise AssertionError(args.name)


def _cmd_demo(args) -> int:
    from bunshin_gym import demo

    return demo.main()


def _cmd_train(args) -> int:
    from bunshin_gym.train import main as train

    train.main(train.args_from(args))
    return 0


def _cmd_explore(args) -> int:
    import uvicorn

    from bunshin_gym.config import paths
    from bunshin_gym.explore import create_app

    if args.host not in ("127.0.0.1", "localhost", "::1"):
        print(f"bunshin explore: serving on {args.host}: anyone who reaches it sees the runs and the live "
              "workspaces' screens (there is no login)", file=sys.stderr)
    root = None if args.run else paths().home / "train"
    app = create_app(args.run, root)  # a bad --run is refused here, before anything is served
    print(f"bunshin explore: http://{args.host}:{args.port}/  ({args.run or root})", flush=True)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    return 0


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="bunshin", description="Forkable container workspaces for agentic RL.")
    sub = ap.add_subparsers(dest="subcommand", required=True)

    sub.add_parser("doctor", help="check every prerequisite").set_defaults(fn=_cmd_doctor)

    img = sub.add_parser("image", help="build or list workspace images")
    img_sub = img.add_subparsers(dest="action", required=True)
    b = img_sub.add_parser("build", help="build images (cached by recipe)")
    b.add_argument("names", nargs="+", help="image names, e.g. base")
    img_sub.add_parser("ls", help="list built images")
    img_sub.add_parser("prune", help="delete stale images (recipe changed) that nothing uses")
    img.set_defaults(fn=_cmd_image)

    ws = sub.add_parser("ws", help="manage workspaces")
    ws_sub = ws.add_subparsers(dest="action", required=True)
    s = ws_sub.add_parser("start", help="start a detached workspace and print its id")
    s.add_argument("--image", default="base")
    ws_sub.add_parser("ls", help="list workspaces")
    e = ws_sub.add_parser("exec", help="run a command in a workspace")
    e.add_argument("id")
    e.add_argument("--timeout", type=float, default=None, help="seconds (default: none)")
    e.add_argument("--user", default=None, help="run as this user (default root)")
    e.add_argument("command", nargs="*", help="a shell line, or an argv after -- (options go before --)")
    f = ws_sub.add_parser("fork", help="snapshot a workspace and start N detached clones of it")
    f.add_argument("id")
    f.add_argument("-n", type=int, default=1, help="number of clones (default 1)")
    f.add_argument("--mode", default=None,
                   help="memory mode: share (default), ksm, copy, kmod (needs the bunshin_share module), map-anon")
    st = ws_sub.add_parser("stop", help="stop workspaces and reclaim them")
    st.add_argument("ids", nargs="*")
    st.add_argument("--all", action="store_true")
    ws.set_defaults(fn=_cmd_ws)

    sn = sub.add_parser("snap", help="list, flatten or delete snapshots")
    sn_sub = sn.add_subparsers(dest="action", required=True)
    sn_sub.add_parser("ls", help="list snapshots, who holds and who uses them")
    rm = sn_sub.add_parser("rm", help="delete snapshots (refused while in use)")
    rm.add_argument("ids", nargs="+")
    fl = sn_sub.add_parser("flatten", help="make snapshots self-contained (take over their ancestors' page files)")
    fl.add_argument("ids", nargs="+")
    sn.set_defaults(fn=_cmd_snap)

    g = sub.add_parser("gc", help="reclaim what crashed processes left")
    g.add_argument("--all", action="store_true", help="also stop every running workspace")
    g.set_defaults(fn=_cmd_gc)

    be = sub.add_parser("bench", help="run a benchmark")
    be.add_argument("name", choices=["workspace", "fork", "rollout", "epoch", "env", "containment", "soak", "serve",
                                        "cluster", "density", "scaling", "train", "bgdump", "fanout"])
    be.add_argument("--json", default=None, help="write the results to this JSON file")
    be.add_argument("--image", default=None,
                    help="fork, bgdump: workspace image (default base); fanout: (default osworld)")
    be.add_argument("--counts", default=None,
                    help="fork, env, fanout: clone counts (default 1,2,4,8,16; env, fanout: 1,8,16); "
                         "scaling: concurrent rollouts (default 8,16,32,64)")
    be.add_argument("--modes", default=None,
                    help="fork, env: memory modes (default copy,ksm,share,share+ksm,map-anon; env: share,copy); "
                         "epoch: rollout modes (default copy-base,share-base,spec,full); "
                         "density: default share,share+ksm,copy; "
                         "share+ksm: share with its clones KSM-mergeable (BUNSHIN_SHARE_KSM=1); "
                         "fork: copy-untracked, ksm-untracked: without write tracking (full delta snapshots); "
                         "fork: any label ending in -before (share-before): clones restored by the fork path "
                         "before bunshin_gym/workspace/fanout.py; "
                         "train: the runs in turn (default base,full,base); fanout: default share,copy")
    be.add_argument("--env", default=None, help="env, epoch: the env id to measure, e.g. Bunshin-WebArena-v0")
    be.add_argument("--heap-mb", type=int, default=300, help="fork, bgdump: heap held by the source's processes")
    be.add_argument("--plot", default=None, help="fork, rollout: PNG path (default: next to the JSON)")
    be.add_argument("--epochs", type=int, default=None, help="rollout, epoch: epochs per mode (default 3)")
    be.add_argument("--group", type=int, default=None,
                    help="rollout, epoch: GRPO group size G (default 4); density: clones forked at a time (default 16)")
    be.add_argument("--tasks", type=int, default=None, help="epoch: number of tasks (default 4)")
    be.add_argument("--quick", action="store_true", help="epoch: smoke-test size (2 tasks, G=2, 2 epochs)")
    be.add_argument("--paper", action="store_true", help="epoch: the paper's size (8 tasks, G=8, 3 epochs)")
    be.add_argument("--seed", type=int, default=7,
                    help="epoch: seed of the recorded trajectories; train: the main job's seed")
    be.add_argument("--think-scale", type=float, default=0.2,
                    help="epoch: factor on the policy's think time (lognormal, median 6 s before scaling)")
    be.add_argument("--parallel", type=int, default=0, help="epoch: groups run at a time (default 0: all of an epoch)")
    be.add_argument("--replay", default=None, help="epoch: replay the trajectories saved in this results JSON")
    be.add_argument("--cache-budget-mb", type=int, default=None,
                    help="epoch: snapshot MB the prefix cache keeps resident (default: sized from the run, "
                         "2%% of its workspaces' peak memory)")
    be.add_argument("--before", default=None,
                    help="containment: git revision to compare with (default 7213947, the last without containment)")
    be.add_argument("--rounds", type=int, default=2, help="containment, bgdump: interleaved rounds of each side")
    be.add_argument("--log-levels", default=None,
                    help="bgdump: CRIU log levels to take background snapshots at too, side by side (e.g. 3,4)")
    from bunshin_gym.bench.bgdump import add_old_way_options

    add_old_way_options(be, prefix="bgdump: ")
    be.add_argument("--settle", action="store_true",
                    help="bgdump: each snapshot after sync and a 0.5 s pause (not in the previous one's writeback)")
    be.add_argument("--background-only", action="store_true",
                    help="bgdump: no stop-the-world snapshots (background ones compared with each other)")
    be.add_argument("--cycles", type=int, default=500, help="soak: fork/close cycles of phase 1")
    be.add_argument("--minutes", type=float, default=30.0, help="soak: minutes of the mixed workload")
    be.add_argument("--threads", type=int, default=8, help="soak: threads of the mixed workload")
    be.add_argument("--envs", default=None, help="soak: env kinds of the mixed workload (default shell,desktop,web)")
    be.add_argument("--nodes", default=None, help="cluster: simulated host counts (default 1,2,3)")
    be.add_argument("--max-desktops", type=int, default=400, help="density: stop at this many live desktops")
    be.add_argument("--period", type=float, default=10.0, help="density: seconds between two steps of a desktop")
    be.set_defaults(fn=_cmd_bench)

    sub.add_parser("demo", help="start, run and fork a workspace").set_defaults(fn=_cmd_demo)

    from bunshin_gym.serve.__main__ import add_arguments as serve_arguments
    from bunshin_gym.serve.__main__ import main as serve_main

    sv = sub.add_parser("serve", help="E2B-compatible sandboxes (with fork) and envs as an HTTP service")
    serve_arguments(sv)
    sv.set_defaults(fn=serve_main)

    ex = sub.add_parser("explore", help="a local web page: rollouts as fork trees, steps, curves, live workspaces")
    ex.add_argument("--run", default=None, help="a run directory (default: every run under $BUNSHIN_HOME/train)")
    ex.add_argument("--port", type=int, default=8765, help="port (default: 8765)")
    ex.add_argument("--host", default="127.0.0.1", help="address to listen on (default: loopback only)")
    ex.set_defaults(fn=_cmd_explore)

    tr = sub.add_parser("train", help="GRPO training with TRL over bunshin envs (tiny offline policy by default)")
    from bunshin_gym.train.args import add_arguments

    add_arguments(tr)
    tr.set_defaults(fn=_cmd_train)
    return ap


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # `bunshin ws exec ID [options] -- CMD ...`: everything after -- is the command, verbatim
    tail = argv[argv.index("--") + 1:] if "--" in argv else None
    args = parser().parse_args(argv[:argv.index("--")] if tail is not None else argv)
    if tail is not None and hasattr(args, "command"):
        args.command = [*args.command, *tail]
    from bunshin_gym.workspace.errors import WorkspaceError

    try:
        return args.fn(args) or 0
    except (WorkspaceError, ValueError) as e:
        print(f"bunshin: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
