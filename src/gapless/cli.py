"""Command line: `gapless train [CONFIG] [--run-dir DIR] [--resume] [--dotted.key value ...]`,
`gapless serve --model.path DIR [--host H] [--port P] [--threads N] [--api-key KEY]
[--generator.engine torch|vllm]` (an OpenAI-compatible server over a local checkpoint, e.g. as a
judge; docs/serving.md),
`gapless serve-training [CONFIG] [--host H] [--port P] [--api-key KEY] [--section.key VALUE ...]`
(the Tinker-compatible training service for the official `tinker` SDK; docs/service.md),
`gapless eval [CONFIG] [--run-dir DIR] [--dotted.key value ...]` (pass@1 of `model.path` on the
eval split of `task.name`, written to RUN_DIR/eval.json),
`gapless sandbox run FILE --json [--timeout-s S] [--memory-mb M]` and
`gapless sandbox check [--path warm|cold|both] [--mode auto|bwrap|reduced] [--json]`, which runs
the hostile probes (gapless.sandbox.probes) on this host and prints probe, status and whether
the host stayed clean; it exits 0 only if every probe ended as expected with a clean host.
`gapless report RUN_DIR [RUN_DIR ...] [--out DIR]` writes one self-contained HTML page (and a
PNG per chart) comparing the runs (gapless.report); default DIR is FIRST_RUN_DIR/report.
`gapless simulate [CONFIG] [--dotted.key value ...]` and `gapless simulate --calibrate RUN_DIR ...`
run the capacity simulator (gapless.simulate, docs/simulator.md).
`gapless swe build --packages NAME==VER ... --out DIR [--seed S] [--max-per-package N] [--jobs J]`
builds a SWE task set from real packages (gapless.envs.swe.build, docs/agentic.md).

User errors (bad config, missing model path, malformed TOML) print one line `gapless: error: ...`
and exit with code 2; infrastructure failures (sandbox cannot start) exit with code 3 and say
what to do.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from gapless.config import ConfigError, load_config
from gapless.errors import InfrastructureError, RunStopped


class _Usage(Exception):
    pass


def _split_overrides(rest: list[str]) -> dict[str, str]:
    """`--a.b 1 --c=2` -> {"a.b": "1", "c": "2"}; anything else is a usage error."""
    overrides, i = {}, 0
    while i < len(rest):
        arg = rest[i]
        if not arg.startswith("--") or len(arg) == 2:
            raise _Usage(f"unexpected argument {arg!r}; overrides look like --trainer.lr 3e-4")
        key, eq, value = arg[2:].partition("=")
        if not eq:
            if i + 1 >= len(rest):
                raise _Usage(f"override --{key} needs a value")
            value = rest[i + 1]
            i += 1
        overrides[key.replace("-", "_")] = value
        i += 1
    return overrides


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="gapless", description="GRPO post-training of language models")
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser("train", help="run a training job (no CONFIG: the embedded default)")
    train.add_argument(
        "args",
        nargs=argparse.REMAINDER,
        help="[CONFIG] [--run-dir DIR] [--resume] [--section.key VALUE ...]; "
        "CONFIG is a TOML run file such as configs/default.toml",
    )
    serve = sub.add_parser("serve", help="serve a local checkpoint over an OpenAI-compatible HTTP API")
    serve.add_argument("--model.path", dest="model_path", required=True, help="local Hugging Face checkpoint directory")
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    serve.add_argument("--port", type=int, default=8000, help="TCP port; 0 picks a free one")
    serve.add_argument("--model-name", default=None, help="name reported by /v1/models (default: the path)")
    serve.add_argument("--threads", type=int, default=None, help="torch threads (default: all cores but one)")
    serve.add_argument(
        "--api-key",
        default=os.environ.get("GAPLESS_API_KEY"),
        help="require 'Authorization: Bearer KEY' (default: $GAPLESS_API_KEY; unset = no check)",
    )
    serve.add_argument("--max-batch", type=int, default=64, help="sequences decoded together by the engine")
    serve.add_argument(
        "--prefix-cache-mb",
        type=int,
        default=256,
        help="MB of keys/values the torch engine keeps for prompts that repeat an earlier context (0 = off)",
    )
    serve.add_argument(
        "--generator.engine",
        dest="engine",
        choices=["torch", "vllm"],
        default="torch",
        help="the engine behind the scheduler: torch (default) or vllm (bash scripts/setup.sh --vllm)",
    )
    serve.add_argument(
        "--max-seq-len",
        type=int,
        default=None,
        help="served context, prompt + completion (default: the model's, at most 2048)",
    )
    training = sub.add_parser(
        "serve-training", help="serve the Tinker training API to the tinker SDK (docs/service.md)"
    )
    training.add_argument(
        "args",
        nargs=argparse.REMAINDER,
        help="[CONFIG] [--host 127.0.0.1] [--port 8001] [--api-key KEY (default: $TINKER_API_KEY)] "
        "[--threads N] [--section.key VALUE ...]; base models: [service] base_models in CONFIG",
    )
    simulate = sub.add_parser("simulate", help="simulate the pipeline on a simulated clock (capacity planning)")
    simulate.add_argument(
        "args", nargs=argparse.REMAINDER, help="[CONFIG] [--section.key VALUE ...] | --calibrate RUN_DIR [RUN_DIR ...]"
    )
    report = sub.add_parser("report", help="compare runs in one self-contained HTML page")
    report.add_argument("run_dirs", nargs="+", metavar="RUN_DIR")
    report.add_argument("--out", default=None, help="output directory (default: FIRST_RUN_DIR/report)")

    evaluate = sub.add_parser("eval", help="pass@1 of a checkpoint on a task's eval split (RUN_DIR/eval.json)")
    evaluate.add_argument(
        "args",
        nargs=argparse.REMAINDER,
        help="[CONFIG] [--run-dir DIR] [--section.key VALUE ...], e.g. "
        "--task.name humaneval --model.path DIR --generator.max_new_tokens 256",
    )
    sandbox = sub.add_parser("sandbox", help="run programs in the sandbox")
    sandbox_sub = sandbox.add_subparsers(dest="sandbox_command", required=True)
    run = sandbox_sub.add_parser("run", help="run a Python file in the sandbox")
    run.add_argument("file")
    run.add_argument("--json", action="store_true", help="print one JSON object")
    run.add_argument("--timeout-s", type=float, default=5.0)
    run.add_argument("--memory-mb", type=int, default=512)
    check = sandbox_sub.add_parser("check", help="run the hostile probes on this host")
    check.add_argument(
        "--path",
        choices=["warm", "cold", "both"],
        default="both",
        help="warm: jobs forked from a pre-started server; cold: fresh bwrap per job",
    )
    check.add_argument("--mode", choices=["auto", "bwrap", "reduced"], default="auto")
    check.add_argument("--json", action="store_true", help="one JSON object per probe")
    swe = sub.add_parser("swe", help="SWE task sets (task.name = 'swe', docs/agentic.md)")
    swe_build = swe.add_subparsers(dest="swe_command", required=True).add_parser(
        "build", help="inject bugs into real packages, validated by their own tests, into DIR/instances.jsonl"
    )
    swe_build.add_argument("--packages", nargs="+", help="NAME==VERSION, or a local sdist or folder")
    swe_build.add_argument("--out", help="the task set's folder (DIR/instances.jsonl)")
    swe_build.add_argument(
        "--default", action="store_true", help="the default set (envs/swe/default_set.py): its packages, seed, folder"
    )
    swe_build.add_argument("--seed", type=int)
    swe_build.add_argument("--max-per-package", type=int, help="instances kept per package at most (default 20)")
    swe_build.add_argument("--max-tries", type=int, help="mutations tried per package at most (default 200)")
    swe_build.add_argument("--jobs", type=int, default=2, help="test jobs at once in the sandbox")
    swe_build.add_argument("--python", default="/usr/bin/python3", help="the sandbox's interpreter")
    swe_build.add_argument(
        "--offline-env", action="store_true", help="copy pytest and test requirements from this interpreter, no index"
    )
    return parser


def _load(argv: list[str]):
    config_path = None
    if argv and not argv[0].startswith("--"):
        config_path, argv = argv[0], argv[1:]
    overrides = _split_overrides([a for a in argv if a != "--resume"])
    for key in ("run_dir", "model.path", "task.path"):  # paths are strings even when they look like numbers
        if key in overrides and not overrides[key].startswith(('"', "'")):
            overrides[key] = json.dumps(overrides[key])
    return load_config(config_path, overrides)


def _vllm_preflight(cfg) -> None:
    """generator.engine = 'vllm' where vLLM is absent, or on a model its CPU attention cannot run:
    one line at start (exit 2), before any model is built."""
    g = cfg.generator
    if g.engine == "vllm" or (g.engine == "vllm-server" and g.vllm_url is None):  # a server started here
        _vllm_check(cfg.model.path, cfg.model.hidden_size // cfg.model.num_heads)


def _vllm_check(model_path: str | None, default_head_dim: int) -> None:
    """`_vllm_preflight` for a checkpoint directory (or, without one, the embedded model's head dim)."""
    from gapless.generate.vllm.engine import VLLMUnavailable, check_model

    head_dim = default_head_dim
    if model_path is not None:
        hf = json.loads((Path(model_path) / "config.json").read_text())
        head_dim = hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]
    try:
        check_model(int(head_dim))
    except VLLMUnavailable as exc:
        raise ConfigError(str(exc)) from None


def _cmd_train(argv: list[str]) -> int:
    cfg = _load(argv)
    _vllm_preflight(cfg)
    from gapless.orchestrate.loop import train  # heavy imports only once the config is valid

    summary = train(cfg, resume="--resume" in argv)
    print(json.dumps(summary))
    return 0


def _cmd_report(args: argparse.Namespace) -> int:
    from gapless.report import build_report

    print(build_report(args.run_dirs, args.out))
    return 0


def _engine_threads_wait() -> None:
    """For a command whose process runs an engine (serve, serve-training, eval): its OpenMP threads
    sleep at barriers instead of spinning (cluster/placement.engine_wait_policy says why). Set
    before anything imports torch, which reads it once, when it loads OpenMP."""
    from gapless.cluster.placement import engine_wait_policy

    os.environ.update(engine_wait_policy())


def _cmd_eval(argv: list[str]) -> int:
    if "--resume" in argv:
        raise _Usage("--resume is for gapless train")
    _engine_threads_wait()
    cfg = _load(argv)
    _vllm_preflight(cfg)
    from gapless.orchestrate.eval_run import run_eval

    result = run_eval(cfg, log=lambda line: print(line, file=sys.stderr))
    print(json.dumps({k: v for k, v in result.items() if k != "per_task"}))
    return 0


def _cmd_serve_training(argv: list[str]) -> int:
    """[CONFIG] [--host H] [--port P] [--api-key KEY] [--threads N] [--section.key VALUE ...]"""
    flags = {"--host": "127.0.0.1", "--port": "8001", "--api-key": os.environ.get("TINKER_API_KEY"), "--threads": None}
    rest, i = [], 0
    while i < len(argv):
        name, eq, value = argv[i].partition("=")
        if name in flags:
            if not eq:
                if i + 1 >= len(argv):
                    raise _Usage(f"{name} needs a value")
                value, i = argv[i + 1], i + 1
            flags[name] = value
        else:
            rest.append(argv[i])
        i += 1
    key = flags["--api-key"]
    if not key:
        raise _Usage("no API key: set TINKER_API_KEY or pass --api-key (the SDK wants it to start with 'tml-')")
    _engine_threads_wait()  # the trainer shares the process: the engines' wait is the service's
    cfg = _load(rest)
    from gapless.service.server import sampling_engine

    if sampling_engine(cfg) == "vllm":  # its one base model (configured, else the embedded one)
        first = next(iter(cfg.service.base_models.values()), None)
        _vllm_check(first.path if first is not None else None, cfg.model.hidden_size // cfg.model.num_heads)
    from gapless.serve.listen import PortInUse, bind

    try:
        sock = bind(flags["--host"], int(flags["--port"]))
    except (PortInUse, ValueError) as exc:
        raise _Usage(str(exc)) from None
    from gapless.service.server import serve

    serve(cfg, sock, key, int(flags["--threads"]) if flags["--threads"] else None)
    print("gapless: service stopped", file=sys.stderr)
    return 0


def _cmd_sandbox_run(args: argparse.Namespace) -> int:
    from gapless.sandbox import BwrapSandbox, SandboxLimits

    limits = SandboxLimits(timeout_s=args.timeout_s, memory_mb=args.memory_mb)
    with BwrapSandbox(limits, warm=False) as sandbox:  # one program: a warm server would not pay
        result = sandbox.run_file(args.file, limits)
    if args.json:
        print(json.dumps(result.to_json()))
    else:
        sys.stdout.write(result.stdout)
        sys.stderr.write(result.stderr)
        print(f"[{result.status.value}] exit={result.exit_code} wall={result.wall_s:.3f}s", file=sys.stderr)
    return 0 if result.status.value == "ok" else 1


def _cmd_swe_build(args: argparse.Namespace) -> int:
    from gapless.envs.swe import default_set
    from gapless.envs.swe.build import BuildOptions, build

    packages, out, seed, max_per_package, max_tries = None, None, 0, 20, 200
    if args.default:
        packages, out, seed = default_set.DEFAULT_PACKAGES, default_set.default_set_dir(), default_set.DEFAULT_SEED
        max_per_package, max_tries = default_set.DEFAULT_MAX_PER_PACKAGE, default_set.DEFAULT_MAX_TRIES
    packages, out = args.packages or packages, args.out or out
    if not packages or not out:
        raise _Usage("swe build needs --packages NAME==VERSION ... and --out DIR (or --default)")
    seed = seed if args.seed is None else args.seed
    max_per_package = max_per_package if args.max_per_package is None else args.max_per_package
    max_tries = max_tries if args.max_tries is None else args.max_tries
    if max_per_package < 1 or args.jobs < 1 or max_tries < 1:
        raise _Usage("--max-per-package, --max-tries and --jobs must be at least 1")
    options = BuildOptions(
        packages=tuple(packages), out=Path(out), seed=seed, max_per_package=max_per_package,
        jobs=args.jobs, max_tries_per_package=max_tries, python=args.python, offline_env=args.offline_env,
    )  # fmt: skip
    reports = build(options)
    for report in reports:
        rejected = ", ".join(f"{reason} {count}" for reason, count in sorted(report.rejected.items())) or "none"
        print(
            f"{report.package}: {report.kept} kept of {report.tried} tried ({report.candidates} candidates, "
            f"{report.stable_tests} stable tests; rejected: {rejected}) in {report.seconds:.1f}s"
            + (f"  ERROR {report.error}" if report.error else "")
        )
    print(f"gapless: {sum(r.kept for r in reports)} instances in {Path(out) / 'instances.jsonl'}")
    return 1 if any(r.error for r in reports) else 0


def _cmd_sandbox_check(args: argparse.Namespace) -> int:
    from gapless.envs.code import probes as code_probes
    from gapless.sandbox import SandboxError, open_sandbox, probes

    paths = ["warm", "cold"] if args.path == "both" else [args.path]
    outcomes = []
    for path in paths:
        try:
            sandbox = open_sandbox(mode=args.mode, warm=path == "warm")
        except SandboxError as exc:
            print(f"gapless: sandbox unavailable: {exc}", file=sys.stderr)
            return 3
        with sandbox:
            if not args.json:
                print(f"# {sandbox.mode}, {sandbox.path} path; {sandbox.cgroup_note}")
                print(f"{'probe':<46}{'expected':<32}{'status':<20}{'ok':<5}host clean")
            for probe in (*probes.PROBES, *code_probes.HARNESS_PROBES):  # the sandbox's, then its code harness's
                outcome = probes.run_probe(sandbox, probe)
                outcomes.append(outcome)
                if args.json:
                    print(json.dumps({**vars(outcome), "expected": sorted(probe.expect)}))
                    continue
                print(
                    f"{probe.name:<46}{'/'.join(sorted(probe.expect)):<32}{outcome.status:<20}"
                    f"{'yes' if outcome.is_expected else 'NO':<5}"
                    f"{'yes' if outcome.is_host_clean else 'NO'}" + (f"  ({outcome.detail})" if outcome.detail else "")
                )
    failed = [o for o in outcomes if not (o.is_expected and o.is_host_clean)]
    if not args.json:
        print(
            f"{len(outcomes) - len(failed)}/{len(outcomes)} probes ended as expected "
            "with a clean host" + ("" if not failed else "; see the rows marked NO")
        )
    return 0 if not failed else 1


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    argv = sys.argv[1:] if argv is None else argv
    try:
        if argv[:1] == ["simulate"] and not {"-h", "--help"} & set(argv):
            from gapless.simulate import main as simulate_main

            return simulate_main(argv[1:], _load)
        if argv[:1] in (["train"], ["eval"], ["serve-training"]) and not {"-h", "--help"} & set(argv):
            command = {"train": _cmd_train, "eval": _cmd_eval, "serve-training": _cmd_serve_training}[argv[0]]
            return command(argv[1:])  # free-form dotted overrides: parsed by hand, not argparse
        args = parser.parse_args(argv)
        if args.command == "serve":
            from gapless.serve.listen import PortInUse, bind

            _engine_threads_wait()
            if args.engine == "vllm":
                _vllm_check(args.model_path, 0)
            try:
                sock = bind(args.host, args.port)  # before the heavy imports: a port in use fails at once
            except PortInUse as exc:
                raise _Usage(str(exc)) from None
            from gapless.serve.openai.server import serve

            serve(
                args.model_path,
                sock,
                args.model_name,
                args.threads,
                args.api_key,
                args.max_batch,
                args.max_seq_len,
                engine=args.engine,
                prefix_cache_mb=args.prefix_cache_mb,
            )
            print("gapless: server stopped", file=sys.stderr)
            return 0
        if args.command == "report":
            return _cmd_report(args)
        if args.command == "swe":
            return _cmd_swe_build(args)
        if args.sandbox_command == "check":
            return _cmd_sandbox_check(args)
        return _cmd_sandbox_run(args)
    except (ConfigError, _Usage) as exc:
        print(f"gapless: error: {exc}", file=sys.stderr)
        return 2
    except FileNotFoundError as exc:
        print(f"gapless: error: {exc}", file=sys.stderr)
        return 2
    except InfrastructureError as exc:
        print(f"gapless: error: {exc}", file=sys.stderr)
        print(
            "gapless: the last checkpoint in the run directory is intact; fix the cause above, then rerun with --resume",
            file=sys.stderr,
        )
        return 3
    except RunStopped as exc:
        print(f"gapless: stopped by {exc}; the steps done are checkpointed (continue with --resume)", file=sys.stderr)
        return 143 if str(exc) == "SIGTERM" else 130
    except KeyboardInterrupt:
        print("gapless: interrupted; the last checkpoint in the run dir is intact (use --resume)", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
