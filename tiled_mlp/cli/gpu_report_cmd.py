"""``tiled-mlp gpu-report``: measures docs/gpu.md's rows on one CUDA device and writes its tables and plots.

Sections (``--sections``, default all): mlp (the seed's MLP table), checkpointed (MLP half and decoder layer),
loss (the tiled loss against torch's chunked loss), compiled (the compiled step), planner (the planner against a
real step, whole stack, 4 layers). Each has a time budget; the whole report is sized for 8 minutes on one H100
or H200. Rows a run does not measure keep their previous figures, marked "not measured since <date>, <card>".
"""
from __future__ import annotations

import datetime
import importlib.util
import os
import shutil
import subprocess
import sys
import time

import torch

from tiled_mlp.strategies.checked_versions import installed

from ..bench import gpu_doc
from ..bench.gpu_sections import SECTIONS, Context
from . import parsing


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("gpu-report", help="measure docs/gpu.md's rows on one CUDA device and write its tables",
                              description=__doc__)
    p.add_argument("--sections", default=",".join(SECTIONS),
                   help=f"comma-separated subset of: {', '.join(SECTIONS)} (default: all)")
    p.add_argument("--repeats", type=parsing.positive_int, default=10, help="timed rounds per measurement (median)")
    p.add_argument("--out", default="docs", metavar="DIR",
                   help=f"the folder holding {gpu_doc.DOC} and {gpu_doc.STORE} (default docs/)")
    p.add_argument("--planner-max-seq", type=parsing.positive_int, default=262144,
                   help="the longest length the planner section steps (its attention time grows as its square)")
    p.add_argument("--time-budget", type=parsing.positive_int, default=420, metavar="SECONDS",
                   help="no new row starts after this many seconds (default 420: the report ends within 8 minutes, "
                        "start-up and the last row included)")
    p.set_defaults(run=run)


def sections_arg(text: str, parser_error) -> list:
    names = list(dict.fromkeys(n.strip() for n in text.split(",") if n.strip()))
    unknown = [n for n in names if n not in SECTIONS]
    if not names or unknown:
        parser_error(f"--sections {text!r}: unknown or empty ({', '.join(unknown) or 'none given'}); "
                     f"choose from {', '.join(SECTIONS)}")
    return names


def check_out(folder: str, parser_error) -> dict:
    """The store already in ``folder`` (its rows are kept); an error unless the folder can be written."""
    if not os.path.isdir(folder):
        parser_error(f"--out {folder}: no such directory")
    if not os.access(folder, os.W_OK | os.X_OK):
        parser_error(f"--out {folder}: this user cannot write there")
    for name in (gpu_doc.DOC, gpu_doc.STORE):
        path = os.path.join(folder, name)
        if os.path.exists(path) and not os.access(path, os.W_OK):
            parser_error(f"--out {folder}: {path} cannot be written")
    try:
        return gpu_doc.load_store(folder)
    except ValueError as error:  # json's decode error is a ValueError too
        parser_error(f"--out {folder}: {error}")
        raise


def missing_cuda() -> str:
    """What this machine lacks for the report ('' when it has a CUDA device)."""
    if torch.version.cuda is None:
        return (f"no CUDA: torch {torch.__version__} is a CPU-only build; install a CUDA build of torch on a machine "
                "with an NVIDIA GPU")
    if not torch.cuda.is_available():
        return f"no CUDA device: torch {torch.__version__} (CUDA {torch.version.cuda}) sees no GPU on this machine"
    return ""


def cuda_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device())


def _driver() -> str:
    if shutil.which("nvidia-smi") is None:
        return ""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return ""
    return out.strip().splitlines()[0] if out.strip() else ""


def this_run(device: torch.device) -> dict:
    return dict(date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
                card=torch.cuda.get_device_name(device), driver=_driver(),
                memory_gib=round(torch.cuda.get_device_properties(device).total_memory / 2**30, 1),
                versions={name: installed(name) or "" for name in gpu_doc.VERSIONS})


def run(args, parser_error) -> int:
    # Every argument first, then the device: nothing is measured or written before both pass.
    names = sections_arg(args.sections, parser_error)
    store = check_out(args.out, parser_error)
    plots = importlib.util.find_spec("matplotlib") is not None
    missing = missing_cuda()
    if missing:
        print(f"tiled-mlp gpu-report: {missing}", file=sys.stderr)
        return 2
    device = cuda_device()
    started = time.perf_counter()

    def say(line: str) -> None:
        print(f"[gpu-report {time.perf_counter() - started:6.1f} s] {line}", file=sys.stderr, flush=True)

    run_info = this_run(device)
    run_id = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    say(f"{run_info['card']}, driver {run_info['driver'] or '?'}; sections {', '.join(names)}, "
        f"estimated {sum(SECTIONS[n].estimate_s for n in names)} s")
    store = gpu_doc.merge(store, run_id, run_info, {})  # the run is named in the tables even where nothing is measured
    titles = {n: s.title for n, s in SECTIONS.items()}
    measured = {}
    failed: list = []
    for name in names:
        section = SECTIONS[name]
        say(f"{name}: {section.title} (estimated {section.estimate_s} s, budget {section.budget_s} s)")
        ctx = Context(device=device, repeats=args.repeats, budget_s=section.budget_s, say=say,
                      planner_max_seq=args.planner_max_seq, deadline=started + args.time_budget)
        try:
            measured[name] = section.measure(ctx)
        except Exception as error:  # one section's failure (out of memory, a peer's bug) must not cost the others
            failed.append(name)
            say(f"{name}: FAILED after {time.perf_counter() - ctx.started:.0f} s: {type(error).__name__}: "
                f"{str(error).strip().splitlines()[0] if str(error).strip() else ''}")
            torch.cuda.empty_cache()
            continue
        say(f"{name}: {len(measured[name])} row(s) in {time.perf_counter() - ctx.started:.0f} s")
        # Written after every section: a run cut short keeps what it measured.
        store = gpu_doc.merge(store, run_id, run_info, {name: measured[name]})
        gpu_doc.write(args.out, store, run_id, titles)
    written = gpu_doc.write(args.out, store, run_id, titles)
    if plots:
        written += gpu_doc.plot(args.out, store, run_id)
    else:
        say("matplotlib is not installed: no plots (pip install 'tiled-mlp[bench]')")
    say(f"wrote {', '.join(written)} in {time.perf_counter() - started:.0f} s"
        + (f"; failed: {', '.join(failed)} (their rows keep their previous figures)" if failed else ""))
    return 1 if failed else 0
